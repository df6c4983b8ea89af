"""The VNNI span kernel's dots (16-bit activations as int16 words, 4-bit weights)."""

from __future__ import annotations

import z3

from exactness import dataflow
from exactness.contract import GROUP_SIZE, act_qmax

from .terms import Obligation, accumulate_step, fits, product, signed_var, wide


def span_fold(w_bits: int) -> Obligation:
    """cpu_vnni.c's span kernel: the folded weights q * f, |f| <= dataflow.span_fold_limit, are
    s16 values (what vpmullw and vpdpwssd hold)."""

    def build():
        limit = dataflow.span_fold_limit(w_bits)
        q, q_ok = signed_var("q", -(2 ** (w_bits - 1)), 2 ** (w_bits - 1) - 1)
        f, f_ok = signed_var("f", -limit, limit)
        return z3.And(q_ok, f_ok), fits(product(q, f), dataflow.SPAN_WEIGHT_BITS), {"q": q, "f": f}

    return Obligation(f"span-fold-w{w_bits}", f"folded weights q * f in "
                      f"int{dataflow.SPAN_WEIGHT_BITS}", build, w_bits=w_bits,
                      acc_bits=dataflow.SPAN_WEIGHT_BITS)


def span_group(w_bits: int, a_bits: int, dot_bits: int) -> Obligation:
    """cpu_vnni.c's span kernel with a span of one group, which the certificate always allows:
    there f = c >> base is the odd part of ms << shift, |f| <= 255, and the 32 products
    qa * (q * f) sum in int32 (vpdpwssd) whatever the activations and weights."""
    qmax, f_max = act_qmax(a_bits), 2**dataflow.SCALE_MANT_BITS - 1

    def make():
        a, a_ok = signed_var("qa", -qmax, qmax)
        q, q_ok = signed_var("q", -(2 ** (w_bits - 1)), 2 ** (w_bits - 1) - 1)
        f, f_ok = signed_var("f", -f_max, f_max)
        bits = q.size() + f.size()  # q * f at its natural width: exact
        qf = z3.SignExt(bits - q.size(), q) * z3.SignExt(bits - f.size(), f)
        return product(a, qf), z3.And(a_ok, q_ok, f_ok), z3.BoolVal(True), {"qa": a, "q": q,
                                                                            "f": f}

    return accumulate_step(
        f"span-group-w{w_bits}-a{a_bits}", f"one group of folded s16 dots (vpdpwssd) in "
        f"int{dot_bits}", dot_bits, GROUP_SIZE, qmax * 2 ** (w_bits - 1) * f_max, make,
        w_bits=w_bits, a_bits=a_bits)


def span_unshifted(a_bits: int, dot_bits: int) -> Obligation:
    """cpu_vnni.c's span kernel on an unshifted block, one step of its induction over the chains
    of every group: a chain's sums lo (even lane, started at 2**31) and hi (odd lane, from 0),
    each certified to |.| <= Qa * dataflow.span_size_limit, wrap into int32 registers whose 64-bit
    lane V (hi above lo) is added to A, and V >> 32 (arithmetic) to H, both mod 2**64. Claim: the
    registers hold hi exactly and V = hi * 2**32 + lo + 2**31, and the invariant
    A - (H << 32) - n * 2**31 == L (mod 2**64, L the sum of the lo's, n the chains so far) holds
    for n + 1. So the kernel's A - ((H + G) << 32) after 2 G chains is the even rows' T mod 2**64,
    and T itself, as |T| < 2**63 (combine); the odd rows' T is H."""
    bound = act_qmax(a_bits) * dataflow.span_size_limit(a_bits)

    def build():
        lo, lo_ok = signed_var("lo", -bound, bound)
        hi, hi_ok = signed_var("hi", -bound, bound)
        acc, h_acc, low_sum, n = (z3.BitVec(name, 64) for name in ("A", "H", "L", "n"))
        bias = z3.BitVecVal(2**31, 64)
        invariant = acc - (h_acc << 32) - n * bias == low_sum
        lo_reg = z3.Extract(dot_bits - 1, 0, z3.SignExt(64 - lo.size(), lo)) + 2**31  # wraps
        hi_reg = z3.Extract(dot_bits - 1, 0, z3.SignExt(64 - hi.size(), hi))
        v = z3.Concat(hi_reg, lo_reg)
        new_acc, new_h = acc + v, h_acc + (v >> 32)  # vpaddq; vpsraq then vpaddq
        new_low = low_sum + z3.SignExt(64 - lo.size(), lo)
        post = z3.And(fits(lo, dot_bits), fits(hi, dot_bits),
                      wide(v) == wide(hi) * 2**32 + wide(lo) + 2**31,
                      new_acc - (new_h << 32) - (n + 1) * bias == new_low)
        return z3.And(lo_ok, hi_ok, invariant), post, {"lo": lo, "hi": hi, "A": acc, "H": h_acc,
                                                       "L": low_sum, "n": n}

    return Obligation(f"span-unshifted-a{a_bits}", f"an unshifted block's biased chains "
                      f"(int{dot_bits}) recombine exactly mod 2**64", build, a_bits=a_bits,
                      acc_bits=dot_bits)
