"""Every kernel, in one registry: the plan takes the first that runs here, holds the inputs and
is preferred at the batch's size (kernels/registry.py). A wing per backend: cpu/ (C kernels and
torch GEMMs), triton/ (the GPU), and wide.py (Python integers). Adding a kernel is its own module
and one line here (docs/ARCHITECTURE.md).

Each computes T[r, n] = sum_k qa[r, k] * q[n, k] * ms[n, g] << shift[n, g] exactly, then the
one final rounding (docs/SPEC.md section 5).
"""

from . import wide
from .cpu import amx, gemm, vnni
from .registry import (
    Fit,
    GroupedKernel,
    Kernel,
    KernelUnavailableError,
    Plan,
    Weights,
    plan,
    plan_grouped,
)
from .triton import grouped, layer

REGISTRY: tuple[Kernel, ...] = (
    amx.AMX,  # C, AMX-INT8 tiles (Intel Xeon): the limb kernel's dots on tiles, from 16 rows on
    vnni.SPANS,  # C, AVX-512 VNNI: 16-bit activations as int16 words, from 24 rows on
    vnni.LIMBS,  # C, AVX-512 VNNI: activations as int8 limbs
    vnni.GROUPED,  # C, AVX-512 VNNI: an MoE layer's routed experts in one call
    vnni.AVX2_LIMBS,  # C, AVX2 (every x86-64 CPU): activations as int8 limbs
    vnni.AVX2_GROUPED,  # C, AVX2: an MoE layer's routed experts in one call
    gemm.INT8_GEMM,  # torch._int_mm on folded weight digits
    gemm.FLOAT64_GEMM,  # any widths (32-bit activations): two exact float64 GEMMs of integers
    gemm.INT64_MATMUL,  # an int64 matmul, where torch._int_mm is not exact (or nothing else holds)
    layer.FOLDED,  # GPU, many rows: an int8 GEMM on folded weight digits
    layer.GROUP,  # GPU: per group of 32, int8 dots on tensor cores
    grouped.GROUPED,  # GPU: an MoE layer's routed experts in one launch
    wide.WIDE,  # Python integers, any scale spread: the certificate's slow rows
)

__all__ = ["REGISTRY", "Fit", "GroupedKernel", "Kernel", "KernelUnavailableError", "Plan",
           "Weights", "plan", "plan_grouped"]
