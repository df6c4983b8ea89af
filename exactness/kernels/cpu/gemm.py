"""The CPU path: int8 GEMMs (torch._int_mm, exact integer arithmetic) on scale-folded weight limbs.

At load, each certified weight row's scales are folded into its integers,
    Wf[n, k] = q[n, k] * ms[n, g] << (es[n, g] - emin[n]),
and Wf is split into signed int8 digits W_j. With activation limbs A_i (dataflow.activation_limbs)
    T = sum_{i,j} int_mm(A_i, W_j^T) << 8 (i + j)   (+ 128 * sum_k Wf for 16-bit activations),
exactly: each int_mm sums at most dataflow.int_mm_chunk(K) products of two int8s in int32
(dataflow.int_mm_bound; a longer K is summed in slices), and the combination is int64 within the
certified bound.
"""

from __future__ import annotations

import functools

import torch

from ... import dataflow
from ...contract import GROUP_SIZE, FloatFormat
from ...formats import bits_to_tensor, check_finite_tensor, round_scaled_array
from ..registry import Fit, Weights, int8_limbs_hold, no, yes
from .activations import quantize_rows


def fold(q: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """Wf [N, K] int64 = q * f: each group's factor f = ms << shift folded into its weights."""
    n, k = q.shape
    scale = factor.to(torch.int64)  # [N, G] ms << shift, zero for other rows
    return (q.to(torch.int64).view(n, k // GROUP_SIZE, GROUP_SIZE) * scale[:, :, None]).view(n, k)


class FoldedWeights:
    """Derived at load: the int8 digits of Wf [L, N, K] and sum_k Wf [N] (int64)."""

    def __init__(self, q: torch.Tensor, factor: torch.Tensor):
        folded = fold(q, factor)
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


def forward(x: torch.Tensor, weights: Weights, out_format: FloatFormat, accumulate_t):
    """The CPU kernels' forward around their T: x checked finite and quantized in float64
    (quantize_rows), T = accumulate_t(qa) [M, N] int64, then the one rounding by formats."""
    check_finite_tensor(x, "x")
    qa, e_r = quantize_rows(x, weights.act_bits)
    t = accumulate_t(qa)
    e = e_r[:, None] + weights.certificate.emin[None, :]
    return bits_to_tensor(round_scaled_array(t, e, out_format), out_format)


def accumulate(limbs: torch.Tensor, folded: FoldedWeights) -> torch.Tensor:
    """T [M, N] int64 from activation limbs [L, M, K] int8."""
    m, k = limbs.shape[1:]
    t = torch.zeros((m, folded.row_sum.shape[0]), dtype=torch.int64)
    chunk = dataflow.int_mm_chunk(k)
    for i, a in enumerate(limbs):
        for j, w in enumerate(folded.limbs):
            for k0 in range(0, k, chunk):  # each GEMM's int32 sum within int_mm_bound(chunk)
                z = torch._int_mm(a[:, k0:k0 + chunk].contiguous(),
                                  w[:, k0:k0 + chunk].contiguous().t())
                t += z.to(torch.int64) << (dataflow.LIMB_BITS * (i + j))
    if limbs.shape[0] == 2:
        t += dataflow.LIMB_OFFSET * folded.row_sum
    return t


def accumulate_int64(qa: torch.Tensor, folded: FoldedWeights) -> torch.Tensor:
    """The same T without _int_mm (CPUs where it is missing or inexact): int64 matmul of digits."""
    w = sum(limb.to(torch.int64) << (dataflow.LIMB_BITS * j)
            for j, limb in enumerate(folded.limbs))
    return qa.to(torch.int64) @ w.t()


class _GemmKernel:
    """The CPU path without the C kernel: activations quantized in float64 (quantize_rows), T by
    int8 GEMMs of limbs and digits (`int8-gemm`) or an int64 matmul (`int64-matmul`, for CPUs
    whose torch._int_mm is missing or inexact), the one rounding by formats."""

    family, layout, auto, min_rows, grouped = "cpu", "folded", True, 0, False

    def __init__(self, name: str, int8: bool):
        self.name, self.int8 = name, int8
        self.act_limbs = dataflow.GEMM_ACT_LIMBS if int8 else 0

    def available(self, device: torch.device) -> Fit:
        if device.type != "cpu":
            return no(f"it runs on the CPU, x is on {device}")
        if self.int8 and not int_mm_exact():
            return no("torch._int_mm is missing or not exact on this CPU")
        return yes("torch._int_mm, exact here" if self.int8 else "int64 matmul")

    def eligible(self, rows: int, weights: Weights) -> Fit:
        if self.int8:
            return int8_limbs_hold(weights.act_bits, self.act_limbs)
        return yes("any widths (int64 products, 32-bit activations too)")

    def prepare(self, weights: Weights) -> FoldedWeights:
        return FoldedWeights(weights.q(), weights.certificate.factor.cpu())

    def run(self, x, weights: Weights, prepared: FoldedWeights, out_format: FloatFormat):
        if self.int8:
            return forward(x, weights, out_format, lambda qa: accumulate(
                dataflow.activation_limbs(qa, weights.act_bits), prepared))
        return forward(x, weights, out_format, lambda qa: accumulate_int64(qa, prepared))


INT8_GEMM = _GemmKernel("int8-gemm", int8=True)
INT64_MATMUL = _GemmKernel("int64-matmul", int8=False)


class Float64Weights:
    """Derived at load: the folded weights Wf^T [K, N] as float64 (integers, exact: |Wf| < 2**24),
    8 bytes a weight."""

    def __init__(self, q: torch.Tensor, factor: torch.Tensor):
        self.folded_t = fold(q, factor).t().to(torch.float64).contiguous()

    @property
    def nbytes(self) -> int:
        return self.folded_t.numel() * 8


def accumulate_float64(qa: torch.Tensor, weights: Float64Weights) -> torch.Tensor:
    """T [M, N] int64 = qa @ Wf^T: qa's halves (hi signed, lo in [0, 2**16)) each times Wf^T in
    float64, every partial sum an integer within 2**53 (dataflow.float64_gemm_holds), so exact;
    then T = hi_part << 16 + lo_part in int64, within the certified combine bound."""
    qa = qa.to(torch.int64)
    hi, lo = qa >> dataflow.HALF_BITS, qa & (2**dataflow.HALF_BITS - 1)
    parts = [(half.to(torch.float64) @ weights.folded_t).to(torch.int64) for half in (hi, lo)]
    return (parts[0] << dataflow.HALF_BITS) + parts[1]


class _Float64Kernel:
    """Any activation width on the CPU, 32 bits included: two exact float64 GEMMs
    (accumulate_float64), the one rounding by formats. After the int8 kernels, of which only
    the C kernel carries 32 bits on the CPU; the int64 matmul takes what it does not hold (K and
    spread past 2**53)."""

    name, family, layout, auto, min_rows, grouped = "float64-gemm", "cpu", "float64", True, 0, \
        False
    act_limbs = 0  # no int8 limbs: qa in two 16-bit halves

    def available(self, device: torch.device) -> Fit:
        if device.type != "cpu":
            return no(f"it runs on the CPU, x is on {device}")
        return yes("float64 GEMMs of integers, exact below 2**53")

    def eligible(self, rows: int, weights: Weights) -> Fit:
        # at the certified spread, the most a fast row has (the plan reads no scales)
        spread = dataflow.certified_spread(weights.k, weights.bits, weights.act_bits)
        if not dataflow.float64_gemm_holds(weights.k, weights.bits, spread):
            return no(f"K = {weights.k} halves by folded weights of spread {spread} could pass "
                      f"2**53 in float64")
        return yes(f"act_bits {weights.act_bits} in two 16-bit halves, sums below 2**53")

    def prepare(self, weights: Weights) -> Float64Weights:
        return Float64Weights(weights.q(), weights.certificate.factor.cpu())

    def run(self, x, weights: Weights, prepared: Float64Weights, out_format: FloatFormat):
        return forward(x, weights, out_format, lambda qa: accumulate_float64(qa, prepared))


FLOAT64_GEMM = _Float64Kernel()
