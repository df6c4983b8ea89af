"""The AMX kernel's layout: cpu_vnni.c's weight blocks (NativeWeights) with the scales folded in
over spans of groups (amx_spans), derived once per layer and kept beside them, and the struct
cpu_amx.c reads.
"""

from __future__ import annotations

import ctypes

import torch

from ... import dataflow
from .vnni_layout import LANE_ROWS, NativeWeights, at_span_ends


def amx_spans(weights: NativeWeights) -> AmxSpans:
    """The AMX kernel's spans of one layer's weights (NativeWeights: c [G, Np] in row order, wsum
    [G, Np] in lane order). Per block of 16 rows, groups are taken into a span greedily while, for
    every row, the largest |c| of the span over the largest power of two dividing them all (base)
    is at most dataflow.span_fold_limit (then every q * (c >> base) is an s16, proofs:
    amx-span-digits), and the span has at most AMX_SPAN_GROUPS groups. A group alone always
    fits: c >> its low bit is |ms| <= 255."""
    c, groups = weights.c.t().to(torch.int64), weights.k // 32
    nb = weights.np // 16
    c = c.reshape(nb, 16, groups)  # row order
    limit = dataflow.span_fold_limit(4 if weights.nibbles else 8)
    never = 1 << 40  # "no nonzero factor yet": divides nothing
    low_bit = torch.where(c != 0, c & -c, never)
    top = c.abs()
    ends = torch.zeros(nb, groups, dtype=torch.bool)
    lows = torch.ones(nb, 16, groups, dtype=torch.int64)  # 2**base at each span's end
    span_low, span_top = low_bit[..., 0], top[..., 0]
    length = torch.ones(nb, dtype=torch.int64)
    for g in range(1, groups):  # greedy: extend the span while every row's fold holds
        low, high = torch.minimum(span_low, low_bit[..., g]), torch.maximum(span_top, top[..., g])
        fits = (high // low <= limit).all(1) & (length < dataflow.AMX_SPAN_GROUPS)
        ends[~fits, g - 1] = True
        lows[~fits, :, g - 1] = span_low[~fits]
        keep = fits[:, None]
        span_low = torch.where(keep, low, low_bit[..., g])
        span_top = torch.where(keep, high, top[..., g])
        length = torch.where(fits, length + 1, 1)
    ends[:, -1] = True
    lows[..., -1] = span_low
    low = at_span_ends(lows, ends)
    base = torch.where(low == never, 0, low.double().log2().round().to(torch.int64))  # exact
    f = c >> base
    rows = torch.tensor(LANE_ROWS).argsort()  # each row's lane
    wsum = weights.wsum.to(torch.int64).view(groups, nb, 16)[:, :, rows].reshape(groups, -1)
    rsum = (wsum * weights.c.to(torch.int64)).sum(0)  # R = sum_k q * c, row order
    return AmxSpans(f[:, LANE_ROWS].transpose(1, 2).to(torch.int16).contiguous(),
                    base.transpose(1, 2).to(torch.int8).contiguous(),
                    ends.to(torch.uint8).contiguous(), rsum.contiguous())


class AmxLayer(ctypes.Structure):
    """cpu_amx.c's AmxLayer: what the AMX kernel reads of a layer."""

    _fields_ = [(name, ctypes.c_void_p) for name in
                ("w", "f", "base", "ends", "rsum", "emin")] + [
        ("k", ctypes.c_int64), ("np", ctypes.c_int64), ("n", ctypes.c_int64),
        ("nibbles", ctypes.c_int32)]


class AmxSpans:
    """The AMX kernel's spans of one layer (amx_spans), derived once and kept beside its
    NativeWeights: f [Np/16, G, 16] int16 in lane order, base [Np/16, G, 16] int8 and the
    rows' R = sum_k q * c [Np] int64 in row order, ends [Np/16, G] uint8."""

    def __init__(self, f, base, ends, rsum):
        self.f, self.base, self.ends, self.rsum = f, base, ends, rsum
        self.tensors = (f, base, ends, rsum)
        self._layer: tuple = ()  # (emin, its padded copy, the AmxLayer pointing into them)

    def layer(self, weights: NativeWeights, emin: torch.Tensor) -> AmxLayer:
        """The AmxLayer for the certificate's `emin`, built once per emin and kept."""
        if not self._layer or self._layer[0] is not emin:
            padded = weights.padded(emin)
            self._layer = (emin, padded, AmxLayer(
                weights.w.data_ptr(), self.f.data_ptr(), self.base.data_ptr(),
                self.ends.data_ptr(), self.rsum.data_ptr(), padded.data_ptr(), weights.k,
                weights.np, weights.n, int(weights.nibbles)))
        return self._layer[2]


def spans_of(weights: NativeWeights) -> AmxSpans:
    return weights.derived("amx", amx_spans)
