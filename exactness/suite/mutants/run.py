"""Planted bugs: the suite shows it can fail. This is the runner; the bugs are data in
catalogue.py and catalogue_c_and_moe.py, their targets and killers' names in targets.py.

A mutant is one small textual change to one function of the package, compiled in memory and
patched in for as long as `applied(mutant)` is open: nothing on disk changes. Each mutant names
the tests that must fail while it is applied (its killers), as pytest node ids (parametrized ids
too); `judge` runs them through pytest itself, in this process, with the mutant applied. A kill
is a test failing in its call; a killer not collected, erring in setup or skipping is the
harness's error, never a kill. tests/test_mutants.py checks every mutant.
"""

from __future__ import annotations

import importlib
import inspect
import sys
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from ...kernels.cpu import amx_library, vnni_library
from ...kernels.cpu.vnni import SPANS
from .catalogue import CATALOGUE
from .targets import (  # noqa: F401  (at and triton_at: importable from here, as before)
    AMX_KERNEL,
    C_FILES,
    C_KERNEL,
    C_ONLY,
    ROOT,
    Mutant,
    at,
    triton_at,
)


def _resolve(target: str):
    """(owner, name, original) of "package.module:function" or "package.module:Class.method"."""
    module_name, path = target.split(":")
    owner = importlib.import_module(module_name)
    *outer, name = path.split(".")
    for part in outer:
        owner = getattr(owner, part)
    return owner, name, getattr(owner, name)


def _planted(source: str, mutant: Mutant) -> str:
    """`source` with the mutant's one change; refuses a snippet that does not occur exactly once."""
    if source.count(mutant.old) != 1:
        raise ValueError(f"mutant {mutant.name}: {mutant.old!r} occurs "
                         f"{source.count(mutant.old)} times in {mutant.target}, not once")
    return source.replace(mutant.old, mutant.new)


def mutated_function(mutant: Mutant):
    """(original, mutated): the target function and its mutated twin, compiled in memory."""
    owner, name, original = _resolve(mutant.target)
    module = sys.modules[mutant.target.split(":")[0]]
    # a @triton.jit kernel keeps its Python function in .fn; its source carries the decorator
    source = textwrap.dedent(inspect.getsource(getattr(original, "fn", original)))
    namespace = dict(vars(module))
    code = compile(_planted(source, mutant), f"<mutant {mutant.name}>", "exec")
    exec(code, namespace)  # noqa: S102 - the point: our own source, one planted change
    return original, namespace[name]


def _rebind(old, new) -> None:
    """Bind `new` wherever a loaded module binds `old` (module globals, `from x import f` too)."""
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if namespace is None:
            continue
        for name, value in list(namespace.items()):
            if value is old:
                namespace[name] = new


# A mutant is built at -O0 (the last -O wins): a bug planted in the source is in every build of
# it, and its killers still have to catch it built so. Emulated, a C mutant's cold build and
# first run then take 3.5 s (5 s at -O1, 7 s at -O2), an AMX mutant's 4 s (14 s at -O1), and
# their kills run no slower than a second (issue 53).
MUTANT_FLAGS = ("-O0",)


def mutated_c_kernel(mutant: Mutant, build: vnni_library.Build):
    """`build` of the C kernel compiled with the mutant's C file mutated, its start-up self-check
    skipped (the self-check would refuse it: tests/test_mutants.py shows it does)."""
    path = ROOT / mutant.target
    source = build.source({path: _planted(path.read_text(), mutant)})
    lib = build.load(source, check=False, extra_flags=MUTANT_FLAGS)
    if lib is None:
        raise RuntimeError(f"mutant {mutant.name}: the mutated C kernel ({build.what}) does not "
                           f"compile")
    return lib


