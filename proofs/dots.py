"""The group dots on int8 limbs (the Triton group kernel, AVX-512 VNNI), and their recombination."""

from __future__ import annotations

import z3

from exactness import dataflow
from exactness.contract import GROUP_SIZE, act_qmax

from .terms import (
    WIDE,
    Obligation,
    accumulate_step,
    fits,
    product,
    product_term,
    signed_var,
    wide,
    within,
)


def group_dot(w_bits: int, a_bits: int, dot_bits: int) -> Obligation:
    limb_max = act_qmax(a_bits) if dataflow.act_limbs(a_bits) == 1 else 128
    return accumulate_step(
        f"group-dot-w{w_bits}-a{a_bits}", f"int8 x int{w_bits} limb dots of 32 in int{dot_bits}",
        dot_bits, GROUP_SIZE, limb_max * 2 ** (w_bits - 1),
        product_term(-limb_max, min(limb_max, 127), w_bits),
        w_bits=w_bits, a_bits=a_bits)


def vnni_dot(w_bits: int, dot_bits: int) -> Obligation:
    """cpu_vnni.c: vpdpbusd sums (limb + 128) * q, limb + 128 in [0, 255], in int32 lanes."""
    return accumulate_step(
        f"vnni-dot-w{w_bits}", f"biased u8 x int{w_bits} dots of 32 (vpdpbusd) in int{dot_bits}",
        dot_bits, GROUP_SIZE, 255 * 2 ** (w_bits - 1), product_term(0, 255, w_bits),
        w_bits=w_bits)


def group_recombine(w_bits: int, a_bits: int, dot_bits: int) -> Obligation:
    """P' = 256 * D_hi + D_lo in the dot width, from the limb dots' bounds. The GPU kernel's MMA
    may add the low limb's products onto C = 256 * D_hi in its (saturating) accumulator: D_lo
    ranges over every partial sum of the low dot too (group-dot bounds them all)."""

    def build():
        bound = GROUP_SIZE * 128 * 2 ** (w_bits - 1)
        d_hi, hi_ok = signed_var("d_hi", -bound, bound)
        d_lo, lo_ok = signed_var("d_lo", -bound, bound)
        t1 = wide(d_hi) * 256
        t2 = t1 + wide(d_lo)
        return (z3.And(hi_ok, lo_ok), z3.And(fits(t1, dot_bits), fits(t2, dot_bits)),
                {"d_hi": d_hi, "d_lo": d_lo})

    return Obligation(f"group-recombine-w{w_bits}-a{a_bits}",
                      f"two-limb recombination of P' in int{dot_bits}", build, w_bits=w_bits,
                      a_bits=a_bits, acc_bits=dot_bits)


def vnni_recombine(w_bits: int, a_bits: int, dot_bits: int) -> Obligation:
    """cpu_vnni.c's correction of its biased dots D' = D + 128 * sum_k q: the low limb's sum
    starts at -(sum_k q << 15) (two limbs) or -(sum_k q << 7) (one limb); every partial sum from
    there, and P = (D'_hi << 8) + that sum, stay in int32 and give dataflow's
    P = 256 * D_hi + D_lo + 128 * sum_k q (or P = D_lo)."""
    two = dataflow.act_limbs(a_bits) == 2
    limb_max = 128 if two else act_qmax(a_bits)

    def build():
        bound = GROUP_SIZE * limb_max * 2 ** (w_bits - 1)
        biased_bound = GROUP_SIZE * 255 * 2 ** (w_bits - 1)  # vnni-dot: every partial sum
        d_hi, hi_ok = signed_var("D_hi", -bound, bound)
        d_lo, lo_ok = signed_var("D_lo", -bound, bound)
        wsum, sum_ok = signed_var("wsum", -GROUP_SIZE * 2 ** (w_bits - 1),
                                  GROUP_SIZE * (2 ** (w_bits - 1) - 1))
        partial, partial_ok = signed_var("partial", -biased_bound, biased_bound)
        offset = dataflow.LIMB_OFFSET * wide(wsum)
        biased_hi, biased_lo = wide(d_hi) + offset, wide(d_lo) + offset  # vpdpbusd's D'
        correction = wide(wsum) * 2 ** (15 if two else 7)
        low_sum = biased_lo - correction
        steps = [correction, -correction, wide(partial) - correction, low_sum]
        if two:
            steps += [biased_hi * 256, biased_hi * 256 + low_sum]
            want = wide(d_hi) * 256 + wide(d_lo) + offset
        else:
            want = wide(d_lo)
        post = z3.And(*[fits(v, dot_bits) for v in steps], steps[-1] == want)
        return (z3.And(hi_ok, lo_ok, sum_ok, partial_ok), post,
                {"D_hi": d_hi, "D_lo": d_lo, "wsum": wsum, "partial": partial})

    return Obligation(f"vnni-recombine-w{w_bits}-a{a_bits}",
                      f"the VNNI kernel's bias correction gives P in int{dot_bits}", build,
                      w_bits=w_bits, a_bits=a_bits, acc_bits=dot_bits)


