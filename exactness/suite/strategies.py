"""Hypothesis strategies for the exact-linear contract: weights, scales, activations, whole cases.

Large tensors are drawn as a small structure (a kind, a few parameters, a seed) expanded by numpy,
plus a handful of explicitly drawn elements: Hypothesis shrinks the kind and parameters toward the
simplest, the seed toward 0, and the explicit elements individually, so a failure at full Kimi
size still shrinks to something readable. Everything is returned as integer bit patterns.
"""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from .. import dataflow
from ..contract import (
    ACT_BITS,
    BFLOAT16,
    FORMATS,
    GROUP_SIZE,
    WEIGHT_BITS,
    FloatFormat,
    act_qmax,
    check_act_bits,
    check_weight_bits,
    float_format,
    weight_range,
)
from ..formats import pack_weights, round_scaled
from ..kernels.registry import int8_limbs_hold
from .cases import LinearCase

KIMI_SHAPES = ((7168, 2048), (2048, 7168))  # (K, N) of the routed experts: gate/up, down
KIMI_DENSE_K = 18432

seeds = st.integers(0, 2**32 - 1)
formats = st.sampled_from([FORMATS["bfloat16"], FORMATS["float16"], FORMATS["float32"]])
act_bits = st.sampled_from(ACT_BITS)
# the widths every int8 kernel holds: 32 bits need four limbs, which the int8 GEMMs do not carry
# (the group kernels do: a kernel's own widths are paths.held_act_bits)
INT8_KERNEL_ACT_BITS = tuple(a for a in ACT_BITS if int8_limbs_hold(a, dataflow.GEMM_ACT_LIMBS))
weight_bits = st.sampled_from(WEIGHT_BITS)


def _bits(sign: np.ndarray, field: np.ndarray, frac: np.ndarray, fmt: FloatFormat) -> np.ndarray:
    return (sign.astype(np.int64) << (fmt.width - 1)) | (field.astype(np.int64) << fmt.mant_bits) \
        | frac.astype(np.int64)


def _random_floats(rng, shape, fmt: FloatFormat, field_lo: int, field_hi: int, signed=True):
    """Finite patterns with exponent fields in [field_lo, field_hi] and uniform fractions."""
    sign = rng.integers(0, 2, shape) if signed else np.zeros(shape, np.int64)
    field = rng.integers(field_lo, field_hi + 1, shape)
    frac = rng.integers(0, 2**fmt.mant_bits, shape)
    return _bits(sign, field, frac, fmt)


# --------------------------------------------------------------------------- shapes


