"""`python -m exactness prove`: every obligation, three verdicts (Alive2's): proved; refuted, with
Z3's concrete model and, where the input can be realized, a replayable counterexample file that
shows the wrong bits; unknown (timeout), never reported as proved.

Verdicts of identical queries are cached (.proof-cache/, keyed by the Z3 version and the query
text), so a re-run after an unrelated change costs nothing; a changed width or routine is a new
query and is proved afresh. The catalogue's proofs are also recorded in the repository
(proofs/verdicts.json, `--record`: proved afresh, every obligation), so that a fresh clone
re-proves only what changed since; `--no-cache` (what `make verify --thorough` runs) ignores
both and proves everything.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import z3

from exactness import dataflow
from exactness.contract import ACT_BITS, BFLOAT16, FLOAT32, GROUP_SIZE, act_qmax
from exactness.formats import pack_weights, round_scaled
from exactness.suite.cases import LinearCase

from . import obligations as ob
from .rounding import ROUNDING_FORMATS, rounding, rounding_normal
from .terms import Obligation, const, product

CACHE = Path(".proof-cache/verdicts.json")
RECORDED = Path(__file__).with_name("verdicts.json")
KIMI_K = (2048, 7168, 18432)


@dataclass
class Verdict:
    name: str
    w_bits: int | None
    a_bits: int | None
    k: int | None
    acc_bits: int | None
    spread: int | None
    verdict: str  # proved | refuted | unknown
    seconds: float
    claim: str = ""
    model: dict | None = None
    counterexample: str | None = None
    cached: bool = False
    key: str = ""


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _recorded() -> dict:
    """The recorded proofs (only proofs: an entry of any other verdict is not taken)."""
    return {key: v for key, v in _read(RECORDED).items() if v.get("verdict") == "proved"}


def _cache() -> dict:
    """The recorded proofs, and this checkout's cache over them."""
    return {**_recorded(), **_read(CACHE)}


def query_of(o: Obligation) -> tuple[z3.BoolRef, dict]:
    """The claim's negation under its preconditions (a model of it is a counterexample), and
    the obligation's named variables."""
    pre, post, names = o.build()
    return z3.And(pre, z3.Not(post)), names


def query_key(query: z3.BoolRef) -> str:
    return hashlib.sha256((z3.get_version_string() + query.sexpr()).encode()).hexdigest()


def unrecorded() -> list[str]:
    """The whole catalogue's obligations whose query has no recorded proof (`--record`)."""
    recorded = _recorded()
    return [o.name for o in catalogue(_parser().parse_args([]))
            if query_key(query_of(o)[0]) not in recorded]


def prove(o: Obligation, timeout_s: float = 60.0, cache: dict | None = None) -> Verdict:
    start = time.perf_counter()
    query, names = query_of(o)
    key = query_key(query)
    meta = dict(name=o.name, w_bits=o.w_bits, a_bits=o.a_bits, k=o.k, acc_bits=o.acc_bits,
                spread=o.spread, claim=o.claim)
    if cache is not None and key in cache:
        return Verdict(**meta, **cache[key], seconds=round(time.perf_counter() - start, 3),
                       cached=True, key=key)
    solvers = [z3.Solver()]
    if o.tactic:  # faster to unsat through an explicit bit-blast, but it cannot give models
        solvers.insert(0, z3.Then("simplify", "fpa2bv", "simplify", "solve-eqs", "bit-blast",
                                  "sat").solver())
    for solver in solvers:
        solver.set("timeout", int(timeout_s * 1000))
        solver.add(query)
        result = solver.check()
        if result != z3.unknown:
            break
    model = None
    if result == z3.unsat:
        verdict = "proved"
        if "attained" in o.extra:  # the closed form must also be reached, or it is not the bound
            verdict = "proved" if _attained(o) else "refuted"
    elif result == z3.sat:
        verdict = "refuted"
        m = solver.model()
        model = {n: _signed(m.eval(v, model_completion=True)) for n, v in names.items()}
    else:
        verdict = "unknown"
    return Verdict(**meta, verdict=verdict, seconds=round(time.perf_counter() - start, 3),
                   model=model, key=key)


def _remember(verdicts: list[Verdict]) -> None:
    """Add the verdicts Z3 gave (not unknown) to this checkout's cache."""
    fresh = {v.key: {"verdict": v.verdict, "model": v.model} for v in verdicts
             if v.key and not v.cached and v.verdict != "unknown"}
    if fresh:
        CACHE.parent.mkdir(exist_ok=True)
        partial = CACHE.with_name(f"{CACHE.name}.{os.getpid()}")  # whole, for a reader beside
        partial.write_text(json.dumps({**_read(CACHE), **fresh}))
        os.replace(partial, CACHE)


