"""quantize_kernel: x's rows quantized on the device (contract section 3) into dataflow's int8
limbs, with each row's exponent and a flag for a row holding inf or NaN. Nothing is read back.
"""

from __future__ import annotations

import torch

from ... import dataflow
from ...contract import act_qmax, float_format
from .launch import BIT_VIEW, BLOCK_M, INTERPRETED, fill_slices, tl, triton

# quantize_kernel's step: QUANT_TILE activations, [rows, QUANT_TILE // rows], rows = M rounded up
# to a power of two, at most BLOCK_M (quantize_tile: one decode row of Kimi's K in two steps)
GPU_QUANT_TILE = 4096
QUANT_TILE = 16384 if INTERPRETED else GPU_QUANT_TILE


if triton is not None:
    from .integers import bit_length, decode, rne_shift_right

    @triton.jit
    def quantize_kernel(
        x_ptr, a_ptr, e_ptr, nonfinite_ptr, M, K, slice_k, stride_xm, stride_limb,
        MANT: tl.constexpr, EXP: tl.constexpr, QMAX: tl.constexpr, LIMBS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        """quantize.quantize_activations and dataflow.activation_limbs for BLOCK_M rows of x
        and their slice of K (program_id 1; slice_k activations, a multiple of BLOCK_K). Every
        slice finds its rows' exponents over all of K itself (no program waits on another: a few
        rows spread over many SMs); the first stores them, and nonfinite[r] = 1 where row r
        holds a non-finite value (its e_r and limbs are junk then)."""
        offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_k = tl.arange(0, BLOCK_K)
        mask_m = offs_m < M
        width: tl.constexpr = MANT + EXP + 1
        # per element in int32 (16- and 32-bit patterns, significands < 2**24): half the
        # instructions of int64; per row in int64
        amax = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.int32)
        for k0 in tl.range(0, K, BLOCK_K, loop_unroll_factor=4):  # 4 steps' loads in flight
            mask = mask_m[:, None] & (k0 + offs_k < K)[None, :]
            b = tl.load(x_ptr + offs_m[:, None] * stride_xm + (k0 + offs_k)[None, :], mask=mask,
                        other=0)
            amax = tl.maximum(amax, b.to(tl.int32) & ((1 << (width - 1)) - 1))
        # inf and NaN are the patterns with every exponent bit set: the largest magnitudes
        row_max = tl.max(amax, axis=1)
        first = mask_m & (offs_m * 0 == tl.program_id(1))  # (a scalar bool widens: interpreter)
        tl.store(nonfinite_ptr + offs_m, (row_max >= ((1 << EXP) - 1) << MANT).to(tl.int8),
                 mask=first)
        am, ae = decode(row_max.to(tl.int64), MANT, EXP)
        # the least t with am <= Qa * 2**t is t0 or t0 + 1 (t0 from the bit lengths)
        qmax = am * 0 + QMAX
        t0 = bit_length(am) - bit_length(qmax)
        fits = tl.where(t0 >= 0, am <= qmax << tl.maximum(t0, 0), am << tl.maximum(-t0, 0) <= qmax)
        e_r = tl.where(am == 0, 0, ae + t0 + tl.where(fits, 0, 1))
        tl.store(e_ptr + offs_m, e_r, mask=first)
        e_row = e_r.to(tl.int32)
        k_start = tl.program_id(1) * slice_k
        for k0 in range(k_start, tl.minimum(K, k_start + slice_k), BLOCK_K):
            mask = mask_m[:, None] & (k0 + offs_k < K)[None, :]
            b = tl.load(x_ptr + offs_m[:, None] * stride_xm + (k0 + offs_k)[None, :], mask=mask,
                        other=0).to(tl.int32)
            if width == 16:
                b = b & 0xFFFF  # the pattern, not its sign extension
            m, e = decode(b, MANT, EXP)
            s = e - e_row[:, None]
            a = tl.abs(m)
            # a < 2**24: a right shift past 25 gives 0 and rounds to 0, so clipping shifts to 30
            # changes nothing; a left shift is at most 30 (a * 2**s <= Qa < 2**31)
            n = tl.where(s >= 0, a << tl.minimum(tl.maximum(s, 0), 30),
                         rne_shift_right(a, tl.minimum(tl.maximum(-s, 0), 30)))
            qa = tl.where(m < 0, -n, n)
            a_ptrs = a_ptr + offs_m[:, None] * K + (k0 + offs_k)[None, :]
            for j in tl.static_range(LIMBS):  # dataflow.activation_limbs: the bytes of
                # qa + 2**(8 LIMBS - 1), less 128 (adding 2**(8 LIMBS - 1) flips the top bit)
                limb = (((qa >> (8 * j)) & 255) ^ (128 * (j == LIMBS - 1))) - 128
                tl.store(a_ptrs + j * stride_limb, limb.to(tl.int8), mask=mask)