def four_limb_bounds(w_bits: int, kind: str) -> tuple[int, int]:
    """The largest |P_lo| and |P_hi| of a four-limb group: P_lo = 256 * D_1 + D_0 and
    P_hi = 256 * D_3 + D_2, each D_j a limb dot of 32 (group-dot). "vnni": the AVX-512 build's
    (vnni_four_limbs), whose biased dots vnni-dot bounds by 32 * 255 * 2**(w_bits - 1) and whose
    P_hi also holds the correction -2**15 * sum_k q. "avx2": the AVX2 build's, P_lo = sum_k q *
    (qa & 0xFFFF) and P_hi = sum_k q * (qa >> 16)."""
    if kind == "avx2":
        q_max = GROUP_SIZE * 2 ** (w_bits - 1)
        return q_max * 0xFFFF, q_max * 2**15
    if kind == "group":
        dot = GROUP_SIZE * 128 * 2 ** (w_bits - 1)
        return 257 * dot, 257 * dot
    dot, wsum = GROUP_SIZE * 255 * 2 ** (w_bits - 1), GROUP_SIZE * 2 ** (w_bits - 1)
    return 257 * dot, 257 * dot + 2**15 * wsum  # "vnni"


def vnni_four_limbs(w_bits: int, a_bits: int, dot_bits: int) -> Obligation:
    """cpu_vnni.c at 32-bit activations: four biased limbs (the bytes of qa + 2**31), their dots
    D'_j = D_j + 128 * sum_k q. The high pair's low sum starts at -(sum_k q << 15); every
    partial sum from there, P_hi = (D'_3 << 8) + that sum and P_lo = (D'_1 << 8) + D'_0 stay in
    int32, and 2**16 * P_hi + P_lo is dataflow's P = sum_j 256**j D_j + limb_offset * sum_k q."""
    bound = GROUP_SIZE * 128 * 2 ** (w_bits - 1)
    biased_bound = GROUP_SIZE * 255 * 2 ** (w_bits - 1)  # vnni-dot: every partial sum

    def build():
        dots = [signed_var(f"D_{j}", -bound, bound) for j in range(4)]
        wsum, sum_ok = signed_var("wsum", -GROUP_SIZE * 2 ** (w_bits - 1),
                                  GROUP_SIZE * (2 ** (w_bits - 1) - 1))
        partial, partial_ok = signed_var("partial", -biased_bound, biased_bound)
        offset = dataflow.LIMB_OFFSET * wide(wsum)
        biased = [wide(d) + offset for d, _ in dots]  # vpdpbusd's D'_j
        correction = wide(wsum) * 2**15
        high_low = biased[2] - correction
        p_hi, p_lo = biased[3] * 256 + high_low, biased[1] * 256 + biased[0]
        steps = [correction, -correction, wide(partial) - correction, high_low, biased[3] * 256,
                 p_hi, biased[1] * 256, p_lo]
        want = sum(wide(d) * 256**j for j, (d, _) in enumerate(dots)) \
            + dataflow.limb_offset(a_bits) * wide(wsum)
        post = z3.And(*[fits(v, dot_bits) for v in steps], p_hi * 2**16 + p_lo == want)
        names = {f"D_{j}": d for j, (d, _) in enumerate(dots)}
        return (z3.And(*[ok for _, ok in dots], sum_ok, partial_ok), post,
                {**names, "wsum": wsum, "partial": partial})

    return Obligation(f"vnni-four-limbs-w{w_bits}-a{a_bits}",
                      f"the VNNI kernel's four limbs give P as two int{dot_bits} halves", build,
                      w_bits=w_bits, a_bits=a_bits, acc_bits=dot_bits)


