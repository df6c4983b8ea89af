"""One description of the integer dataflow: the widths every step uses, and the bounds they imply.

The reference, the kernels and the proofs all read these numbers, so changing a width here changes
what the code does and what is proved about it.

Dataflow of one output y[r, n] (contract section 4), in the GPU group kernel's order:
  1. activation limbs: qa (|qa| <= Qa) is split into int8 limbs; 16-bit activations as
     qa - LIMB_OFFSET = hi * 256 + lo (hi, lo in [-128, 127]) since [-32767, 32767] shifted by
     128 fits the 65536 values two signed limbs span, while unshifted 32767 would need hi = 128
     (32-bit activations: four limbs of qa - limb_offset(32), the same rule);
  2. group dot: D = sum_{k in group} limb * qw (int8 x int8 -> DOT_ACC_BITS), then
     P' = 256 * D_hi + D_lo (exact in DOT_ACC_BITS), so that the group's P = sum_k qa * qw is
     P' + LIMB_OFFSET * sum_k qw (one limb: P' = P);
  3. combine: with the bf16 scale ms * 2**es (|ms| < 2**SCALE_MANT_BITS) and its factor
     f = ms << (es - emin[n]) (a FACTOR_BITS integer), T = sum_g P' * f + LIMB_OFFSET * R[n] in
     COMBINE_ACC_BITS, where R[n] = sum_k qw * f is derived once per weights (the limb offset
     leaves no per-group work); y = RNE(T * 2**(e_r + emin[n])). T is the contract's
     sum_g P * f; the partial sums on the way, in any order of groups, stay within combine_bound.
"""

from __future__ import annotations

from .contract import GROUP_SIZE, act_qmax, check_weight_bits, group_dot_bound

LIMB_BITS = 8
LIMB_OFFSET = 128
DOT_ACC_BITS = 32
COMBINE_ACC_BITS = 64
SCALE_MANT_BITS = 8  # bf16 significand with the hidden bit: |ms| <= 255
FACTOR_BITS = 32  # f = ms << shift as the kernels hold it (int32 for certified spreads: proved)


