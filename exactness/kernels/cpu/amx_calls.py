"""cpu_amx.c's entry points, called with tensors: amx_tiles (T, or T rounded, from the biased
limbs), exact_linear_amx (the whole forward in one call) and amx_layer_spans (the spans the kernel
derives, for the suite). Each takes a layer of either kind: derived (NativeWeights, for the
self-check) or read in place (AmxInPlace, a forward's). `lib` defaults to the loaded,
self-checked library.
"""

from __future__ import annotations

import ctypes

import torch

from ... import dataflow
from ...contract import FloatFormat, act_qmax, float_format
from ...formats import check_finite, float_bits, torch_dtype
from . import amx_library
from .amx_layout import AmxInPlace, fold_limit
from .vnni_calls import FORMAT_CODES
from .vnni_layout import NativeWeights


def layer_of(weights: NativeWeights | AmxInPlace, emin: torch.Tensor | None):
    """The Layer the C reads: a derived one's for the certificate's `emin` (zeros where None),
    or the in-place one's (which writes its own emin)."""
    if isinstance(weights, NativeWeights) and emin is None:
        emin = torch.zeros(weights.n, dtype=torch.int64)
    return weights.layer(emin, False)


def accumulate(limbs: torch.Tensor, act_bits: int, weights: NativeWeights | AmxInPlace, lib,
               rounding: tuple | None = None) -> torch.Tensor:
    """amx_tiles on the biased limbs [L, M, K] uint8 (vnni_layout.biased_limbs; against 4-bit
    words in place, in prepare_block's order): T [M, Np] int64, or, with `rounding` =
    (e_r, emin, out_format), y [M, N] rounded once in the kernel (an in-place layer's emin is
    its own: rounding's is not read)."""
    count, m, k = limbs.shape
    planes = torch.zeros(lib.amx_plane_bytes(m, k, count), dtype=torch.uint8)  # and the slack
    planes[:limbs.numel()] = limbs.contiguous().view(-1)
    layer = layer_of(weights, rounding[1] if rounding else None)
    t = y = e_r = None
    fmt = float_format("float32")
    if rounding:
        e_r, fmt = rounding[0].to(torch.int64).contiguous(), rounding[2]
        y = torch.empty((m, weights.n), dtype=torch_dtype(fmt))
    else:
        t = torch.empty((m, weights.np), dtype=torch.int64)
    if lib.amx_tiles(ctypes.byref(layer), planes.data_ptr(), m, count,
                     None if t is None else t.data_ptr(), None if y is None else y.data_ptr(),
                     None if e_r is None else e_r.data_ptr(), fmt.mant_bits, fmt.exp_bits,
                     fold_limit(weights)):
        raise MemoryError(f"no memory for the AMX kernel's scratch (K = {weights.k})")
    return y if rounding else t


def spans(weights: NativeWeights | AmxInPlace, lib) -> tuple[torch.Tensor, ...]:
    """The spans cpu_amx.c derives for every block (amx_layer_spans), in amx_layout.amx_spans'
    shapes: (f, base, ends, rsum)."""
    nb, groups = weights.np // 16, weights.k // 32
    f = torch.empty((nb, groups, 16), dtype=torch.int16)
    base = torch.empty((nb, groups, 16), dtype=torch.int8)
    ends = torch.empty((nb, groups), dtype=torch.uint8)
    rsum = torch.empty(weights.np, dtype=torch.int64)
    if lib.amx_layer_spans(ctypes.byref(layer_of(weights, None)), fold_limit(weights),
                           f.data_ptr(), base.data_ptr(), ends.data_ptr(), rsum.data_ptr()):
        raise MemoryError(f"no memory for a block of K = {weights.k}")
    return f, base, ends, rsum


def linear(x: torch.Tensor, act_bits: int, weights: NativeWeights | AmxInPlace,
           emin: torch.Tensor | None, out_format: FloatFormat, lib=None) -> torch.Tensor:
    """The AMX forward of x [M, K] in one call (exact_linear_amx): quantized, the tiles, one
    rounding; y [M, N] in `out_format`. `emin`: a derived layer's (an in-place one writes its
    own, with its flags: found()). Raises NonFiniteError for a non-finite x."""
    lib = lib or amx_library.library()
    fmt = float_format(x.dtype)
    x = x.contiguous()
    y = torch.empty((x.shape[0], weights.n), dtype=torch_dtype(out_format))
    bad = lib.exact_linear_amx(ctypes.byref(layer_of(weights, emin)), x.data_ptr(),
                               FORMAT_CODES[fmt.name], fmt.mant_bits, fmt.exp_bits,
                               act_qmax(act_bits), dataflow.act_limbs(act_bits), x.shape[0],
                               y.data_ptr(), out_format.mant_bits, out_format.exp_bits,
                               fold_limit(weights))
    if bad < 0:
        raise MemoryError(f"no memory for the AMX kernel's activations of x {tuple(x.shape)}")
    if bad:
        check_finite(float_bits(x), fmt, "x")  # raises, with the count and the first index
    return y
