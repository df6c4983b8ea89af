"""`python -m exactness repro FILE`: replay a counterexample against the reference and every path.

Prints, per path, whether its bits equal the reference's and, where they do not, a readable diff:
the row and output, both values exactly, the first (most significant) differing bit and what it
is, and the group whose term dominates that output. Exit 1 while any replayed path still differs
(the file's own path included), 0 once all agree, and 2 for a file it cannot read (one line on
stderr names the file and the key or row at fault): such a file is never replayed, so never "fixed".
"""

from __future__ import annotations

import argparse
import sys
from fractions import Fraction

import numpy as np

from ...contract import BFLOAT16, GROUP_SIZE, FloatFormat
from ...formats import decode, is_finite
from ..cases import LinearCase
from ..counterexamples import CounterexampleFileError, _count, read
from ..device import DEVICES, describe, require, restart_on
from ..paths import available_paths, grouped_paths, run
from ..reference import quantize_activations


def describe_bits(bits: int, fmt: FloatFormat) -> str:
    bits = int(bits)
    if not is_finite(bits, fmt):  # a wrong path, or a file's expected bits, may hold inf or NaN
        name = "-inf" if bits & fmt.sign_bit else "inf"
        name = name if (bits & fmt.abs_mask) == fmt.inf_bits else "nan"
        return f"{bits:#0{fmt.width // 4 + 2}x} ({name})"
    m, e = decode(bits, fmt)
    value = Fraction(m) * Fraction(2) ** e
    return f"{bits:#0{fmt.width // 4 + 2}x} ({float(value)!r})" if abs(m) < 2**60 else \
        f"{bits:#x}"


def bit_name(position: int, fmt: FloatFormat) -> str:
    if position == fmt.width - 1:
        return "the sign bit"
    if position >= fmt.mant_bits:
        return f"exponent bit {position - fmt.mant_bits}"
    return f"mantissa bit {position}"


