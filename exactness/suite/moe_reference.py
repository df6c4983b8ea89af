"""The exact block's reference (exactness.moe, block "exact"), step by step from the contract's
pieces, in Python: the projections by the reference (reference_linear, fp32 out), h and the
weighted sum in Python floats (IEEE float64), each rounding by formats.round_scaled (the
contract's RNE). Only SiLU is torch's (float64, every element on its vector path, as the block
computes it): the block defines h as that value, rounded once.

    h      = RNE_fp32(silu(gate) * up)                  gate, up: the reference's fp32 outputs
    y      = the reference's down projection of h, fp32
    block  = RNE_dtype(((0 + y_1 w_1) + y_2 w_2) + ...)  float64 adds, experts ascending, then
                                                         slots; each y w exact in float64
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ..contract import FLOAT32, FloatFormat
from ..formats import bits_to_tensor, round_scaled
from ..glue import on_vector_path
from .cases import MoECase
from .paths import run


def rne(value: float, fmt: FloatFormat) -> int:
    """The bits of RNE(value) in `fmt`, value a Python float (float64), its zero's sign kept;
    NaN as fmt's canonical quiet NaN."""
    if math.isnan(value):
        return fmt.inf_bits | (1 << (fmt.mant_bits - 1))
    sign = fmt.sign_bit if math.copysign(1.0, value) < 0 else 0
    if math.isinf(value):
        return sign | fmt.inf_bits
    if value == 0:
        return sign
    n, d = value.as_integer_ratio()  # d a power of two
    return round_scaled(n, -(d.bit_length() - 1), fmt)


def silu64(gate: np.ndarray) -> np.ndarray:
    """torch's SiLU in float64, each element on its vector path (glue.on_vector_path)."""
    g = torch.from_numpy(np.asarray(gate, dtype=np.float64))
    return on_vector_path(torch.nn.functional.silu, g).numpy()


def exact_block(case: MoECase) -> np.ndarray:
    """The exact block's output bits [T, H] in case.x_format."""
    assert case.block == "exact", case
    t, top_k = case.routing.shape
    i, fmt = case.inter, case.x_format
    gate_up = bits_to_tensor(run(case.gate_up_case(), "reference"), FLOAT32).double().numpy()
    pairs = sorted((int(case.routing[token, slot]), slot, token)
                   for token in range(t) for slot in range(top_k)
                   if case.routing[token, slot] < case.experts)
    out = np.zeros((t, case.hidden), dtype=np.int64)
    if not pairs:
        return out
    h = []
    for _, slot, token in pairs:
        row = gate_up[token, slot * 2 * i:(slot + 1) * 2 * i]
        with np.errstate(all="ignore"):
            values = silu64(row[:i]) * row[i:]  # float64: as Python floats
        h.append([rne(float(v), FLOAT32) for v in values])
    y = run(case.down_case(np.array(h, dtype=np.int64), np.array([e for e, _, _ in pairs])),
            "reference")
    y = bits_to_tensor(y, FLOAT32).double().numpy()
    sums = np.zeros((t, case.hidden))
    for r, (_, slot, token) in enumerate(pairs):  # each token's in ascending experts, slots
        weight = float(case.top_k_weights[token, slot])
        for c in range(case.hidden):
            sums[token, c] = float(sums[token, c]) + float(y[r, c]) * weight
    for token in range(t):
        out[token] = [rne(float(v), fmt) for v in sums[token]]
    return out
