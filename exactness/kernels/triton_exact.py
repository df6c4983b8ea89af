"""The GPU kernels, in Triton; on CPU they run under the interpreter (TRITON_INTERPRET=1).

One forward, below FOLDED_MIN_ROWS activation rows, is two launches:
- `quantize_kernel`, up to BLOCK_M activation rows and a slice of K per program: the row
  exponent e_r by the contract's integer rule (section 3) on the row maximum's bit pattern (which
  also flags a row holding inf or NaN), then qa = RNE(x * 2**-e_r) by integer shifts of each
  value's significand, written as dataflow's int8 limbs;
- `exact_group_kernel`, per output tile and per group of 32: the packed words unpacked to int8 in
  registers, one int8 x int8 -> int32 dot per activation limb gives the group's exact
  P' = 256 * D_1 + D_0, and P' * f (f = ms << shift, int32 x int32) is added into an int64
  accumulator, the limb offset's sum once at the end (widths: exactness/dataflow.py); with four
  limbs (32-bit activations) P' stays in two int32 halves, P'_hi = 256 * D_3 + D_2 and
  P'_lo = 256 * D_1 + D_0, and the term is (P'_hi * f << 16) + P'_lo * f in int64; the tile's
  exact T is rounded once (`round_scaled`, the twin of formats.round_scaled_array) and stored as
  the output's bit patterns.
From FOLDED_MIN_ROWS rows on, `linear_folded` runs kernels/cpu.py's dataflow instead, which
leaves the GEMM no per-group work: `fold_kernel` (the scales folded into the weights' int8
digits), one integer GEMM (torch._int_mm) and `combine_kernel` (int64 combination, the rounding).
The integer helpers are twins of formats.py's and reference.py's; the suite checks the kernels
bit for bit against the reference.
"""

from __future__ import annotations

import functools
import os

import torch

from .. import dataflow
from ..contract import GROUP_SIZE, ContractValueError, FloatFormat, act_qmax, float_format
from ..formats import torch_dtype
from . import registry
from .cpu import int_mm_exact
from .registry import Fit, Weights, int8_limbs_hold, no, yes

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU path needs no Triton
    triton = None

# Under the interpreter every program and loop step costs Python time: wide tiles, few programs.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
GPU_BLOCK_N = 64
BLOCK_M = 16
BLOCK_N = 512 if INTERPRETED else GPU_BLOCK_N
# quantize_kernel's step: QUANT_TILE activations, [rows, QUANT_TILE // rows], rows = M rounded up
# to a power of two, at most BLOCK_M (quantize_tile: one decode row of Kimi's K in two steps)
GPU_QUANT_TILE = 4096
QUANT_TILE = 16384 if INTERPRETED else GPU_QUANT_TILE
# (BLOCK_M, BLOCK_N, num_warps) of exact_group_kernel that bench/gpu_check.py times beside the
# default, on a GPU; `python -m exactness.suite.triton_aot --tiles` compiles them without one
# (none spills on sm_90; 256 x 64 does on sm_80; 64 x 128 with 4 warps and 128 x 128 spill on
# sm_90, so they are not here)
TUNING_TILES = ((16, 64, 4), (16, 128, 4), (32, 64, 4), (32, 128, 4), (64, 64, 8), (128, 32, 8),
                (128, 64, 8), (64, 128, 8), (256, 64, 8))
# The group kernel's slices of K (k_slices): programs to aim at under the interpreter (on a GPU:
# twice its SMs) and the fewest groups a slice, so that the suite runs split and whole launches
INTERPRETED_PROGRAMS = 4
MIN_SLICE_GROUPS = 1 if INTERPRETED else 8
# The folded path (linear_folded): fold_kernel's rows and k per step, combine_kernel's tile
GPU_FOLD, GPU_COMBINE_BLOCK = (16, 128), 32  # no spills (triton_aot)
FOLD_BLOCK_N, FOLD_BLOCK_K = (64, 1024) if INTERPRETED else GPU_FOLD
COMBINE_BLOCK = 128 if INTERPRETED else GPU_COMBINE_BLOCK
# From this many activation rows the plan prefers linear_folded. The count of each kernel's
# instructions (docs/PERFORMANCE.md) puts the crossover at tens of rows; measuring it on a GPU
# (bench/gpu_check.py times both paths at every M) is issue 27.
FOLDED_MIN_ROWS = 64


