"""The scales' certificate: what the fast kernels need of a layer's bf16 scales, and which weight
rows they hold exactly (docs/SPEC.md, the certificate). Derived from the live scales when a
forward asks, never kept: a write to weight_scale is seen at the next forward.

The C kernel derives the same per block as it runs (cpu_vnni.c's prepare_block), and the GPU's
grouped kernel per program (triton/grouped.py); this is their twin, and the self-checks and
tests tie them to it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import dataflow
from ..contract import BFLOAT16
from ..formats import finite_mask, float_bits, split_scales


@dataclass
class Certificate:
    """A row is fast when its scale-exponent spread is within dataflow.certified_spread (the int64
    combine and the folded weights' digits both hold it); other rows take the exact `wide` path."""

    emin: torch.Tensor  # [N] int64: least exponent of the row's nonzero scales (0 if none)
    spread: torch.Tensor  # [N] int64
    factor: torch.Tensor  # [N, G] int32: ms << (es - emin), 0 on slow rows (dataflow step 3)
    fast: torch.Tensor  # [N] bool
    spread_limit: int
    nonfinite: torch.Tensor  # [N] bool: the row holds a non-finite scale, counted as 0 here

    @property
    def slow_rows(self) -> torch.Tensor:
        """[N_slow] int64 on the scales' device: the rows not fast (a read of the device)."""
        return torch.nonzero(~self.fast).flatten()

    @property
    def nan_rows(self) -> torch.Tensor:
        """[N_nan] int64: rows whose outputs are the canonical NaN (contract v1.2, section 2)."""
        return torch.nonzero(self.nonfinite).flatten()

    @property
    def fast_spread(self) -> int:
        """The largest spread of a fast row (0 if none): the folded digits it needs."""
        return int(torch.where(self.fast, self.spread, 0).max()) if self.spread.numel() else 0

    def summary(self) -> dict:
        return {"rows": int(self.fast.numel()), "fast_rows": int(self.fast.sum()),
                "slow_rows": int((~self.fast).sum()), "max_spread": int(self.spread.max()),
                "spread_limit": self.spread_limit, "nan_rows": int(self.nonfinite.sum())}


def certify(weight_scale: torch.Tensor, k: int, w_bits: int, act_bits: int) -> Certificate:
    """The certificate of `weight_scale` [N, G] bf16 on its own device, read nothing back."""
    bits = float_bits(weight_scale)
    finite = finite_mask(bits, BFLOAT16)
    ms, shift, emin, spread = split_scales(torch.where(finite, bits, 0))
    limit = dataflow.certified_spread(k, w_bits, act_bits)
    fast = spread <= limit
    # an int32 for every certified spread (proved: scale-factor)
    keep = fast[:, None]
    factor = torch.where(keep, ms.to(torch.int64) << torch.where(keep, shift, 0), 0)
    return Certificate(emin, spread, factor.to(torch.int32), fast, limit, ~finite.all(dim=1))
