"""The C kernel's entry points (csrc/cpu_kernel.c), called with tensors on a build's library
(`lib`: vnni_library.AVX512.library(), AVX2's, or a test's). One forward is one call
(exact_grouped, through `linear` or `grouped`) that runs two passes: the activations quantized (the
row exponents e_r by the contract's integer rule on the row maxima, as
quantize.quantize_activations computes them) into biased int8 limbs, or into int16 words for the
span kernel (16-bit activations, 4-bit weights); then the exact accumulation T, rounded once in
registers and written straight into the output tensor. The passes are also called one by one
(quantize, accumulate, round_rows) by the self-check and the tests. The span kernel's calls default
to the AVX-512 build, the one that holds it.
"""

from __future__ import annotations

import ctypes

import torch

from ... import dataflow
from ...contract import ContractValueError, FloatFormat, act_qmax, float_format
from ...formats import check_finite, float_bits, torch_dtype
from . import vnni_library
from .vnni_layout import Grouped, InPlace, NativeWeights

FORMAT_CODES = {"bfloat16": 0, "float16": 1, "float32": 2}  # the ISA files' load16, load8


def quantize_mode(act_bits: int, words: bool) -> int:
    """cpu_kernel.c's quantize_limbs mode: 0, int16 words for the span kernel; else how many limbs
    exact_linear_limbs takes (1, 2 or 4)."""
    return 0 if words else dataflow.act_limbs(act_bits)


def quantize(x: torch.Tensor, act_bits: int, lib, words: bool = False):
    """(a, e_r): x [M, K] as the build's limbs a [L, M, lib.act_row_bytes(K)] uint8 (the AVX-512
    build's: biased_limbs, [L, M, K]; the AVX2 build's: plain_limbs, against 8-bit words), or
    with `words` qa itself as int16 [M, K] in exact_linear_spans' order (16 bits at most), and
    the row exponents e_r [M] int64 (contract section 3). Raises NonFiniteError
    (formats.check_finite) if x holds a non-finite value."""
    if words and not hasattr(lib, "exact_linear_spans"):
        raise ContractValueError("this build holds no span kernel: it writes no int16 words")
    fmt = float_format(x.dtype)
    x = x.contiguous()
    m, k = x.shape
    e_r = torch.empty(m, dtype=torch.int64)
    if lib.row_exponents(x.data_ptr(), fmt.mant_bits, fmt.exp_bits, act_qmax(act_bits), m, k,
                         e_r.data_ptr()):
        check_finite(float_bits(x), fmt, "x")
    if words and act_qmax(act_bits) > 2**15 - 1:
        raise ContractValueError(f"int16 words hold 16-bit activations at most, not act_bits "
                                 f"{act_bits}")
    mode = quantize_mode(act_bits, words)
    a = torch.empty((m, k) if words else (mode, m, lib.act_row_bytes(k)),
                    dtype=torch.int16 if words else torch.uint8)
    lib.quantize_limbs(x.data_ptr(), FORMAT_CODES[fmt.name], m, k, e_r.data_ptr(), a.data_ptr(),
                       mode)
    return a, e_r


def accumulate(a: torch.Tensor, act_bits: int, weights: NativeWeights, lib,
               rounding: tuple | None = None, spans: bool = False) -> torch.Tensor:
    """T [M, Np] int64 (padded columns are 0) from the biased limbs a [L, M, K] (or, with
    `spans`, from quantize's words [M, K] through exact_linear_spans); or, with `rounding` =
    (e_r, emin, out_format), y [M, N] in out_format: T rounded in the kernel's registers, the
    same rounding as round_rows."""
    if not spans and a.shape[0] != dataflow.act_limbs(act_bits):
        raise ValueError(f"act_bits {act_bits} takes {dataflow.act_limbs(act_bits)} limbs, "
                         f"got {a.shape[0]}")
    a = a.contiguous()
    m = a.shape[-2]
    t = y = e_r = emin = None
    fmt = rounding[2] if rounding else float_format("float32")
    if rounding:
        e_r = rounding[0].to(torch.int64).contiguous()
        emin = weights.padded(rounding[1])
        y = torch.empty((m, weights.n), dtype=torch_dtype(fmt))
    else:
        t = torch.empty((m, weights.np), dtype=torch.int64)
    out = (*(v.data_ptr() if v is not None else None for v in (y, e_r, emin)), weights.n,
           fmt.mant_bits, fmt.exp_bits)
    t_ptr = t.data_ptr() if t is not None else None
    if spans:
        f, rsh, ends, unshifted = weights.spans
        lib.exact_linear_spans(a.data_ptr(), weights.w.data_ptr(), f.data_ptr(), rsh.data_ptr(),
                               ends.data_ptr(), unshifted.data_ptr(), t_ptr, m, weights.k,
                               weights.np, *out)
    else:
        lib.exact_linear_limbs(a.data_ptr(), weights.w.data_ptr(), weights.wsum.data_ptr(),
                              weights.c.data_ptr(), t_ptr, m, weights.k, weights.np,
                              dataflow.act_limbs(act_bits), int(weights.nibbles), *out)
    return y if rounding else t


