"""The CPU path: int8 GEMMs (torch._int_mm, exact integer arithmetic) on scale-folded weight limbs.

At load, each certified weight row's scales are folded into its integers,
    Wf[n, k] = q[n, k] * ms[n, g] << (es[n, g] - emin[n]),
and Wf is split into signed int8 digits W_j. With activation limbs A_i (dataflow.activation_limbs)
    T = sum_{i,j} int_mm(A_i, W_j^T) << 8 (i + j)   (+ 128 * sum_k Wf for 16-bit activations),
exactly: each int_mm sums at most K products of two int8s in int32 (dataflow.int_mm_bound), and
the combination is int64 within the certified bound.
"""

from __future__ import annotations

import functools

import torch

from .. import dataflow
from ..contract import GROUP_SIZE


class FoldedWeights:
    """Derived at load: the int8 digits of Wf [L, N, K] and sum_k Wf [N] (int64)."""

    def __init__(self, q: torch.Tensor, factor: torch.Tensor):
        n, k = q.shape
        scale = factor.to(torch.int64)  # [N, G] ms << shift, zero for other rows
        folded = (q.to(torch.int64).view(n, k // GROUP_SIZE, GROUP_SIZE) * scale[:, :, None])
        folded = folded.view(n, k)
        lo, hi = (int(folded.min()), int(folded.max())) if folded.numel() else (0, 0)
        self.limbs = dataflow.int8_digits(folded, dataflow.weight_limbs_needed(lo, hi))
        self.row_sum = folded.sum(dim=1)

    @property
    def nbytes(self) -> int:
        return self.limbs.numel() + self.row_sum.numel() * 8


@functools.cache
def int_mm_exact(device: str = "cpu") -> bool:
    """torch._int_mm exists on `device` and sums int8 products in int32 exactly.

    Checked once per device, at the worst case (every product +2**14, where a 16-bit
    intermediate would saturate) and on random limbs against int64.
    """
    if not hasattr(torch, "_int_mm"):
        return False
    worst = torch.full((24, 4096), -128, dtype=torch.int8, device=device)
    mixed = torch.randint(-128, 128, (40, 4096), dtype=torch.int8,
                          generator=torch.Generator().manual_seed(0)).to(device)
    try:
        return bool((torch._int_mm(worst, worst.t()) == 4096 * 128 * 128).all()) and bool(
            (torch._int_mm(mixed, mixed.t()).to(torch.int64).cpu()
             == mixed.cpu().to(torch.int64) @ mixed.cpu().to(torch.int64).t()).all())
    except RuntimeError:
        return False


def accumulate(limbs: torch.Tensor, folded: FoldedWeights) -> torch.Tensor:
    """T [M, N] int64 from activation limbs [L, M, K] int8."""
    m = limbs.shape[1]
    t = torch.zeros((m, folded.row_sum.shape[0]), dtype=torch.int64)
    for i, a in enumerate(limbs):
        for j, w in enumerate(folded.limbs):
            t += torch._int_mm(a, w.t()).to(torch.int64) << (dataflow.LIMB_BITS * (i + j))
    if limbs.shape[0] == 2:
        t += dataflow.LIMB_OFFSET * folded.row_sum
    return t


def accumulate_int64(qa: torch.Tensor, folded: FoldedWeights) -> torch.Tensor:
    """The same T without _int_mm (CPUs where it is missing or inexact): int64 matmul of digits."""
    w = sum(limb.to(torch.int64) << (dataflow.LIMB_BITS * j)
            for j, limb in enumerate(folded.limbs))
    return qa.to(torch.int64) @ w.t()
