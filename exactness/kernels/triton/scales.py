"""scales_kernel: the scales' certificate on the device, in one launch (the twin of
certificate.certify, as grouped_kernel derives it per program): each weight row's emin, whether
its spread passes the certified limit (slow) or it holds a non-finite scale, the factors
f = ms << (es - emin) (zero on slow rows) and the offset sums R = sum_k q * f. Nothing is read
back and nothing is kept: a forward derives them from the live buffers, so a write in place is
seen at the next one, a replayed CUDA graph included.
"""

from __future__ import annotations

import torch

from ... import dataflow
from ...contract import GROUP_SIZE
from .launch import INTERPRETED, tl, triton

SLOW, NONFINITE = 1, 2  # the bits of a weight row's flags
# scales_kernel's weight rows and groups a step; the groups a step of the other kernels' pass over
# a row's scales (row_exponents): few on a GPU (registers), many under the interpreter (each
# step costs its Python)
SCALES_BLOCK_N, SCALES_BLOCK_G = (256, 64) if INTERPRETED else (64, 2)
ROW_GROUPS = 64 if INTERPRETED else 1


if triton is not None:
    from .integers import decode, unpack_fields

    SLOW_BIT, NONFINITE_BIT = tl.constexpr(SLOW), tl.constexpr(NONFINITE)  # for the kernels
    ROW_GROUPS_STEP = tl.constexpr(ROW_GROUPS)

    @triton.jit
    def decoded(b):
        """(ms, es, finite) of bf16 patterns b (int32, formats.decode_array); a non-finite scale
        reads as ms = 0, as certify takes it."""
        finite = ((b >> 7) & 0xFF) != 0xFF
        ms, es = decode(b, 7, 8)
        return tl.where(finite, ms, 0), es, finite

    @triton.jit
    def bf16_scale(s_ptr, offs_n, mask_n, groups, g):
        """decoded() of the scales s[offs_n, g], one group."""
        return decoded(tl.load(s_ptr + offs_n * groups + g, mask=mask_n, other=0).to(tl.int32)
                       & 0xFFFF)

    @triton.jit
    def bf16_scales(s_ptr, offs_n, mask_n, groups, offs_g):
        """decoded() of the scales s[offs_n, offs_g] [BLOCK_N, BLOCK_G], groups past G as 0."""
        mask = mask_n[:, None] & (offs_g < groups)[None, :]
        return decoded(tl.load(s_ptr + offs_n[:, None] * groups + offs_g[None, :], mask=mask,
                               other=0).to(tl.int32) & 0xFFFF)

    @triton.jit
    def row_exponents(s_ptr, offs_n, mask_n, groups, BLOCK_G: tl.constexpr):
        """formats.split_scales per weight row: (emin, spread, any non-finite scale) [BLOCK_N],
        from BLOCK_G groups a step."""
        big = 1 << 20
        emin = tl.full(offs_n.shape, big, tl.int32)
        emax = tl.full(offs_n.shape, -big, tl.int32)
        nonfinite = offs_n < 0
        for g0 in range(0, groups, BLOCK_G):
            ms, es, finite = bf16_scales(s_ptr, offs_n, mask_n, groups, g0 + tl.arange(0, BLOCK_G))
            emin = tl.minimum(emin, tl.min(tl.where(ms != 0, es, big), axis=1))
            emax = tl.maximum(emax, tl.max(tl.where(ms != 0, es, -big), axis=1))
            nonfinite = nonfinite | ((tl.max((~finite).to(tl.int32), axis=1) != 0) & mask_n)
        emin = tl.where(emin == big, 0, emin)
        return emin, tl.where(emax == -big, 0, emax - emin), nonfinite

    @triton.jit
    def scales_kernel(s_ptr, w_ptr, f_ptr, r_ptr, emin_ptr, flags_ptr, N, G, stride_wn,
                      W_BITS: tl.constexpr, SPREAD_LIMIT: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr):
        """certify's (factor, emin, slow, nonfinite) and R = sum_k q * f for BLOCK_N weight rows,
        BLOCK_G groups a step: flags = SLOW | NONFINITE bits."""
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        emin, spread, nonfinite = row_exponents(s_ptr, offs_n, mask_n, G, BLOCK_G)
        slow = spread > SPREAD_LIMIT
        per_word: tl.constexpr = 32 // W_BITS
        offs_w = tl.arange(0, BLOCK_G * W_BITS)  # a step's words, each group's W_BITS in turn
        fields = tl.arange(0, per_word) * W_BITS
        r = tl.zeros((BLOCK_N,), dtype=tl.int64)
        for g0 in range(0, G, BLOCK_G):
            offs_g = g0 + tl.arange(0, BLOCK_G)
            mask = mask_n[:, None] & (offs_g < G)[None, :]
            ms, es, _ = bf16_scales(s_ptr, offs_n, mask_n, G, offs_g)
            # an int32 for every certified spread (proved: scale-factor); slow rows: zero
            zero = slow[:, None] | (ms == 0)
            f = tl.where(zero, 0, ms << tl.where(zero, 0, es - emin[:, None]))
            tl.store(f_ptr + offs_n[:, None] * G + offs_g[None, :], f, mask=mask)
            words = tl.load(w_ptr + offs_n[:, None] * stride_wn + (g0 * W_BITS + offs_w)[None, :],
                            mask=mask_n[:, None] & (g0 * W_BITS + offs_w < G * W_BITS)[None, :],
                            other=0)
            q_sum = tl.sum(tl.reshape(unpack_fields(words, fields, W_BITS),
                                      (BLOCK_N, BLOCK_G, 32)), axis=2)
            r += tl.sum(q_sum.to(tl.int64) * f.to(tl.int64), axis=1)
        tl.store(r_ptr + offs_n, r, mask=mask_n)
        tl.store(emin_ptr + offs_n, emin.to(tl.int64), mask=mask_n)
        flags = slow.to(tl.int8) * SLOW_BIT + nonfinite.to(tl.int8) * NONFINITE_BIT
        tl.store(flags_ptr + offs_n, flags, mask=mask_n)


def device_certificate(weight_packed: torch.Tensor, weight_scale: torch.Tensor, k: int,
                       w_bits: int, act_bits: int) -> tuple:
    """(factor [N, G] int32, R [N] int64, emin [N] int64, flags [N] int8) of the live buffers,
    on their device, in one launch: what the group kernel, the folded GEMM and the finishing
    launch (triton/wide.py) read."""
    n, groups = weight_scale.shape[0], k // GROUP_SIZE
    device = weight_scale.device
    factor = torch.empty((n, groups), dtype=torch.int32, device=device)
    r = torch.empty(n, dtype=torch.int64, device=device)
    emin = torch.empty(n, dtype=torch.int64, device=device)
    flags = torch.empty(n, dtype=torch.int8, device=device)
    scales_kernel[(triton.cdiv(n, SCALES_BLOCK_N),)](
        weight_scale.view(torch.int16), weight_packed, factor, r, emin, flags, n, groups,
        weight_packed.stride(0), **scales_constants(w_bits, k, act_bits))
    return factor, r, emin, flags


def scales_constants(w_bits: int, k: int, act_bits: int) -> dict:
    """scales_kernel's compile-time constants: the spread certified for K = k and the widths."""
    return dict(W_BITS=w_bits, SPREAD_LIMIT=dataflow.certified_spread(k, w_bits, act_bits),
                BLOCK_N=SCALES_BLOCK_N, BLOCK_G=SCALES_BLOCK_G)
