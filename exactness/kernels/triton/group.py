"""exact_group_kernel: per output tile and per group of 32, the packed words unpacked in
registers, one int8 dot per activation limb, and the group's exact term added into an int64
accumulator; the tile rounded once, or (K split into slices) summed by integer atomics and
rounded by folded.combine_kernel.
"""

from __future__ import annotations

import torch

from ... import dataflow
from ...contract import GROUP_SIZE, float_format
from . import folded
from .folded import COMBINE_BLOCK, combine_constants
from .launch import BIT_VIEW, BLOCK_M, INTERPRETED, TRITON_INT, fill_slices, tl, triton

GPU_BLOCK_N = 64
BLOCK_N = 512 if INTERPRETED else GPU_BLOCK_N
# (BLOCK_M, BLOCK_N, num_warps) of exact_group_kernel that bench/gpu_check.py times beside the
# default, on a GPU; `python -m exactness.suite.triton_aot --tiles` compiles them without one
# (none spills on sm_90; 256 x 64 does on sm_80; 64 x 128 with 4 warps and 128 x 128 spill on
# sm_90, so they are not here)
TUNING_TILES = ((16, 64, 4), (16, 128, 4), (32, 64, 4), (32, 128, 4), (64, 64, 8), (128, 32, 8),
                (128, 64, 8), (64, 128, 8), (256, 64, 8))
# The group kernel's slices of K (k_slices): the fewest groups a slice, so that the suite runs
# split and whole launches
MIN_SLICE_GROUPS = 1 if INTERPRETED else 8


if triton is not None:
    from .integers import store_rounded, unpack_fields

    @triton.jit
    def limb_dot(a_ptrs, limb, mask_m, w8, DOT_ACC: tl.constexpr):
        """D = sum_k limb * q of one activation limb's [rows, 32] and the group's w8 [N, 32]."""
        a = tl.load(a_ptrs + limb, mask=mask_m[:, None], other=0)
        return tl.dot(a, tl.trans(w8), out_dtype=DOT_ACC)

    @triton.jit
    def group_sums(a_ptrs, stride_limb, mask_m, w8, LIMBS: tl.constexpr, DOT_ACC: tl.constexpr):
        """A group's (P'_lo, P'_hi) in DOT_ACC: P'_lo = 256 * D_1 + D_0 (one limb: D_0) and,
        with four limbs, P'_hi = 256 * D_3 + D_2 (else P'_hi is P'_lo, unused); the limb offset
        is added apart."""
        if LIMBS == 4:  # the high half first: after the low one, ptxas spilled registers
            # (grouped_kernel, 8-bit weights, fp32 out, sm_90: python -m ...triton_aot)
            p_hi = limb_dot(a_ptrs, 2 * stride_limb, mask_m, w8, DOT_ACC) \
                + limb_dot(a_ptrs, 3 * stride_limb, mask_m, w8, DOT_ACC) * 256
        p = limb_dot(a_ptrs, 0, mask_m, w8, DOT_ACC)
        if LIMBS > 1:
            p += limb_dot(a_ptrs, stride_limb, mask_m, w8, DOT_ACC) * 256
        if LIMBS < 4:
            p_hi = p
        return p, p_hi

    @triton.jit
    def group_term(p, p_hi, f, LIMBS: tl.constexpr, COMBINE_ACC: tl.constexpr):
        """A group's P' * f in COMBINE_ACC from group_sums (f [N] int32): P'_lo * f, and with
        four limbs + (P'_hi * f << 16), each an int32 x int32 -> int64 product."""
        term = p.to(COMBINE_ACC) * f.to(COMBINE_ACC)[None, :]
        if LIMBS == 4:
            term += (p_hi.to(COMBINE_ACC) * f.to(COMBINE_ACC)[None, :]) << 16
        return term

    @triton.jit
    def exact_group_kernel(
        a_ptr, w_ptr, f_ptr, r_ptr, e_ptr, emin_ptr, y_ptr, t_ptr,
        M, N, G, groups_per_slice,
        stride_limb, stride_am, stride_wn, stride_fn, stride_ym,
        W_BITS: tl.constexpr, LIMBS: tl.constexpr, LIMB_OFFSET: tl.constexpr,
        DOT_ACC: tl.constexpr, COMBINE_ACC: tl.constexpr,
        OUT_MANT: tl.constexpr, OUT_EXP: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
    ):
        """The tile's T over the groups of its slice of K (program_id 2; one slice unless SPLIT),
        rounded here, or (SPLIT) added into t [M, N] int64 by integer atomics: exact in any
        order, the rounding left to combine_kernel."""
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        g_start = tl.program_id(2) * groups_per_slice
        g_end = tl.minimum(G, g_start + groups_per_slice)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, 32)
        mask_m = offs_m < M
        mask_n = offs_n < N
        per_word: tl.constexpr = 32 // W_BITS  # fields per int32 word; a group is W_BITS words
        offs_w = tl.arange(0, W_BITS)
        fields = tl.arange(0, per_word) * W_BITS
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=COMBINE_ACC)
        for g in range(g_start, g_end):
            # each word loaded once and split into its fields: k = word * per_word + field
            words = tl.load(w_ptr + offs_n[:, None] * stride_wn + (g * W_BITS + offs_w)[None, :],
                            mask=mask_n[:, None], other=0)
            w8 = tl.reshape(unpack_fields(words, fields, W_BITS).to(tl.int8), (BLOCK_N, 32))
            a_ptrs = a_ptr + offs_m[:, None] * stride_am + (g * 32 + offs_k)[None, :]
            p, p_hi = group_sums(a_ptrs, stride_limb, mask_m, w8, LIMBS, DOT_ACC)
            f = tl.load(f_ptr + offs_n * stride_fn + g, mask=mask_n, other=0)
            acc += group_term(p, p_hi, f, LIMBS, COMBINE_ACC)
        if LIMBS > 1:  # LIMB_OFFSET * sum_k q * f, by the first slice of K alone
            r = tl.load(r_ptr + offs_n, mask=mask_n, other=0).to(COMBINE_ACC)
            acc += tl.where(g_start == 0, LIMB_OFFSET, 0) * r[None, :]
        if SPLIT:
            tl.atomic_add(t_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(tl.int64),
                          mask=mask_m[:, None] & mask_n[None, :], sem="relaxed")
        else:
            store_rounded(acc.to(tl.int64), e_ptr, emin_ptr, y_ptr, offs_m, offs_n, mask_m, mask_n,
                          stride_ym, OUT_MANT, OUT_EXP)


