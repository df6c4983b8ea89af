"""Activation quantization for the int8-GEMM fallback, in float64 where that is exact (the VNNI
and Triton paths quantize inside their own kernels).

Same result as `quantize.quantize_activations` (the suite checks it bit for bit), but few passes:
e_r comes from the integer rule on the [M] row maxima alone; then x * 2**-e_r is exact in float64
(a power-of-two scaling of a bf16/fp16/fp32 value, |result| <= Qa, far inside float64's
exponent range both ways) and torch.round is round-half-to-even on it.
"""

from __future__ import annotations

import torch

from ...contract import float_format
from ...formats import float_bits
from ...quantize import quantize_activations


def quantize_rows(x: torch.Tensor, act_bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(qa int32 [M, K], e_r int64 [M]) for finite x [M, K]."""
    amax = x.abs().amax(dim=1, keepdim=True)  # exact: a max of finite values
    _, e_r = quantize_activations(float_bits(amax.to(x.dtype)), float_format(x.dtype), act_bits)
    # 2**-e_r built from its float64 bit pattern: exact, no libm involved
    scale = ((1023 - e_r) << 52).view(torch.float64)
    scaled = x.to(torch.float64) * scale[:, None]
    return torch.round(scaled).to(torch.int32), e_r
