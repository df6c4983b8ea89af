"""The `wide` kernel: the contract's combine in Python integers, for any scale spread.

The fast kernels' int64 combine holds rows whose scale-exponent spread is within
dataflow.certified_spread; the certificate sends the other rows (the slow rows) here. Each group
sum P = sum_k qa * q is summed in dataflow.group_sum_bits (int32, or int64 for 32-bit
activations: |P| < 2**40), and the combine T = sum_g (P * ms) << shift is taken in Python
integers, which never overflow; then the one rounding (formats.round_scaled). A forward runs in
blocks of BLOCK_ROWS rows of x, so its memory is bounded whatever the batch, and its time is
about that of the slow rows' own outputs. Slow per output but exact for every input: the layer
uses it for slow rows only, and `kernel="wide"` runs every row through it.
"""

from __future__ import annotations

import torch

from .. import dataflow
from ..contract import BFLOAT16, GROUP_SIZE, FloatFormat
from ..formats import (
    bits_to_tensor,
    check_finite_tensor,
    finite_mask,
    float_bits,
    round_scaled,
    split_scales,
)
from .cpu import vnni_calls, vnni_library
from .cpu.activations import quantize_rows
from .registry import Fit, Weights, yes

# x's rows per block, and a block's most group sums P (rows x weight rows x groups): the memory
# a forward's slow rows take is bounded by these, whatever the batch (issue 20: a whole batch of
# 20000 rows took 13.4 GB through one weight row)
BLOCK_ROWS = 256
BLOCK_SUMS = 2**22


class WideRows:
    """The unpacked weights and split scales of the rows asked for, kept: the slow rows are
    found once, at load, so a forward unpacks nothing."""

    def __init__(self, weights: Weights):
        self.weights = weights
        self._rows: dict = {}

    def of(self, rows: torch.Tensor | None) -> tuple:
        """(q int8 [N', G, 32], ms and shift int64 [N', G], emin [N'])."""
        key = None if rows is None else tuple(rows.tolist())
        if key not in self._rows:
            scale = self.weights.scale.cpu()
            q = self.weights.q(rows)
            bits = float_bits(scale if rows is None else scale[rows.cpu()])
            # a non-finite scale as 0: its row's outputs are NaN (the certificate's nan_rows)
            ms, shift, emin, _ = split_scales(torch.where(finite_mask(bits, BFLOAT16), bits, 0))
            self._rows[key] = (q.view(q.shape[0], -1, GROUP_SIZE), ms.to(torch.int64),
                               shift.to(torch.int64), emin)
        return self._rows[key]

    @property
    def nbytes(self) -> int:
        return sum(q.numel() + 8 * 3 * ms.numel() for q, ms, _, _ in self._rows.values())


def combine(p: torch.Tensor, ms: torch.Tensor, shift: torch.Tensor, per_sum: int) -> list[int]:
    """T = sum_g (P[:, g] * ms[g]) << shift[g] for one weight row, exactly, as Python ints [M']:
    the groups of each shift summed in int64 first, `per_sum` groups at a time
    (dataflow.wide_groups_per_sum: those never reach 2**63), then one Python-int term per
    distinct shift and slice."""
    t = [0] * p.shape[0]
    for first in range(0, p.shape[1], per_sum):
        part_of = slice(first, first + per_sum)
        shifts, where = torch.unique(shift[part_of], return_inverse=True)
        parts = torch.zeros((p.shape[0], shifts.numel()), dtype=torch.int64)
        parts.index_add_(1, where, p[:, part_of] * ms[part_of])
        for s, part in zip(shifts.tolist(), parts.t().tolist(), strict=True):
            t = [a + (b << s) for a, b in zip(t, part, strict=True)]
    return t


def quantized(x: torch.Tensor, act_bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(qa int32 [M, K], e_r [M]) of x [M, K] on the CPU: by the AVX-512 build's quantization
    pass where it runs (one pass over x, its biased limbs: the slow rows then cost little more
    than their own outputs), else by quantize_rows. Either raises NonFiniteError for a
    non-finite x."""
    lib = vnni_library.AVX512.library()
    if lib is None:
        check_finite_tensor(x, "x")  # raises: count, index
        return quantize_rows(x, act_bits)
    limbs, e_r = vnni_calls.quantize(x, act_bits, lib)  # the bytes of qa + 2**(8 L - 1)
    biased = torch.zeros(limbs.shape[1:], dtype=torch.int64)
    for j, limb in enumerate(limbs):
        biased.add_(limb.to(torch.int64) << (dataflow.LIMB_BITS * j))
    return biased.sub_(1 << (dataflow.LIMB_BITS * limbs.shape[0] - 1)).to(torch.int32), e_r


def linear_rows(x: torch.Tensor, weights: Weights, rows: torch.Tensor | None,
                out_format: FloatFormat, prepared: WideRows) -> torch.Tensor:
    """y [M, len(rows)] for the weight rows `rows` (None: all), in `out_format`, on x's device,
    computed in blocks of at most BLOCK_ROWS rows of x."""
    q, ms, shift, emin = prepared.of(rows)
    n, groups = q.shape[0], q.shape[1]
    sums = {32: torch.int32, 64: torch.int64}[dataflow.group_sum_bits(weights.bits,
                                                                      weights.act_bits)]
    per_sum = dataflow.wide_groups_per_sum(weights.bits, weights.act_bits)
    rows_of_weights = max(1, BLOCK_SUMS // (BLOCK_ROWS * groups))
    out = torch.empty((x.shape[0], n), dtype=torch.int64)
    for start in range(0, x.shape[0], BLOCK_ROWS):
        qa, e_r = quantized(x[start:start + BLOCK_ROWS].cpu(), weights.act_bits)
        qa = qa.view(qa.shape[0], groups, GROUP_SIZE).to(sums)
        for first in range(0, n, rows_of_weights):
            block = slice(first, first + rows_of_weights)
            # P [M', N', G]: exact in `sums`, every partial sum too (proved: wide-group-sum)
            p = torch.einsum("mgk,ngk->mng", qa, q[block].to(sums)).to(torch.int64)
            for j in range(p.shape[1]):
                t = combine(p[:, j], ms[first + j], shift[first + j], per_sum)
                e = (e_r + emin[first + j]).tolist()
                out[start:start + len(t), first + j] = torch.tensor(
                    [round_scaled(v, s, out_format) for v, s in zip(t, e, strict=True)])
    return bits_to_tensor(out, out_format).to(x.device)


class _WideKernel:
    name, family, layout, min_rows, grouped, act_limbs = "wide", "any", "wide", 0, False, 0
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


def splice_slow_rows(y: torch.Tensor, x: torch.Tensor, weights: Weights, slow: torch.Tensor,
                     out_format: FloatFormat, rows=slice(None), column: int = 0) -> None:
    """Write into y[rows, column + slow] the outputs of the weight rows `slow`, whose scale
    spread no fast kernel holds, for x's rows: this kernel's. A layer's forward and the grouped
    MoE call both finish with it."""
    y[rows, column + slow.to(y.device)] = linear_rows(x, weights, slow, out_format,
                                                      WIDE.prepare(weights))
