"""bench/gpu_check.sh, the GPU machine's one prepared call, run here end to end on the
interpreter (DEVICE=interpret) at the smoke profile: its header, a verdict a step, unknown (never
passed) for the steps that need a GPU, and a failed step where a planted bug makes one fail."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEPS = ("verify", "pytest", "capture", "memcheck", "tables")


def script(tmp_path: Path, **env: str) -> tuple[int, dict[str, str], str]:
    """The script's exit status, each step's verdict from its summary, and its header."""
    keep = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"
            and not k.startswith(("EXACTNESS_", "HYPOTHESIS_", "PYTEST_"))}
    proc = subprocess.run(["bash", "bench/gpu_check.sh"], cwd=ROOT, capture_output=True, text=True,
                          timeout=900, env={**keep, "DEVICE": "interpret", "PROFILE": "smoke",
                                            "LOGS": str(tmp_path), "PYTHON": sys.executable,
                                            "WORKERS": "1", **env})
    summary = (tmp_path / "summary.txt").read_text().splitlines()
    verdicts = {line.split()[0]: line.split()[1] for line in summary}
    return proc.returncode, verdicts, (tmp_path / "header.txt").read_text() + proc.stderr[-2000:]


def test_the_gpu_script_runs_end_to_end_on_the_interpreter(tmp_path):
    code, verdicts, header = script(tmp_path, STAGES="devices corpus",
                                    SUBSET="tests/test_corpus.py")
    assert code == 0, (verdicts, header)
    assert "torch " in header and "triton " in header and "device interpret" in header, header
    assert list(verdicts) == list(STEPS)
    assert verdicts["verify"] == verdicts["pytest"] == "passed", verdicts
    for step in ("capture", "memcheck", "tables"):  # they need a GPU: unknown, never passed
        assert verdicts[step] == "unknown", (step, verdicts)
    report = (tmp_path / "reports" / "verify.json").read_text()
    assert '"verdict": "exact"' in report and '"device": "interpret"' in report


def test_a_planted_bug_fails_the_gpu_scripts_verify(tmp_path):
    code, verdicts, header = script(tmp_path, STAGES="devices", SUBSET="tests/test_corpus.py",
                                    EXACTNESS_MUTANT="kernel-scale-of-the-previous-group")
    assert code == 1, (verdicts, header)
    assert verdicts["verify"] == "failed", verdicts
    assert list((tmp_path / "counterexamples").glob("*.json")), "no counterexample file written"
