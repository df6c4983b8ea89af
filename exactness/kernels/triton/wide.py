"""finish_kernel: a Triton forward's last launch, on the device: the slow rows (a scale spread no
int64 combine holds) in multiword integers, and the canonical NaN of every output of a row of x
holding inf or NaN, or of a weight row holding a non-finite scale (contract v1.2). The twin of
kernels/wide.py, for any spread, with nothing read back: a program whose tile holds neither
returns at once.

The multiword combine: T = sum_g (P * ms) << shift in dataflow.WIDE_WORDS words of
WIDE_WORD_BITS bits, word j worth 2**(32 j), each an int64 that sums its parts unnormalized
(dataflow.wide_word_adds_hold). The carries run once at the end; T's sign is the last carry; its
magnitude's top 62 bits, with a sticky bit for the rest, give the one rounding.
"""

from __future__ import annotations

import torch

from ... import dataflow
from ...contract import GROUP_SIZE, FloatFormat
from .launch import BIT_VIEW, BLOCK_M, INTERPRETED, tl, triton

FINISH_BLOCK_N = 64  # a finishing program's weight rows (and BLOCK_M rows of x)
# weight rows a step of the multiword combine: WIDE_WORDS int64 words an output, in registers
WIDE_N = 64 if INTERPRETED else 1


