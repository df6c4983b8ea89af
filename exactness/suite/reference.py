"""The contract end to end in integer arithmetic, on bit patterns in and out.

Two layers:
- `oracle_linear`: plain Python integers and Fractions, short enough to check line by line
  against the contract (docs/SPEC.md);
- `reference_linear`: vectorized numpy int64 for full sizes. Its int64 steps are safe by the bounds
  of `dataflow` (proved in proofs/); rows whose scale-exponent spread breaks them are computed
  with Python integers instead.

Inputs: `x_bits` [M, K] patterns of `x_format`; `weight_packed` int32 [N, K*w_bits/32];
`scale_bits` bf16 patterns [N, K/32]. Output: patterns of `out_format` [M, N].
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np

from .. import dataflow
from ..contract import (
    BFLOAT16,
    GROUP_SIZE,
    ShapeError,
    act_qmax,
    check_act_bits,
    check_in_features,
    check_weight_bits,
    float_format,
)
from ..formats import (
    decode,
    finite_mask,
    round_scaled,
    round_scaled_array,
    split_scales,
    unpack_weights,
)
from ..quantize import quantize_activations

# --------------------------------------------------------------------------- the oracle


def _exact(bits: int, fmt) -> Fraction:
    m, e = decode(bits, fmt)
    return _dyadic(m, e)


def _dyadic(m: int, e: int) -> Fraction:
    """m * 2**e, exactly (built directly: Fraction's power and product are 5x slower)."""
    return Fraction(m << e) if e >= 0 else Fraction(m, 1 << -e)


def oracle_quantize_row(row_bits, x_format, act_bits: int) -> tuple[list[int], int]:
    """Contract section 3 for one row: (qa, e_r); a zero row gives zeros and e_r = 0."""
    qmax = act_qmax(act_bits)
    xs = [_exact(int(b), float_format(x_format)) for b in row_bits]
    amax = max(abs(v) for v in xs)
    if amax == 0:
        return [0] * len(xs), 0
    e = 0
    while amax > qmax * Fraction(2) ** e:  # smallest e with amax <= Qa * 2**e
        e += 1
    while amax <= qmax * Fraction(2) ** (e - 1):
        e -= 1
    return [round(v / Fraction(2) ** e) for v in xs], e  # round(): half to even


def non_finite(x_bits, x_format, scale_bits):
    """Contract v1.2's rule, sections 2 and 3: (x, scales) with every non-finite value made 0,
    then the rows of x and the weight rows that held one, whose outputs are the canonical NaN."""
    x_bits, scale_bits = np.asarray(x_bits), np.asarray(scale_bits)
    x_ok, s_ok = finite_mask(x_bits, float_format(x_format)), finite_mask(scale_bits, BFLOAT16)
    return (np.where(x_ok, x_bits, 0), np.where(s_ok, scale_bits, 0), ~x_ok.all(axis=1),
            ~s_ok.all(axis=1))


def with_nans(out, bad_rows, bad_weight_rows, out_format):
    """`out` [M, N] with the canonical NaN in every output of those rows of x and weight rows."""
    out = np.array(out, dtype=np.int64)
    out[bad_rows] = out_format.nan_bits
    out[:, bad_weight_rows] = out_format.nan_bits
    return out


def oracle_linear(x_bits, x_format, weight_packed, scale_bits, *, act_bits: int = 16,
                  out_format=None, w_bits: int = 4) -> list[list[int]]:
    """y[r][n] = RNE(2**e_r * sum_g s[n,g] * sum_k qa[r,k] * qw[n,k]) in plain Python numbers;
    the canonical NaN in every output of a non-finite row of x or of scales (non_finite)."""
    out_format = float_format(out_format or x_format)
    x_bits, scale_bits, bad_rows, bad_weight_rows = non_finite(x_bits, x_format, scale_bits)
    if bad_rows.any() or bad_weight_rows.any():
        out = oracle_linear(x_bits, x_format, weight_packed, scale_bits, act_bits=act_bits,
                            out_format=out_format, w_bits=w_bits)
        return with_nans(out, bad_rows, bad_weight_rows, out_format).tolist()
    per = 32 // w_bits
    mask, offset = 2**w_bits - 1, 2 ** (w_bits - 1)
    qw = [[((int(w) & 0xFFFFFFFF) >> (w_bits * j) & mask) - offset for w in row for j in range(per)]
          for row in np.asarray(weight_packed).tolist()]
    s = [[_exact(int(b), BFLOAT16) for b in row] for row in np.asarray(scale_bits).tolist()]
    out = []
    for row in np.asarray(x_bits).tolist():
        qa, e = oracle_quantize_row(row, x_format, act_bits)
        y_row = []
        for qw_n, s_n in zip(qw, s, strict=True):
            y = Fraction(0)
            for g, s_ng in enumerate(s_n):
                ks = range(GROUP_SIZE * g, GROUP_SIZE * (g + 1))
                y += s_ng * sum(qa[k] * qw_n[k] for k in ks)
            y *= Fraction(2) ** e
            # y is dyadic: numerator * 2**-log2(denominator)
            y_row.append(round_scaled(y.numerator, 1 - y.denominator.bit_length(), out_format))
        out.append(y_row)
    return out


def oracle_quantize_weight(w_bits, w_format, bits: int) -> tuple[list[list[int]], list[list[int]]]:
    """docs/SPEC.md section 6 per group: scale = the least bf16 >= amax / Qw, q = RNE(w / scale)."""
    qw = 2 ** (bits - 1) - 1
    q_rows, scale_rows = [], []
    for row in np.asarray(w_bits).tolist():
        ws = [_exact(int(b), float_format(w_format)) for b in row]
        q_row, s_row = [], []
        for g in range(0, len(ws), GROUP_SIZE):
            group = ws[g:g + GROUP_SIZE]
            amax = max(abs(v) for v in group)
            if amax == 0:
                q_row += [0] * GROUP_SIZE
                s_row.append(0)
                continue
            # bf16 holds every ms * 2**es with ms <= 255, es >= quantum_min: the least such
            # es with ratio <= 255 * 2**es. Bit lengths put ratio in (2**(b-1), 2**(b+1)), so
            # the search starts below the answer (255 * 2**(b-9) < 2**(b-1)), a few steps off.
            ratio = amax / qw
            es = max(BFLOAT16.quantum_min,
                     ratio.numerator.bit_length() - ratio.denominator.bit_length() - 9)
            while ratio > 255 * _dyadic(1, es):
                es += 1
            ms = math.ceil(ratio / _dyadic(1, es))
            scale = _dyadic(ms, es)
            q_row += [round(v / scale) for v in group]
            s_row.append(round_scaled(ms, es, BFLOAT16))
        q_rows.append(q_row)
        scale_rows.append(s_row)
    return q_rows, scale_rows


# --------------------------------------------------------------------------- numpy reference


def check_linear_inputs(x_bits, x_format, weight_packed, scale_bits, act_bits, w_bits):
    """Validate shapes and widths; return (x_bits, packed, scale_bits) as arrays."""
    check_act_bits(act_bits)
    check_weight_bits(w_bits)
    x_format = float_format(x_format)
    x_bits, packed, scale_bits = map(np.asarray, (x_bits, weight_packed, scale_bits))
    if x_bits.ndim != 2:
        raise ShapeError(f"x must be 2-D [M, K] here, got shape {x_bits.shape}")
    k = check_in_features(x_bits.shape[1], "x.shape[-1] (K)")
    n = packed.shape[0]
    if packed.shape != (n, k * w_bits // 32):
        raise ShapeError(
            f"weight_packed has shape {packed.shape}, expected [N, {k * w_bits // 32}] for K={k}")
    if scale_bits.shape != (n, k // GROUP_SIZE):
        raise ShapeError(
            f"weight_scale has shape {scale_bits.shape}, expected [{n}, {k // GROUP_SIZE}]")
    return x_bits, packed, scale_bits






def reference_linear(x_bits, x_format, weight_packed, scale_bits, *, act_bits: int = 16,
                     out_format=None, w_bits: int = 4) -> np.ndarray:
    """The contract, vectorized in int64 with a Python-int fallback per weight row; the
    canonical NaN in every output of a non-finite row of x or of scales (non_finite)."""
    x_bits, packed, scale_bits = check_linear_inputs(
        x_bits, x_format, weight_packed, scale_bits, act_bits, w_bits)
    out_format = float_format(out_format or x_format)
    x_bits, scale_bits, bad_rows, bad_weight_rows = non_finite(x_bits, x_format, scale_bits)
    if bad_rows.any() or bad_weight_rows.any():
        out = reference_linear(x_bits, x_format, packed, scale_bits, act_bits=act_bits,
                               out_format=out_format, w_bits=w_bits)
        return with_nans(out, bad_rows, bad_weight_rows, out_format)
    k = x_bits.shape[1]
    groups = k // GROUP_SIZE
    qa, e_r = quantize_activations(x_bits, x_format, act_bits)
    qw = unpack_weights(packed, w_bits, k).astype(np.int64).reshape(-1, groups, GROUP_SIZE)
    ms, shift, emin, spread = split_scales(scale_bits)
    safe = spread <= dataflow.max_safe_spread(k, w_bits, act_bits)
    out = np.empty((x_bits.shape[0], qw.shape[0]), dtype=np.int64)
    for r in range(x_bits.shape[0]):
        p = group_dots(qa[r], qw)
        t = combine_groups(p, ms, np.where(safe[:, None], shift, 0))  # int64 by the bound
        out[r] = round_scaled_array(t, e_r[r] + emin, out_format)
        for n in np.flatnonzero(~safe):  # spread too wide for int64: exact Python integers
            t_n = sum(int(p[n, g]) * int(ms[n, g]) << int(shift[n, g]) for g in range(groups))
            out[r, n] = round_scaled(t_n, int(e_r[r] + emin[n]), out_format)
    return out


def group_dots(qa_row: np.ndarray, qw: np.ndarray) -> np.ndarray:
    """P[n, g] = sum_{k in g} qa[k] * q[n, k] for one row, in int64 (|P| < 2**44)."""
    return np.einsum("ngk,gk->ng", qw, qa_row.reshape(-1, GROUP_SIZE))


def combine_groups(p: np.ndarray, ms: np.ndarray, shift: np.ndarray) -> np.ndarray:
    """T[n] = sum_g (P * ms) << shift in int64, for rows the certificate bounds."""
    return ((p * ms) << shift).sum(axis=1)
