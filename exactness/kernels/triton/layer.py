"""The Triton kernels as the registry sees them: `triton-group` (the group kernel, any widths) and
`triton-folded` (the folded GEMM, from FOLDED_MIN_ROWS rows on), each quantizing x first.
"""

from __future__ import annotations

import torch

from ... import dataflow
from ...contract import FloatFormat, float_format
from ...formats import torch_dtype
from ..cpu.gemm import int_mm_exact
from ..registry import Fit, Weights, int8_limbs_hold, no, yes
from .folded import folded_fits, linear_folded
from .group import linear
from .launch import INTERPRETED, triton
from .quantize import quantize
from .scales import device_certificate
from .wide import finish

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
    (rows_per_launch); the certificate before them and finish_kernel after, all on the device."""

    family, layout, auto, grouped = "triton", "triton", True, False

    def __init__(self, name: str, folded: bool, min_rows: int):
        self.name, self.folded, self.min_rows = name, folded, min_rows
        self.act_limbs = dataflow.GEMM_ACT_LIMBS if folded else dataflow.GROUP_ACT_LIMBS

    def available(self, device: torch.device) -> Fit:
        if triton is None:
            return no("the triton package is not installed (pip install 'exactness[triton]')")
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
        return None  # the scales' certificate is derived on the device per forward

    def run(self, x, weights: Weights, prepared: None, out_format: FloatFormat):
        """y for x [M, K], every output: the fast rows by this kernel, then the slow rows and the
        NaN outputs by finish_kernel. Launches only: nothing is read back, nothing allocated by
        a value on the device, so a CUDA graph can capture it."""
        return self.launches(x, weights, torch_dtype(out_format))

    def launches(self, x, weights: Weights, out_dtype: torch.dtype):
        """y, every block of rows queued, nothing read back."""
        factor, row_sums, emin, flags = device_certificate(
            weights.packed, weights.scale, weights.k, weights.bits, weights.act_bits)
        args = (weights.packed, factor, row_sums, emin, weights.bits)
        out = float_format(out_dtype)
        ys = []
        for rows in x.split(rows_per_launch(weights.k, weights.n, weights.act_bits)):
            limbs, e_r, bad = quantize(rows, weights.act_bits)
            if self.folded:
                y = linear_folded(limbs, e_r, *args, folded_digits(weights), out_dtype)
            else:
                y = linear(limbs, e_r, *args, out_dtype)
            ys.append(finish(y, limbs, e_r, bad, weights.packed, weights.scale, flags,
                             weights.bits, weights.act_bits, out))
        return ys[0] if len(ys) == 1 else torch.cat(ys)


def gpu_weights(weights: Weights, device: torch.device) -> tuple:
    """(factor, offset sums, emin) of the live buffers on `device`, by scales_kernel: what the
    group kernel and the folded GEMM read (the tests and bench/gpu_check.py call them alone)."""
    factor, row_sums, emin, _ = device_certificate(
        weights.packed.to(device), weights.scale.to(device), weights.k, weights.bits,
        weights.act_bits)
    return factor, row_sums, emin


def folded_digits(weights: Weights) -> int:
    """The folded GEMM's int8 digits of q * f: enough for every certified spread, a bound that
    holds for every input, so that no read of the scales sizes them (4 for 4-bit weights where
    Kimi's spreads would need 2: docs/PERFORMANCE.md)."""
    spread = dataflow.certified_spread(weights.k, weights.bits, weights.act_bits)
    return dataflow.folded_weight_limbs(weights.bits, spread)


FOLDED = _TritonKernel("triton-folded", folded=True, min_rows=FOLDED_MIN_ROWS)
GROUP = _TritonKernel("triton-group", folded=False, min_rows=0)
