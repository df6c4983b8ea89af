"""Quantization onto the contract's integers: activations per row (`quantize_activations`,
contract section 3, numpy or torch) and `ExactLinear.from_weight`'s weights per group
(`quantize_weight`, docs/SPEC.md section 6, numpy int64).

Per group of 32: scale = the smallest bf16 >= amax / Qw, q = RNE(w / scale), both exactly; so
|q| <= Qw and nothing is ever clamped. The reference's `oracle_quantize_weight` is the same rule in
Fractions; the suite checks the two bit for bit.
"""

from __future__ import annotations

import numpy as np

from .contract import BFLOAT16, GROUP_SIZE, FloatFormat, act_qmax, check_weight_bits, float_format
from .formats import (
    array_module,
    as_int64,
    bit_length_array,
    check_finite,
    decode_array,
    rne_shift_right,
)


def _ceil_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return -((-a) // b)


def _ratio(num_m, num_e, den_m, den_e):
    """(a, b) with a / b == (num_m * 2**num_e) / (den_m * 2**den_e), shifting only one side."""
    d = num_e - den_e
    return num_m << np.clip(d, 0, 40), den_m << np.clip(-d, 0, 40)  # callers zero the rest


def quantize_weight(w_bits: np.ndarray, fmt: FloatFormat, bits: int):
    """(q int64 [N, K], scale bf16 patterns int64 [N, K/32]) for weight patterns of `fmt`."""
    check_weight_bits(bits)
    check_finite(w_bits, fmt, "weight")
    qw = 2 ** (bits - 1) - 1
    n, k = w_bits.shape
    m, e = decode_array(w_bits, fmt)
    mag = (as_int64(w_bits) & fmt.abs_mask).reshape(n, k // GROUP_SIZE, GROUP_SIZE)
    am, ae = decode_array(mag.max(axis=2), fmt)  # amax per group, exactly
    zero = am == 0
    am = np.where(zero, 1, am)
    # es0 puts ceil(amax / Qw / 2**es0) in [129, 512]; at most two steps up bring it under 256.
    es = ae + bit_length_array(am) - qw.bit_length() - BFLOAT16.precision
    for _ in range(2):
        ms = _ceil_div(*_ratio(am, ae, np.full_like(am, qw), es))
        es = np.where(ms > 255, es + 1, es)
    es = np.maximum(es, BFLOAT16.quantum_min)  # subnormal scales: the finest grid there is
    ms = _ceil_div(*_ratio(am, ae, np.full_like(am, qw), es))
    # q = RNE(w / scale) on rationals; far below the scale (shift > 40) it is 0
    ms_k = np.repeat(ms, GROUP_SIZE, axis=1)
    es_k = np.repeat(es, GROUP_SIZE, axis=1)
    num, den = _ratio(np.abs(m), e, ms_k, es_k)
    quot, rem = num // den, num % den
    quot = quot + ((2 * rem > den) | ((2 * rem == den) & (quot % 2 == 1)))
    quot = np.where(es_k - e > 40, 0, quot)
    q = np.where(m < 0, -quot, quot)
    q = np.where(np.repeat(zero, GROUP_SIZE, axis=1), 0, q)
    # the scale as a bf16 pattern: ms * 2**es with ms <= 255 is exact in bf16
    field = np.where(ms >= 128, es - BFLOAT16.quantum_min + 1, 0)
    frac = np.where(ms >= 128, ms - 128, ms)
    scale = np.where(zero, 0, (field << BFLOAT16.mant_bits) | frac)
    return q.astype(np.int64), scale.astype(np.int64)


def quantize_activations(x_bits, x_format, act_bits: int):
    """Contract section 3, vectorized (numpy or torch): (qa int64 [M, K], e_r int64 [M]).

    Zero rows get e_r = 0. Finiteness is the caller's to check.
    """
    xp = array_module(x_bits)
    fmt = float_format(x_format)
    qmax = act_qmax(act_bits)
    m, e = decode_array(x_bits, fmt)
    # |x| orders like the magnitude bits of its pattern, so amax is found without decoding all.
    am, ae = decode_array(xp.amax(as_int64(x_bits) & fmt.abs_mask, axis=1), fmt)
    # smallest t with am <= Qa * 2**t is t0 or t0 + 1 (t0 from the bit lengths); e_r = ae + t.
    # For t0 <= 0 it is t0: am * 2**-t0 has Qa's bit length, and Qa is all ones.
    t0 = bit_length_array(am) - qmax.bit_length()
    fits = am <= (t0 * 0 + qmax) << t0.clip(min=0)
    e_r = xp.where(am == 0, 0, ae + t0 + xp.where(fits, 0, 1))
    # qa = RNE(m * 2**(e - e_r)): an exact left shift, or a rounded right shift; |m| < 2**25, so
    # right shifts past 26 give 0 (under half) and clipping them to 62 changes nothing.
    s = e - e_r[:, None]
    a = xp.abs(m)
    n = xp.where(s >= 0, a << s.clip(0, 62), rne_shift_right(a, (-s).clip(0, 62)))
    return xp.where(m < 0, -n, n), e_r