def prove_once(o: Obligation, timeout_s: float = 60.0) -> Verdict:
    """prove(o) through the checkout's cache: Z3 runs for a query it has not answered here."""
    v = prove(o, timeout_s, cache=_cache())
    _remember([v])
    return v


_JOBS: list = []  # (obligation, timeout, cache), inherited by the forked workers


def _indexed_job(i: int) -> tuple[int, Verdict]:
    return i, _prove_job(i)


def _prove_job(i: int) -> Verdict:
    o, timeout, cache = _JOBS[i]
    v = prove(o, timeout, cache)
    if v.verdict == "refuted" and o.name.startswith(("combine", "group-dot")):
        dot = o.acc_bits if o.name.startswith("group-dot") else dataflow.DOT_ACC_BITS
        comb = o.acc_bits if o.name.startswith("combine") else dataflow.COMBINE_ACC_BITS
        v.counterexample = realize(v, dot, comb)
    return v


def _signed(value) -> int:
    v = value.as_long()
    bits = value.size()
    return v - (1 << bits) if v >> (bits - 1) else v


def _attained(o: Obligation) -> bool:
    pre, _, names = o.build()
    a, w = names["a"], names["w"]
    s = z3.Solver()
    s.add(pre, product(a, w) == const(o.extra["attained"]))
    return s.check() == z3.sat


# --------------------------------------------------------------------------- counterexamples


