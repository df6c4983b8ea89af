"""A planted kernel bug: verify exits 1 and leaves a counterexample whose replay shows the bits;
without the bug the same replay exits 0."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "exactness", *args], cwd=ROOT, text=True,
                          capture_output=True, env={**os.environ, **(env or {})})


def test_planted_kernel_bug_is_caught_saved_and_replayed(tmp_path):
    from exactness.kernels import native

    # the CPU path's activation exponent off by one: in the C kernel, or where that does not run
    # here, in the int8-GEMM fallback's Python
    bug = "vnni-row-exponent-too-small" if native.library() else "activation-exponent-too-large"
    env = {"EXACTNESS_MUTANT": bug, "EXACTNESS_COUNTEREXAMPLES": str(tmp_path),
           "TRITON_INTERPRET": "1"}
    verify = cli("verify", "--stage", "vectors", env=env)
    assert verify.returncode == 1, verify.stdout
    assert "NOT exact" in verify.stdout
    files = sorted(tmp_path.glob("cpu-*.json"))
    assert files, verify.stdout
    doc = json.loads(files[0].read_text())
    assert doc["format"] == "exactness-counterexample" and doc["path"] == "cpu"
    assert doc["expected_bits"] != doc["actual_bits"]
    still = cli("repro", str(files[0]), env=env)
    assert still.returncode == 1 and "DIFFERS" in still.stdout
    assert "first differing bit" in still.stdout and "row 0, out" in still.stdout
    fixed = cli("repro", str(files[0]), env={"TRITON_INTERPRET": "1"})
    assert fixed.returncode == 0 and "fixed" in fixed.stdout, fixed.stdout