def c_builds(mutant: Mutant) -> list[vnni_library.Build]:
    """The builds of the C kernel a C mutant is planted in that run here: every build for a bug
    in cpu_kernel.c, its own for one in an ISA file; a bug whose every killer is the span
    kernel's only in the builds that hold it."""
    spans_only = all(f"[{SPANS.name}" in killer for killer in mutant.killers)
    return [build for build in C_FILES.get(mutant.target, ())
            if build.library() is not None and (build.spans or not spans_only)]


def mutated_amx_kernel(mutant: Mutant):
    """The AMX kernel built with the mutated cpu_amx.c, its self-check skipped (as above)."""
    lib, why = amx_library.load(_planted(amx_library.SOURCE.read_text(), mutant), check=False,
                                extra_flags=MUTANT_FLAGS)
    if lib is None:
        raise RuntimeError(f"mutant {mutant.name}: the mutated AMX kernel does not build or "
                           f"run: {why.why}")
    return lib


def runs_here(mutant: Mutant) -> bool:
    """C mutants need a build of the C kernel they are planted in (c_builds), those of the code
    only the C kernel runs its AVX-512 build (real or emulated); the AMX kernel's, the AMX kernel
    (real or emulated tiles)."""
    if mutant.target == AMX_KERNEL:
        return amx_library.library() is not None
    if mutant.target in C_FILES:
        return bool(c_builds(mutant))
    return (mutant.target.split(":")[0] not in C_ONLY
            or vnni_library.AVX512.library() is not None)


@contextmanager
def applied(mutant: Mutant) -> Iterator[None]:
    """The mutated function (or C kernel) in place of the original everywhere, until the block
    ends.

    Restoring sweeps for the mutant again, so a module first imported inside the block (and so
    bound to the mutant) is put right too.
    """
    for build in vnni_library.BUILDS:  # each build loaded and self-checked with the real code
        build.library()
    if mutant.target == AMX_KERNEL:
        amx_library.library()  # the real one first, as above
        lib, original_library = mutated_amx_kernel(mutant), amx_library.library
        amx_library.library = lambda: lib
        try:
            yield
        finally:
            amx_library.library = original_library
        return
    if mutant.target in C_FILES:  # each build it is planted in swapped for its mutated twin
        builds = c_builds(mutant)
        libs = [mutated_c_kernel(mutant, build) for build in builds]
        for build, lib in zip(builds, libs, strict=True):
            build.library = lambda lib=lib: lib
        try:
            yield
        finally:
            for build in builds:
                del build.library  # the class's method again
        return
    original, mutated = mutated_function(mutant)
    owner, name, _ = _resolve(mutant.target)
    if isinstance(owner, type):  # a method: it lives in its class
        setattr(owner, name, mutated)
    else:
        _rebind(original, mutated)
    try:
        yield
    finally:
        if isinstance(owner, type):
            setattr(owner, name, original)
        else:
            _rebind(mutated, original)



class _Outcomes:
    """A pytest plugin: each test's outcome in the call phase (setup and teardown failures are
    the harness's errors, never kills)."""

    def __init__(self):
        self.calls: dict[str, str] = {}  # node id -> "passed" | "failed" | "skipped"
        self.errors: list[str] = []  # node ids whose setup or teardown failed
        self.collected: list[str] = []
        self.report = ""  # what pytest printed

    def pytest_collection_finish(self, session):
        self.collected = [item.nodeid for item in session.items]

    def pytest_runtest_logreport(self, report):
        if report.when == "call":
            self.calls[report.nodeid] = report.outcome
        elif report.failed:
            self.errors.append(report.nodeid)
        elif report.skipped and report.when == "setup":
            self.calls[report.nodeid] = "skipped"