def four_limb_terms(w_bits: int, a_bits: int, k: int, spread: int, kind: str) -> Obligation:
    """A group term at 32-bit activations, (P_hi * c << 16) + P_lo * c with c = ms << shift:
    both products, the shift and the sum fit int64 for every P_hi and P_lo of four_limb_bounds,
    shift <= spread. So the term is P * c exactly (P' * c: the Triton kernels add the limb
    offset apart), the term the combine proof sums. `kind`: "vnni" (the AVX-512 build's two
    vpmuldq), "group" (the Triton kernels' group_term) or "avx2" (the AVX2 build's halves of qa
    itself)."""
    lo_max, hi_max = four_limb_bounds(w_bits, kind)
    mant = 2**dataflow.SCALE_MANT_BITS - 1
    bits = dataflow.COMBINE_ACC_BITS

    def build():
        p_hi, hi_ok = signed_var("P_hi", -hi_max, hi_max)
        p_lo, lo_ok = signed_var("P_lo", -lo_max, lo_max)
        ms, ms_ok = signed_var("ms", -mant, mant)
        sh = z3.BitVec("shift", 8)
        shift = z3.ZeroExt(WIDE - 8, sh)
        high, low = (product(p_hi, ms) << shift) << 16, product(p_lo, ms) << shift
        return (z3.And(hi_ok, lo_ok, ms_ok, z3.ULE(sh, spread)),
                z3.And(fits(high, bits), fits(low, bits), fits(high + low, bits)),
                {"P_hi": p_hi, "P_lo": p_lo, "ms": ms, "shift": sh})

    return Obligation(f"{kind}-four-limb-terms-w{w_bits}-a{a_bits}-k{k}",
                      f"(P_hi * c << 16) + P_lo * c in int{bits}, spread <= {spread}", build,
                      w_bits=w_bits, a_bits=a_bits, k=k, acc_bits=bits, spread=spread)


def group_bound(w_bits: int, a_bits: int) -> Obligation:
    """The closed form (A2Q-style) |P| <= 32 * 2**(bw-1) * Qa: never exceeded, and attained; with
    two limbs also the group kernel's |P'| = |sum_k (qa - LIMB_OFFSET) * q| <=
    dataflow.group_term_bound."""
    qmax, bound = act_qmax(a_bits), 2 ** (w_bits - 1) * act_qmax(a_bits)
    term_bound = dataflow.group_term_bound(w_bits, a_bits) // GROUP_SIZE

    def build():
        a, a_ok = signed_var("a", -qmax, qmax)
        w, w_ok = signed_var("w", -(2 ** (w_bits - 1)), 2 ** (w_bits - 1) - 1)
        post = within(product(a, w), bound)
        if dataflow.act_limbs(a_bits) > 1:  # a - limb_offset one bit wider: it cannot wrap
            shifted = z3.SignExt(1, a) - dataflow.limb_offset(a_bits)
            post = z3.And(post, within(product(shifted, w), term_bound))
        return z3.And(a_ok, w_ok), post, {"a": a, "w": w}

    return Obligation(f"group-bound-w{w_bits}-a{a_bits}",
                      f"|qa * q| <= {bound}, so |P| <= 32 * that = {GROUP_SIZE * bound}", build,
                      w_bits=w_bits, a_bits=a_bits, extra={"attained": bound})
