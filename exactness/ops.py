"""The exact layer's forward as one torch custom op, `exactness::linear`: the way vLLM and SGLang
take a kernel (`direct_register_custom_op`), and what `torch.compile` and `make_fx` see of it.

The op takes x [M, K] and the live buffers, and returns y [M, N]. Its fake implementation gives
the shape and dtype alone, so a trace never runs a kernel. On a CUDA device (and under the Triton
interpreter) its body only launches kernels: the certificate, the quantization, the GEMM, then
the slow rows and the NaN outputs on the device; no value is read back and nothing is sized by
one, so a CUDA graph captures it. On the CPU its body is the CPU kernels' forward: the plan, the
kernel, the slow rows spliced in from `wide` and the NaN rows (those read their own flags, which
costs nothing there).
"""

from __future__ import annotations

import os

import torch

from .contract import NonFiniteError, float_format
from .kernels import REGISTRY, Plan, Weights, plan
from .kernels.registry import ENV
from .kernels.wide import WIDE, splice_slow_rows

PLANS: dict = {}  # by plan_key: the widths, shapes and switches, never the buffers' values
SWITCHES = ("EXACTNESS_NATIVE", "EXACTNESS_AMX")  # which C builds may run (the builds' status)


def plan_key(family: str, device: torch.device, rows: int, weights: Weights,
             forced: str | None) -> tuple:
    """What a plan depends on: the family, device, rows, the kernel forced on the layer or by
    EXACTNESS_KERNEL, the shape and widths, and the C builds' switches. (The builds' status is
    judged once a process: docs/VERIFY.md, the register of the caches.)"""
    return (family, device, rows, forced, os.environ.get(ENV), weights.n, weights.k,
            weights.bits, weights.act_bits, *(os.environ.get(s) for s in SWITCHES))


def planned(family: str, device: torch.device, rows: int, weights: Weights,
            forced: str | None) -> Plan:
    """registry.plan, kept per plan_key: a forward plans without walking the registry."""
    key = plan_key(family, device, rows, weights, forced)
    if key not in PLANS:
        if len(PLANS) > 4096:  # many batch sizes and layers: keep the cache bounded
            PLANS.clear()
        PLANS[key] = plan(REGISTRY, family, device, rows, weights, forced)
    return PLANS[key]


@torch.library.custom_op("exactness::linear", mutates_args=())
def linear(x: torch.Tensor, weight_packed: torch.Tensor, weight_scale: torch.Tensor,
           in_features: int, bits: int, act_bits: int, out_dtype: torch.dtype, family: str,
           kernel: str | None) -> torch.Tensor:
    """y [M, N] in out_dtype = RNE(2**e_r * sum_g s[n, g] * sum_k qa[r, k] * q[n, k]) for a
    finite row of x, the canonical NaN for a row holding inf or NaN or a weight row holding a
    non-finite scale (contract v1.2). `family`: "triton" or "cpu"; `kernel`: a forced kernel's
    name, or None for the plan's."""
    return forward(x, weight_packed, weight_scale, in_features, bits, act_bits, out_dtype,
                   family, kernel)


@linear.register_fake
def _(x, weight_packed, weight_scale, in_features, bits, act_bits, out_dtype, family, kernel):
    return x.new_empty((x.shape[0], weight_packed.shape[0]), dtype=out_dtype)


def forward(x: torch.Tensor, weight_packed: torch.Tensor, weight_scale: torch.Tensor,
            in_features: int, bits: int, act_bits: int, out_dtype: torch.dtype, family: str,
            kernel: str | None) -> torch.Tensor:
    """The op's body: plan, then the Triton kernel (every output on the device) or the CPU's."""
    if x.shape[0] == 0:  # no row: no kernel to plan or launch (a grid of none divides by 0)
        return x.new_empty((0, weight_packed.shape[0]), dtype=out_dtype)
    weights = Weights(weight_packed, weight_scale, weight_packed.shape[0], in_features, bits,
                      act_bits)
    chosen = planned(family, x.device, x.shape[0], weights, kernel)
    out_format = float_format(out_dtype)
    prepared = chosen.kernel.prepare(weights)
    if chosen.kernel.family == "triton":  # every output on the device, nothing read back
        return chosen.kernel.run(x, weights, prepared, out_format)
    return cpu_forward(x, weights, chosen, prepared, out_format)


def cpu_forward(x: torch.Tensor, weights: Weights, chosen: Plan, prepared,
                out_format) -> torch.Tensor:
    """y by a CPU kernel (or `wide`, asked for by name): the kernels find a non-finite x as they
    quantize (no pass of its own); then the slow rows from `wide` and the NaN rows."""
    bad_rows = None
    try:
        y = chosen.kernel.run(x, weights, prepared, out_format)
    except NonFiniteError:
        bad_rows = ~torch.isfinite(x).all(dim=1)
        x = x.masked_fill(bad_rows[:, None], 0)
        y = chosen.kernel.run(x, weights, prepared, out_format)
    slow, nan_rows = weights.rows_apart()  # as the C kernel found them, or the certificate
    if slow.numel() and chosen.kernel is not WIDE:  # spreads no fast kernel holds
        splice_slow_rows(y, x, weights, slow, out_format)
    if bad_rows is not None:
        y = y.masked_fill_(bad_rows[:, None], float("nan"))
    if nan_rows.numel():
        y = y.index_fill_(1, nan_rows.to(y.device), float("nan"))
    return y
