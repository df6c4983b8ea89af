"""`make verify`: every check the project has, one verdict table, one exit code.

Each stage gives a verdict in Alive2's words: proved/passed, refuted/failed (with where to look),
or unknown; never a silent pass. A stage any of whose checks skipped is unknown: a check that
did not run here vouches for nothing. Stages that are test selections run pytest in a
subprocess in the chosen Hypothesis profile, those of one PytestSession together, and write
JUnit XML beside the JSON report. `--shard I/N` runs one shard of a CI matrix (stage_shard);
`--select EXPR` only the pytest checks pytest's `-k EXPR` picks (one kernel's, while working on
it), and its verdict vouches for those alone.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .. import device
from . import ci
from .profiles import SMOKE_EXAMPLES

ROOT = Path(__file__).resolve().parents[3]  # the repository
UNKNOWN_EXIT = 3  # nothing failed, but some stage is unknown: not exact, and not refuted
REPORTS = Path(os.environ.get("EXACTNESS_REPORTS") or ROOT / "reports")  # the script's: its logs


@dataclass
class StageResult:
    name: str
    verdict: str  # "passed" | "failed" | "unknown"
    checks: int = 0
    seconds: float = 0.0
    detail: str = ""
    failures: list[str] = field(default_factory=list)
    compared: int = 0  # contract outputs compared bit for bit
    skipped: list[str] = field(default_factory=list)  # checks that did not run here, and why
    check_seconds: dict[str, float] = field(default_factory=dict)  # each check's, slowest first


@dataclass
class Stage:
    name: str
    what: str
    run: Callable[[str], StageResult] | None = None
    session: PytestSession | None = None  # a pytest selection, run with the session's others


class PytestSession:
    """Stages that are pytest selections, run as one pytest session in a subprocess (one xdist
    start-up, ~7 s on 2 cores, instead of one per stage, and one pool for all their tests), then
    reported per stage from the session's JUnit XML. A test module says its stage itself
    (`pytestmark = pytest.mark.stage("name")`); `pytest --stage name` selects those modules, and
    conftest records each test's stage in the XML. kill_only: the selection only has to fail
    under planted bugs, so the ci profile runs it without shrinking. dist: xdist's scheduling
    (loadgroup keeps each C or AMX mutant's tests on one worker: tests/test_mutants.py; the
    other stages' session has no groups, and ran no faster on it, so it takes load, one test
    a send: load's default sends the next chunk of a module, and once all of test_modules.py's
    heavy tests went to one worker, the other idled for 73 s)."""

    def __init__(self, name: str, kill_only: bool = False, dist: str = "load"):
        self.name, self.kill_only, self.dist = name, kill_only, dist
        self.what: dict[str, str] = {}  # stage -> what it checks

    def stage(self, name: str, what: str) -> Stage:
        self.what[name] = what
        return Stage(name, what, session=self)

    def run(self, profile: str, stages: list[str], shard: tuple[int, int] | None = None,
            select: str | None = None) -> dict[str, StageResult]:
        """The chosen `stages` of this session, run together (their tests of one `shard` (i, n)
        where given, those pytest's `-k select` picks where given): {stage: its result}; a
        stage's seconds are its tests' own times (the session's wall time is shared)."""
        if self.kill_only and profile == "ci":
            profile = "ci-kill"
        junit = REPORTS / f"junit-{self.name}.xml"
        junit.unlink(missing_ok=True)
        env = dict(os.environ, HYPOTHESIS_PROFILE=profile, EXACTNESS_FIRST_KILLER="1",
                   EXACTNESS_DEVICE=device.chosen())  # this process's device (run)
        workers = os.environ.get("EXACTNESS_WORKERS", "2")  # the CI machine's 2 cores
        if workers == "1":  # one worker is this process: no xdist controller beside it
            workers = "0"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", workers,
               "--dist", self.dist, *(["--maxschedchunk", "1"] if self.dist == "load" else []),
               f"--junitxml={junit}",
               *(f"--stage={stage}" for stage in stages),
               *([f"--shard={shard[0]}/{shard[1]}"] if shard else []),
               *(["-k", select] if select else [])]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        results = {name: StageResult(name, "passed", detail=self.what[name]) for name in stages}
        if junit.exists():
            for case in ET.parse(junit).iter("testcase"):
                stage = next((p.get("value") for p in case.iter("property")
                              if p.get("name") == "stage"), None)
                result = results.get(stage)
                if result is None:
                    continue
                result.checks += 1
                result.seconds += float(case.get("time") or 0)
                name = f"{case.get('classname')}::{case.get('name')}"
                result.check_seconds[name] = round(float(case.get("time") or 0), 2)
                failure = case.find("failure")
                failure = case.find("error") if failure is None else failure
                if failure is not None:  # its message's first line says what was wrong
                    said = (failure.get("message") or "").strip().splitlines()
                    result.failures.append(f"{name}: {said[0][:300]}" if said else name)
                elif case.find("skipped") is not None:
                    result.skipped.append(f"{name}: {case.find('skipped').get('message')}")
        # exit 1: tests failed, which the stages holding them report; anything else but 0 (a
        # collection error, an interrupted session) leaves every stage unknown
        failed = any(r.failures for r in results.values())
        explained = proc.returncode == 0 or (proc.returncode == 1 and failed)
        for result in results.values():
            result.seconds = round(result.seconds, 2)
            result.check_seconds = dict(sorted(result.check_seconds.items(),
                                               key=lambda item: -item[1]))
            if result.failures:
                result.verdict, result.detail = "failed", proc.stdout[-2000:]
            elif not explained or not result.checks:
                result.verdict = "unknown"
                result.detail = f"pytest exit {proc.returncode}: {proc.stdout[-1000:]}"
            elif result.skipped:  # never a pass by skipping
                result.verdict = "unknown"
                result.detail = (f"{len(result.skipped)} of {result.checks} checks skipped: "
                                 + "; ".join(result.skipped[:5]))
        return results


def proofs_stage(profile: str) -> StageResult:
    """The Z3 catalogue (python -m exactness prove), verdicts read from its JSON: in the ci
    profile what changed since the recorded proofs (proofs/verdicts.json) is proved, in the
    thorough profile everything, afresh."""
    cmd = [sys.executable, "-m", "exactness", "prove", "--json"] + (
        ["--no-cache"] if profile == "thorough" else [])
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    try:
        verdicts = json.loads(proc.stdout)
    except ValueError:
        return StageResult("proofs", "unknown", detail=proc.stderr[-1000:])
    bad = [f"{v['verdict']}: {v['name']} k={v['k']} {v.get('counterexample') or ''}"
           for v in verdicts if v["verdict"] != "proved"]
    verdict = "passed" if not bad and proc.returncode == 0 else (
        "failed" if any(b.startswith("refuted") for b in bad) else "unknown")
    cached = sum(v["cached"] for v in verdicts)
    return StageResult("proofs", verdict, len(verdicts), failures=bad,
                       detail=f"every accumulator bound and the final rounding, proved by Z3 "
                              f"({len(verdicts) - cached} afresh, {cached} recorded or cached)")


def corpus_stage(profile: str) -> StageResult:
    from ..counterexamples import CounterexampleFileError
    from .repro import replay

    files = sorted((ROOT / "tests" / "counterexamples").glob("*.json"))
    sink = open(os.devnull, "w")  # noqa: SIM115 - replay's report is not needed here
    failures = []
    for f in files:
        try:
            if replay(str(f), out=sink):
                failures.append(str(f))
        except CounterexampleFileError as e:  # a file it cannot read is a failure, not a crash
            failures.append(f"{f} (unreadable: {e})")
    return StageResult("corpus", "failed" if failures else ("passed" if files else "unknown"),
                       len(files), detail="every counterexample ever found still replays exact",
                       failures=failures)


_TESTS = PytestSession("tests")
STAGES = [
    Stage("proofs", "Z3: accumulator bounds at Kimi sizes, the rounding routine", proofs_stage),
    _TESTS.stage("vectors", "the contract's independent test vectors, every path"),
    _TESTS.stage("reference", "oracle == numpy reference == peers; proofs cross-checked"),
    _TESTS.stage("equivalence", "every layer path == reference, bit for bit, full Kimi sizes too"),
    _TESTS.stage("devices", "the same cases on the C kernels (CPU) and the Triton kernels (the "
                            "chosen device): equal to each other and to the reference"),
    _TESTS.stage("compiled", "the Triton kernels compile for sm_90 (thorough: sm_80 too), int MMA"),
    _TESTS.stage("reliability", "bad input refused, writes seen, the Kimi loader, the kernel "
                                "cache, repro's refusals"),
    Stage("corpus", "tests/counterexamples replayed on every path", corpus_stage),
    PytestSession("mutants", kill_only=True, dist="loadgroup").stage(
        "mutants", "every planted bug is caught"),
]


def _compared(counts: Path, stage: str | None = None) -> int:
    """Outputs compared, from the tallies the checks wrote (counterexamples._count: a count and
    the test's stage, "-" outside one); with `stage`, only that stage's."""
    if not counts.exists():
        return 0
    tallies = (line.split() for line in counts.read_text().splitlines() if line)
    return sum(int(n) for n, *tagged in tallies
               if stage is None or (tagged[0] if tagged else "-") == stage)


def _add_launches(launches: dict, tallies: Path) -> None:
    """The processes' interpreted launches (interpreter_replay.tally), added to `launches`."""
    if tallies.exists():
        for line in tallies.read_text().splitlines():
            for kind, n in json.loads(line).items():
                launches[kind] = launches.get(kind, 0) + n
        tallies.unlink()


def _junit(results: list[StageResult]) -> str:
    suite = ET.Element("testsuite", name="exactness-verify", tests=str(len(results)),
                       failures=str(sum(r.verdict == "failed" for r in results)),
                       errors=str(sum(r.verdict == "unknown" for r in results)))
    for r in results:
        case = ET.SubElement(suite, "testcase", classname="verify", name=r.name,
                             time=str(r.seconds))
        if r.verdict != "passed":
            tag = "failure" if r.verdict == "failed" else "error"
            ET.SubElement(case, tag, message=r.verdict).text = "\n".join(r.failures) or r.detail
    return ET.tostring(suite, encoding="unicode")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m exactness verify")
    parser.add_argument("--thorough", action="store_true", help="nightly-scale Hypothesis profile")
    parser.add_argument("--smoke", action="store_true",
                        help=f"{SMOKE_EXAMPLES} examples a property: a quick run of the stages, "
                             f"which vouches for little (bench/gpu_check.sh's own test)")
    parser.add_argument("--device", choices=device.DEVICES,
                        help="where the Triton kernels run, for every stage (EXACTNESS_DEVICE; "
                             "default: cuda where there is a GPU, else interpret)")
    parser.add_argument("--stage", action="append", help="run only this stage (repeatable)")
    parser.add_argument("--shard", type=parse_shard, metavar="I/N",
                        help="run shard I of N (a CI matrix): every N-th test of the pytest "
                             "stages, and the other stages shared out (stage_shard)")
    parser.add_argument("--select", metavar="EXPR",
                        help="only the pytest stages' checks whose names pytest's -k EXPR picks "
                             "(e.g. vnni): the verdict vouches for those alone")
    args = parser.parse_args(argv)
    if args.thorough and args.smoke:
        parser.error("--thorough and --smoke are two profiles: name one")
    # one device for every stage: this process's, which the interpreter fixed at import
    device.restart_on(args.device or (None if device.chosen() else "interpret"),
                      ["verify", *(sys.argv[1:] if argv is None else argv)])
    device.require()
    return run("thorough" if args.thorough else "smoke" if args.smoke else "ci", args.stage,
               args.shard, args.select)


def parse_shard(text: str) -> tuple[int, int]:
    try:
        i, n = (int(v) for v in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected I/N, got {text!r}") from None
    if not 1 <= i <= n:
        raise argparse.ArgumentTypeError(f"expected 1 <= I <= N, got {text!r}")
    return i, n


def stage_shard(stage: Stage, n: int) -> int | None:
    """The shard of n that runs a stage that is no pytest session (the k-th such stage: shard
    k mod n + 1); None for a pytest stage, which every shard runs a share of."""
    if stage.session is not None:
        return None
    alone = [s for s in STAGES if s.session is None]
    return alone.index(stage) % n + 1


def run(profile: str = "ci", stages: list[str] | None = None,
        shard: tuple[int, int] | None = None, select: str | None = None) -> int:
    """Every stage (or the chosen `stages`; with `shard` (i, n) its share of them; with
    `select` only the pytest checks pytest's -k picks) in the Hypothesis `profile` (ci,
    thorough or smoke), the table, the reports: 0 iff exact, 1 where a stage failed,
    UNKNOWN_EXIT where none failed but one is unknown."""
    from ..mutants import from_env
    from .profiles import THOROUGH_EXAMPLES, thorough_examples

    thorough = profile == "thorough"
    examples = thorough_examples()
    shown = profile  # a thorough run at what CI's time held (.ci/run, gate/ci.py) says so
    if thorough and examples < THOROUGH_EXAMPLES:
        shown = f"thorough at {examples} of {THOROUGH_EXAMPLES} examples per property"
    chosen = [s for s in STAGES if (not stages or s.name in stages)
              and (shard is None or stage_shard(s, shard[1]) in (None, shard[0]))]
    mutant = from_env()
    print(f"exactness verify  (Hypothesis profile: {shown}"
          f"{f', planted mutant: {mutant.name}' if mutant else ''}"
          f"{f', shard {shard[0]}/{shard[1]}' if shard else ''}"
          f"{f', only the checks -k {select!r} picks' if select else ''})", flush=True)
    from ..paths import emulate_the_c_kernel_where_missing

    c_kernel = emulate_the_c_kernel_where_missing()
    print(f"  checking {c_kernel}", flush=True)
    ran_on = device.describe()
    gpu = f" on {ran_on['gpu']}" if ran_on["gpu"] else ""
    print(f"  Triton kernels: {ran_on['device'] or 'nowhere'}{gpu}, Triton {ran_on['triton']}",
          flush=True)
    REPORTS.mkdir(parents=True, exist_ok=True)
    verifying = ci.watched_digest() if thorough else None  # the files this run vouches for
    results = []
    done: dict[str, StageResult] = {}  # stages a pytest session ran with an earlier one
    launches = {"run": 0, "replayed": 0, "recalled": 0}  # interpreted Triton launches
    begin = time.perf_counter()
    for i, stage in enumerate(chosen, 1):
        print(f"  [{i}/{len(chosen)}] {stage.name}: {stage.what} ...", flush=True)
        start = time.perf_counter()
        session = stage.session
        if session is not None and stage.name in done:
            result = done.pop(stage.name)
        else:
            counts = REPORTS / f"count-{session.name if session else stage.name}.txt"
            counts.unlink(missing_ok=True)
            os.environ["EXACTNESS_COUNT_FILE"] = str(counts)
            tallies = counts.with_suffix(".launches")  # interpreter_replay.tally, a process each
            tallies.unlink(missing_ok=True)
            os.environ["EXACTNESS_LAUNCH_TALLY"] = str(tallies)
            if session is None:
                result = stage.run(profile)
                result.seconds = round(time.perf_counter() - start, 2)
                result.compared = _compared(counts)
            else:
                together = [s.name for s in chosen if s.session is session]
                done.update(session.run(profile, together, shard, select))
                for name in together:
                    done[name].compared = _compared(counts, name)
                if len(together) > 1:
                    print(f"      (one pytest session for {', '.join(together)}: "
                          f"{time.perf_counter() - start:.1f} s)", flush=True)
                result = done.pop(stage.name)
            _add_launches(launches, tallies)
        print(f"      {result.verdict} in {result.seconds:.1f} s "
              f"(elapsed {time.perf_counter() - begin:.0f} s)", flush=True)
        results.append(result)
    width = max(len(r.name) for r in results)
    print(f"\n  {'stage':<{width}}  verdict  checks  outputs compared  seconds")
    for r in results:
        print(f"  {r.name:<{width}}  {r.verdict:<7}  {r.checks:>6}  {r.compared:>16}  "
              f"{r.seconds:>7.1f}")
        if r.check_seconds:  # where the time goes: the stage's slowest check
            slowest, seconds = next(iter(r.check_seconds.items()))
            print(f"  {'':<{width}}    slowest: {slowest} ({seconds:.1f} s)")
        for f in r.failures[:10]:
            print(f"  {'':<{width}}    x {f[:400]}")
        for s in r.skipped[:10]:
            print(f"  {'':<{width}}    ? {s[:400]}")
    ok = all(r.verdict == "passed" for r in results)
    report = {"verdict": "exact" if ok else "NOT exact", "profile": shown, "device": ran_on,
              "mutant": mutant.name if mutant else None, "c_kernel": c_kernel,
              "shard": f"{shard[0]}/{shard[1]}" if shard else None, "select": select,
              "seconds": round(time.perf_counter() - begin, 1),
              "outputs_compared": sum(r.compared for r in results),
              "interpreted_launches": launches,
              "stages": [asdict(r) for r in results]}
    # a shard, a subset or fewer examples vouch for part of the thorough profile only
    if ok and thorough and not stages and not mutant and not shard and not select and \
            examples == THOROUGH_EXAMPLES:
        ci.record_thorough_verdict(verifying, report["seconds"])
    name = f"verify-shard-{shard[0]}-of-{shard[1]}" if shard else "verify"
    (REPORTS / f"{name}.json").write_text(json.dumps(report, indent=2))
    (REPORTS / f"{name}-junit.xml").write_text(_junit(results))
    where = (REPORTS / name).relative_to(ROOT) if REPORTS.is_relative_to(ROOT) else REPORTS / name
    if any(launches.values()):
        print(f"\n  interpreted Triton launches: {launches['run']} run, {launches['replayed']} "
              f"replayed in their process, {launches['recalled']} recalled from the launch "
              f"store (the same code on the same bytes; EXACTNESS_LAUNCH_STORE=off runs them)")
    print(f"\n  verdict: {report['verdict']}  ({report['outputs_compared']} outputs compared bit "
          f"for bit, {report['seconds']} s; {where}.json, {where}-junit.xml)")
    failed = any(r.verdict == "failed" for r in results)
    return 0 if ok else 1 if failed else UNKNOWN_EXIT
