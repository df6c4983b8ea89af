"""The CPU-only install (issue 69): `pip install .` without extras, into a Python that holds the
required packages alone (torch, numpy, safetensors, tqdm, hypothesis and what they need; no
Triton, z3, transformers or pytest), imports, runs README's quickstart and an MoE call, checks a
kernel with `python -m exactness check`, and says what is missing where a GPU path is asked for.
The install is a real wheel's, so a file missing from the package (a C source) fails here."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HIDDEN = ("triton", "z3", "transformers", "pytest", "compressed_tensors")  # extras only


def _name(requirement: str) -> str:
    return re.match(r"[A-Za-z0-9._-]+", requirement).group(0)


def required_distributions() -> set[str]:
    """pyproject's dependencies and theirs, in turn, as this Python has them installed (a
    requirement of an extra left out; other markers kept: a package too many is harmless)."""
    todo = [_name(r) for r in tomllib.loads((ROOT / "pyproject.toml").read_text())
            ["project"]["dependencies"]]
    found: set[str] = set()
    while todo:
        name = re.sub(r"[-_.]+", "-", todo.pop()).lower()
        if name in found:
            continue
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        found.add(name)
        todo += [_name(r) for r in dist.requires or () if "extra ==" not in r]
    return found


@pytest.fixture(scope="module")
def cpu_only(tmp_path_factory) -> Path:
    """A virtual environment with exactness installed from a wheel of this checkout, without
    extras, beside links to the required distributions: its python."""
    home = tmp_path_factory.mktemp("cpu-only")
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT,
                            capture_output=True, check=True).stdout.split(b"\0")
    for name in filter(None, (n.decode() for n in listed)):  # the checkout, not its build files
        if (ROOT / name).is_file():
            (home / "src" / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, home / "src" / name)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(home / "venv")],
                   check=True)
    (site,) = (home / "venv" / "lib").glob("python*/site-packages")
    installed = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
         "--no-build-isolation", "--target", str(site), str(home / "src")],
        capture_output=True, text=True)
    assert installed.returncode == 0, installed.stderr[-3000:]
    for name in required_distributions():
        dist = importlib.metadata.distribution(name)
        for top in {Path(str(f)).parts[0] for f in dist.files or () if ".." not in str(f)}:
            target, link = Path(dist.locate_file(top)), site / top
            if target.exists() and not link.exists():
                link.symlink_to(target)
    return home / "venv" / "bin" / "python"


def run(python: Path, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """`python` run outside the checkout (which it must not import), with caches of its own and
    the suite's settings (EXACTNESS_DEVICE=interpret, the emulated C kernel) unset."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "EXACTNESS_DEVICE", "EXACTNESS_NATIVE", "EXACTNESS_AMX",
                        "TRITON_INTERPRET", "EXACTNESS_KERNEL")}
    env["XDG_CACHE_HOME"] = str(python.parents[2] / "cache")
    return subprocess.run([str(python), *args], cwd=python.parents[2], env=env,
                          capture_output=True, text=True, timeout=timeout)


USE = """
import importlib.util, json, sys
import torch
hidden = {name: importlib.util.find_spec(name) is not None for name in sys.argv[1].split(",")}
import exactness
from exactness import ExactLinear, KernelUnavailableError
from exactness.kimi import ExactExperts

exec(compile(sys.argv[2], "README.md", "exec"), {})  # the quickstart

torch.manual_seed(0)
experts = ExactExperts(4, 64, 32, torch.nn.SiLU())
for expert in experts:
    for proj in (expert.gate_proj, expert.up_proj, expert.down_proj):
        weight = torch.randn(proj.out_features, proj.in_features)
        proj.load_state_dict(ExactLinear.from_weight(weight).state_dict())
x = torch.randn(5, 64, dtype=torch.bfloat16)
ids, weights = torch.tensor([[0, 1], [2, 3], [1, 0], [3, 2], [0, 3]]), torch.rand(5, 2)
grouped = experts(x, ids, weights)
loop = experts.per_expert(x, ids, weights)
moe_exact = torch.equal(grouped.view(torch.int16), loop.view(torch.int16)) and bool(grouped.any())

try:
    ExactLinear.from_weight(torch.randn(8, 64), backend="triton")(x)
    gpu = "ran"
except KernelUnavailableError as e:
    gpu = str(e)
print(json.dumps({"file": exactness.__file__, "hidden": hidden, "moe_exact": moe_exact,
                  "gpu": gpu}))
"""


def test_the_cpu_only_install_runs_the_quickstart_and_an_moe_call(cpu_only):
    quickstart = (ROOT / "README.md").read_text().split("```python")[1].split("```")[0]
    done = run(cpu_only, "-c", USE, ",".join(HIDDEN), quickstart)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.splitlines()[-1])
    assert Path(seen["file"]).is_relative_to(cpu_only.parents[2] / "venv"), seen  # installed
    assert not any(seen["hidden"].values()), seen["hidden"]  # the extras are not there
    assert seen["moe_exact"]
    assert "the triton package is not installed (pip install 'exactness[triton]')" in \
        seen["gpu"], seen["gpu"]


def test_the_cpu_only_install_checks_a_kernel(cpu_only):
    done = run(cpu_only, "-m", "exactness", "check", "int8-gemm", "--examples", "5")
    assert done.returncode == 0 and "verdict: passed" in done.stdout, done.stdout + done.stderr
    done = run(cpu_only, "-m", "exactness", "check", "triton-group", "--examples", "5")
    assert done.returncode == 1, done.stdout + done.stderr  # not passed: nothing checked
    assert done.stdout.count("unknown       0  it cannot run here: the triton package is not "
                             "installed") == 5, done.stdout