def span_scales_of(weights: NativeWeights | InPlace, lib=None) -> tuple[torch.Tensor, ...]:
    """The span scales cpu_vnni.c builds per block (span_layer_scales) of a layer with 4-bit words,
    derived or read in place, in vnni_layout.span_scales' shapes: (f, rsh, ends, unshifted)."""
    lib = lib or vnni_library.AVX512.library()
    nb, groups = weights.np // 16, weights.k // 32
    f = torch.empty((nb, groups, 16), dtype=torch.int16)
    rsh = torch.empty((nb, groups, 16), dtype=torch.int8)
    ends = torch.empty((nb, groups), dtype=torch.uint8)
    unshifted = torch.empty(nb, dtype=torch.uint8)
    emin = torch.zeros(weights.n, dtype=torch.int64)
    if lib.span_layer_scales(ctypes.byref(weights.layer(emin, False)), f.data_ptr(),
                             rsh.data_ptr(), ends.data_ptr(), unshifted.data_ptr()):
        raise MemoryError(f"no memory for a block of K = {weights.k}")
    return f, rsh, ends, unshifted


def round_rows(t: torch.Tensor, n: int, e_r: torch.Tensor, emin: torch.Tensor,
               out_format: FloatFormat, lib) -> torch.Tensor:
    """formats.round_scaled of t[:, :n] * 2**(e_r[r] + emin[n]), in C, as an [M, n] tensor of
    `out_format`."""
    e_r, emin = e_r.to(torch.int64).contiguous(), emin.to(torch.int64).contiguous()
    out = torch.empty((t.shape[0], n), dtype=torch_dtype(out_format))
    lib.round_rows(t.data_ptr(), t.shape[1], e_r.data_ptr(), emin.data_ptr(), t.shape[0], n,
                   out_format.mant_bits, out_format.exp_bits, out.data_ptr())
    return out


def linear(x: torch.Tensor, act_bits: int, weights: NativeWeights, emin: torch.Tensor,
           out_format: FloatFormat, lib, spans: bool = False) -> torch.Tensor:
    """The whole fast path for x [M, K], in one call of the C kernel: `grouped` with one expert
    of one part, every row routed to it (quantize, then accumulate with the rounding fused,
    through the span kernel with `spans`): y [M, N] in `out_format` (raises on non-finite x)."""
    return grouped(x, act_bits, [[(weights, emin)]], [spans], (0, x.shape[0]), None, out_format,
                   lib)


