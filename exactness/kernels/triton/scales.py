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
SCALES_BLOCK_N = 256 if INTERPRETED else 64


if triton is not None:
    from .integers import decode, unpack_fields

    SLOW_BIT, NONFINITE_BIT = tl.constexpr(SLOW), tl.constexpr(NONFINITE)  # for the kernels

    @triton.jit
    def bf16_scale(s_ptr, offs_n, mask_n, groups, g):
        """(ms, es, finite) of the bf16 scales s[offs_n, g] (formats.decode_array; a non-finite
        scale reads as ms = 0, as certify takes it)."""
        b = tl.load(s_ptr + offs_n * groups + g, mask=mask_n, other=0).to(tl.int32) & 0xFFFF
        finite = ((b >> 7) & 0xFF) != 0xFF
        ms, es = decode(b, 7, 8)
        return tl.where(finite, ms, 0), es, finite

    @triton.jit
    def row_exponents(s_ptr, offs_n, mask_n, groups):
        """formats.split_scales per weight row: (emin, spread, any non-finite scale) [BLOCK_N]."""
        big = 1 << 20
        emin = tl.full(offs_n.shape, big, tl.int32)
        emax = tl.full(offs_n.shape, -big, tl.int32)
        nonfinite = offs_n < 0
        for g in range(groups):
            ms, es, finite = bf16_scale(s_ptr, offs_n, mask_n, groups, g)
            emin = tl.minimum(emin, tl.where(ms != 0, es, big))
            emax = tl.maximum(emax, tl.where(ms != 0, es, -big))
            nonfinite = nonfinite | (~finite & mask_n)
        emin = tl.where(emin == big, 0, emin)
        return emin, tl.where(emax == -big, 0, emax - emin), nonfinite

    @triton.jit
    def scales_kernel(s_ptr, w_ptr, f_ptr, r_ptr, emin_ptr, flags_ptr, N, G, stride_wn,
                      W_BITS: tl.constexpr, SPREAD_LIMIT: tl.constexpr,
                      BLOCK_N: tl.constexpr):
        """certify's (factor, emin, slow, nonfinite) and group.offset_sums' R for BLOCK_N weight
        rows: flags = SLOW | NONFINITE bits."""
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        emin, spread, nonfinite = row_exponents(s_ptr, offs_n, mask_n, G)
        slow = spread > SPREAD_LIMIT
        per_word: tl.constexpr = 32 // W_BITS
        offs_w = tl.arange(0, W_BITS)
        fields = tl.arange(0, per_word) * W_BITS
        r = tl.zeros((BLOCK_N,), dtype=tl.int64)
        for g in range(G):
            ms, es, _ = bf16_scale(s_ptr, offs_n, mask_n, G, g)
            # an int32 for every certified spread (proved: scale-factor); slow rows: zero
            f = tl.where(slow | (ms == 0), 0, ms << tl.where(slow | (ms == 0), 0, es - emin))
            tl.store(f_ptr + offs_n * G + g, f, mask=mask_n)
            words = tl.load(w_ptr + offs_n[:, None] * stride_wn + (g * W_BITS + offs_w)[None, :],
                            mask=mask_n[:, None], other=0)
            q_sum = tl.sum(tl.reshape(unpack_fields(words, fields, W_BITS), (BLOCK_N, 32)), axis=1)
            r += q_sum.to(tl.int64) * f.to(tl.int64)
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
        weight_packed.stride(0), W_BITS=w_bits,
        SPREAD_LIMIT=dataflow.certified_spread(k, w_bits, act_bits), BLOCK_N=SCALES_BLOCK_N)
    return factor, r, emin, flags