if triton is not None:
    from .integers import store_exact, unpack_fields
    from .scales import NONFINITE_BIT, ROW_GROUPS_STEP, SLOW_BIT, bf16_scale, row_exponents

    @triton.jit
    def add_shifted(acc, v, shift, WORDS: tl.constexpr):
        """acc [BM, BN, WORDS] (word j worth 2**(32 j)) += v << shift, v [BM, BN] int64 with
        |v| < 2**62, shift [BN] >= 0: v's low and high 32 bits, each shifted by shift % 32, go
        to words shift // 32 .. + 2 as parts under 2**33."""
        word = tl.arange(0, WORDS)[None, None, :]
        q = (shift >> 5)[None, :, None]
        r = (shift & 31).to(tl.int64)[None, :, None]
        low = (v & 0xFFFFFFFF)[:, :, None] << r  # < 2**63
        high = (v >> 32)[:, :, None] << r  # |high| < 2**61
        mask = 0xFFFFFFFF
        return acc + tl.where(word == q, low & mask, 0) \
            + tl.where(word == q + 1, (low >> 32) + (high & mask), 0) \
            + tl.where(word == q + 2, high >> 32, 0)

    @triton.jit
    def carried(acc, WORDS: tl.constexpr):
        """(words in [0, 2**32), the last carry) of acc [BM, BN, WORDS]: the carry is 0 for
        T >= 0 and -1 for T < 0 (|T| < 2**(32 WORDS - 1))."""
        word = tl.arange(0, WORDS)[None, None, :]
        carry = tl.sum(acc * 0, axis=2)
        out = acc * 0
        for j in tl.static_range(WORDS):
            column = tl.sum(tl.where(word == j, acc, 0), axis=2) + carry
            out = tl.where(word == j, (column & 0xFFFFFFFF)[:, :, None], out)
            carry = column >> 32
        return out, carry

    @triton.jit
    def wide_round(acc, e, WORDS: tl.constexpr):
        """(m, e') with RNE(m * 2**e') == RNE(T * 2**e) for every output format of at most 24
        significand bits: m is T itself where |T| < 2**32, else |T|'s top 62 bits with a sticky
        bit at the bottom (at least 31 bits, so the sticky sits below the rounding bit)."""
        words, carry = carried(acc, WORDS)
        negative = carry < 0
        words, _ = carried(tl.where(negative[:, :, None], -acc, acc), WORDS)  # |T|
        word = tl.arange(0, WORDS)[None, None, :]
        top = tl.max(tl.where(words != 0, word, -1), axis=2)  # -1 for T = 0
        high = tl.sum(tl.where(word == top[:, :, None], words, 0), axis=2)
        below = tl.sum(tl.where(word == top[:, :, None] - 1, words, 0), axis=2)
        sticky = tl.max(tl.where((word < top[:, :, None] - 1) & (words != 0), 1, 0), axis=2)
        window = (high << 30) | (below >> 2) | ((below & 3) != 0).to(tl.int64) | sticky
        single = top <= 0
        m = tl.where(single, high, window)
        return tl.where(negative, -m, m), e + tl.where(single, 0, 32 * (top - 1) + 2)

    @triton.jit
    def wide_columns(a_ptr, a_rows, valid, bad, e_r, stride_limb, stride_am, w_ptr, stride_wn,
                     s_ptr, n0, N, G, y_ptr, y_rows, stride_ym, col0,
                     SPREAD_LIMIT: tl.constexpr, W_BITS: tl.constexpr, LIMBS: tl.constexpr,
                     LIMB_OFFSET: tl.constexpr, WORDS: tl.constexpr, OUT_MANT: tl.constexpr,
                     OUT_EXP: tl.constexpr, BLOCK_M: tl.constexpr, WIDE_N: tl.constexpr):
        """The slow outputs of weight rows n0 .. n0 + WIDE_N (spread past SPREAD_LIMIT, scales
        finite) for the limbs' rows a_rows, stored at y[y_rows, col0 + n]; nothing else. Each
        group's P = sum_j 256**j * D_j + LIMB_OFFSET * sum_k q (dataflow step 2) is summed
        elementwise (a few weight rows: no dot's least tile), then T = sum_g (P * ms) << shift
        in WORDS words."""
        offs_n = n0 + tl.arange(0, WIDE_N)
        mask_n = offs_n < N
        emin, spread, nonfinite = row_exponents(s_ptr, offs_n, mask_n, G, ROW_GROUPS_STEP)
        slow = (spread > SPREAD_LIMIT) & mask_n & ~nonfinite
        if tl.max(slow.to(tl.int32)) > 0:
            per_word: tl.constexpr = 32 // W_BITS
            offs_w = tl.arange(0, W_BITS)
            fields = tl.arange(0, per_word) * W_BITS
            offs_k = tl.arange(0, 32)
            acc = tl.zeros((BLOCK_M, WIDE_N, WORDS), dtype=tl.int64)
            for g in range(G):
                words = tl.load(w_ptr + offs_n[:, None] * stride_wn
                                + (g * W_BITS + offs_w)[None, :], mask=mask_n[:, None], other=0)
                q = tl.reshape(unpack_fields(words, fields, W_BITS), (WIDE_N, 32))
                p = tl.zeros((BLOCK_M, WIDE_N), dtype=tl.int64)
                for j in tl.static_range(LIMBS):
                    a = tl.load(a_ptr + j * stride_limb + a_rows[:, None] * stride_am
                                + (g * 32 + offs_k)[None, :], mask=valid[:, None], other=0)
                    d = tl.sum(a.to(tl.int32)[:, None, :] * q[None, :, :], axis=2)
                    p += d.to(tl.int64) << (8 * j)
                if LIMBS > 1:
                    p += LIMB_OFFSET * tl.sum(q, axis=1).to(tl.int64)[None, :]
                ms, es, _ = bf16_scale(s_ptr, offs_n, mask_n, G, g)
                shift = tl.where(ms != 0, es - emin, 0)
                acc = add_shifted(acc, p * ms.to(tl.int64)[None, :], shift, WORDS)
            m, e = wide_round(acc, e_r[:, None] + emin.to(tl.int64)[None, :], WORDS)
            store_exact(m, e, y_ptr + y_rows[:, None] * stride_ym + (col0 + offs_n)[None, :],
                        valid[:, None] & ~bad[:, None] & slow[None, :], OUT_MANT, OUT_EXP)

    @triton.jit
    def store_nan(y_ptrs, nan, OUT_MANT: tl.constexpr, OUT_EXP: tl.constexpr):
        """The output format's canonical quiet NaN where `nan` (contract v1.2)."""
        nan_bits: tl.constexpr = ((1 << OUT_EXP) - 1) << OUT_MANT | (1 << (OUT_MANT - 1))
        tl.store(y_ptrs, tl.full(nan.shape, nan_bits, tl.int32).to(y_ptrs.dtype.element_ty),
                 mask=nan)

    @triton.jit
    def finish_kernel(
        a_ptr, e_ptr, bad_ptr, w_ptr, s_ptr, flags_ptr, y_ptr, M, N, G,
        stride_limb, stride_am, stride_wn, stride_ym,
        SPREAD_LIMIT: tl.constexpr, W_BITS: tl.constexpr, LIMBS: tl.constexpr,
        LIMB_OFFSET: tl.constexpr, WORDS: tl.constexpr, OUT_MANT: tl.constexpr,
        OUT_EXP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        WIDE_N: tl.constexpr,
    ):
        """The tile's slow weight rows by the multiword combine, and its NaN outputs; nothing
        else is written. bad [M] int8: a row of x holding inf or NaN (quantize's flag)."""
        offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        n_start = tl.program_id(1) * BLOCK_N
        offs_n = n_start + tl.arange(0, BLOCK_N)
        mask_m = offs_m < M
        mask_n = offs_n < N
        flags = tl.load(flags_ptr + offs_n, mask=mask_n, other=0).to(tl.int32)
        bad = tl.load(bad_ptr + offs_m, mask=mask_m, other=0) != 0
        nan = (bad[:, None] | ((flags & NONFINITE_BIT) != 0)[None, :]) \
            & mask_m[:, None] & mask_n[None, :]
        if tl.max(nan.to(tl.int32)) > 0:
            store_nan(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], nan, OUT_MANT,
                      OUT_EXP)
        if tl.max(((flags & SLOW_BIT) != 0).to(tl.int32)) > 0:
            e_r = tl.load(e_ptr + offs_m, mask=mask_m, other=0)
            for n0 in range(n_start, tl.minimum(N, n_start + BLOCK_N), WIDE_N):
                wide_columns(a_ptr, offs_m, mask_m, bad, e_r, stride_limb, stride_am, w_ptr,
                             stride_wn, s_ptr, n0, N, G, y_ptr, offs_m, stride_ym, 0,
                             SPREAD_LIMIT, W_BITS, LIMBS, LIMB_OFFSET, WORDS, OUT_MANT,
                             OUT_EXP, BLOCK_M, WIDE_N)


