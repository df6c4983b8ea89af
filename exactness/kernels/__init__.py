"""Every kernel, in one registry: the plan takes the first that runs here, holds the inputs and
is preferred at the batch's size (kernels/registry.py). Adding a kernel is its own module and
one line here (docs/ARCHITECTURE.md).

Each computes T[r, n] = sum_k qa[r, k] * q[n, k] * ms[n, g] << shift[n, g] exactly, then the
one final rounding (docs/SPEC.md section 5).
"""

from . import amx, cpu, native, triton_exact, triton_grouped, wide
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

REGISTRY: tuple[Kernel, ...] = (
    amx.AMX,  # C, AMX-INT8 tiles (Intel Xeon): the limb kernel's dots on tiles, from 16 rows on
    native.SPANS,  # C, AVX-512 VNNI: 16-bit activations as int16 words, from 24 rows on
    native.LIMBS,  # C, AVX-512 VNNI: activations as int8 limbs
    native.GROUPED,  # C, AVX-512 VNNI: an MoE layer's routed experts in one call
    cpu.INT8_GEMM,  # torch._int_mm on folded weight digits
    cpu.FLOAT64_GEMM,  # any widths (32-bit activations): two exact float64 GEMMs of integers
    cpu.INT64_MATMUL,  # an int64 matmul, where torch._int_mm is not exact (or nothing else holds)
    triton_exact.FOLDED,  # GPU, many rows: an int8 GEMM on folded weight digits
    triton_exact.GROUP,  # GPU: per group of 32, int8 dots on tensor cores
    triton_grouped.GROUPED,  # GPU: an MoE layer's routed experts in one launch
    wide.WIDE,  # Python integers, any scale spread: the certificate's slow rows
)

__all__ = ["REGISTRY", "Fit", "GroupedKernel", "Kernel", "KernelUnavailableError", "Plan",
           "Weights", "plan", "plan_grouped"]