def dominant_group(case: LinearCase, r: int, n: int) -> int:
    """The group whose term dominates output (r, n) (weight row n; case.weight_row maps a
    grouped projection's column)."""
    qa, _ = quantize_activations(case.x_bits[r:r + 1], case.x_format, case.act_bits)
    terms = []
    for g in range(case.shape[1] // GROUP_SIZE):
        ks = slice(GROUP_SIZE * g, GROUP_SIZE * (g + 1))
        p = int((qa[0, ks] * case.q[n, ks]).sum())
        m, e = decode(int(case.scale_bits[n, g]), BFLOAT16)
        terms.append(abs(Fraction(p * m) * Fraction(2) ** e))
    return int(np.argmax(terms)) if terms else 0


def diff(case: LinearCase, got: np.ndarray, want: np.ndarray, limit: int = 5) -> list[str]:
    fmt = case.out_format
    where = np.argwhere(got != want)
    lines = [f"{len(where)} of {want.size} outputs differ"]
    for r, n in where[:limit]:
        x = int(got[r, n]) ^ int(want[r, n])
        row = case.weight_row(r, n)
        term = "no expert" if row >= case.shape[2] else \
            f"largest term: group {dominant_group(case, r, row)}"
        if case.routing is not None and row < case.shape[2]:
            term = f"expert {row // (case.shape[2] // case.experts)}, {term}"
        lines.append(
            f"  row {r}, out {n} ({term}): "
            f"expected {describe_bits(want[r, n], fmt)}, got {describe_bits(got[r, n], fmt)}; "
            f"first differing bit: {bit_name(x.bit_length() - 1, fmt)}")
    return lines


def replay(file: str, paths: list[str] | None = None, out=None, kernel: str | None = None) -> int:
    """Exit status 1 or 0 (see above); CounterexampleFileError for a file it cannot read. With
    `kernel`, or for a file of an outside kernel's check, the property it names on that kernel
    (replay_kernel)."""
    out = sys.stdout if out is None else out  # looked up now: a later redirect applies
    case, doc = read(file)
    if kernel or doc["path"] == "kernel":
        return replay_kernel(file, case, doc, kernel, out)
    m, k, n = case.shape
    routed = "" if case.routing is None else \
        f" ({case.experts} experts, top_k={case.routing.shape[1]})"
    print(f"{file}: {doc['source']} counterexample for path {doc['path']!r}, M={m} K={k} N={n}"
          f"{routed}, act_bits={case.act_bits}, w_bits={case.w_bits}, {case.x_format.name} -> "
          f"{case.out_format.name}", file=out)
    if doc.get("note"):
        print(f"  note: {doc['note']}", file=out)
    print(f"  found on {where(doc.get('device'))}; replayed on {where(describe())}", file=out)
    want = run(case, "reference")
    if case.expected is not None and (case.expected != want).any():
        print("  the file's expected bits differ from today's reference:", file=out)
        print("\n".join(diff(case, case.expected, want)), file=out)
    failing = 0
    if not paths:
        grouped = grouped_paths() if case.routing is not None else []
        paths = sorted((set(available_paths(case)) | set(grouped) | {doc["path"]})
                       - {"reference"})
        if m * k * n > 2**20:  # the Fraction oracle would take minutes: the reference suffices
            paths.remove("oracle")
    for path in paths:
        got = run(case, path)
        _count(want.size)
        if (got == want).all():
            print(f"  {path:<24} exact", file=out)
        else:
            failing += 1
            print(f"  {path:<24} DIFFERS: " + "\n".join(diff(case, got, want)), file=out)
    print("still fails" if failing else "fixed: every path agrees with the reference", file=out)
    return 1 if failing else 0


def where(device: dict | None) -> str:
    """A counterexample's device in words (a file older than the record: "a device not
    recorded")."""
    if not device:
        return "a device not recorded"
    name = {"interpret": "the Triton interpreter", "cuda": "cuda", None: "no Triton"}.get(
        device.get("device"), str(device.get("device")))
    gpu = f" ({device['gpu']})" if device.get("gpu") else ""
    return f"{name}{gpu}, Triton {device.get('triton')}"


def replay_kernel(file: str, case: LinearCase, doc: dict, kernel: str | None, out) -> int:
    """A `python -m exactness check` counterexample against `kernel` (default: the file's): 1
    while its property still fails, 0 once it holds."""
    from ..peers import replay as replay_property

    kernel = kernel or doc.get("kernel")
    m, k, n = case.shape
    print(f"{file}: {doc['source']} counterexample, property {doc.get('property', 'claim')!r} of "
          f"kernel {kernel} (claim {doc.get('claim', 'exact')}), M={m} K={k} N={n}", file=out)
    if doc.get("note"):
        print(f"  note: {doc['note']}", file=out)
    failing = replay_property(case, doc, kernel)
    print(f"  still fails: {failing}" if failing else "fixed: the property holds", file=out)
    return 1 if failing else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m exactness repro", description=__doc__)
    parser.add_argument("files", nargs="+")
    parser.add_argument("--path", action="append", help="replay only these paths")
    parser.add_argument("--kernel", metavar="KERNEL", help="replay a `check` counterexample's "
                        "property on this kernel (MODULE:FACTORY or a registered name)")
    parser.add_argument("--device", choices=DEVICES,
                        help="where the Triton paths replay (EXACTNESS_DEVICE; default: cuda "
                             "where there is a GPU, else interpret), whatever the file's device")
    args = parser.parse_args(argv)
    restart_on(args.device, ["repro", *(sys.argv[1:] if argv is None else argv)])
    require()
    codes = []
    for file in args.files:
        try:
            codes.append(replay(file, args.path, kernel=args.kernel))
        except CounterexampleFileError as error:  # 2: neither "fixed" (0) nor "still differs" (1)
            print(f"repro: {error}", file=sys.stderr)
            codes.append(2)
    return max(codes)