def finish_constants(w_bits: int, limbs: int, k: int, act_bits: int, out: FloatFormat,
                     block_m: int = BLOCK_M, block_n: int = FINISH_BLOCK_N) -> dict:
    """finish_kernel's compile-time constants for activations in `limbs` int8 limbs (of
    `act_bits`-bit ones: the certified spread), output in `out` (a FloatFormat)."""
    return dict(SPREAD_LIMIT=dataflow.certified_spread(k, w_bits, act_bits), W_BITS=w_bits,
                LIMBS=limbs, LIMB_OFFSET=dataflow.offset_for_limbs(limbs),
                WORDS=dataflow.WIDE_WORDS, OUT_MANT=out.mant_bits, OUT_EXP=out.exp_bits,
                BLOCK_M=block_m, BLOCK_N=block_n, WIDE_N=WIDE_N)


def finish(y: torch.Tensor, limbs: torch.Tensor, e_r: torch.Tensor, bad: torch.Tensor,
           weight_packed: torch.Tensor, weight_scale: torch.Tensor, flags: torch.Tensor,
           w_bits: int, act_bits: int, out: FloatFormat) -> torch.Tensor:
    """y with its slow weight rows (flags' SLOW) computed exactly and its NaN outputs set, in
    place: one launch, nothing read back."""
    n_limbs, m, k = limbs.shape
    n = weight_packed.shape[0]
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, FINISH_BLOCK_N))
    finish_kernel[grid](
        limbs, e_r, bad, weight_packed, weight_scale.view(torch.int16), flags,
        y.view(BIT_VIEW[out.width]), m, n, k // GROUP_SIZE, limbs.stride(0), limbs.stride(1),
        weight_packed.stride(0), y.stride(0),
        **finish_constants(w_bits, n_limbs, k, act_bits, out))
    return y
