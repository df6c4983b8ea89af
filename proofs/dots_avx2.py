"""The AVX2 kernel's group dots (kernel_avx2.h): the stored fields w = q + 2**(bits - 1)
(unsigned) against qa's bytes b_l in two's complement, the low ones unsigned and the top one
signed; per word of 32 bits, D_l = sum w * b_l over its k (8 of 4-bit fields, 4 of 8-bit ones);
P' = sum_l 256**l D_l over a group's words; and P = P' - 2**(bits - 1) * S with S = sum_k qa
(four limbs: each 16-bit half so).
"""

from __future__ import annotations

from collections.abc import Callable

import z3

from exactness import dataflow
from exactness.contract import GROUP_SIZE, act_qmax

from .terms import Obligation, accumulate_step, const, fits, product, signed_var, wide


def avx2_limb(a_bits: int, limb: int) -> tuple[int, int]:
    """The range of qa's byte `limb` in the AVX2 build's activations (quantize_into)."""
    limbs = dataflow.act_limbs(a_bits)
    if limbs == 1:
        return -act_qmax(a_bits), act_qmax(a_bits)
    return (-128, 127) if limb == limbs - 1 else (0, 255)


def avx2_halves(a_bits: int) -> list[tuple[int, ...]]:
    """The limbs of each int32 half of P: all of them, or with four limbs (0, 1) and (2, 3)."""
    limbs = dataflow.act_limbs(a_bits)
    return [(0, 1), (2, 3)] if limbs == 4 else [tuple(range(limbs))]


def avx2_pairs(a_bits: int, field_max: int, pairs: tuple[tuple[int, int], ...],
               bits: int) -> Callable:
    """build() for a lane's products of 4 fields (w in [0, field_max]) by 4 bytes of each limb:
    every pair of `pairs` (indices of the products it adds) fits int`bits`, and so does the sum
    of the two."""

    def build():
        names, pre, post = {}, [], []
        for limb in range(dataflow.act_limbs(a_bits)):
            lo, hi = avx2_limb(a_bits, limb)
            terms = []
            for i in range(4):
                w, w_ok = signed_var(f"w{limb}_{i}", 0, field_max)
                b, b_ok = signed_var(f"b{limb}_{i}", lo, hi)
                names |= {f"w{limb}_{i}": w, f"b{limb}_{i}": b}
                terms.append(product(w, b))
                pre += [w_ok, b_ok]
            sums = [terms[i] + terms[j] for i, j in pairs]
            post += [*(fits(p, bits) for p in sums), fits(sums[0] + sums[1], bits)]
        return z3.And(*pre), z3.And(*post), names

    return build


def avx2_nibble_pairs(a_bits: int, field_max: int = 15) -> Obligation:
    """4-bit fields (w in [0, field_max = 15]): each vpmaddubsw pair w0 * b0 + w1 * b1 of every
    limb fits int16 (none saturates), and so do the two pairs of a chunk's low and high nibbles
    added by vpaddw (which wraps). (8-bit fields, field_max 255, would saturate.)"""
    return Obligation(f"avx2-nibble-pairs-a{a_bits}",
                      "vpmaddubsw pairs of 4-bit fields and qa's bytes, two added, fit int16",
                      avx2_pairs(a_bits, field_max, ((0, 1), (2, 3)), 16), w_bits=4,
                      a_bits=a_bits, acc_bits=16)


def avx2_byte_words(a_bits: int) -> Obligation:
    """8-bit fields (w in [0, 255]): vpmaddwd's pairs of 16-bit w * b_l (even k, odd k) fit
    int32, and so does the sum of a lane's two (byte_dots). (vpmaddubsw's would saturate:
    avx2-nibble-pairs at 8-bit fields is refuted.)"""
    return Obligation(f"avx2-byte-words-a{a_bits}",
                      "vpmaddwd pairs of 8-bit fields and qa's bytes, two added, fit int32",
                      avx2_pairs(a_bits, 255, ((0, 2), (1, 3)), 32), w_bits=8, a_bits=a_bits,
                      acc_bits=32)


def avx2_group_sum(w_bits: int, a_bits: int, half: tuple[int, ...]) -> Obligation:
    """A group's P' (one half with four limbs) summed word by word in int32: each word's value
    sum_l 256**l D_l ((D_1 << 8) + D_0) fits, and every partial sum of the group's words (vphaddd
    adds them in a tree: each partial sum is a sum of some of the words) stays within int32."""
    per_word = 32 // w_bits  # k a 32-bit word holds
    w_max = 2**w_bits - 1
    d_max = [per_word * w_max * max(map(abs, avx2_limb(a_bits, limb))) for limb in half]
    word_bound = sum(d << (8 * i) for i, d in enumerate(d_max))

    def make():
        names, pre, value = {}, [], const(0)
        for i, d in enumerate(d_max):
            v, ok = signed_var(f"D{half[i]}", -d, d)
            names[f"D{half[i]}"] = v
            pre.append(ok)
            value = value + (wide(v) << (8 * i))
        return value, z3.And(*pre), fits(value, 32), names

    return accumulate_step(
        f"avx2-group-sum-w{w_bits}-a{a_bits}-l{half[0]}",
        f"a group's words' sum_l 256**l D_l (limbs {half}) in int32", 32,
        GROUP_SIZE // per_word, word_bound, make, w_bits=w_bits, a_bits=a_bits)


def avx2_offset(w_bits: int, a_bits: int, half: tuple[int, ...]) -> Obligation:
    """P = P' - (S << (bits - 1)) in int32: the fields' offset 2**(bits - 1) taken off on the
    activations' side (S: the group's sum of qa, or of its 16-bit half), both terms and the
    difference fitting int32, for every P' within the group bound (avx2-group-sum)."""
    per_word = 32 // w_bits
    w_max = 2**w_bits - 1
    p_max = GROUP_SIZE // per_word * sum(
        per_word * w_max * max(map(abs, avx2_limb(a_bits, limb))) << (8 * i)
        for i, limb in enumerate(half))
    s_lo = min(avx2_limb(a_bits, half[-1])[0] << (8 * (len(half) - 1)), 0)
    s_hi = sum(avx2_limb(a_bits, limb)[1] << (8 * i) for i, limb in enumerate(half))
    if len(half) == 1 or dataflow.act_limbs(a_bits) == 2:  # S sums qa itself
        s_lo, s_hi = -act_qmax(a_bits), act_qmax(a_bits)

    def build():
        p, p_ok = signed_var("P'", -p_max, p_max)
        s, s_ok = signed_var("S", GROUP_SIZE * s_lo, GROUP_SIZE * s_hi)
        offset = wide(s) << (w_bits - 1)
        return (z3.And(p_ok, s_ok), z3.And(fits(offset, 32), fits(wide(p) - offset, 32)),
                {"P'": p, "S": s})

    return Obligation(f"avx2-offset-w{w_bits}-a{a_bits}-l{half[0]}",
                      f"P' - (S << {w_bits - 1}) in int32 (limbs {half})", build,
                      w_bits=w_bits, a_bits=a_bits, acc_bits=32)
