"""The AMX kernel's span dots (cpu_amx.c): weight digits folded per span of groups, int8 tiles."""

from __future__ import annotations

import z3

from exactness import dataflow
from exactness.contract import GROUP_SIZE, act_qmax

from .terms import (
    WIDE,
    Obligation,
    accumulate_step,
    bounded_product,
    const,
    fits,
    product,
    signed_var,
    wide,
    within,
)


def amx_span_digits(w_bits: int) -> Obligation:
    """cpu_amx.c's fold: q * f with |f| <= dataflow.span_fold_limit, as vpmullw computes it (16
    bits, wrapping), is exact; its low byte read as u8 (lo, vpmovwb) and its arithmetic shift by 8
    read as s8 (hi) give it back: 256 * hi + lo == q * f."""

    def build():
        limit = dataflow.span_fold_limit(w_bits)
        q, q_ok = signed_var("q", -(2 ** (w_bits - 1)), 2 ** (w_bits - 1) - 1)
        f, f_ok = signed_var("f", -limit, limit)
        exact = product(q, f)
        folded = z3.Extract(15, 0, exact)  # vpmullw keeps the low 16 bits
        lo = z3.ZeroExt(WIDE - 8, z3.Extract(7, 0, folded))
        hi = z3.SignExt(WIDE - 8, z3.Extract(15, 8, folded))  # vpsraw 8, then the low byte
        post = z3.And(fits(exact, dataflow.SPAN_WEIGHT_BITS), hi * 256 + lo == exact)
        return z3.And(q_ok, f_ok), post, {"q": q, "f": f}

    return Obligation(f"amx-span-digits-w{w_bits}", "folded weights q * f in s16, split into a "
                      "u8 and an s8 digit exactly", build, w_bits=w_bits,
                      acc_bits=dataflow.SPAN_WEIGHT_BITS)


def amx_span_dot(dot_bits: int) -> Obligation:
    """cpu_amx.c: a span's tdpbuud and tdpbusd add, per int32 element of a tile zeroed per span,
    products u * d, u a biased u8 limb and d a u8 or s8 digit, over at most AMX_SPAN_GROUPS
    groups. One product a step: Intel adds a dword's 4 products, then the sum, so each of its
    partial sums is one of these."""
    steps = dataflow.AMX_SPAN_GROUPS * GROUP_SIZE
    return accumulate_step(
        "amx-span-dot", f"tdpbuud / tdpbusd: {steps} u8 x (u8 or s8) products in int{dot_bits}",
        dot_bits, steps, 255 * 255, bounded_product(("u", 0, 255), ("d", -128, 255)))


def amx_span_terms(a_bits: int) -> Obligation:
    """cpu_amx.c's add_span: E = sum_ij D_ij << 8 (i + j) over its limbs i and digits j, each D
    within dataflow.amx_span_dot_bound, summed in int64 term by term."""
    bound = dataflow.amx_span_dot_bound()
    limbs = dataflow.act_limbs(a_bits)

    def build():
        names, pre, post, acc = {}, [], [], const(0)
        for i in range(limbs):
            for j in range(2):
                d, d_ok = signed_var(f"D{i}{j}", -bound, bound)
                names[f"D{i}{j}"] = d
                pre.append(d_ok)
                acc = acc + (wide(d) << (8 * (i + j)))
                post.append(fits(acc, dataflow.COMBINE_ACC_BITS))
        return z3.And(pre), z3.And(post), names

    return Obligation(f"amx-span-terms-a{a_bits}", f"{limbs}x2 span dots combined in "
                      f"int{dataflow.COMBINE_ACC_BITS}", build, a_bits=a_bits,
                      acc_bits=dataflow.COMBINE_ACC_BITS)


def amx_span_combine(w_bits: int, a_bits: int, k: int, spread: int) -> Obligation:
    """cpu_amx.c's T, one k at a time (a span's E << base is the sum of its k's terms, so each
    span's end is one of these partial sums): T starts at -B * R (B = 2**(8 L - 1), R =
    sum_k q * c) and adds (qa + B) * q * c per k, c = ms << shift. Invariant: T = X - B * R',
    X = sum of qa * q * c so far, R' the rest of R. Claim: every T, and each span's term, fits
    int64, within dataflow.amx_combine_bound."""
    bias = 2 ** (8 * dataflow.act_limbs(a_bits) - 1)
    qmax, mant = act_qmax(a_bits), 2**dataflow.SCALE_MANT_BITS - 1
    qc_max = 2 ** (w_bits - 1) * mant << spread
    bound = dataflow.amx_combine_bound(k, w_bits, a_bits, spread)
    bits = dataflow.COMBINE_ACC_BITS

    def build():
        j, acc = z3.BitVec("j", 32), z3.BitVec("T", bits)
        x, x_ok = signed_var("X", -k * qmax * qc_max, k * qmax * qc_max)
        rest, rest_ok = signed_var("R'", -k * qc_max, k * qc_max)
        qa, qa_ok = signed_var("qa", -qmax, qmax)
        qc, qc_ok = signed_var("q * c", -qc_max, qc_max)  # |q| * |ms| << spread at most
        done = z3.ZeroExt(WIDE - 32, j)
        exact = product(qa, qc)  # the contract's term; the kernel adds (qa + B) * q * c
        new_x = wide(x) + exact
        qc = wide(qc)
        pre = z3.And(z3.ULT(j, k), x_ok, rest_ok, qa_ok, qc_ok,
                     wide(x) <= done * (qmax * qc_max), wide(x) >= -done * (qmax * qc_max),
                     wide(rest) <= (k - 1 - done) * qc_max,
                     wide(rest) >= -(k - 1 - done) * qc_max,
                     wide(acc) == wide(x) - bias * (wide(rest) + qc))
        new = wide(acc) + exact + bias * qc
        post = z3.And(fits(new, bits), within(new, bound), new == new_x - bias * wide(rest),
                      new_x <= (done + 1) * (qmax * qc_max), new_x >= -(done + 1) * (qmax * qc_max),
                      fits(const(bound), bits),
                      fits(const(bias * k * qc_max), bits))  # the start, -B * R
        return pre, post, {"j": j, "T": acc, "X": x, "R'": rest, "qa": qa, "q * c": qc}

    return Obligation(f"amx-span-combine-w{w_bits}-a{a_bits}-k{k}",
                      f"the AMX kernel's T over {k} k, starting at -B * R, in int{bits}, spread "
                      f"<= {spread}", build, w_bits=w_bits, a_bits=a_bits, k=k, acc_bits=bits,
                      spread=spread)
