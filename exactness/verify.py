"""`make verify`: every check the project has, one verdict table, one exit code.

Each stage gives a verdict in Alive2's words: proved/passed, refuted/failed (with where to look),
or unknown; never a silent pass. Stages that are test selections run pytest in a subprocess in the
chosen Hypothesis profile and write JUnit XML beside the JSON report.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REPORTS = ROOT / "reports"


@dataclass
class StageResult:
    name: str
    verdict: str  # "passed" | "failed" | "unknown"
    checks: int = 0
    seconds: float = 0.0
    detail: str = ""
    failures: list[str] = field(default_factory=list)


@dataclass
class Stage:
    name: str
    what: str
    run: Callable[[str], StageResult]


def pytest_stage(name: str, what: str, *selection: str) -> Stage:
    """A stage that runs a pytest selection and reads its JUnit XML."""

    def run(profile: str) -> StageResult:
        REPORTS.mkdir(exist_ok=True)
        junit = REPORTS / f"junit-{name}.xml"
        env = dict(os.environ, HYPOTHESIS_PROFILE=profile, TRITON_INTERPRET="1")
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2",
               f"--junitxml={junit}", *selection]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        tests = failed = 0
        failures = []
        if junit.exists():
            for case in ET.parse(junit).iter("testcase"):
                tests += 1
                if case.find("failure") is not None or case.find("error") is not None:
                    failed += 1
                    failures.append(f"{case.get('classname')}::{case.get('name')}")
        if proc.returncode == 0 and tests:
            return StageResult(name, "passed", tests, detail=what)
        if failed:
            return StageResult(name, "failed", tests, detail=proc.stdout[-2000:],
                               failures=failures)
        return StageResult(name, "unknown", tests,
                           detail=f"pytest exit {proc.returncode}: {proc.stdout[-1000:]}")

    return Stage(name, what, run)


def proofs_stage(profile: str) -> StageResult:
    """The Z3 catalogue (python -m exactness prove), verdicts read from its JSON."""
    cmd = [sys.executable, "-m", "exactness", "prove", "--json"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    try:
        verdicts = json.loads(proc.stdout)
    except ValueError:
        return StageResult("proofs", "unknown", detail=proc.stderr[-1000:])
    bad = [f"{v['verdict']}: {v['name']} k={v['k']} {v.get('counterexample') or ''}"
           for v in verdicts if v["verdict"] != "proved"]
    verdict = "passed" if not bad and proc.returncode == 0 else (
        "failed" if any(b.startswith("refuted") for b in bad) else "unknown")
    return StageResult("proofs", verdict, len(verdicts), failures=bad,
                       detail="every accumulator bound and the final rounding, proved by Z3")


def vectors_stage(profile: str) -> StageResult:
    from .cases import load_vectors
    from .reference import oracle_linear, reference_linear

    failures = []
    cases = load_vectors()
    for case in cases:
        args = (case.x_bits, case.x_format, case.weight_packed, case.scale_bits)
        for path, fn in (("oracle", oracle_linear), ("reference", reference_linear)):
            got = fn(*args, **case.kwargs())
            if not (got == case.expected).all():
                failures.append(f"{path}: {case.name}")
    return StageResult("vectors", "failed" if failures else "passed", 2 * len(cases),
                       detail="shared/vectors reproduced by the oracle and the numpy reference",
                       failures=failures)


STAGES = [
    Stage("proofs", "Z3: accumulator bounds at Kimi sizes, the rounding routine", proofs_stage),
    Stage("vectors", "the contract's independent test vectors, every path", vectors_stage),
    pytest_stage("reference", "oracle == numpy reference == peers; proofs cross-checked",
                 "tests/test_formats.py", "tests/test_reference.py", "tests/test_vectors.py",
                 "tests/test_proofs.py"),
    pytest_stage("equivalence", "every layer path == reference, bit for bit, full Kimi sizes too",
                 "tests/test_modules.py"),
    pytest_stage("mutants", "every planted bug is caught", "tests/test_mutants.py"),
]


def main(thorough: bool = False, stages: list[str] | None = None) -> int:
    profile = "thorough" if thorough else "ci"
    results = []
    print(f"exactness verify  (Hypothesis profile: {profile})", flush=True)
    for stage in STAGES:
        if stages and stage.name not in stages:
            continue
        print(f"  [{len(results) + 1}/{len(STAGES)}] {stage.name}: {stage.what} ...", flush=True)
        start = time.perf_counter()
        result = stage.run(profile)
        result.seconds = round(time.perf_counter() - start, 2)
        results.append(result)
    width = max(len(r.name) for r in results)
    print(f"\n  {'stage':<{width}}  verdict  checks  seconds")
    for r in results:
        print(f"  {r.name:<{width}}  {r.verdict:<7}  {r.checks:>6}  {r.seconds:>7.1f}")
        for f in r.failures[:10]:
            print(f"  {'':<{width}}    x {f}")
    ok = all(r.verdict == "passed" for r in results)
    REPORTS.mkdir(exist_ok=True)
    report = {"verdict": "exact" if ok else "NOT exact", "profile": profile,
              "stages": [asdict(r) for r in results]}
    (REPORTS / "verify.json").write_text(json.dumps(report, indent=2))
    print(f"\n  verdict: {report['verdict']}  (report: {REPORTS / 'verify.json'})")
    return 0 if ok else 1
