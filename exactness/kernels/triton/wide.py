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
from .launch import BIT_VIEW, BLOCK_M, tl, triton
from .scales import NONFINITE, SLOW

FINISH_BLOCK_N = 16  # the tile's weight rows: tl.dot's least; WIDE_WORDS words an output


if triton is not None:
    from .group import group_sums
    from .integers import store_exact, unpack_fields
    from .scales import bf16_scale

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
    def wide_tile(a_ptr, rows, valid, stride_limb, stride_am, w_ptr, stride_wn, s_ptr, offs_n,
                  mask_n, emin, e, G, W_BITS: tl.constexpr, LIMBS: tl.constexpr,
                  LIMB_OFFSET: tl.constexpr, DOT_ACC: tl.constexpr, WORDS: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """(m, e') of wide_round for the tile: rows `rows` of the limbs a [L, M, K] against
        weight rows offs_n, every scale spread, T = sum_g (P * ms) << (es - emin); e [BM, BN]
        is e_r + emin."""
        per_word: tl.constexpr = 32 // W_BITS
        offs_w = tl.arange(0, W_BITS)
        fields = tl.arange(0, per_word) * W_BITS
        offs_k = tl.arange(0, 32)
        acc = tl.zeros((BLOCK_M, BLOCK_N, WORDS), dtype=tl.int64)
        for g in range(G):
            words = tl.load(w_ptr + offs_n[:, None] * stride_wn + (g * W_BITS + offs_w)[None, :],
                            mask=mask_n[:, None], other=0)
            q = tl.reshape(unpack_fields(words, fields, W_BITS), (BLOCK_N, 32))
            a_ptrs = a_ptr + rows[:, None] * stride_am + (g * 32 + offs_k)[None, :]
            p_lo, p_hi = group_sums(a_ptrs, stride_limb, valid, q.to(tl.int8), LIMBS, DOT_ACC)
            p = p_lo.to(tl.int64)  # P = P' + LIMB_OFFSET * sum_k q (dataflow step 2)
            if LIMBS == 4:
                p += p_hi.to(tl.int64) << 16
            if LIMBS > 1:
                p += LIMB_OFFSET * tl.sum(q, axis=1).to(tl.int64)[None, :]
            ms, es, _ = bf16_scale(s_ptr, offs_n, mask_n, G, g)
            shift = tl.where(ms != 0, es - emin.to(tl.int32), 0)
            acc = add_shifted(acc, p * ms.to(tl.int64)[None, :], shift, WORDS)
        return wide_round(acc, e, WORDS)

    @triton.jit
    def store_nan(y_ptrs, nan, OUT_MANT: tl.constexpr, OUT_EXP: tl.constexpr):
        """The output format's canonical quiet NaN where `nan` (contract v1.2)."""
        nan_bits: tl.constexpr = ((1 << OUT_EXP) - 1) << OUT_MANT | (1 << (OUT_MANT - 1))
        tl.store(y_ptrs, tl.full(nan.shape, nan_bits, tl.int32).to(y_ptrs.dtype.element_ty),
                 mask=nan)

    @triton.jit
    def finish_kernel(
        a_ptr, e_ptr, bad_ptr, w_ptr, s_ptr, emin_ptr, flags_ptr, y_ptr, M, N, G,
        stride_limb, stride_am, stride_wn, stride_ym,
        W_BITS: tl.constexpr, LIMBS: tl.constexpr, LIMB_OFFSET: tl.constexpr,
        DOT_ACC: tl.constexpr, WORDS: tl.constexpr, OUT_MANT: tl.constexpr,
        OUT_EXP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        """The tile's slow weight rows by the multiword combine, and its NaN outputs; nothing
        else is written. bad [M] int8: a row of x holding inf or NaN (quantize's flag)."""
        offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_m = offs_m < M
        mask_n = offs_n < N
        flags = tl.load(flags_ptr + offs_n, mask=mask_n, other=0).to(tl.int32)
        bad = tl.load(bad_ptr + offs_m, mask=mask_m, other=0) != 0
        mask = mask_m[:, None] & mask_n[None, :]
        nan = (bad[:, None] | ((flags & NONFINITE) != 0)[None, :]) & mask
        slow = ((flags & SLOW) != 0) & mask_n
        y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
        if tl.max(slow.to(tl.int32)) > 0:
            emin = tl.load(emin_ptr + offs_n, mask=mask_n, other=0)
            e_r = tl.load(e_ptr + offs_m, mask=mask_m, other=0)
            m, e = wide_tile(a_ptr, offs_m, mask_m, stride_limb, stride_am, w_ptr, stride_wn,
                             s_ptr, offs_n, mask_n, emin, e_r[:, None] + emin[None, :], G,
                             W_BITS, LIMBS, LIMB_OFFSET, DOT_ACC, WORDS, BLOCK_M, BLOCK_N)
            store_exact(m, e, y_ptrs, mask & slow[None, :] & ~nan, OUT_MANT, OUT_EXP)
        if tl.max(nan.to(tl.int32)) > 0:
            store_nan(y_ptrs, nan, OUT_MANT, OUT_EXP)


def finish_constants(w_bits: int, limbs: int, out: FloatFormat, block_m: int = BLOCK_M,
                     block_n: int = FINISH_BLOCK_N) -> dict:
    """finish_kernel's compile-time constants for activations in `limbs` int8 limbs, output in
    `out` (a FloatFormat)."""
    from .launch import TRITON_INT

    return dict(W_BITS=w_bits, LIMBS=limbs, LIMB_OFFSET=dataflow.offset_for_limbs(limbs),
                DOT_ACC=TRITON_INT[dataflow.DOT_ACC_BITS], WORDS=dataflow.WIDE_WORDS,
                OUT_MANT=out.mant_bits, OUT_EXP=out.exp_bits, BLOCK_M=block_m, BLOCK_N=block_n)


def finish(y: torch.Tensor, limbs: torch.Tensor, e_r: torch.Tensor, bad: torch.Tensor,
           weight_packed: torch.Tensor, weight_scale: torch.Tensor, emin: torch.Tensor,
           flags: torch.Tensor, w_bits: int, out: FloatFormat) -> torch.Tensor:
    """y with its slow weight rows (flags' SLOW) computed exactly and its NaN outputs set, in
    place: one launch, nothing read back."""
    n_limbs, m, k = limbs.shape
    n = weight_packed.shape[0]
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, FINISH_BLOCK_N))
    finish_kernel[grid](
        limbs, e_r, bad, weight_packed, weight_scale.view(torch.int16), emin, flags,
        y.view(BIT_VIEW[out.width]), m, n, k // GROUP_SIZE, limbs.stride(0), limbs.stride(1),
        weight_packed.stride(0), y.stride(0), **finish_constants(w_bits, n_limbs, out))
    return y