def extreme_case(w_bits: int, a_bits: int, k: int, spread: int, groups: int) -> LinearCase:
    """One row, one output: every weight -2**(bw-1), every activation -Qa (so P is at its bound,
    positive), scale mantissas 255, the first group's exponent `spread` below the others', and
    only the first `groups` groups nonzero."""
    qmax = act_qmax(a_bits)
    q = np.full((1, k), -(2 ** (w_bits - 1)))
    x = np.full((1, k), round_scaled(-qmax, 0, FLOAT32))
    es = np.where(np.arange(k // GROUP_SIZE) == 0, -100, -100 + spread)
    scales = np.array([[round_scaled(255, int(e), BFLOAT16) for e in es]])
    scales[:, groups:] = 0
    return LinearCase(x, FLOAT32, q, pack_weights(q, w_bits), scales, a_bits, FLOAT32, w_bits)


def realize(v: Verdict, dot_bits: int, combine_bits: int) -> str | None:
    """A counterexample file for a refuted accumulator obligation: the smallest number of
    nonzero groups of the extreme input whose simulation at these widths gives wrong bits."""
    from exactness.suite.counterexamples import write
    from exactness.suite.reference import reference_linear
    from exactness.suite.simulate import simulate

    if v.k is None or v.w_bits is None or v.a_bits is None:
        return None

    def wrong(groups):
        case = extreme_case(v.w_bits, v.a_bits, v.k, v.spread or 0, groups)
        want = reference_linear(case.x_bits, case.x_format, case.weight_packed,
                                case.scale_bits, **case.kwargs())
        got = simulate(case, dot_bits, combine_bits)
        return case, want, got, bool((want != got).any())

    lo, hi = 1, v.k // GROUP_SIZE
    if not wrong(hi)[3]:
        return None
    while lo < hi:  # smallest failing number of groups
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if wrong(mid)[3] else (mid + 1, hi)
    case, want, got, _ = wrong(lo)
    path = f"simulated-dot{dot_bits}-acc{combine_bits}"
    note = f"refuted {v.name} ({v.claim}); Z3 model {v.model}; {lo} nonzero group(s)"
    return str(write(case, path=path, expected=want, actual=got, source="proof", note=note))


# --------------------------------------------------------------------------- the catalogue


def catalogue(args) -> list[Obligation]:
    configs = [(w, a, k) for w in (args.w_bits or (4, 8)) for a in (args.a_bits or ACT_BITS)
               for k in (args.k or KIMI_K)]
    seen, out = set(), []
    for w, a, k in configs:
        for o in ob.for_config(w, a, k, args.acc_bits, args.spread):
            key = (o.name, o.acc_bits, o.spread, o.k if "k" in o.name else None)
            if key not in seen:  # limb and group obligations do not depend on K
                seen.add(key)
                out.append(o)
    if not args.no_rounding:
        out += [rounding(f) for f in ROUNDING_FORMATS]
        out += [rounding_normal(f) for f in ROUNDING_FORMATS]
    return [o for o in out if o.name.startswith(tuple(args.only))] if args.only else out


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m exactness prove", description=__doc__)
    parser.add_argument("--w-bits", type=int, nargs="+", choices=(4, 8))
    parser.add_argument("--a-bits", type=int, nargs="+", choices=ACT_BITS)
    parser.add_argument("--k", type=int, nargs="+", help="in_features (multiples of 32)")
    parser.add_argument("--acc-bits", type=int, choices=(32, 64),
                        help="the combine accumulator (default: dataflow.COMBINE_ACC_BITS)")
    parser.add_argument("--spread", type=int, help="scale-exponent spread to prove for "
                        "(default: the certificate's limit)")
    parser.add_argument("--json", action="store_true", help="print a JSON list of verdicts")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per obligation")
    parser.add_argument("--no-rounding", action="store_true", help="skip the rounding proofs")
    parser.add_argument("--only", action="append", metavar="NAME",
                        help="only the obligations whose names start with NAME (repeatable)")
    parser.add_argument("--no-cache", action="store_true",
                        help="prove everything afresh: no cache, no recorded verdicts")
    parser.add_argument("--record", action="store_true",
                        help=f"prove the whole catalogue afresh and record its proofs in "
                             f"{RECORDED.parent.name}/{RECORDED.name}")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="processes")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    for k in args.k or ():
        if k <= 0 or k % GROUP_SIZE:
            parser.error(f"--k must be a positive multiple of {GROUP_SIZE}, got {k}")
    narrowed = [f for f in ("w_bits", "a_bits", "k", "acc_bits", "spread", "no_rounding", "only")
                if getattr(args, f) not in (None, False)]
    if args.record and narrowed:
        parser.error(f"--record proves the whole catalogue: drop {narrowed}")
    cache = None if args.no_cache or args.record else _cache()
    start = time.perf_counter()
    global _JOBS
    _JOBS = [(o, args.timeout, cache) for o in catalogue(args)]
    if not _JOBS:
        parser.error(f"--only {' '.join(args.only)} names no obligation of this catalogue")
    # the slow ones first (the rounding proofs, fp32's the slowest, last in the catalogue), so
    # that the processes finish together; rows still print in catalogue order
    order = sorted(range(len(_JOBS)), key=lambda i: (not _JOBS[i][0].tactic, -i))
    done: dict[int, Verdict] = {}
    printed = 0
    with multiprocessing.get_context("fork").Pool(args.jobs) as pool:
        for i, v in pool.imap_unordered(_indexed_job, order):
            done[i] = v
            while printed in done:  # every row as soon as those before it are in
                if not args.json:
                    print(_row(done[printed]), flush=True)
                printed += 1
    verdicts = [done[i] for i in range(len(_JOBS))]
    total = time.perf_counter() - start
    if cache is not None:
        _remember(verdicts)
    ok = all(v.verdict == "proved" for v in verdicts)
    if args.record:
        RECORDED.write_text(json.dumps({v.key: {"verdict": v.verdict, "model": None}
                                        for v in verdicts if v.verdict == "proved"}, indent=0,
                                       sort_keys=True) + "\n")
    if args.json:
        print(json.dumps([asdict(v) for v in verdicts], indent=1))
    else:
        counts = {s: sum(v.verdict == s for v in verdicts) for s in ("proved", "refuted",
                                                                      "unknown")}
        cached = sum(v.cached for v in verdicts)
        print(f"\n{len(verdicts)} obligations: {counts['proved']} proved, {counts['refuted']} "
              f"refuted, {counts['unknown']} unknown, in {total:.1f} s"
              f"{f' ({cached} from the cache or the recorded proofs)' if cached else ''}")
    return 0 if ok else 1


def _row(v: Verdict) -> str:
    cfg = " ".join(f"{k}={getattr(v, k)}" for k in ("w_bits", "a_bits", "k", "acc_bits",
                                                    "spread") if getattr(v, k) is not None)
    line = f"{v.verdict:<8} {v.name:<28} {cfg:<52} {v.seconds:>7.2f}s{' (cached)' * v.cached}"
    if v.model:
        line += f"\n         model: {v.model}"
    if v.counterexample:
        line += f"\n         counterexample: {v.counterexample} (replay: python -m exactness " \
                f"repro {v.counterexample})"
    return line


if __name__ == "__main__":
    sys.exit(main())
