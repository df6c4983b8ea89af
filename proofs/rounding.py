"""The one final rounding: round_scaled against IEEE round-to-nearest-even, every format."""

from __future__ import annotations

import z3

from exactness.contract import BFLOAT16, FLOAT16, FLOAT32

from .terms import Obligation


def rounding_inputs(m: z3.BitVecRef, e: z3.BitVecRef) -> z3.BoolRef:
    """What the roundings are proved for: every int64 m but -2**63, and every e the layers
    produce (|e| <= 320, beyond every e_r + emin: activations and scales are at most 2**128 or
    2**-149)."""
    return z3.And(m != z3.BitVecVal(-(2**63), 64), e >= -320, e <= 320)


def rounding(fmt) -> Obligation:
    """formats.round_scaled_array itself (run on bit-vectors) == IEEE RNE of m * 2**e, for every
    int64 m (but -2**63) and every e the layers produce, and all its shifts stay in [0, 63]."""
    from exactness.formats import round_scaled_array

    from .symbolic import Sym, shift_amounts_in_range

    def build():
        m, e = z3.BitVec("m", 64), z3.BitVec("e", 64)
        Sym.shift_conditions = []
        got = round_scaled_array(Sym(m), Sym(e), fmt).term
        pre = rounding_inputs(m, e)
        post = z3.And(got == ieee_rne_bits(m, e, fmt), shift_amounts_in_range())
        return pre, post, {"m": m, "e": e}

    return Obligation(f"rounding-{fmt.name}", f"round_scaled_array is IEEE RNE to {fmt.name}",
                      build, acc_bits=64, tactic=True)


def rounding_normal(fmt) -> Obligation:
    """cpu_vnni.c's round8_normal, one lane, as written there: where its test passes (bits to
    drop, s > 0, and the leading bit's binade normal and finite), RNE as one add,
    (a + 2**(s-1) - 1 + the last kept bit) >> s, joined to the exponent field by an add that
    carries a rounded-up significand into it, is IEEE RNE of m * 2**e; its shifts stay in
    [0, 63]. Every other vector goes to round8, whose arithmetic is round_scaled_array's."""
    mant, bias, emax = fmt.mant_bits, fmt.bias, fmt.exp_max_field

    def build():
        m, e = z3.BitVec("m", 64), z3.BitVec("e", 64)
        a = z3.If(m < 0, -m, m)  # vpabsq
        lz = z3.BitVecVal(64, 64)  # vplzcntq
        for bit in range(64):
            lz = z3.If(z3.Extract(bit, bit, a) == 1, z3.BitVecVal(63 - bit, 64), lz)
        s = (64 - fmt.precision) - lz
        field = e + (62 + bias) - lz
        normal = z3.And(s > 0, field >= 0, field < emax - 1)
        one = z3.BitVecVal(1, 64)
        last_kept = z3.LShR(a, s) & one
        below_half = (one << (s - 1)) - one
        n = z3.LShR(a + below_half + last_kept, s)
        bits = (field << mant) + n
        bits = z3.If(m < 0, bits | (1 << (mant + fmt.exp_bits)), bits)
        shifts = z3.And(*(z3.And(x >= 0, x <= 63) for x in (s, s - 1)))
        pre = z3.And(rounding_inputs(m, e), normal)
        return pre, z3.And(bits == ieee_rne_bits(m, e, fmt), shifts), {"m": m, "e": e}

    return Obligation(f"rounding-normal-{fmt.name}", f"round8_normal's add-based RNE is IEEE RNE "
                      f"to {fmt.name} where its test passes", build, acc_bits=64, tactic=True)


def ieee_rne_bits(m: z3.BitVecRef, e: z3.BitVecRef, fmt) -> z3.BitVecRef:
    """Z3's own IEEE semantics: m exactly into a wide float, times 2**e (exponent field), RNE."""
    sort = z3.FPSort(13, 66)  # 65 fraction bits: every int64 exact; exponents far from limits
    value = z3.fpSignedToFP(z3.RNE(), m, sort)
    bits = z3.fpToIEEEBV(value)
    scaled = z3.Concat(z3.Extract(78, 78, bits), z3.Extract(77, 65, bits) + z3.Extract(12, 0, e),
                       z3.Extract(64, 0, bits))
    exact_value = z3.If(m == 0, value, z3.fpBVToFP(scaled, sort))
    out = z3.fpToFP(z3.RNE(), exact_value, z3.FPSort(fmt.exp_bits, fmt.precision))
    return z3.ZeroExt(64 - fmt.width, z3.fpToIEEEBV(out))


ROUNDING_FORMATS = (BFLOAT16, FLOAT16, FLOAT32)
