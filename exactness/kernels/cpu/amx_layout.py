"""The AMX kernel's layout. It reads a layer as the limb kernel does (vnni_layout.InPlace: the
checkpoint's buffers, each block of 16 rows built in C as its thread reaches it); cpu_amx.c then
derives the block's spans and digit planes there too, so nothing is built in Python or kept.
`amx_spans` is the Python twin of that C (amx_block_spans), for the suite to check it against.
"""

from __future__ import annotations

import torch

from ... import dataflow
from ...contract import GROUP_SIZE
from .vnni_layout import LANE_ROWS, InPlace, NativeWeights, at_span_ends


class AmxInPlace(InPlace):
    """A layer read in place by the AMX kernel (InPlace), whose scratch is larger: besides the
    block, its spans and its two digit planes."""

    @property
    def nbytes(self) -> int:
        """The rows' emin and flags, and each thread's scratch (cpu_amx.c's amx_scratch_bytes)."""
        groups = self.k // GROUP_SIZE
        scratch = (self.k * 16 + 4 * groups * 16 * 4 + groups * 16 * 3 + groups + 16 * 8
                   + groups * 2048 + groups * 2 * 4 + 64 * 4)
        return self.emin.numel() * 8 + self.flags.numel() + scratch * torch.get_num_threads()


def fold_limit(weights: NativeWeights | InPlace) -> int:
    """dataflow.span_fold_limit of the weights' width as the kernel reads them: 4-bit pairs
    (derived, where every weight fits) or the checkpoint's own width (in place)."""
    return dataflow.span_fold_limit(weights.bits)


def amx_spans(weights: NativeWeights) -> tuple[torch.Tensor, ...]:
    """The twin of cpu_amx.c's amx_block_spans, for one layer's weights (NativeWeights: c [G, Np]
    in row order, wsum [G, Np] in lane order): (f [Np/16, G, 16] int16 in lane order, base
    [Np/16, G, 16] int8 in row order, ends [Np/16, G] uint8, rsum [Np] int64 in row order).
    Per block of 16 rows, groups are taken into a span greedily while, for every row, the largest
    |c| of the span over the largest power of two dividing them all (2**base) is at most
    dataflow.span_fold_limit (then every q * (c >> base) is an s16, proofs: amx-span-digits), and
    the span has at most AMX_SPAN_GROUPS groups. A group alone always fits: c >> its low bit is
    |ms| <= 255. R = sum_k q * c."""
    c, groups = weights.c.t().to(torch.int64), weights.k // GROUP_SIZE
    nb = weights.np // 16
    c = c.reshape(nb, 16, groups)  # row order
    limit = fold_limit(weights)
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
    return (f[:, LANE_ROWS].transpose(1, 2).to(torch.int16).contiguous(),
            base.transpose(1, 2).to(torch.int8).contiguous(), ends.to(torch.uint8).contiguous(),
            rsum.contiguous())