def act_limbs(act_bits: int) -> int:
    """How many int8 limbs carry one activation: 1 for |qa| <= 127, 2 for 16 bits, 4 for 32."""
    return -(-act_qmax(act_bits).bit_length() // LIMB_BITS)


def limb_offset(act_bits: int) -> int:
    """What activation_limbs subtracts from qa: 0 for one limb, else 128 * (1 + 256 + ...) over
    all limbs but the top one (LIMB_OFFSET for 16 bits, 0x808080 for 32). L signed limbs span
    [-128 S, 127 S] (S = (256**L - 1) / 255): 2**(8 L) values, one more than [-Qa, Qa] holds,
    so qa fits once shifted down by this (proved: limb-split)."""
    return offset_for_limbs(act_limbs(act_bits))


def offset_for_limbs(limbs: int) -> int:
    """limb_offset for activations in `limbs` int8 limbs."""
    return LIMB_OFFSET * (2 ** (LIMB_BITS * (limbs - 1)) - 1) // 255 if limbs > 1 else 0


def limb_offset_sum_bound(w_bits: int, act_bits: int) -> int:
    """Worst |limb_offset * sum_k qw| of one group: the part of P that step 3 adds once per row."""
    return limb_offset(act_bits) * GROUP_SIZE * 2 ** (w_bits - 1)


def group_term_bound(w_bits: int, act_bits: int) -> int:
    """Worst |P'| of one group (step 2): P' = P - LIMB_OFFSET * sum_k qw."""
    return group_dot_bound(w_bits, act_bits) + limb_offset_sum_bound(w_bits, act_bits)


def combine_bound(k: int, w_bits: int, act_bits: int, spread: int) -> int:
    """Worst |T| of step 3, and of every partial sum on the way (each group's P' * f, the offset
    sum's LIMB_OFFSET * sum_k qw * f), for K inputs and a per-row scale-exponent spread."""
    check_weight_bits(w_bits)
    groups = k // GROUP_SIZE
    per_group = group_term_bound(w_bits, act_bits) + limb_offset_sum_bound(w_bits, act_bits)
    return groups * (2**SCALE_MANT_BITS - 1) * per_group << spread


def max_safe_spread(k: int, w_bits: int, act_bits: int, acc_bits: int = COMBINE_ACC_BITS) -> int:
    """The largest spread whose combine fits a signed `acc_bits` accumulator (-1: none does).
    combine_bound is its bound at spread 0 shifted left by the spread, so that is the largest s
    with bound << s <= limit: the bit length of limit // bound, less one (a layer's every forward
    asks, on the CPU: no search)."""
    limit = 2 ** (acc_bits - 1) - 1
    return (limit // combine_bound(k, w_bits, act_bits, 0)).bit_length() - 1

MAX_WEIGHT_LIMBS = 3  # the CPU path folds scales into weights of at most 3 int8 limbs

# The CPU span kernel (16-bit activations, 4-bit weights): weights q * f with the scale folded in,
# f = (ms << shift) >> base (base 0 in unshifted blocks), in SPAN_WEIGHT_BITS; whole spans of
# groups (in unshifted blocks, each of a group's two chains) summed in DOT_ACC_BITS.
SPAN_WEIGHT_BITS = 16


def span_fold_limit(w_bits: int = 4) -> int:
    """The largest |f| whose folded weights q * f fit SPAN_WEIGHT_BITS for every q."""
    return (2 ** (SPAN_WEIGHT_BITS - 1) - 1) // 2 ** (w_bits - 1)


def span_size_limit(act_bits: int = 16) -> int:
    """The largest sum_g |f_g| * sum_k |q| of a span (of a chain, in unshifted blocks): times Qa,
    still a DOT_ACC_BITS value."""
    return (2 ** (DOT_ACC_BITS - 1) - 1) // act_qmax(act_bits)


def int8_digits(v, count: int):
    """Signed base-256 digits of an int32 / int64 tensor, lowest first: [count, *v.shape] int8.

    sum_j digit[j] * 256**j == v, each digit in [-128, 127]. Raises if `count` digits do not hold
    `v` (never wraps).
    """
    import torch

    digits = []
    rest = v.long()  # digits of any integer tensor, taken in int64
    for _ in range(count):
        low = ((rest + 128) & 255) - 128
        digits.append(low.to(torch.int8))
        rest = (rest - low) >> LIMB_BITS
    if bool((rest != 0).any()):
        raise OverflowError(f"{count} int8 limbs do not hold these values")
    return torch.stack(digits)


def activation_limbs(qa, act_bits: int):
    """qa as int8 limbs [L, M, K]: the digits of qa - limb_offset (qa itself for one limb)."""
    return int8_digits(qa.long() - limb_offset(act_bits), act_limbs(act_bits))


# How many activation limbs the int8 kernels carry (each kernel's `act_limbs`, checked by
# registry.int8_limbs_hold in its `eligible`). The group kernels (C and Triton, grouped too) carry
# four: with 32-bit activations a group's P stays in two int32 halves, P_hi * 2**16 + P_lo. The
# int8 GEMMs on folded weights (int8-gemm, triton-folded) carry two. Activations wider than a
# kernel carries take another: the float64 GEMMs, the int64 matmul or `wide` on the CPU.
GROUP_ACT_LIMBS = 4
GEMM_ACT_LIMBS = 2

# The AMX kernel (cpu_amx.c): an int8 GEMM on tiles of the folded weights q * f, f = c >> base over
# a span of groups (|q * f| <= span_fold_limit: s16), split into a u8 and an s8 digit, against the
# activations' 1 or 2 biased u8 limbs (AMX_ACT_LIMBS). Each span's dots are summed in
# DOT_ACC_BITS over at most AMX_SPAN_GROUPS groups (amx_span_dot_bound), then combined in int64
# (amx_combine_bound). Tiles of AMX_TILE_ROWS activation rows, AMX_STEP_K k per tile step.
AMX_TILE_ROWS = 16
AMX_STEP_K = 64
AMX_ACT_LIMBS = 2
AMX_SPAN_GROUPS = 1024


def amx_span_dot_bound(groups: int = AMX_SPAN_GROUPS) -> int:
    """Worst |D| of one span's tile dot: u8 limbs times u8 (low) or s8 (high) digits."""
    return groups * GROUP_SIZE * 255 * 255


def amx_combine_bound(k: int, w_bits: int, act_bits: int, spread: int) -> int:
    """Worst |T| of the AMX kernel's combine, and of every partial sum on the way: each span adds
    sum_k (qa + B) * q * c (B = 2**(8 L - 1), the limbs' bias) to a T that starts at -B * R,
    R = sum_k q * c; so (Qa + B) * sum_k |q * c|, with |c| <= 255 << spread."""
    bias = 2 ** (LIMB_BITS * act_limbs(act_bits) - 1)
    return (act_qmax(act_bits) + bias) * k * 2 ** (w_bits - 1) * (2**SCALE_MANT_BITS - 1) << spread


def amx_holds(k: int, w_bits: int, act_bits: int, spread: int) -> bool:
    """Whether the AMX kernel's combine stays within COMBINE_ACC_BITS (proved: amx-span-combine)
    and its activations within AMX_ACT_LIMBS limbs."""
    return (act_limbs(act_bits) <= AMX_ACT_LIMBS and
            amx_combine_bound(k, w_bits, act_bits, spread) <= 2 ** (COMBINE_ACC_BITS - 1) - 1)


def wide_groups_per_sum(w_bits: int, act_bits: int) -> int:
    """How many groups' P * ms the wide kernel sums in int64 before taking Python integers:
    |P * ms| <= group_dot_bound * 255, so this many never pass 2**63 - 1 (2**32 groups at 16
    bits, 4112 for 8-bit weights and 32-bit activations)."""
    return (2 ** (COMBINE_ACC_BITS - 1) - 1) // (group_dot_bound(w_bits, act_bits)
                                                * (2**SCALE_MANT_BITS - 1))


# The CPU's 32-bit path (gemm.FLOAT64_GEMM): qa = hi * 2**16 + lo (lo in [0, 2**16), hi signed),
# each half an exact float64 GEMM against the folded weights: integers whose every partial sum
# stays within FLOAT64_EXACT_BITS (|v| <= 2**53: float64 holds it, so each add and FMA is exact).
HALF_BITS = 16
FLOAT64_EXACT_BITS = 54  # a signed 54-bit integer: |v| <= 2**53, every one a float64


def float64_gemm_holds(k: int, w_bits: int, spread: int) -> bool:
    """Whether the float64 GEMMs of K = k halves (|half| <= 2**16) by folded weights of this
    spread keep every partial sum within 2**53 (proved: cpu-float64-gemm)."""
    return k * 2**HALF_BITS * folded_weight_max(w_bits, spread) <= 2 ** (FLOAT64_EXACT_BITS - 1)


def group_sum_bits(w_bits: int, act_bits: int) -> int:
    """The signed width that holds a group's P = sum_k qa * qw and its partial sums: 32 up to
    16-bit activations, 64 for 32-bit ones (|P| < 2**40)."""
    return DOT_ACC_BITS if group_dot_bound(w_bits, act_bits) < 2 ** (DOT_ACC_BITS - 1) \
        else COMBINE_ACC_BITS


def weight_limbs_needed(lo: int, hi: int) -> int:
    """How many signed int8 digits hold every integer in [lo, hi]."""
    count = 1
    while not -128 * (256**count - 1) // 255 <= lo <= hi <= 127 * (256**count - 1) // 255:
        count += 1
    return count


def int_mm_bound(k: int) -> int:
    """Worst |sum_k limb * limb| of one int8 x int8 GEMM: must fit DOT_ACC_BITS."""
    return k * 128 * 128


# The CPU fallback's int8 GEMMs sum at most this many products each: K * 128 * 128 < 2**31
# (proved: cpu-int-mm), where all of a K >= 2**17 would wrap. A multiple of GROUP_SIZE.
INT_MM_CHUNK = 2**16


def int_mm_chunk(k: int) -> int:
    """The K of each of the CPU fallback's int8 GEMMs (gemm.accumulate) for a layer of K = k."""
    return min(k, INT_MM_CHUNK)


def folded_weight_max(w_bits: int, spread: int) -> int:
    """The largest |q * ms << shift| with shift <= spread, for scales of either sign:
    |q| <= 2**(w_bits - 1) and |ms| < 2**SCALE_MANT_BITS (q = -8 with a negative scale folds to
    +2040, past 7 * 255)."""
    return 2 ** (w_bits - 1) * (2**SCALE_MANT_BITS - 1) << spread


def folded_weight_limbs(w_bits: int, spread: int) -> int:
    """How many int8 digits hold every folded weight q * ms << shift with shift <= spread."""
    fold_max = folded_weight_max(w_bits, spread)
    return weight_limbs_needed(-fold_max, fold_max)


def max_folded_spread(w_bits: int) -> int:
    """The largest spread whose folded weights q * ms << spread fit MAX_WEIGHT_LIMBS int8 limbs
    for positive scales (a row with negative ones may need one more: the CPU path sizes its digits
    from the weights, the GPU's by folded_weight_limbs)."""
    lo, hi = -(2 ** (w_bits - 1)), 2 ** (w_bits - 1) - 1
    mant = 2**SCALE_MANT_BITS - 1
    spread = -1
    while weight_limbs_needed(lo * mant << (spread + 1),
                              hi * mant << (spread + 1)) <= MAX_WEIGHT_LIMBS:
        spread += 1
    return spread


def certified_spread(k: int, w_bits: int, act_bits: int,
                     acc_bits: int = COMBINE_ACC_BITS) -> int:
    """The largest scale-exponent spread of a weight row that the fast paths take: its combine
    fits `acc_bits` and its folded weights MAX_WEIGHT_LIMBS digits (certificate.certify)."""
    return min(max_safe_spread(k, w_bits, act_bits, acc_bits), max_folded_spread(w_bits))


# The GPU's slow rows (triton/wide.py, the device's twin of kernels/wide.py): T = sum_g
# (P * ms) << shift in WIDE_WORDS words of WIDE_WORD_BITS bits, each word an int64 that sums its
# parts unnormalized (every part under 2**WIDE_WORD_BITS + 1 in magnitude), carried once at the
# end. A bf16 scale's shift is at most BF16_SHIFT_MAX.
WIDE_WORD_BITS = 32
WIDE_WORDS = 16
BF16_SHIFT_MAX = 253  # exponents of finite bf16 significands: -133 .. 120 (ms * 2**es)


def wide_words_needed(k: int, w_bits: int, act_bits: int) -> int:
    """Words the GPU's multiword combine needs for the worst |T| of K = k inputs at any spread,
    a sign bit included: it must be at most WIDE_WORDS (tests/test_device_rows.py checks Kimi's
    sizes and the widest contract widths)."""
    groups = k // GROUP_SIZE
    worst = groups * group_dot_bound(w_bits, act_bits) * (2**SCALE_MANT_BITS - 1) \
        << BF16_SHIFT_MAX
    return -(-(worst.bit_length() + 1) // WIDE_WORD_BITS)


def wide_word_adds_hold(k: int) -> bool:
    """Whether a word's unnormalized int64 sum holds: each group adds at most three parts to a
    word, each under 2**(WIDE_WORD_BITS + 1), so 3 * groups of them stay under 2**63."""
    return 3 * (k // GROUP_SIZE) << (WIDE_WORD_BITS + 1) < 2 ** (COMBINE_ACC_BITS - 1)
