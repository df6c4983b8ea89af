"""The true product, exactly, and a float output's distance from it in units in the last place.

y = x . (q * scale) for float activations x and the checkpoint's integer weights, with nothing
rounded: x and the dequantized weights are dyadic rationals. Per row x = X * 2**ex, per weight row
and group q * scale = q * F * 2**es (X, F integers), so y = T * 2**(ex + es) with T = X . (q * F).

T is summed exactly by float64 GEMMs of integer limbs, which never round: limbs of X below 2**16,
limbs of F below 2**10 times |q| <= 2**7, K <= 2**17 terms, so every partial sum stays below
2**50. They are recombined in Python integers. The oracle's Fractions take minutes at Kimi's
sizes; this takes seconds, at any scale spread.
"""

from __future__ import annotations

import numpy as np

from ..contract import BFLOAT16, GROUP_SIZE, FloatFormat
from ..formats import decode_array, finite_mask, round_scaled

X_LIMB, F_LIMB = 16, 10
MAX_K = 2**17  # the limbs' bound holds for K up to here


def _row_integers(m: np.ndarray, e: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each row of m * 2**e as integers [rows, cols] (object) times 2**lowest[rows]: the lowest
    exponent of the row's nonzero elements (0 for an all-zero row)."""
    lowest = np.where(m != 0, e, np.iinfo(np.int64).max).min(axis=1)
    lowest = np.where(lowest == np.iinfo(np.int64).max, 0, lowest)
    shift = np.where(m != 0, e - lowest[:, None], 0)
    return m.astype(object) << shift.astype(object), lowest


def _limbs(v: np.ndarray, width: int) -> list[tuple[int, np.ndarray]]:
    """(place, limb) of signed integers v (object) split as sign * sum(limb << place), each limb
    in [0, 2**width) times the sign, as float64; all-zero limbs left out."""
    sign = np.where(v < 0, -1, 1)
    a = np.abs(v)
    top = max((int(x).bit_length() for x in a.flat), default=0)
    out = []
    for place in range(0, top, width):
        limb = ((a >> place) & ((1 << width) - 1)).astype(np.float64) * sign
        if limb.any():
            out.append((place, limb))
    return out


def true_product(x_bits, x_format: FloatFormat, q, scale_bits) -> tuple[np.ndarray, np.ndarray]:
    """(T, E): y[r, n] = T[r, n] * 2**E[r, n] exactly, T Python integers (object array [M, N]),
    E int64. x_bits [M, K] finite patterns of x_format, q [N, K] integer weights, scale_bits
    [N, K / 32] bf16 patterns."""
    x_bits, q, scale_bits = (np.asarray(a, dtype=np.int64) for a in (x_bits, q, scale_bits))
    (m, k), n = x_bits.shape, q.shape[0]
    if k > MAX_K or q.shape[1] != k or scale_bits.shape != (n, k // GROUP_SIZE):
        raise ValueError(f"shapes: x {x_bits.shape}, q {q.shape}, scales {scale_bits.shape}; "
                         f"K must be at most {MAX_K}")
    if np.abs(q).max(initial=0) > 2**7:
        raise ValueError("weights must fit 8 bits")
    if not finite_mask(x_bits, x_format).all() or not finite_mask(scale_bits, BFLOAT16).all():
        raise ValueError("x and the scales must be finite: the true product of inf is no number")
    x_int, ex = _row_integers(*decode_array(x_bits, x_format))
    f_int, es = _row_integers(*decode_array(scale_bits, BFLOAT16))
    t = np.zeros((m, n), dtype=object)
    x_limbs = _limbs(x_int, X_LIMB)
    for place_f, f_limb in _limbs(f_int, F_LIMB):
        w = (q * np.repeat(f_limb, GROUP_SIZE, axis=1)).T  # [K, N], |w| < 2**17
        for place_x, x_limb in x_limbs:
            part = (x_limb @ w).astype(np.int64)  # exact: integers below 2**50
            t = t + (part.astype(object) << (place_x + place_f))
    return t, ex[:, None] + es[None, :]


def correctly_rounded_bits(t: np.ndarray, e: np.ndarray, fmt: FloatFormat) -> np.ndarray:
    """RNE(T * 2**E) in `fmt`, bit patterns [M, N] int64: the most precise answer there is."""
    return np.array([[round_scaled(int(v), int(x), fmt) for v, x in zip(row, erow, strict=True)]
                     for row, erow in zip(t, e, strict=True)], dtype=np.int64).reshape(t.shape)


def ulp_errors(y_bits, t: np.ndarray, e: np.ndarray, fmt: FloatFormat) -> np.ndarray:
    """|y - T * 2**E| in units of fmt's last place at the true value, float64 [M, N]: at most 0.5
    where y is correctly rounded, inf where y is not finite (0 where the true value rounds to
    that same infinity). ulp(t) = 2**(max(floor(log2 |t|), 1 - bias) - mant_bits)."""
    y_bits = np.asarray(y_bits, dtype=np.int64)
    finite = finite_mask(y_bits, fmt)
    my, ey = decode_array(np.where(finite, y_bits, 0), fmt)
    out = np.empty(t.shape, dtype=np.float64)
    for (r, c), tv in np.ndenumerate(t):
        tv, te = int(tv), int(e[r, c])
        if not finite[r, c]:
            same = round_scaled(tv, te, fmt) == int(y_bits[r, c])
            out[r, c] = 0.0 if same else np.inf
            continue
        ym, ye = int(my[r, c]), int(ey[r, c])
        low = min(te, ye)
        diff = abs((ym << (ye - low)) - (tv << (te - low)))  # |y - t| * 2**-low, exactly
        top = te + tv.bit_length() - 1 if tv else 1 - fmt.bias
        out[r, c] = _ldexp(diff, low - (max(top, 1 - fmt.bias) - fmt.mant_bits))
    return out


def _ldexp(v: int, e: int) -> float:
    """v * 2**e as float64 for a Python integer v of any size (inf past float64's range)."""
    drop = max(v.bit_length() - 60, 0)
    try:
        return float(np.ldexp(float(v >> drop), e + drop))
    except OverflowError:
        return float("inf")
