"""The `wide` kernel: the contract in Python integers, for any scale spread.

The fast kernels' int64 combine holds rows whose scale-exponent spread is within
dataflow.certified_spread; the certificate sends the other rows (the slow rows) here. Each group
sum P = sum_k qa * q is an int64 (|P| <= 32 * Qa * 128 < 2**28), and the combine
T = sum_g (P * ms) << shift is taken in Python integers, which never overflow; then the one
rounding (formats.round_scaled). Slow but exact for every input: the layer uses it for slow rows
only, and `kernel="wide"` runs every row through it.
"""

from __future__ import annotations

import numpy as np
import torch

from ..contract import GROUP_SIZE, FloatFormat, float_format
from ..formats import (
    bits_to_tensor,
    check_finite,
    float_bits,
    round_scaled,
    split_scales,
)
from ..quantize import quantize_activations
from .registry import Fit, Weights, yes


class WideRows:
    """The unpacked weights and split scales of the rows asked for, kept: the slow rows are
    found once, at load, so a forward unpacks nothing."""

    def __init__(self, weights: Weights):
        self.weights = weights
        self._rows: dict = {}

    def of(self, rows: torch.Tensor | None) -> tuple:
        """(q int8 [N', G, 32], ms and shift as Python-int arrays [N', G], emin [N'])."""
        key = None if rows is None else tuple(rows.tolist())
        if key not in self._rows:
            scale = self.weights.scale.cpu()
            q = self.weights.q(rows).numpy().astype(np.int8)
            ms, shift, emin, _ = split_scales(float_bits(
                scale if rows is None else scale[rows.cpu()]).numpy())
            self._rows[key] = (q.reshape(q.shape[0], -1, GROUP_SIZE), ms.astype(object),
                               shift.astype(object), emin)
        return self._rows[key]

    @property
    def nbytes(self) -> int:
        return sum(q.nbytes + 8 * 3 * ms.size for q, ms, _, _ in self._rows.values())


def linear_rows(x: torch.Tensor, weights: Weights, rows: torch.Tensor | None,
                out_format: FloatFormat, prepared: WideRows) -> torch.Tensor:
    """y [M, len(rows)] for the weight rows `rows` (None: all), in `out_format`, on x's device."""
    x_format = float_format(x.dtype)
    x_bits = float_bits(x).cpu().numpy()
    check_finite(x_bits, x_format, "x")
    q, ms, shift, emin = prepared.of(rows)
    qa, e_r = quantize_activations(x_bits, x_format, weights.act_bits)
    # P [M, N, G] in int64, then the combine in Python integers (object arrays)
    p = np.einsum("ngk,mgk->mng", q.astype(np.int64), qa.reshape(qa.shape[0], -1, GROUP_SIZE))
    t = ((p.astype(object) * ms) << shift).sum(axis=2)
    out = np.array([[round_scaled(int(t[r, n]), int(e_r[r] + emin[n]), out_format)
                     for n in range(t.shape[1])] for r in range(t.shape[0])], dtype=np.int64)
    return bits_to_tensor(out.reshape(t.shape), out_format).to(x.device)


class _WideKernel:
    name, family, layout, min_rows = "wide", "any", "wide", 0
    auto = False  # the slow rows' kernel, or asked for by name: never the plan's own choice

    def available(self, device: torch.device) -> Fit:
        return yes("Python integers, on the CPU")

    def eligible(self, rows: int, weights: Weights) -> Fit:
        return yes("any widths, any scale spread")

    def prepare(self, weights: Weights) -> WideRows:
        return WideRows(weights)

    def run(self, x, weights: Weights, prepared: WideRows, out_format: FloatFormat):
        return linear_rows(x, weights, None, out_format, prepared)


WIDE = _WideKernel()
