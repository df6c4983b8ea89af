"""cpu_amx.c's entry points, called with tensors: amx_tiles (T, or T rounded, from the biased
limbs) and exact_linear_amx (the whole forward in one call). `lib` defaults to the loaded,
self-checked library.
"""

from __future__ import annotations

import ctypes

import torch

from ... import dataflow
from ...contract import FloatFormat, act_qmax, float_format
from ...formats import check_finite, float_bits, torch_dtype
from . import amx_library
from .amx_layout import spans_of
from .vnni_calls import FORMAT_CODES
from .vnni_layout import NativeWeights


def accumulate(limbs: torch.Tensor, act_bits: int, weights: NativeWeights, lib,
               rounding: tuple | None = None) -> torch.Tensor:
    """amx_tiles on the biased limbs [L, M, K] uint8 (vnni_layout.biased_limbs): T [M, Np]
    int64, or, with `rounding` = (e_r, emin, out_format), y [M, N] rounded once in the kernel."""
    count, m, k = limbs.shape
    planes = torch.zeros(lib.amx_plane_bytes(m, k, count), dtype=torch.uint8)  # and the slack
    planes[:limbs.numel()] = limbs.contiguous().view(-1)
    emin = rounding[1] if rounding else torch.zeros(weights.n, dtype=torch.int64)
    layer = spans_of(weights).layer(weights, emin)
    t = y = e_r = None
    fmt = float_format("float32")
    if rounding:
        e_r, fmt = rounding[0].to(torch.int64).contiguous(), rounding[2]
        y = torch.empty((m, weights.n), dtype=torch_dtype(fmt))
    else:
        t = torch.empty((m, weights.np), dtype=torch.int64)
    if lib.amx_tiles(ctypes.byref(layer), planes.data_ptr(), m, count,
                     None if t is None else t.data_ptr(), None if y is None else y.data_ptr(),
                     None if e_r is None else e_r.data_ptr(), fmt.mant_bits, fmt.exp_bits):
        raise MemoryError(f"no memory for the AMX kernel's digit planes (K = {weights.k})")
    return y if rounding else t


def linear(x: torch.Tensor, act_bits: int, weights: NativeWeights, emin: torch.Tensor,
           out_format: FloatFormat, lib=None) -> torch.Tensor:
    """The AMX forward of x [M, K] in one C call (exact_linear_amx): quantized, the tiles, one
    rounding; y [M, N] in `out_format`. Raises NonFiniteError for a non-finite x."""
    lib = lib or amx_library.library()
    fmt = float_format(x.dtype)
    x = x.contiguous()
    y = torch.empty((x.shape[0], weights.n), dtype=torch_dtype(out_format))
    bad = lib.exact_linear_amx(ctypes.byref(spans_of(weights).layer(weights, emin)),
                               x.data_ptr(), FORMAT_CODES[fmt.name], fmt.mant_bits,
                               fmt.exp_bits, act_qmax(act_bits), dataflow.act_limbs(act_bits),
                               x.shape[0], y.data_ptr(), out_format.mant_bits,
                               out_format.exp_bits)
    if bad < 0:
        raise MemoryError(f"no memory for the AMX kernel's activations of x {tuple(x.shape)}")
    if bad:
        check_finite(float_bits(x), fmt, "x")  # raises, with the count and the first index
    return y