def quantize_tile(m: int, tile: int = QUANT_TILE) -> tuple[int, int]:
    """quantize_kernel's (BLOCK_M, BLOCK_K) for M rows: `tile` activations a step, over as few
    rows as M needs (a power of two, at most BLOCK_M): masked rows would cost as much as real."""
    block_m = min(BLOCK_M, 1 << max(m - 1, 0).bit_length())
    return block_m, tile // block_m


def quant_tile(act_bits: int, tile: int = QUANT_TILE) -> int:
    """quantize_kernel's activations a step for `act_bits`: `tile`, halved for four limbs (their
    16 x 256 tile spilled registers on sm_90: python -m exactness.suite.triton_aot)."""
    return tile // 2 if dataflow.act_limbs(act_bits) == 4 else tile


def quantize_constants(fmt, act_bits: int, block_m: int, block_k: int) -> dict:
    """quantize_kernel's compile-time constants for x in `fmt` (a FloatFormat)."""
    return dict(MANT=fmt.mant_bits, EXP=fmt.exp_bits, QMAX=act_qmax(act_bits),
                LIMBS=dataflow.act_limbs(act_bits), BLOCK_M=block_m, BLOCK_K=block_k)


def quantize(x: torch.Tensor, act_bits: int, slices: int | None = None,
             tile: int = QUANT_TILE) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(limbs [L, M, K] int8, e_r [M] int64, nonfinite [M] int8) of x [M, K] (contract section 3,
    dataflow): nonfinite[r] = 1 where row r holds a non-finite value, its limbs and e_r junk. The
    caller reads it back once the launches that use them are queued (no wait between them).
    `slices` of K (None: quantize_slices) and `tile` (quantize_tile) change the speed, never
    the bits."""
    fmt = float_format(x.dtype)
    x = x.contiguous()
    m, k = x.shape
    limbs = torch.empty((dataflow.act_limbs(act_bits), m, k), dtype=torch.int8, device=x.device)
    e_r = torch.empty(m, dtype=torch.int64, device=x.device)
    nonfinite = torch.empty(m, dtype=torch.int8, device=x.device)
    block_m, block_k = quantize_tile(m, quant_tile(act_bits, tile))
    row_blocks, steps = triton.cdiv(m, block_m), triton.cdiv(k, block_k)
    slice_k = triton.cdiv(steps, slices or quantize_slices(row_blocks, steps, x.device)) * block_k
    quantize_kernel[(row_blocks, triton.cdiv(k, slice_k))](
        x.view(BIT_VIEW[fmt.width]), limbs, e_r, nonfinite, m, k, slice_k, x.stride(0),
        limbs.stride(0), **quantize_constants(fmt, act_bits, block_m, block_k))
    return limbs, e_r, nonfinite


def quantize_slices(row_blocks: int, steps: int, device: torch.device) -> int:
    """How many slices of K quantize_kernel splits each block of rows into: enough programs for
    the GPU's SMs (at M <= 16 one program would quantize all of x on one SM, one serial step
    after another), a step a slice at least."""
    return fill_slices(row_blocks, steps, device)