def run_tests(node_ids, stop_at_first_failure: bool = False, collect_only: bool = False,
              extra: tuple[str, ...] = ()):
    """The tests `node_ids` ("tests/test_x.py::test_y[param]") run by pytest itself, in this
    process (so a mutant applied here is in them), with `extra` options: (pytest's exit code,
    _Outcomes)."""
    import contextlib
    import gc
    import io

    import pytest

    outcomes = _Outcomes()
    args = [str(ROOT / node) for node in node_ids]
    options = ["-q", "-p", "no:cacheprovider", f"--rootdir={ROOT}", "-o", "addopts=",
               "--tb=line", "-W", "ignore::pytest.PytestAssertRewriteWarning",
               *(["-x"] if stop_at_first_failure else []),
               *(["--collect-only"] if collect_only else []), *extra]
    # pytest ends a session with a full garbage collection, which in a worker holding the
    # suite's heap took seconds a run: the heap is frozen first, so it sweeps only this run's
    gc.freeze()
    try:
        with contextlib.redirect_stdout(io.StringIO()) as report:  # the caller's table stays clean
            code = pytest.main([*options, *args], plugins=[outcomes])
    finally:
        gc.unfreeze()
    outcomes.report = report.getvalue()
    return int(code), outcomes


@dataclass
class Verdict:
    """A mutant's result: killed (by which test), survived, or an error of the harness (a killer
    that is not collected, fails in setup, or skips): never a kill."""

    mutant: str
    killed_by: str | None
    survivors: list[str]
    error: str | None
    failed: list[str] = field(default_factory=list)  # every killer that failed (all run)


def judge(mutant: Mutant, killers, every: bool = False, all_killers: bool = False) -> Verdict:
    """Run `killers` under the mutant: the first must fail (with `every`, each must); with
    `all_killers` each runs, to count how many fail (the kill's strength)."""
    with applied(mutant):
        code, outcomes = run_tests(killers, stop_at_first_failure=not (every or all_killers))
    ids = {node: _collected_as(node, outcomes.collected) for node in killers}
    missing = [node for node, found in ids.items() if found is None]
    failed = [node for node, found in ids.items() if outcomes.calls.get(found) == "failed"]
    ran = [node for node, found in ids.items() if found in outcomes.calls]
    error = None
    if missing or outcomes.errors or code not in (0, 1):
        error = (f"pytest exit {code}; not collected: {missing}; "
                 f"setup/teardown errors: {outcomes.errors}; {outcomes.report[-600:]}")
    skipped = [node for node in ran if outcomes.calls[ids[node]] == "skipped"]
    if skipped and not failed:
        error = f"skipped (not a kill): {skipped}"
    survivors = [node for node in ran if node not in failed]
    killed = (failed and not survivors) if every else bool(failed)
    return Verdict(mutant.name, failed[0] if killed and not error else None, survivors, error,
                   failed)


def _collected_as(node: str, collected: list[str]) -> str | None:
    """The collected node id that `node` (relative to the repository) names."""
    return next((c for c in collected if c == node or c.endswith("/" + node)), None)


@dataclass
class Outcome:
    mutant: str
    killed_by: str | None
    error: str | None
    seconds_to_first: float | None
    seconds: float
    counterexample: str | None
    size: str | None  # M x K x N of the shrunk counterexample
    replays_clean: bool | None  # repro of that file against the unmutated code passes
    strength: int = 0  # how many of its killers failed
    killers: int = 0  # how many it names