def group_constants(w_bits: int, limbs: int, out, block_n: int = BLOCK_N,
                    block_m: int = BLOCK_M, split: bool = False) -> dict:
    """exact_group_kernel's compile-time constants for activations in `limbs` int8 limbs,
    output in `out` (a FloatFormat)."""
    return dict(W_BITS=w_bits, LIMBS=limbs, LIMB_OFFSET=dataflow.offset_for_limbs(limbs),
                DOT_ACC=TRITON_INT[dataflow.DOT_ACC_BITS],
                COMBINE_ACC=TRITON_INT[dataflow.COMBINE_ACC_BITS],
                OUT_MANT=out.mant_bits, OUT_EXP=out.exp_bits, BLOCK_M=block_m, BLOCK_N=block_n,
                SPLIT=split)


def linear(limbs: torch.Tensor, e_r: torch.Tensor, weight_packed: torch.Tensor,
           factor: torch.Tensor, row_sums: torch.Tensor, emin: torch.Tensor, w_bits: int,
           out_dtype: torch.dtype, block_m: int = BLOCK_M, block_n: int = BLOCK_N,
           num_warps: int = 4, slices: int | None = None) -> torch.Tensor:
    """y [M, N] of `out_dtype` from activation limbs [L, M, K] int8, their row exponents, the
    certified scale factors (`factor` int32 [N, G], ms << shift, zero for rows the certificate
    sends elsewhere), their offset sums R and `emin` [N] (scales.device_certificate). The tile
    (block_m x block_n outputs per program, powers of two, at least 16), num_warps and the
    slices of K (None: k_slices) change the speed, never the bits (bench/gpu_check.py compares
    them)."""
    if triton is None:
        raise RuntimeError("the Triton path needs the triton package (pip install triton)")
    n_limbs, m, k = limbs.shape
    n = weight_packed.shape[0]
    out = float_format(out_dtype)
    device = limbs.device
    y = torch.empty((m, n), dtype=out_dtype, device=device)
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    groups = k // GROUP_SIZE
    per_slice = triton.cdiv(groups, slices if slices else k_slices(tiles, groups, device))
    split = per_slice < groups
    t = torch.zeros((m, n), dtype=torch.int64, device=device) if split else y  # y: unused
    emin = emin.to(torch.int64)
    y_bits = y.view(BIT_VIEW[out.width])
    exact_group_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n),
                        triton.cdiv(groups, per_slice))](
        limbs, weight_packed, factor, row_sums, e_r, emin, y_bits, t, m, n, groups, per_slice,
        limbs.stride(0), limbs.stride(1), weight_packed.stride(0), factor.stride(0), y.stride(0),
        **group_constants(w_bits, n_limbs, out, block_n, block_m, split), num_warps=num_warps)
    if split:
        folded.combine_kernel[(triton.cdiv(m, COMBINE_BLOCK), triton.cdiv(n, COMBINE_BLOCK))](
            t, t, e_r, emin, y_bits, m, n, t.stride(0), y.stride(0),
            **combine_constants(1, 1, out))
    return y


def k_slices(tiles: int, groups: int, device: torch.device) -> int:
    """How many slices of K the group kernel splits into for `tiles` output tiles: enough
    programs for twice the GPU's SMs (a few rows leave most SMs idle otherwise: 32 tiles at
    Kimi's gate/up), MIN_SLICE_GROUPS a slice at least."""
    return fill_slices(tiles, groups // MIN_SLICE_GROUPS, device, per_sm=2)
