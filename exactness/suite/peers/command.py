"""`python -m exactness check KERNEL`: the suite, run on a kernel this project did not write.

KERNEL is MODULE:FACTORY, or a kernel of this project's registry by name (`int8-gemm`): both are
checked alike, through a factory. The factory takes the checkpoint's three tensors
(weight_packed [N, K / 8] int32, weight_scale [N, K / 32] bf16, weight_shape [2]) and, under the
exact claim, `act_bits=`; it returns the kernel as a callable x [M, K] -> y [M, N].

Claims:
- exact: the contract's bits at act_bits (the reference's), bit for bit;
- w4a16: x times the dequantized weights, measured against the correctly rounded true product
  (truth.py) in units in the last place of y's format. The worst error is searched for
  (Hypothesis's target()), and refuted past --max-ulp where given.

Each property gets its own verdict, in Alive2's words: passed (with how many inputs), refuted
(with a counterexample file), or unknown (nothing could be checked):
- claim: on the suite's inputs (scale spreads, ties, extremes; full Kimi sizes with --kimi);
- batch-invariant: each row's bits are the same alone, in its batch, in the batch reversed, and
  among other rows;
- deterministic: a second call, and a kernel built again, give the same bits;
- non-finite: an inf or NaN in x gives every output of its row the canonical NaN (contract
  v1.2), is refused (an exception), or is propagated (that row's outputs are not finite), the
  other rows' bits unchanged, as --non-finite says the kernel does;
- tails: the claim at M, N, K that are multiples of no tile (3 x 96 -> 7, and more).
A refutation is written as a counterexample file naming the kernel and the property; it replays
with `python -m exactness repro FILE --kernel KERNEL`.
"""

from __future__ import annotations

import argparse
import sys

from ..cases import LinearCase
from .properties import (
    CLAIMS,
    PROPERTIES,
    SCALE_KINDS,
    ULP_BINS,
    CheckError,
    Claim,
    Refuted,
    Report,
    build,
    check,
    check_batch_invariant,
    check_claim,
    check_deterministic,
    check_non_finite,
    load_kernel,
)


def render(report: Report) -> str:
    c = report.claim
    head = f"check {report.kernel}  (claim {c.name}" + (
        f", act_bits {c.act_bits}" if c.name == "exact" else "") + (
        f", max {c.max_ulp} ulp" if c.max_ulp is not None else "") + (
        f", non-finite inputs: {c.on_non_finite})")
    lines = [head, f"  {'property':<16} {'verdict':<8} {'inputs':>6}  detail"]
    for v in report.verdicts:
        detail = v.detail + (f"\n  {'':<16} {'':<8} {'':>6}  counterexample: {v.file} (replay: "
                             f"python -m exactness repro {v.file} --kernel {report.kernel})"
                             if v.file else "")
        lines.append(f"  {v.prop:<16} {v.verdict:<8} {v.inputs:>6}  {detail}")
    if report.worst_ulp is not None:
        shares = ", ".join(f"<= {b:g}: {report.within[b] / report.outputs:.2%}"
                           for b in ULP_BINS)
        lines.append(f"  worst error found: {report.worst_ulp:.4g} ulp, at {report.where}")
        lines.append(f"  outputs by error ({report.outputs} outputs): {shares}")
    lines.append("  verdict: " + ("passed" if report.ok else "NOT passed"))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m exactness check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kernel", metavar="KERNEL", help="MODULE:FACTORY or a registered name")
    parser.add_argument("--claim", default="exact", help=f"one of {', '.join(CLAIMS)}")
    parser.add_argument("--max-ulp", type=float, help="w4a16: refute an error past this")
    parser.add_argument("--act-bits", type=int, default=16, help="exact: the activation width")
    parser.add_argument("--non-finite", help="nan, refuse or propagate (default: nan for "
                        "exact, contract v1.2; propagate for w4a16)")
    parser.add_argument("--examples", type=int, default=30, help="inputs per property")
    parser.add_argument("--kimi", action="store_true", help="full Kimi sizes too")
    parser.add_argument("--n-multiple", type=int, default=1,
                        help="N drawn as multiples of this (a kernel's tile; tails still tries "
                             "others)")
    parser.add_argument("--scales", help=f"only one kind of scales: {', '.join(SCALE_KINDS)}")
    parser.add_argument("--property", action="append", help="check only these")
    args = parser.parse_args(argv)
    try:
        report = check(args.kernel, Claim(args.claim, args.act_bits, args.max_ulp,
                                          args.non_finite),
                       examples=args.examples, kimi=args.kimi, n_multiple=args.n_multiple,
                       scales=args.scales, properties=args.property or PROPERTIES)
    except CheckError as e:
        print(f"check: {e}", file=sys.stderr)
        return 2
    print(render(report))
    return 0 if report.ok else 1


def replay(case: LinearCase, doc: dict, kernel: str | None = None) -> str | None:
    """The property a counterexample file names, run once more on its input against `kernel`
    (default: the file's): None where it holds now, else what fails."""
    kernel = kernel or doc["kernel"]
    claim = Claim(doc.get("claim", "exact"), case.act_bits, doc.get("max_ulp"),
                  doc.get("non_finite"))
    factory = load_kernel(kernel)
    prop = doc.get("property", "claim")  # a file of this project's paths: its claim, exact
    try:
        fn = build(factory, case, claim, prop)
        if prop in ("claim", "tails"):
            check_claim(fn, case, claim, Report(kernel, claim), prop)
        elif prop == "batch-invariant":
            check_batch_invariant(fn, case, claim, Report(kernel, claim))
        elif prop == "deterministic":
            check_deterministic(fn, case, claim, Report(kernel, claim), factory)
        elif prop == "non-finite":
            r, c, pattern = doc["poison"]
            check_non_finite(fn, case, claim, (int(r), int(c), int(pattern, 16)))
        else:
            raise CheckError(f"the file names no property of {', '.join(PROPERTIES)}: {prop!r}")
    except Refuted as r:
        return r.detail
    return None
