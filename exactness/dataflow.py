"""One description of the integer dataflow: the widths every step uses, and the bounds they imply.

The reference, the kernels and the proofs all read these numbers, so changing a width here changes
what the code does and what is proved about it.

Dataflow of one output y[r, n] (contract section 4):
  1. activation limbs: qa (|qa| <= Qa) is split into int8 limbs; 16-bit activations as
     qa - LIMB_OFFSET = hi * 256 + lo (hi, lo in [-128, 127]) since [-32767, 32767] shifted by
     128 fits the 65536 values two signed limbs span, while unshifted 32767 would need hi = 128;
  2. group dot: D = sum_{k in group} limb * qw (int8 x int8 -> DOT_ACC_BITS), then
     P = 256 * D_hi + D_lo + LIMB_OFFSET * sum_k qw (exact in DOT_ACC_BITS);
  3. combine: T = sum_g (P * ms[n, g]) << (es[n, g] - emin[n]) in COMBINE_ACC_BITS, where the bf16
     scale is ms * 2**es, |ms| < 2**SCALE_MANT_BITS; y = RNE(T * 2**(e_r + emin[n])).
"""

from __future__ import annotations

from .contract import GROUP_SIZE, act_qmax, check_weight_bits, group_dot_bound

LIMB_BITS = 8
LIMB_OFFSET = 128
DOT_ACC_BITS = 32
COMBINE_ACC_BITS = 64
SCALE_MANT_BITS = 8  # bf16 significand with the hidden bit: |ms| <= 255


def act_limbs(act_bits: int) -> int:
    """How many int8 limbs carry one activation: 1 for |qa| <= 127, else 2."""
    return 1 if act_qmax(act_bits) < 2 ** (LIMB_BITS - 1) else 2


def combine_bound(k: int, w_bits: int, act_bits: int, spread: int) -> int:
    """Worst |T| of step 3 for K inputs and a per-row scale-exponent spread `spread`."""
    check_weight_bits(w_bits)
    groups = k // GROUP_SIZE
    return groups * (2**SCALE_MANT_BITS - 1) * group_dot_bound(w_bits, act_bits) << spread


def max_safe_spread(k: int, w_bits: int, act_bits: int, acc_bits: int = COMBINE_ACC_BITS) -> int:
    """The largest spread whose combine fits a signed `acc_bits` accumulator (-1: none does)."""
    limit = 2 ** (acc_bits - 1) - 1
    spread = -1
    while combine_bound(k, w_bits, act_bits, spread + 1) <= limit:
        spread += 1
    return spread