def scratch_bytes(rows: int, k: int, lib) -> int:
    """The most bytes exact_grouped's quantized x [rows, K] takes in the build `lib`: words and
    two limbs (16-bit activations), or four limbs (32-bit ones)."""
    limbs = rows * lib.act_row_bytes(k)
    return max((rows * k * 2 + 63) // 64 * 64 + (2 * limbs + 63) // 64 * 64,
               (4 * limbs + 63) // 64 * 64)


def grouped(x: torch.Tensor, act_bits: int, experts, spans, offsets, source: torch.Tensor | None,
            out_format: FloatFormat, lib, out: torch.Tensor | None = None,
            scratch: torch.Tensor | None = None) -> torch.Tensor:
    """One grouped call of the C kernel (exact_grouped) for x [M, K]: `experts` lists, for each
    expert that has routed rows, its parts' (NativeWeights, emin) (gate and up: two parts of the
    same K and N; down: one); spans[e] sends expert e through the span kernel (16-bit
    activations, 4-bit weights). Expert e's routed rows are offsets[e] .. offsets[e + 1] (a
    sequence of ints), and routed row r reads row source[r] of x (int64; None: row r). Returns
    y [rows, parts * N] in `out_format`, part p of routed row r at columns p * N .. p * N + N
    (into `out` where given); raises NonFiniteError (formats.check_finite) if x holds a
    non-finite value. `scratch` (uint8, scratch_bytes long) holds the quantized x where given:
    a caller that keeps it across calls saves the page faults of a fresh allocation."""
    fmt = float_format(x.dtype)
    x = x.contiguous()
    layers = [w.layer(emin, use_spans) for parts, use_spans in zip(experts, spans, strict=True)
              for w, emin in parts]
    table = (ctypes.c_void_p * len(layers))(*map(ctypes.addressof, layers))
    offsets = (ctypes.c_int64 * len(offsets))(*offsets)
    kinds = (ctypes.c_uint8 * len(spans))(*map(bool, spans))
    if source is not None:
        source = source.to(torch.int64).contiguous()
    parts = len(experts[0])
    shape = (offsets[-1], parts * layers[0].n)
    y = torch.empty(shape, dtype=torch_dtype(out_format)) if out is None else out
    if y.shape != shape or y.dtype != torch_dtype(out_format) or not y.is_contiguous():
        raise ValueError(f"out must be a contiguous {shape} tensor of {out_format.name}")
    call = Grouped(ctypes.addressof(table), ctypes.addressof(offsets),
                   None if source is None else source.data_ptr(), ctypes.addressof(kinds),
                   len(experts), parts)
    bad = lib.exact_grouped(ctypes.byref(call), x.data_ptr(), FORMAT_CODES[fmt.name],
                            fmt.mant_bits, fmt.exp_bits, act_qmax(act_bits),
                            dataflow.act_limbs(act_bits), x.shape[0], y.data_ptr(), None,
                            out_format.mant_bits, out_format.exp_bits,
                            None if scratch is None else scratch.data_ptr(),
                            0 if scratch is None else scratch.numel())
    checked(bad, x)
    return y


def checked(bad: int, x: torch.Tensor) -> None:
    """exact_grouped's answer made an error where it is one: its codes below 0, and the rows of
    x it found non-finite (NonFiniteError, with the count and the first index)."""
    if bad == -2:
        raise ValueError("a grouped call takes layers of one kind: all in place (InPlace) of one "
                         "width, or all derived (NativeWeights)")
    if bad == -3:
        raise ValueError("this build of the C kernel reads layers in place only (InPlace)")
    if bad < 0:
        raise MemoryError(f"no memory for the activations of x {tuple(x.shape)}")
    if bad:
        fmt = float_format(x.dtype)
        check_finite(float_bits(x), fmt, "x")


def accumulate_in_place(x: torch.Tensor, act_bits: int, layer: InPlace, lib) -> torch.Tensor:
    """T [M, Np] int64 of x [M, K] against a layer read in place (exact_grouped with one expert
    of one part, T kept unrounded): its slow rows' and padded columns' T are 0. The self-checks'
    view of the exact sum, in any build."""
    fmt = float_format(x.dtype)
    x = x.contiguous()
    layers = [layer.layer(None, False)]
    table = (ctypes.c_void_p * 1)(*map(ctypes.addressof, layers))
    offsets = (ctypes.c_int64 * 2)(0, x.shape[0])
    kinds = (ctypes.c_uint8 * 1)(0)
    t = torch.zeros((x.shape[0], layer.np), dtype=torch.int64)
    call = Grouped(ctypes.addressof(table), ctypes.addressof(offsets), None,
                   ctypes.addressof(kinds), 1, 1)
    checked(lib.exact_grouped(ctypes.byref(call), x.data_ptr(), FORMAT_CODES[fmt.name],
                              fmt.mant_bits, fmt.exp_bits, act_qmax(act_bits),
                              dataflow.act_limbs(act_bits), x.shape[0], None, t.data_ptr(), 0, 0,
                              None, 0), x)
    return t
