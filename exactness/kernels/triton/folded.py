"""linear_folded: for many activation rows, the CPU GEMM's dataflow (kernels/cpu/gemm.py) on the
GPU. fold_kernel folds the scales into the weights' int8 digits, one torch._int_mm multiplies
every activation limb by every digit, and combine_kernel combines them in int64 and rounds once
(it also rounds the group kernel's split-K sums).
"""

from __future__ import annotations

import torch

from ... import dataflow
from ...contract import float_format
from .launch import BIT_VIEW, INTERPRETED, tl, triton

# fold_kernel's rows and k per step, combine_kernel's tile
GPU_FOLD, GPU_COMBINE_BLOCK = (16, 128), 32  # no spills (triton_aot)
FOLD_BLOCK_N, FOLD_BLOCK_K = (64, 1024) if INTERPRETED else GPU_FOLD
COMBINE_BLOCK = 128 if INTERPRETED else GPU_COMBINE_BLOCK


if triton is not None:
    from .integers import store_rounded, unpack_fields

    @triton.jit
    def fold_kernel(w_ptr, f_ptr, folded_ptr, N, K, stride_wn, stride_fn,
                    W_BITS: tl.constexpr, W_LIMBS: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """gemm.FoldedWeights' digits for BLOCK_N weight rows: the signed int8 digits of
        Wf = q * f (f = ms << shift of q's group, dataflow.int8_digits), digit j of row n at
        folded[j * N + n]."""
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        per_word: tl.constexpr = 32 // W_BITS
        offs_w = tl.arange(0, BLOCK_K // per_word)  # a step's words, each read once
        fields = tl.arange(0, per_word)
        plane = N.to(tl.int64) * K  # one digit's N x K (int64: 3 digits of a big layer pass 2**31)
        for k0 in range(0, K, BLOCK_K):
            ws = k0 // per_word + offs_w
            mask = mask_n[:, None] & (ws < K // per_word)[None, :]
            words = tl.load(w_ptr + offs_n[:, None] * stride_wn + ws[None, :], mask=mask, other=0)
            f = tl.load(f_ptr + offs_n[:, None] * stride_fn + (ws // (32 // per_word))[None, :],
                        mask=mask, other=0)
            # q * f < 2**31: f < 2**(8 + spread)
            v = unpack_fields(words, fields * W_BITS, W_BITS) * f[:, :, None]
            ks = ws[:, None] * per_word + fields[None, :]
            ptrs = folded_ptr + offs_n.to(tl.int64)[:, None, None] * K + ks[None, :, :]
            for j in tl.static_range(W_LIMBS):
                low = ((v + 128) & 255) - 128
                tl.store(ptrs + j * plane, low.to(tl.int8), mask=mask[:, :, None])
                v = (v - low) >> 8

    @triton.jit
    def combine_kernel(z_ptr, sum_ptr, e_ptr, emin_ptr, y_ptr, M, N, stride_zm, stride_ym,
                       A_LIMBS: tl.constexpr, W_LIMBS: tl.constexpr, LIMB_OFFSET: tl.constexpr,
                       OUT_MANT: tl.constexpr, OUT_EXP: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """gemm.accumulate's T = sum_{i,j} Z_ij << 8 (i + j) (+ LIMB_OFFSET * sum_k Wf) from the
        one int8 GEMM Z [A_LIMBS * M, W_LIMBS * N] of the activation limbs by the folded digits,
        rounded once into y; with one plane of each (A_LIMBS = W_LIMBS = 1), the rounding of an
        int64 T that the group kernel's K slices summed (split K)."""
        offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_m = offs_m < M
        mask_n = offs_n < N
        mask = mask_m[:, None] & mask_n[None, :]
        t = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int64)
        if A_LIMBS > 1:
            t += LIMB_OFFSET * tl.load(sum_ptr + offs_n, mask=mask_n, other=0)[None, :]
        for i in tl.static_range(A_LIMBS):
            for j in tl.static_range(W_LIMBS):
                z = tl.load(z_ptr + (i * M + offs_m).to(tl.int64)[:, None] * stride_zm
                            + (j * N + offs_n)[None, :], mask=mask, other=0)
                t += z.to(tl.int64) << (8 * (i + j))
        store_rounded(t, e_ptr, emin_ptr, y_ptr, offs_m, offs_n, mask_m, mask_n, stride_ym,
                      OUT_MANT, OUT_EXP)


def fold_constants(w_bits: int, w_limbs: int, block_n: int = FOLD_BLOCK_N,
                   block_k: int = FOLD_BLOCK_K) -> dict:
    """fold_kernel's compile-time constants."""
    return dict(W_BITS=w_bits, W_LIMBS=w_limbs, BLOCK_N=block_n, BLOCK_K=block_k)


def combine_constants(a_limbs: int, w_limbs: int, out, block: int = COMBINE_BLOCK) -> dict:
    """combine_kernel's compile-time constants, output in `out` (a FloatFormat)."""
    return dict(A_LIMBS=a_limbs, W_LIMBS=w_limbs,
                LIMB_OFFSET=dataflow.offset_for_limbs(a_limbs),
                OUT_MANT=out.mant_bits, OUT_EXP=out.exp_bits, BLOCK_M=block, BLOCK_N=block)


def folded_fits(m: int, n: int, k: int) -> bool:
    """Whether linear_folded takes this shape: its int8 GEMM sums K products in int32
    (dataflow.int_mm_bound), and cuBLAS's takes more than 16 rows, N and K multiples of 8."""
    return (dataflow.int_mm_bound(k) < 2 ** (dataflow.DOT_ACC_BITS - 1) and m > 16
            and n % 8 == 0 and k % 8 == 0)


def linear_folded(limbs: torch.Tensor, e_r: torch.Tensor, weight_packed: torch.Tensor,
                  factor: torch.Tensor, row_sums: torch.Tensor, emin: torch.Tensor, w_bits: int,
                  w_limbs: int, out_dtype: torch.dtype) -> torch.Tensor:
    """group.linear's y by the CPU fallback's dataflow (kernels/cpu/gemm.py), for many activation
    rows: the scales folded into the weights' int8 digits (fold_kernel, per forward: nothing is
    kept), one integer GEMM of every activation limb by every digit (torch._int_mm: the tensor
    cores at full rate, with no per-group work), and the int64 combination with the one rounding
    (combine_kernel; row_sums = offset_sums = sum_k Wf). `w_limbs`: digits that hold every
    q * factor (dataflow.folded_weight_limbs); the shape must pass folded_fits."""
    if triton is None:
        raise RuntimeError("the Triton path needs the triton package (pip install triton)")
    a_limbs, m, k = limbs.shape
    n = weight_packed.shape[0]
    if not folded_fits(m, n, k):
        raise ValueError(f"linear_folded does not take M={m}, N={n}, K={k} (folded_fits)")
    device = limbs.device
    folded = torch.empty((w_limbs * n, k), dtype=torch.int8, device=device)
    fold_kernel[(triton.cdiv(n, FOLD_BLOCK_N),)](
        weight_packed, factor, folded, n, k, weight_packed.stride(0), factor.stride(0),
        **fold_constants(w_bits, w_limbs))
    z = torch._int_mm(limbs.reshape(a_limbs * m, k), folded.t())  # [A * M, W * N] int32
    out = float_format(out_dtype)
    y = torch.empty((m, n), dtype=out_dtype, device=device)
    grid = (triton.cdiv(m, COMBINE_BLOCK), triton.cdiv(n, COMBINE_BLOCK))
    combine_kernel[grid](z, row_sums, e_r, emin.to(torch.int64), y.view(BIT_VIEW[out.width]), m, n,
                         z.stride(0), y.stride(0), **combine_constants(a_limbs, w_limbs, out))
    return y
