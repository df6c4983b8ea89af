"""The GPU kernel, in Triton; on CPU it runs under the interpreter (TRITON_INTERPRET=1).

Per output tile and per group of 32: the packed words are unpacked to int8 in registers, one
int8 x int8 -> int32 dot per activation limb gives the group's exact P, and P * ms << shift is
added into an int64 accumulator (widths: exactness/dataflow.py). The tile's T goes to memory;
the one final rounding happens after (formats.round_scaled_array), from T and the exponent.
"""

from __future__ import annotations

import os

import torch

from .. import dataflow
from ..contract import GROUP_SIZE

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU path needs no Triton
    triton = None

# Under the interpreter every program and loop step costs Python time: wide tiles, few programs.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
BLOCK_M = 16
BLOCK_N = 512 if INTERPRETED else 64


def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def exact_group_kernel(
        a_ptr, w_ptr, c_ptr, sh_ptr, t_ptr,
        M, N, G,
        stride_limb, stride_am, stride_wn, stride_cn, stride_tm,
        W_BITS: tl.constexpr, TWO_LIMBS: tl.constexpr, LIMB_OFFSET: tl.constexpr,
        DOT_ACC: tl.constexpr, COMBINE_ACC: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, 32)
        mask_m = offs_m < M
        mask_n = offs_n < N
        per_word: tl.constexpr = 32 // W_BITS  # elements per int32 word
        word_of_k = offs_k // per_word
        shift_of_k = (offs_k % per_word) * W_BITS
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=COMBINE_ACC)
        for g in range(0, G):
            words = tl.load(w_ptr + offs_n[:, None] * stride_wn + (g * W_BITS + word_of_k)[None, :],
                            mask=mask_n[:, None], other=0)
            # the stored field is q + 2**(bits-1); the mask drops the sign-extended high bits
            w = ((words >> shift_of_k[None, :]) & ((1 << W_BITS) - 1)) - (1 << (W_BITS - 1))
            w8 = w.to(tl.int8)
            a_ptrs = a_ptr + offs_m[:, None] * stride_am + (g * 32 + offs_k)[None, :]
            a_lo = tl.load(a_ptrs, mask=mask_m[:, None], other=0)
            p = tl.dot(a_lo, tl.trans(w8), out_dtype=DOT_ACC)
            if TWO_LIMBS:  # qa - 128 = hi * 256 + lo
                a_hi = tl.load(a_ptrs + stride_limb, mask=mask_m[:, None], other=0)
                d_hi = tl.dot(a_hi, tl.trans(w8), out_dtype=DOT_ACC)
                p = d_hi * 256 + p + LIMB_OFFSET * tl.sum(w, axis=1)[None, :]
            c = tl.load(c_ptr + offs_n * stride_cn + g, mask=mask_n, other=0).to(COMBINE_ACC)
            sh = tl.load(sh_ptr + offs_n * stride_cn + g, mask=mask_n, other=0).to(COMBINE_ACC)
            acc += (p.to(COMBINE_ACC) * c[None, :]) << sh[None, :]
        t_ptrs = t_ptr + offs_m[:, None] * stride_tm + offs_n[None, :]
        tl.store(t_ptrs, acc, mask=mask_m[:, None] & mask_n[None, :])


_INT = {32: tl.int32, 64: tl.int64} if triton is not None else {}  # widths of dataflow


def accumulate(limbs: torch.Tensor, weight_packed: torch.Tensor, mantissa: torch.Tensor,
               shift: torch.Tensor, w_bits: int) -> torch.Tensor:
    """T [M, N] int64 from activation limbs [L, M, K] int8 and the certified scale parts.

    `mantissa` and `shift` are int32 [N, G], zero for rows the certificate sends elsewhere.
    """
    if triton is None:
        raise RuntimeError("the Triton path needs the triton package (pip install triton)")
    n_limbs, m, k = limbs.shape
    n = weight_packed.shape[0]
    t = torch.empty((m, n), dtype={32: torch.int32, 64: torch.int64}[dataflow.COMBINE_ACC_BITS],
                    device=limbs.device)
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
    exact_group_kernel[grid](
        limbs, weight_packed, mantissa, shift, t,
        m, n, k // GROUP_SIZE,
        limbs.stride(0), limbs.stride(1), weight_packed.stride(0), mantissa.stride(0), t.stride(0),
        W_BITS=w_bits, TWO_LIMBS=n_limbs == 2, LIMB_OFFSET=dataflow.LIMB_OFFSET,
        DOT_ACC=_INT[dataflow.DOT_ACC_BITS], COMBINE_ACC=_INT[dataflow.COMBINE_ACC_BITS],
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
    )
    return t
