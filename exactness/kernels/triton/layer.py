"""The Triton kernels as the registry sees them: `triton-group` (the group kernel, any widths) and
`triton-folded` (the folded GEMM, from FOLDED_MIN_ROWS rows on), each quantizing x first.
"""

from __future__ import annotations

import torch

from ... import dataflow
from ...contract import ContractValueError, FloatFormat
from ...formats import torch_dtype
from .. import registry
from ..cpu.gemm import int_mm_exact
from ..registry import Fit, Weights, int8_limbs_hold, no, yes
from .folded import folded_fits, linear_folded
from .group import linear, offset_sums
from .launch import INTERPRETED, triton
from .quantize import quantize

# From this many activation rows the plan prefers linear_folded. The count of each kernel's
# instructions (docs/PERFORMANCE.md) puts the crossover at tens of rows; measuring it on a GPU
# (bench/gpu_check.py times both paths at every M) is issue 27.
FOLDED_MIN_ROWS = 64


# A launch computes its offsets into x, the limbs, T and y (row * row length + column) in int32,
# as Triton does for pointer arithmetic on int32 indices: each of those tensors must stay under
# this many elements, so a forward launches blocks of rows_per_launch rows (a 128K-token prefill
# through a dense down-projection, K = 18432, is 2.4e9 activations).
INT32_OFFSETS = 2**31 - 1


def rows_per_launch(k: int, n: int, act_bits: int) -> int:
    """The most rows of x [M, K] one forward's launches take (limbs [L, M, K], y [M, N])."""
    return max(1, INT32_OFFSETS // max(dataflow.act_limbs(act_bits) * k, n))


class _TritonKernel:
    """The Triton forward: x quantized by quantize_kernel, then the group kernel (`linear`) or
    the folded GEMM (`linear_folded`), in blocks of rows that keep each launch's offsets in int32
    (rows_per_launch). x is finite: the layer gives a non-finite row its NaN (contract v1.2)."""

    family, layout, auto, grouped = "triton", "triton", True, False

    def __init__(self, name: str, folded: bool, min_rows: int):
        self.name, self.folded, self.min_rows = name, folded, min_rows
        self.act_limbs = dataflow.GEMM_ACT_LIMBS if folded else dataflow.GROUP_ACT_LIMBS

    def available(self, device: torch.device) -> Fit:
        if triton is None:
            return no("the triton package is not installed")
        if device.type == "cpu" and not INTERPRETED:
            return no("x is on the CPU and TRITON_INTERPRET=1 is not set")
        if device.type not in ("cpu", "cuda"):
            return no(f"Triton runs on CUDA devices (or the CPU interpreter), x is on {device}")
        if self.folded and not int_mm_exact(str(device)):
            return no(f"torch._int_mm is missing or not exact on {device}")
        return yes("Triton, interpreted" if device.type == "cpu" else f"Triton on {device}")

    def eligible(self, rows: int, weights: Weights) -> Fit:
        held = int8_limbs_hold(weights.act_bits, self.act_limbs)
        if not held:
            return held
        if not self.folded:
            return yes("any weight widths")
        per_launch = rows_per_launch(weights.k, weights.n, weights.act_bits)
        blocks = {min(per_launch, rows - start) for start in range(0, rows, per_launch)}
        if not all(folded_fits(m, weights.n, weights.k) for m in blocks):
            return no(f"torch._int_mm does not take M in {sorted(blocks)}, N = {weights.n}, "
                      f"K = {weights.k} (more than 16 rows, N and K multiples of 8)")
        return yes("int8 GEMM on folded weight digits")

    def prepare(self, weights: Weights) -> None:
        return None  # the scales' factors are derived on the device per forward (gpu_weights)

    def run(self, x, weights: Weights, prepared: None, out_format: FloatFormat):
        """y for a finite x (the layer gives a non-finite row its NaN first): nothing is read
        back."""
        if registry.capturing(x):
            raise ContractValueError(
                "the exact layers cannot be captured into a CUDA graph yet: a forward reads "
                "back whether any weight row is slow; run them eagerly")
        return self.launches(x, weights, gpu_weights(weights, x.device),
                             torch_dtype(out_format))

    def launches(self, x, weights: Weights, derived: tuple, out_dtype: torch.dtype):
        """y, every block of rows queued, nothing read back."""
        args = (weights.packed, *derived, weights.bits)
        # the folded GEMM's digits, sized by the fast rows' spread: a read of the device (the
        # certified spread would need none, and twice the digits at Kimi's scales)
        digits = dataflow.folded_weight_limbs(weights.bits, weights.certificate.fast_spread) \
            if self.folded else 0
        ys = []
        for rows in x.split(rows_per_launch(weights.k, weights.n, weights.act_bits)):
            limbs, e_r, _ = quantize(rows, weights.act_bits)
            if self.folded:
                ys.append(linear_folded(limbs, e_r, *args, digits, out_dtype))
            else:
                ys.append(linear(limbs, e_r, *args, out_dtype))
        return ys[0] if len(ys) == 1 else torch.cat(ys)


def gpu_weights(weights: Weights, device: torch.device) -> tuple:
    """(factor, offset_sums, emin) on `device`, derived from the live buffers for one forward
    (on the buffers' device: nothing read back)."""
    cert = weights.certificate
    factor = cert.factor.to(device)
    return (factor, offset_sums(weights.packed.to(device), factor, weights.bits),
            cert.emin.to(device))


FOLDED = _TritonKernel("triton-folded", folded=True, min_rows=FOLDED_MIN_ROWS)
GROUP = _TritonKernel("triton-group", folded=False, min_rows=0)