def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def narrow(x, length, S: tl.constexpr):
        """One step of the binary search: drop S bits from x where it has more than S."""
        big = (x >> S) != 0
        return tl.where(big, x >> S, x), length + tl.where(big, S, 0)

    @triton.jit
    def bit_length(x):
        """formats.bit_length_array: bit length of int64 x >= 0, by binary search on shifts."""
        x, length = narrow(x, x * 0, 32)
        x, length = narrow(x, length, 16)
        x, length = narrow(x, length, 8)
        x, length = narrow(x, length, 4)
        x, length = narrow(x, length, 2)
        x, length = narrow(x, length, 1)
        return length + (x != 0).to(tl.int64)

    @triton.jit
    def rne_shift_right(a, s):
        """formats.rne_shift_right: RNE(a / 2**s) for int64 a >= 0 and 0 <= s <= 63."""
        one = a * 0 + 1
        n = a >> s
        rem = a & ((one << s) - 1)
        half = tl.where(s > 0, one << tl.maximum(s - 1, 0), 0)
        up = (s > 0) & ((rem > half) | ((rem == half) & ((n & 1) == 1)))
        return n + up.to(tl.int64)

    @triton.jit
    def round_scaled(m, e, MANT: tl.constexpr, EXP: tl.constexpr):
        """formats.round_scaled_array: bit patterns (int64) of RNE(m * 2**e), |m| < 2**63."""
        bias: tl.constexpr = (1 << (EXP - 1)) - 1
        a = tl.abs(m)
        length = bit_length(a)
        q = tl.maximum(e + length - (MANT + 1), 1 - bias - MANT)
        s = q - e
        # s > length: under half an ulp, rounds to zero; otherwise s <= 63
        n = tl.where(s <= 0, a << tl.minimum(tl.maximum(-s, 0), 63),
                     rne_shift_right(a, tl.minimum(tl.maximum(s, 0), 63)))
        n = tl.where(s > length, 0, n)
        carry = n == (1 << (MANT + 1))
        n = tl.where(carry, n >> 1, n)
        q += carry.to(tl.int64)
        field = q + MANT + bias
        normal = tl.where(field >= (1 << EXP) - 1, ((1 << EXP) - 1) << MANT,
                          (field << MANT) | (n & ((1 << MANT) - 1)))
        bits = tl.where(n >= (1 << MANT), normal, n)
        bits = bits | tl.where(m < 0, (a * 0 + 1) << (MANT + EXP), 0)  # int64: fp32's is 2**31
        return tl.where(m == 0, 0, bits)

    @triton.jit
    def store_exact(t, e, y_ptrs, mask, OUT_MANT: tl.constexpr, OUT_EXP: tl.constexpr):
        """The one rounding, from the exact int64 T: y = RNE(T * 2**e), stored at y_ptrs as the
        output's bit patterns."""
        bits = round_scaled(t, e, OUT_MANT, OUT_EXP)
        width: tl.constexpr = OUT_MANT + OUT_EXP + 1
        sign = (bits * 0 + 1) << (width - 1)
        signed = tl.where(bits >= sign, bits - 2 * sign, bits)  # the bits as the int view
        tl.store(y_ptrs, signed.to(y_ptrs.dtype.element_ty), mask=mask)

    @triton.jit
    def store_rounded(t, e_ptr, emin_ptr, y_ptr, offs_m, offs_n, mask_m, mask_n, stride_ym,
                      OUT_MANT: tl.constexpr, OUT_EXP: tl.constexpr):
        """store_exact of the tile [offs_m, offs_n]: y = RNE(T * 2**(e_r + emin))."""
        e_r = tl.load(e_ptr + offs_m, mask=mask_m, other=0)
        emin = tl.load(emin_ptr + offs_n, mask=mask_n, other=0)
        store_exact(t, e_r[:, None] + emin[None, :],
                    y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :],
                    mask_m[:, None] & mask_n[None, :], OUT_MANT, OUT_EXP)

    @triton.jit
    def unpack_fields(words, shifts, W_BITS: tl.constexpr):
        """formats.unpack_weights in registers: int32 words [R, C] -> their signed W_BITS fields
        [R, C, fields] (`shifts`: each field's bit offset). The stored field is q + 2**(bits-1);
        the mask drops the sign-extended high bits."""
        return ((words[:, :, None] >> shifts[None, None, :]) & ((1 << W_BITS) - 1)) - (
            1 << (W_BITS - 1))

    @triton.jit
    def decode(b, MANT: tl.constexpr, EXP: tl.constexpr):
        """formats.decode_array of unsigned finite patterns: (m, e), x = m * 2**e."""
        field = (b >> MANT) & ((1 << EXP) - 1)
        frac = b & ((1 << MANT) - 1)
        m = tl.where(field == 0, frac, frac | (1 << MANT))
        e = (2 - (1 << (EXP - 1)) - MANT) + tl.maximum(field - 1, 0)
        return tl.where((b >> (MANT + EXP)) != 0, -m, m), e

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

    @triton.jit
    def fold_kernel(w_ptr, f_ptr, folded_ptr, N, K, stride_wn, stride_fn,
                    W_BITS: tl.constexpr, W_LIMBS: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """cpu.FoldedWeights' digits for BLOCK_N weight rows: the signed int8 digits of
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
        """cpu.accumulate's T = sum_{i,j} Z_ij << 8 (i + j) (+ LIMB_OFFSET * sum_k Wf) from the
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


TRITON_INT = {32: tl.int32, 64: tl.int64} if triton is not None else {}  # widths of dataflow
BIT_VIEW = {16: torch.int16, 32: torch.int32}  # a float tensor's bit view, by width


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


def group_constants(w_bits: int, limbs: int, out, block_n: int = BLOCK_N,
                    block_m: int = BLOCK_M, split: bool = False) -> dict:
    """exact_group_kernel's compile-time constants for activations in `limbs` int8 limbs,
    output in `out` (a FloatFormat)."""
    return dict(W_BITS=w_bits, LIMBS=limbs, LIMB_OFFSET=dataflow.offset_for_limbs(limbs),
                DOT_ACC=TRITON_INT[dataflow.DOT_ACC_BITS],
                COMBINE_ACC=TRITON_INT[dataflow.COMBINE_ACC_BITS],
                OUT_MANT=out.mant_bits, OUT_EXP=out.exp_bits, BLOCK_M=block_m, BLOCK_N=block_n,
                SPLIT=split)


def fold_constants(w_bits: int, w_limbs: int, block_n: int = FOLD_BLOCK_N,
                   block_k: int = FOLD_BLOCK_K) -> dict:
    """fold_kernel's compile-time constants."""
    return dict(W_BITS=w_bits, W_LIMBS=w_limbs, BLOCK_N=block_n, BLOCK_K=block_k)


def combine_constants(a_limbs: int, w_limbs: int, out, block: int = COMBINE_BLOCK) -> dict:
    """combine_kernel's compile-time constants, output in `out` (a FloatFormat)."""
    return dict(A_LIMBS=a_limbs, W_LIMBS=w_limbs,
                LIMB_OFFSET=dataflow.offset_for_limbs(a_limbs),
                OUT_MANT=out.mant_bits, OUT_EXP=out.exp_bits, BLOCK_M=block, BLOCK_N=block)


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


def offset_sums(weight_packed: torch.Tensor, factor: torch.Tensor, w_bits: int) -> torch.Tensor:
    """R [N] int64 = sum_k q[n, k] * factor[n, g(k)] (dataflow step 3: what the limb offset adds
    to a 16-bit activation's T), from the packed words on their device, once per weights."""
    n = weight_packed.shape[0]
    fields = 32 // w_bits
    mask = (1 << w_bits) - 1
    word_sums = sum((weight_packed >> (j * w_bits)) & mask for j in range(fields))
    group_sums = word_sums.reshape(n, -1, w_bits).sum(-1) - GROUP_SIZE * 2 ** (w_bits - 1)
    return (group_sums.to(torch.int64) * factor).sum(-1)


def linear(limbs: torch.Tensor, e_r: torch.Tensor, weight_packed: torch.Tensor,
           factor: torch.Tensor, row_sums: torch.Tensor, emin: torch.Tensor, w_bits: int,
           out_dtype: torch.dtype, block_m: int = BLOCK_M, block_n: int = BLOCK_N,
           num_warps: int = 4, slices: int | None = None) -> torch.Tensor:
    """y [M, N] of `out_dtype` from activation limbs [L, M, K] int8, their row exponents, the
    certified scale factors (`factor` int32 [N, G], ms << shift, zero for rows the certificate
    sends elsewhere), their offset_sums and `emin` [N]. The tile (block_m x block_n outputs per
    program, powers of two, at least 16), num_warps and the slices of K (None: k_slices) change
    the speed, never the bits (bench/gpu_check.py compares them)."""
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
        combine_kernel[(triton.cdiv(m, COMBINE_BLOCK), triton.cdiv(n, COMBINE_BLOCK))](
            t, t, e_r, emin, y_bits, m, n, t.stride(0), y.stride(0),
            **combine_constants(1, 1, out))
    return y


def k_slices(tiles: int, groups: int, device: torch.device) -> int:
    """How many slices of K the group kernel splits into for `tiles` output tiles: enough
    programs for twice the GPU's SMs (a few rows leave most SMs idle otherwise: 32 tiles at
    Kimi's gate/up), MIN_SLICE_GROUPS a slice at least."""
    return fill_slices(tiles, groups // MIN_SLICE_GROUPS, device, per_sm=2)


def fill_slices(blocks: int, most: int, device: torch.device, per_sm: int = 1) -> int:
    """Slices of K (1 to `most`) for a launch of `blocks` blocks to have per_sm programs for
    each of the GPU's SMs; under the interpreter INTERPRETED_PROGRAMS in all."""
    target = (per_sm * _multiprocessors(device.index) if device.type == "cuda"
              else INTERPRETED_PROGRAMS)
    return max(1, min(most, triton.cdiv(target, blocks)))


@functools.cache
def _multiprocessors(index: int | None) -> int:
    return torch.cuda.get_device_properties(index or 0).multi_processor_count


# A launch computes its offsets into x, the limbs, T and y (row * row length + column) in int32,
# as Triton does for pointer arithmetic on int32 indices: each of those tensors must stay under
# this many elements, so a forward launches blocks of rows_per_launch rows (a 128K-token prefill
# through a dense down-projection, K = 18432, is 2.4e9 activations).
INT32_OFFSETS = 2**31 - 1


def rows_per_launch(k: int, n: int, act_bits: int) -> int:
    """The most rows of x [M, K] one forward's launches take (limbs [L, M, K], y [M, N])."""
    return max(1, INT32_OFFSETS // max(dataflow.act_limbs(act_bits) * k, n))


def folded_fits(m: int, n: int, k: int) -> bool:
    """Whether linear_folded takes this shape: its int8 GEMM sums K products in int32
    (dataflow.int_mm_bound), and cuBLAS's takes more than 16 rows, N and K multiples of 8."""
    return (dataflow.int_mm_bound(k) < 2 ** (dataflow.DOT_ACC_BITS - 1) and m > 16
            and n % 8 == 0 and k % 8 == 0)


def linear_folded(limbs: torch.Tensor, e_r: torch.Tensor, weight_packed: torch.Tensor,
                  factor: torch.Tensor, row_sums: torch.Tensor, emin: torch.Tensor, w_bits: int,
                  w_limbs: int, out_dtype: torch.dtype) -> torch.Tensor:
    """linear's y by the CPU fallback's dataflow (kernels/cpu.py), for many activation rows: the
    scales folded into the weights' int8 digits (fold_kernel, per forward: nothing is kept), one
    integer GEMM of every activation limb by every digit (torch._int_mm: the tensor cores at
    full rate, with no per-group work), and the int64 combination with the one rounding
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


class _TritonKernel:
    """The Triton forward: x quantized by quantize_kernel, then the group kernel (`linear`) or
    the folded GEMM (`linear_folded`), in blocks of rows that keep each launch's offsets in int32
    (rows_per_launch). x is finite: the layer gives a non-finite row its NaN (contract v1.2)."""

    family, layout, auto, grouped = "triton", "triton", True, False

    def __init__(self, name: str, folded: bool, min_rows: int):
        self.name, self.folded, self.min_rows = name, folded, min_rows
        self.act_limbs = dataflow.GEMM_ACT_LIMBS if folded else dataflow.GROUP_ACT_LIMBS

    def available(self, device: torch.device) -> Fit:
        if triton is None:
            return no("the triton package is not installed")
        if device.type == "cpu" and not INTERPRETED:
            return no("x is on the CPU and TRITON_INTERPRET=1 is not set")
        if device.type not in ("cpu", "cuda"):
            return no(f"Triton runs on CUDA devices (or the CPU interpreter), x is on {device}")
        if self.folded and not int_mm_exact(str(device)):
            return no(f"torch._int_mm is missing or not exact on {device}")
        return yes("Triton, interpreted" if device.type == "cpu" else f"Triton on {device}")

    def eligible(self, rows: int, weights: Weights) -> Fit:
        held = int8_limbs_hold(weights.act_bits, self.act_limbs)
        if not held:
            return held
        if not self.folded:
            return yes("any weight widths")
        per_launch = rows_per_launch(weights.k, weights.n, weights.act_bits)
        blocks = {min(per_launch, rows - start) for start in range(0, rows, per_launch)}
        if not all(folded_fits(m, weights.n, weights.k) for m in blocks):
            return no(f"torch._int_mm does not take M in {sorted(blocks)}, N = {weights.n}, "
                      f"K = {weights.k} (more than 16 rows, N and K multiples of 8)")
        return yes("int8 GEMM on folded weight digits")

    def prepare(self, weights: Weights) -> None:
        return None  # the scales' factors are derived on the device per forward (gpu_weights)

    def run(self, x, weights: Weights, prepared: None, out_format: FloatFormat):
        """y for a finite x (the layer gives a non-finite row its NaN first): nothing is read
        back."""
        if registry.capturing(x):
            raise ContractValueError(
                "the exact layers cannot be captured into a CUDA graph yet: a forward reads "
                "back whether any weight row is slow; run them eagerly")
        return self.launches(x, weights, gpu_weights(weights, x.device),
                             torch_dtype(out_format))

    def launches(self, x, weights: Weights, derived: tuple, out_dtype: torch.dtype):
        """y, every block of rows queued, nothing read back."""
        args = (weights.packed, *derived, weights.bits)
        # the folded GEMM's digits, sized by the fast rows' spread: a read of the device (the
        # certified spread would need none, and twice the digits at Kimi's scales)
        digits = dataflow.folded_weight_limbs(weights.bits, weights.certificate.fast_spread) \
            if self.folded else 0
        ys = []
        for rows in x.split(rows_per_launch(weights.k, weights.n, weights.act_bits)):
            limbs, e_r, _ = quantize(rows, weights.act_bits)
            if self.folded:
                ys.append(linear_folded(limbs, e_r, *args, digits, out_dtype))
            else:
                ys.append(linear(limbs, e_r, *args, out_dtype))
        return ys[0] if len(ys) == 1 else torch.cat(ys)


def gpu_weights(weights: Weights, device: torch.device) -> tuple:
    """(factor, offset_sums, emin) on `device`, derived from the live buffers for one forward
    (on the buffers' device: nothing read back)."""
    cert = weights.certificate
    factor = cert.factor.to(device)
    return (factor, offset_sums(weights.packed.to(device), factor, weights.bits),
            cert.emin.to(device))


FOLDED = _TritonKernel("triton-folded", folded=True, min_rows=FOLDED_MIN_ROWS)
GROUP = _TritonKernel("triton-group", folded=False, min_rows=0)