def hunt(mutant: Mutant, directory: Path) -> Outcome:
    """Run every killer of the mutant, counting those that fail (the kill's strength); keep the
    shrunk counterexample of the last."""
    import importlib as _importlib
    import os
    import shutil
    import time

    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    os.environ["EXACTNESS_COUNTEREXAMPLES"] = str(directory)
    start, began = time.perf_counter(), time.time()
    verdict = judge(mutant, mutant.killers, all_killers=True)
    seconds = time.perf_counter() - start
    files = sorted(directory.glob("*.json"), key=lambda f: f.stat().st_mtime_ns)
    first = files[0].stat().st_mtime - began if files and verdict.killed_by else None
    kept, size, clean = None, None, None
    if files:  # Hypothesis replays the shrunk example last: the newest file is the minimal one
        from ..counterexamples import read
        from ..gate import replay

        kept = directory.parent / f"{mutant.name}.json"
        shutil.copy(files[-1], kept)
        m, k, n = read(kept)[0].shape
        size = f"{m}x{k}x{n}"
        clean = replay(str(kept), out=open(os.devnull, "w")) == 0  # noqa: SIM115
        for f in files:
            f.unlink()
    shutil.rmtree(directory, ignore_errors=True)
    _importlib.invalidate_caches()
    return Outcome(mutant.name, verdict.killed_by, verdict.error,
                   None if first is None else round(first, 2), round(seconds, 2),
                   str(kept) if kept else None, size, clean, len(verdict.failed),
                   len(mutant.killers))


def main(argv: list[str] | None = None) -> int:
    """`make mutants`: every mutant against the suite's properties (ci profile), one table;
    "kills" counts the killers that fail, and a mutant only one test kills is flagged (weak)."""
    import argparse
    import json
    import os
    import statistics
    from dataclasses import asdict
    from pathlib import Path

    parser = argparse.ArgumentParser(prog="python -m exactness mutants")
    parser.add_argument("--only", action="append", help="run only these mutants")
    parser.add_argument("--out", default="reports/mutants")
    args = parser.parse_args(argv)
    os.environ.setdefault("HYPOTHESIS_PROFILE", "ci")
    from ..gate import load_profiles

    load_profiles()

    out = Path(args.out)
    outcomes = []
    print(f"{'mutant':<42} {'verdict':<9} {'kills':>5} {'first cex s':>11} {'total s':>8}  "
          f"{'size':<12} killed by")
    for mutant in CATALOGUE:
        if args.only and mutant.name not in args.only:
            continue
        if not runs_here(mutant):
            print(f"{mutant.name:<42} skipped   (no build of the C kernel it is planted in here)")
            continue
        o = hunt(mutant, out / mutant.name)
        outcomes.append(o)
        verdict = "killed" if o.killed_by else ("ERROR" if o.error else "SURVIVED")
        if o.killed_by and o.replays_clean is False:
            verdict = "killed*"  # its counterexample does not replay clean unmutated
        first = "-" if o.seconds_to_first is None else f"{o.seconds_to_first:.2f}"
        kills = f"{o.strength}/{o.killers}" + ("!" if o.killed_by and o.strength == 1 else "")
        print(f"{o.mutant:<42} {verdict:<9} {kills:>5} {first:>11} {o.seconds:>8.2f}  "
              f"{o.size or '-':<12} {o.killed_by or o.error or '-'}", flush=True)
    killed = [o for o in outcomes if o.killed_by]
    firsts = [o.seconds_to_first for o in killed if o.seconds_to_first is not None]
    ok = len(killed) == len(outcomes) and all(o.replays_clean is not False for o in killed)
    print(f"\n{len(killed)}/{len(outcomes)} killed"
          f"{f', median time to the first counterexample {statistics.median(firsts):.2f} s' if firsts else ''}"  # noqa: E501
          f"; counterexamples in {out}/")
    weak = [o.mutant for o in killed if o.strength == 1]
    if weak:
        print(f"weak (one test kills it, marked !): {len(weak)}: {', '.join(weak)}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "mutants.json").write_text(json.dumps([asdict(o) for o in outcomes], indent=1))
    return 0 if ok else 1


def from_env() -> Mutant | None:
    """The mutant named by EXACTNESS_MUTANT (how `make mutants` plants one into a whole run)."""
    import os

    name = os.environ.get("EXACTNESS_MUTANT")
    if not name:
        return None
    by_name = {m.name: m for m in CATALOGUE}
    if name not in by_name:
        raise ValueError(f"EXACTNESS_MUTANT={name!r} is not in the catalogue: {sorted(by_name)}")
    return by_name[name]