@st.composite
def shapes(draw, max_k: int = 256, max_n: int = 8, max_rows: int = 4, kimi: bool = False,
           min_k: int = GROUP_SIZE):
    """(rows, K, N) with K a multiple of 32; with kimi=True the full Kimi sizes can come up."""
    if not GROUP_SIZE <= min_k <= max_k or max_n < 1 or max_rows < 1:
        raise ValueError(f"need {GROUP_SIZE} <= min_k <= max_k, max_n >= 1, max_rows >= 1; got "
                         f"min_k={min_k}, max_k={max_k}, max_n={max_n}, max_rows={max_rows}")
    rows = draw(st.integers(1, max_rows))
    if kimi and draw(st.booleans()):
        k, n = draw(st.sampled_from(KIMI_SHAPES))
        return rows, k, n
    k = GROUP_SIZE * draw(st.integers(-(-min_k // GROUP_SIZE), max_k // GROUP_SIZE))
    return rows, k, draw(st.integers(1, max_n))


# --------------------------------------------------------------------------- rounding inputs


@st.composite
def scaled_integers(draw, fmt: FloatFormat, max_bits: int = 53, exponents=(-1020, 950)):
    """(m, e) for RNE(m * 2**e) in `fmt`, |m| < 2**max_bits: half of them exact ties or one off.

    Uniform integers almost never land on a tie, where half-up or a missing sticky bit shows.
    """
    e = draw(st.integers(*exponents))
    if draw(st.booleans()):
        return draw(st.integers(-(2**max_bits) + 1, 2**max_bits - 1)), e
    shift = draw(st.integers(1, max_bits - fmt.precision - 1))
    n = draw(st.integers(2 ** (fmt.precision - 1), 2**fmt.precision - 1))
    m = (n << shift) + (1 << (shift - 1)) + draw(st.sampled_from((0, 0, -1, 1)))
    return (-m if draw(st.booleans()) else m), e


# --------------------------------------------------------------------------- weights

WEIGHT_KINDS = ("uniform", "min", "max", "alternating", "sparse")


@st.composite
def int_weights(draw, n: int, k: int, bits: int = 4):
    """Integer weights [n, k] in the full range of `bits` (-2**(bits-1) included)."""
    check_weight_bits(bits)
    lo, hi = weight_range(bits)
    kind = draw(st.sampled_from(WEIGHT_KINDS))
    rng = np.random.default_rng(draw(seeds))
    if kind == "uniform":
        q = rng.integers(lo, hi + 1, (n, k))
    elif kind == "min":  # every weight -2**(bits-1): drives |P| to its bound
        q = np.full((n, k), lo)
    elif kind == "max":
        q = np.full((n, k), hi)
    elif kind == "alternating":
        q = np.where(np.arange(k) % 2 == 0, lo, hi) * np.ones((n, 1), np.int64)
    else:
        q = rng.integers(lo, hi + 1, (n, k)) * (rng.random((n, k)) < 0.1)
    for _ in range(draw(st.integers(0, 3))):  # explicit elements shrink one by one
        q[draw(st.integers(0, n - 1)), draw(st.integers(0, k - 1))] = draw(st.integers(lo, hi))
    return q.astype(np.int64)


@st.composite
def packed_weights(draw, n: int, k: int, bits: int = 4):
    """(q, packed): integer weights and their compressed-tensors int32 packing."""
    q = draw(int_weights(n, k, bits))
    return q, pack_weights(q, bits)


# --------------------------------------------------------------------------- scales

SCALE_KINDS = ("qat", "negative", "zeros", "subnormal", "spread", "mixed")


@st.composite
def scale_bits(draw, n: int, groups: int, kind: str | None = None):
    """bf16 scale patterns [n, groups]: QAT-like, negative, zero, subnormal or wide spread."""
    kind = kind or draw(st.sampled_from(SCALE_KINDS))
    if kind not in SCALE_KINDS:
        raise ValueError(f"scale kind must be one of {SCALE_KINDS}, got {kind!r}")
    rng = np.random.default_rng(draw(seeds))
    fmt = BFLOAT16
    shape = (n, groups)
    qat = _random_floats(rng, shape, fmt, 127 - 9, 127 - 4, signed=False)  # ~2**-9 .. 2**-4
    if kind == "qat":
        bits = qat
    elif kind == "negative":
        bits = _random_floats(rng, shape, fmt, 127 - 9, 127 - 4)
    elif kind == "zeros":
        bits = np.where(rng.random(shape) < 0.5, 0, qat)
    elif kind == "subnormal":
        bits = _random_floats(rng, shape, fmt, 0, 0)
    elif kind == "spread":
        lo = draw(st.integers(0, 253))
        bits = _random_floats(rng, shape, fmt, lo, draw(st.integers(lo, 254)))
    else:
        bits = _random_floats(rng, shape, fmt, 0, 254)
        bits = np.where(rng.random(shape) < 0.2, 0, bits)
    for _ in range(draw(st.integers(0, 2))):
        bits[draw(st.integers(0, n - 1)), draw(st.integers(0, groups - 1))] = draw(
            st.integers(0, 0xFFFF).filter(lambda b: (b >> 7) & 0xFF != 0xFF))
    return bits.astype(np.int64)


# --------------------------------------------------------------------------- activations

ACT_KINDS = ("normal", "ties", "subnormal", "zeros", "extreme", "wide")


def _tie_row(rng, k: int, fmt: FloatFormat, qmax: int) -> np.ndarray:
    """A row whose smaller elements are exact ties of x / 2**e_r (odd multiples of 2**(e_r-1))."""
    e_hi = min(fmt.bias - qmax.bit_length(), 10)  # Qa * 2**e_r stays finite
    e_r = int(rng.integers(max(fmt.quantum_min + 1, min(-10, e_hi)), e_hi + 1))  # fp16, 32 bits:
    # e_r <= -16, and the ties' 2**(e_r - 1) stays a subnormal fp16
    s = max(0, qmax.bit_length() - fmt.precision)  # amax must be exact in fmt ...
    top = (int(rng.integers(qmax // 2 + 2**s + 1, qmax + 1)) >> s) << s  # ... and in (Qa/2, Qa]
    odd = 2 * rng.integers(0, min(qmax, 2 ** (fmt.precision - 1)) // 2, k) + 1
    sign = rng.choice([-1, 1], k)
    row = [round_scaled(int(s * o), e_r - 1, fmt) for s, o in zip(sign, odd, strict=True)]
    row[int(rng.integers(0, k))] = round_scaled(top, e_r, fmt)
    return np.array(row, dtype=np.int64)


@st.composite
def activation_bits(draw, rows: int, k: int, fmt: FloatFormat, act_bits: int = 16,
                    kind: str | None = None):
    """Finite activation patterns [rows, k] of `fmt`; some rows may be all (signed) zeros."""
    fmt = float_format(fmt)
    check_act_bits(act_bits)
    kind = kind or draw(st.sampled_from(ACT_KINDS))
    if kind not in ACT_KINDS:
        raise ValueError(f"activation kind must be one of {ACT_KINDS}, got {kind!r}")
    rng = np.random.default_rng(draw(seeds))
    top = fmt.exp_max_field - 1
    if kind == "normal":
        centre = draw(st.integers(1, top))
        x = _random_floats(rng, (rows, k), fmt, max(1, centre - 8), min(top, centre + 8))
    elif kind == "ties":
        x = np.stack([_tie_row(rng, k, fmt, act_qmax(act_bits)) for _ in range(rows)])
    elif kind == "subnormal":
        x = _random_floats(rng, (rows, k), fmt, 0, 0)
    elif kind == "zeros":
        x = np.where(rng.random((rows, k)) < 0.5, 0, fmt.sign_bit)  # +0.0 and -0.0
    elif kind == "extreme":  # every element at the row's amax: qa = +-Qa everywhere
        field = draw(st.integers(0, top))
        frac = rng.integers(0, 2**fmt.mant_bits) if field else 2**fmt.mant_bits - 1
        x = _bits(rng.integers(0, 2, (rows, k)), np.full((rows, k), field),
                  np.full((rows, k), frac), fmt)
    else:
        x = _random_floats(rng, (rows, k), fmt, 0, top)
    zero_rows = draw(st.lists(st.integers(0, rows - 1), max_size=rows, unique=True))
    x[zero_rows] = 0
    for _ in range(draw(st.integers(0, 3))):
        x[draw(st.integers(0, rows - 1)), draw(st.integers(0, k - 1))] = draw(
            st.integers(0, 2**fmt.width - 1).filter(
                lambda b: (b >> fmt.mant_bits) & fmt.exp_max_field != fmt.exp_max_field))
    return x.astype(np.int64)


# --------------------------------------------------------------------------- whole cases


def width(act_bits_) -> st.SearchStrategy[int]:
    """An activation width: `act_bits_` itself, one of a tuple of widths, or any (None)."""
    if act_bits_ is None:
        return act_bits
    return st.sampled_from(act_bits_) if isinstance(act_bits_, tuple) else st.just(act_bits_)


@st.composite
def linear_cases(draw, max_k: int = 256, max_n: int = 8, max_rows: int = 4, kimi: bool = False,
                 w_bits=None, act_bits_=None, x_format=None, out_format=None,
                 min_k: int = GROUP_SIZE):
    """A whole contract input; each argument left None is drawn (act_bits_: a width, or a
    tuple of widths to draw from)."""
    rows, k, n = draw(shapes(max_k, max_n, max_rows, kimi, min_k))
    wb = w_bits if w_bits is not None else draw(st.sampled_from((4, 4, 4, 8)))
    ab = draw(width(act_bits_))
    xf = float_format(x_format) if x_format else draw(formats)
    of = float_format(out_format) if out_format else draw(
        st.sampled_from([xf, FORMATS["float32"], FORMATS["bfloat16"], FORMATS["float16"]]))
    q, packed = draw(packed_weights(n, k, wb))
    return LinearCase(draw(activation_bits(rows, k, xf, ab)), xf, q, packed,
                      draw(scale_bits(n, k // GROUP_SIZE)), ab, of, wb)


@st.composite
def final_rounding_near_ties(draw, out_format=None):
    """Cases whose exact outputs sit at (or one unit beside) a tie of the output format, with
    more significant bits than fp32 holds: where rounding through fp32 first goes wrong.

    K = 64, two groups with scales 2**12 and 1 (a spread the fast paths certify; times 2**-20 for
    fp16), fp32 activations with e_r = 0 (an element of 20000, weight 0, pins it), so
    T = qa[0] * 2**12 + qa[32], with qa[0] = odd << (12 - p) and odd of p + 1 bits: T has 25.
    """
    out = float_format(out_format) if out_format else draw(
        st.sampled_from([FORMATS["bfloat16"], FORMATS["float16"]]))
    # 8 or 16 outputs fill the C kernel's vectors of 8 (round8_normal's path; fewer leave zeros)
    rows, n = draw(st.integers(1, 3)), draw(st.sampled_from((1, 2, 3, 8, 16)))
    f32 = FORMATS["float32"]
    p = out.precision
    x = np.zeros((rows, 64), np.int64)
    q = np.zeros((n, 64), np.int64)
    q[:, 0], q[:, 32] = 1, 1
    for r in range(rows):
        odd = 2 ** p + 1 + 2 * draw(st.integers(0, 2 ** (p - 1) - 1))  # p + 1 bits, tie bit set
        sign = draw(st.sampled_from((1, -1)))
        # row 0 an exact tie whose kept part is odd: where ties-to-even and any other tie rule
        # differ (the other rows anywhere beside a tie)
        odd, beside = (odd | 2, 0) if r == 0 else (odd, draw(st.sampled_from((-1, 0, 1))))
        x[r, 0] = round_scaled(sign * odd << (12 - p), 0, f32)
        x[r, 32] = round_scaled(sign * beside, 0, f32)
        x[r, 1] = round_scaled(20000, 0, f32)
    off = -20 if out.exp_bits < 8 else 0  # keep fp16 outputs finite: a power of two moves no tie
    scales = np.tile(np.array([[round_scaled(1, 12 + off, BFLOAT16),
                                round_scaled(1, off, BFLOAT16)]]), (n, 1))
    return LinearCase(x, f32, q, pack_weights(q, 4), scales, 16, out)


@st.composite
def final_rounding_at_the_top(draw):
    """Whole vectors of outputs in fp16's largest finite binade and past it, where a fast rounding
    meets results due to round to 65504, to carry out of the binade, or to be infinite.

    K = 32, fp16 out, 16 outputs per row: y[r, n] = x[r, 0] * 2**shift[n] (q = 1 on k = 0, scale
    2**shift[n], shift 0 or 1), x[r, 0] an integer in [2**15, 2**17] (fp32)."""
    fp16, f32 = FORMATS["float16"], FORMATS["float32"]
    rows, n = draw(st.integers(1, 2)), 16
    x = np.zeros((rows, 32), np.int64)
    for r in range(rows):
        x[r, 0] = round_scaled(draw(st.integers(2**15, 2**17)), 0, f32)
    q = np.zeros((n, 32), np.int64)
    q[:, 0] = 1
    shifts = draw(st.lists(st.integers(0, 1), min_size=n, max_size=n))
    scales = np.array([[round_scaled(1, shift, BFLOAT16)] for shift in shifts])
    return LinearCase(x, f32, q, pack_weights(q, 4), scales, 16, fp16)


# --------------------------------------------------------------------------- routed cases

ROUTING_KINDS = ("spread", "one-expert", "sparse", "padding")


@st.composite
def routings(draw, tokens: int, experts: int, top_k: int, kind: str | None = None):
    """top_k_index [tokens, top_k]: each token's experts, distinct, in any slot order; E (no
    expert) may repeat. Spread over every expert; expert 0 in every token; a few experts busy
    and the rest empty; or some slots padded with E."""
    if not 1 <= top_k <= experts:
        raise ValueError(f"need 1 <= top_k <= experts, got top_k={top_k}, experts={experts}")
    kind = kind or draw(st.sampled_from(ROUTING_KINDS))
    if kind not in ROUTING_KINDS:
        raise ValueError(f"routing kind must be one of {ROUTING_KINDS}, got {kind!r}")
    rng = np.random.default_rng(draw(seeds))
    busy = np.arange(experts)
    if kind == "sparse":
        busy = rng.permutation(experts)[:draw(st.integers(top_k, experts))]
    ids = np.stack([rng.permutation(busy)[:top_k] for _ in range(tokens)])
    if kind == "one-expert":
        for row in ids:
            if 0 not in row:
                row[rng.integers(top_k)] = 0
    elif kind == "padding":
        ids = np.where(rng.random(ids.shape) < 0.3, experts, ids)
    return ids.astype(np.int64)


@st.composite
def routed_cases(draw, max_k: int = 128, max_n: int = 24, max_experts: int = 5,
                 max_rows: int = 12, act_bits_=None, x_format=None, out_format=None):
    """A grouped projection's input (cases.LinearCase with routing): `experts` experts' 4-bit
    weights [N, K] stacked (gate and up: two parts of N / 2), each row of x routed to top_k of
    them."""
    experts = draw(st.integers(1, max_experts))
    top_k = draw(st.integers(1, min(experts, 4)))
    parts = draw(st.integers(1, 2))
    rows, k, n = draw(shapes(max_k, max_n, max_rows))
    n *= parts
    ab = draw(width(act_bits_))
    xf = float_format(x_format) if x_format else draw(formats)
    of = float_format(out_format) if out_format else draw(
        st.sampled_from([xf, FORMATS["float32"], FORMATS["bfloat16"], FORMATS["float16"]]))
    q, packed = draw(packed_weights(experts * n, k, 4))
    return LinearCase(draw(activation_bits(rows, k, xf, ab)), xf, q, packed,
                      draw(scale_bits(experts * n, k // GROUP_SIZE)), ab, of, 4,
                      routing=draw(routings(rows, experts, top_k)), experts=experts, parts=parts)


MOE_ACT_KINDS = ("unit", "unit", "unit", "wide-rows")  # mostly |x| about 1: nonzero outputs


@st.composite
def moe_cases(draw, max_experts: int = 4, max_tokens: int = 8, max_hidden: int = 96,
              max_inter: int = 64, act_bits_=None, blocks=("exact", "transformers")):
    """An MoE layer's routed experts, an input and its routing (cases.MoECase), with the glue
    of one of `blocks` (exactness.glue.BLOCKS). The edge cases
    of one projection are linear_cases' and routed_cases': here the inputs are mostly of
    magnitude about 1 (or a row spread wide), with scales about 2**-6, so that both projections
    and the weighted sum give nonzero, finite outputs, whose routing and order show."""
    from .cases import MoECase

    experts = draw(st.integers(1, max_experts))
    top_k = draw(st.integers(1, min(experts, 3)))
    tokens = draw(st.integers(1, max_tokens))
    hidden = GROUP_SIZE * draw(st.integers(1, max_hidden // GROUP_SIZE))
    inter = GROUP_SIZE * draw(st.integers(1, max_inter // GROUP_SIZE))
    ab = draw(width(act_bits_))
    xf = draw(formats)
    rng = np.random.default_rng(draw(seeds))
    x = _random_floats(rng, (tokens, hidden), xf, xf.bias - 3, xf.bias + 2)
    if draw(st.sampled_from(MOE_ACT_KINDS)) == "wide-rows":  # some elements far below amax
        x = _random_floats(rng, (tokens, hidden), xf, xf.bias - 12, xf.bias + 2)
    x[draw(st.lists(st.integers(0, tokens - 1), max_size=2, unique=True))] = 0
    scales = draw(st.sampled_from(("qat", "qat", "negative", "spread")))
    _, gate_up = draw(packed_weights(2 * inter * experts, hidden))
    _, down = draw(packed_weights(hidden * experts, inter))
    return MoECase(x.astype(np.int64), xf, ab, draw(routings(tokens, experts, top_k)),
                   rng.random((tokens, top_k)).astype(np.float32), experts,
                   (gate_up, draw(scale_bits(2 * inter * experts, hidden // GROUP_SIZE,
                                             scales))),
                   (down, draw(scale_bits(hidden * experts, inter // GROUP_SIZE, scales))),
                   draw(st.sampled_from(blocks)))
