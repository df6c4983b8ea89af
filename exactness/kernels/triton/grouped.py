"""The GPU's grouped kernel (`triton-grouped`): one projection of every routed expert of an MoE
layer in one launch, scheduled by expert as vLLM's fused_moe is.

The routed rows (routing.py) are cut into blocks of BLOCK_M rows of one expert each, the last
block of each expert padded (`blocks`): a block's row ids, its expert, and how many blocks are in
use, all made on the device, so the grid is an upper bound and a program past the blocks in use
returns at once. A padding row is never read as data nor stored.

Each program reads its expert's weights live, through a table of every (expert, part) layer's
buffer addresses (weight_packed, weight_scale, weight_shape): nothing is derived ahead that a
write could leave stale. It derives what the group kernel's certificate holds (certificate.certify)
from the scales as it goes: each weight row's emin and spread, then per group the factor
f = ms << (es - emin). A row whose spread exceeds dataflow.certified_spread (a slow row) is
left to grouped_finish_kernel, a second launch over the same blocks, which computes it by
finish_kernel's multiword combine (triton/wide.py). It also writes the canonical NaN of a
non-finite x row or scale, an expert not held here (a zero entry) and a weight_shape that
disagrees; its programs with neither return after their first reads. Nothing is read back.
The dataflow is exact_group_kernel's:
int8 dots per limb into P', P' * f into int64 (four limbs: two int32 halves, group_sums), with
the limb offset's LIMB_OFFSET * sum_k q * f added per group (the same T, within
dataflow.combine_bound in any order: proved, combine-*).
"""

from __future__ import annotations

import torch

from ... import dataflow
from ...contract import FloatFormat
from ...formats import torch_dtype
from ..registry import Fit, Weights, int8_limbs_hold, refuse_unheld
from ..routing import Routing, route
from . import layer
from .group import BLOCK_N
from .launch import BIT_VIEW, BLOCK_M, TRITON_INT, tl, triton
from .quantize import quantize
from .wide import WIDE_N

if triton is not None:
    from .group import group_sums, group_term
    from .integers import store_exact, unpack_fields
    from .scales import ROW_GROUPS_STEP, bf16_scale, row_exponents
    from .wide import store_nan, wide_columns

    @triton.jit
    def block_layer(table_ptr, block_rows_ptr, block_expert_ptr, source_ptr, rows_total, N, K,
                    PARTS: tl.constexpr, GATHER: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr):
        """What program (block program_id(0), columns program_id(1)) reads: (w_ptr, s_ptr, live,
        rows, valid, src, offs_n, part). live [BLOCK_N]: its expert is held here (a nonzero
        table entry) and weight_shape is [N, K], else nothing of the layer is read; rows: the
        block's routed row ids (0 for padding, valid false), src the rows of x they read."""
        tiles = tl.cdiv(N, BLOCK_N)
        part = tl.program_id(1) // tiles
        offs_n = (tl.program_id(1) % tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
        expert = tl.load(block_expert_ptr + tl.program_id(0))
        entry = table_ptr + (expert * PARTS + part) * 4  # packed, scale, shape, shape is int64
        offs_2 = tl.arange(0, 2)
        # offs_2 * 0 +: a scalar's bool widened to a vector, as the interpreter's masks need
        held = offs_2 * 0 + tl.load(entry) != 0
        w_ptr = tl.load(entry).to(tl.pointer_type(tl.int32))
        s_ptr = tl.load(entry + 1).to(tl.pointer_type(tl.int16))
        if tl.load(entry + 3) != 0:  # weight_shape int64, or int32
            shape = tl.load(tl.load(entry + 2).to(tl.pointer_type(tl.int64)) + offs_2,
                            mask=held, other=0)
        else:
            shape = tl.load(tl.load(entry + 2).to(tl.pointer_type(tl.int32)) + offs_2,
                            mask=held, other=0).to(tl.int64)
        live = offs_n * 0 + tl.sum((shape == tl.where(offs_2 == 0, N, K)).to(tl.int32)) == 2
        rows = tl.load(block_rows_ptr + tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M))
        valid = rows < rows_total  # padding: the row id rows_total
        rows = tl.where(valid, rows, 0)
        if GATHER:
            src = tl.load(source_ptr + rows, mask=valid, other=0)
        else:
            src = rows
        return w_ptr, s_ptr, live, rows, valid, src, offs_n, part

    @triton.jit
    def grouped_kernel(
        a_ptr, e_ptr, bad_ptr, source_ptr, block_rows_ptr, block_expert_ptr, used_ptr, table_ptr,
        y_ptr, slow_ptr, rows_total, N, K, stride_limb, stride_am, stride_ym,
        W_BITS: tl.constexpr, LIMBS: tl.constexpr, LIMB_OFFSET: tl.constexpr,
        DOT_ACC: tl.constexpr, COMBINE_ACC: tl.constexpr, SPREAD_LIMIT: tl.constexpr,
        OUT_MANT: tl.constexpr, OUT_EXP: tl.constexpr, PARTS: tl.constexpr,
        GATHER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        """Block program_id(0) of routed rows (one expert's) against the columns program_id(1)
        of PARTS parts' outputs: y[row, part * N + n], rounded once; the slow rows and NaN
        outputs left to grouped_finish_kernel, flagged in slow [program]. Row r reads input
        row source[r] (GATHER) or r of the limbs a [L, M, K] and row exponents e [M]."""
        pid_m = tl.program_id(0)
        if pid_m >= tl.load(used_ptr):
            return
        w_ptr, s_ptr, live, rows, valid, src, offs_n, part = block_layer(
            table_ptr, block_rows_ptr, block_expert_ptr, source_ptr, rows_total, N, K, PARTS,
            GATHER, BLOCK_M, BLOCK_N)
        mask_n = offs_n < N
        groups = K // 32
        mask_w = mask_n & live
        emin, spread, nonfinite = row_exponents(s_ptr, offs_n, mask_w, groups, ROW_GROUPS_STEP)
        slow = (spread > SPREAD_LIMIT) & mask_w
        # what grouped_finish_kernel must write: slow rows, NaN (a non-finite scale, a dead layer)
        tl.store(slow_ptr + pid_m * tl.num_programs(1) + tl.program_id(1),
                 tl.max((slow | ((nonfinite | ~live) & mask_n)).to(tl.int8)))
        per_word: tl.constexpr = 32 // W_BITS
        offs_w = tl.arange(0, W_BITS)
        fields = tl.arange(0, per_word) * W_BITS
        offs_k = tl.arange(0, 32)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=COMBINE_ACC)
        for g in range(groups):
            words = tl.load(w_ptr + offs_n[:, None] * (groups * W_BITS)
                            + (g * W_BITS + offs_w)[None, :], mask=mask_w[:, None], other=0)
            w8 = tl.reshape(unpack_fields(words, fields, W_BITS).to(tl.int8), (BLOCK_N, 32))
            a_ptrs = a_ptr + src[:, None] * stride_am + (g * 32 + offs_k)[None, :]
            p, p_hi = group_sums(a_ptrs, stride_limb, valid, w8, LIMBS, DOT_ACC)
            ms, es, _ = bf16_scale(s_ptr, offs_n, mask_w, groups, g)
            # an int32 for every certified spread (proved: scale-factor); slow rows: zero
            f = tl.where(slow | (ms == 0), 0, ms << tl.where(slow | (ms == 0), 0, es - emin))
            acc += group_term(p, p_hi, f, LIMBS, COMBINE_ACC)
            if LIMBS > 1:  # P = P' + LIMB_OFFSET * sum_k q
                q_sum = tl.sum(w8.to(tl.int32), axis=1)
                acc += (LIMB_OFFSET * q_sum.to(COMBINE_ACC) * f.to(COMBINE_ACC))[None, :]
        e_r = tl.load(e_ptr + src, mask=valid, other=0)
        y_ptrs = y_ptr + rows[:, None] * stride_ym + (part * N + offs_n)[None, :]
        out = valid[:, None] & mask_n[None, :]
        store_exact(acc.to(tl.int64), e_r[:, None] + emin.to(tl.int64)[None, :], y_ptrs, out,
                    OUT_MANT, OUT_EXP)

    @triton.jit
    def grouped_finish_kernel(
        a_ptr, e_ptr, bad_ptr, source_ptr, block_rows_ptr, block_expert_ptr, used_ptr,
        table_ptr, y_ptr, slow_ptr, rows_total, N, K, stride_limb, stride_am, stride_ym,
        SPREAD_LIMIT: tl.constexpr, W_BITS: tl.constexpr, LIMBS: tl.constexpr,
        LIMB_OFFSET: tl.constexpr, WORDS: tl.constexpr, OUT_MANT: tl.constexpr,
        OUT_EXP: tl.constexpr, PARTS: tl.constexpr, GATHER: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WIDE_N: tl.constexpr,
    ):
        """grouped_kernel's program's NaN outputs (a non-finite row of x or scale, a layer not
        held or of another shape) and slow rows, by finish_kernel's multiword combine
        (wide.wide_columns); a program with neither returns after its first reads."""
        pid_m = tl.program_id(0)
        if pid_m >= tl.load(used_ptr):
            return
        w_ptr, s_ptr, live, rows, valid, src, offs_n, part = block_layer(
            table_ptr, block_rows_ptr, block_expert_ptr, source_ptr, rows_total, N, K, PARTS,
            GATHER, BLOCK_M, BLOCK_N)
        bad = tl.load(bad_ptr + src, mask=valid, other=0) != 0
        flagged = tl.load(slow_ptr + pid_m * tl.num_programs(1) + tl.program_id(1))
        if (flagged != 0) | (tl.max(bad.to(tl.int32)) > 0):
            mask_n = offs_n < N
            _, _, nonfinite = row_exponents(s_ptr, offs_n, mask_n & live, K // 32,
                                            ROW_GROUPS_STEP)
            nan = (bad[:, None] | (nonfinite | ~live)[None, :]) & valid[:, None] & mask_n[None, :]
            store_nan(y_ptr + rows[:, None] * stride_ym + (part * N + offs_n)[None, :], nan,
                      OUT_MANT, OUT_EXP)
            e_r = tl.load(e_ptr + src, mask=valid, other=0)
            n_start = tl.min(offs_n)
            n_live = tl.where(tl.max(live.to(tl.int32)) > 0, N, 0)  # a dead layer: nothing read
            for n0 in range(n_start, tl.minimum(n_live, n_start + BLOCK_N), WIDE_N):
                wide_columns(a_ptr, src, valid, bad, e_r, stride_limb, stride_am, w_ptr,
                             (K // 32) * W_BITS, s_ptr, n0, N, K // 32, y_ptr, rows,
                             stride_ym, part * N, SPREAD_LIMIT, W_BITS, LIMBS, LIMB_OFFSET,
                             WORDS, OUT_MANT, OUT_EXP, BLOCK_M, WIDE_N)


def grouped_constants(w_bits: int, act_bits: int, k: int, out: FloatFormat, parts: int,
                      gather: bool, block_m: int = BLOCK_M, block_n: int = BLOCK_N) -> dict:
    """grouped_kernel's compile-time constants, output in `out` (a FloatFormat)."""
    return dict(W_BITS=w_bits, LIMBS=dataflow.act_limbs(act_bits),
                LIMB_OFFSET=dataflow.limb_offset(act_bits),
                DOT_ACC=TRITON_INT[dataflow.DOT_ACC_BITS],
                COMBINE_ACC=TRITON_INT[dataflow.COMBINE_ACC_BITS],
                SPREAD_LIMIT=dataflow.certified_spread(k, w_bits, act_bits),
                OUT_MANT=out.mant_bits, OUT_EXP=out.exp_bits, PARTS=parts, GATHER=gather,
                BLOCK_M=block_m, BLOCK_N=block_n)


def grouped_finish_constants(w_bits: int, act_bits: int, k: int, out: FloatFormat,
                             parts: int, gather: bool, block_m: int = BLOCK_M,
                             block_n: int = BLOCK_N) -> dict:
    """grouped_finish_kernel's compile-time constants: grouped_kernel's tile, finish_kernel's
    words."""
    return dict(SPREAD_LIMIT=dataflow.certified_spread(k, w_bits, act_bits), W_BITS=w_bits,
                LIMBS=dataflow.act_limbs(act_bits), LIMB_OFFSET=dataflow.limb_offset(act_bits),
                WORDS=dataflow.WIDE_WORDS, OUT_MANT=out.mant_bits, OUT_EXP=out.exp_bits,
                PARTS=parts, GATHER=gather, BLOCK_M=block_m, BLOCK_N=block_n, WIDE_N=WIDE_N)


def blocks(routing: Routing, block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row ids [B * block_m], expert [B], blocks in use [1]): the routed rows cut into blocks of
    block_m rows of one expert each, the last of each expert padded with the row id
    tokens * top_k; B bounds the blocks in use. Made on the device, nothing read back."""
    experts, device = routing.experts, routing.offsets.device
    rows_total = routing.tokens * routing.top_k
    counts = routing.offsets[1:experts + 1] - routing.offsets[:experts]
    per_expert = (counts + block_m - 1) // block_m
    ends = per_expert.cumsum(0)
    bound = -(-rows_total // block_m) + experts  # sum_e ceil(c_e / block_m) <= this
    block = torch.arange(bound, device=device)
    expert = torch.searchsorted(ends, block, right=True).clamp(max=experts - 1)
    first = routing.offsets[expert] + (block - (ends - per_expert)[expert]) * block_m
    rows = first[:, None] + torch.arange(block_m, device=device)
    rows = torch.where(rows < routing.offsets[expert + 1][:, None], rows, rows_total)
    return rows.reshape(-1), expert, ends[-1:]


_TABLES: dict = {}  # the tables on each device, by their addresses


def table(experts, device: torch.device) -> torch.Tensor:
    """[E * parts, 4] int64: each (expert, part) layer's weight_packed, weight_scale and
    weight_shape addresses, and whether weight_shape is int64 (buffers type-checked already);
    a zero row for an expert this process does not hold (None). Kept on the device by its
    addresses: a call whose buffers have not moved copies nothing (as under a CUDA graph's
    capture, where a copy from the host is not allowed), and a write in place moves none."""
    rows = tuple((0, 0, 0, 0) if buffers is None else
                 (buffers[0].data_ptr(), buffers[1].data_ptr(), buffers[2].data_ptr(),
                  int(buffers[2].dtype == torch.int64))
                 for parts in experts for buffers in parts)
    key = (device, rows)
    if key not in _TABLES:
        if len(_TABLES) > 1024:  # layers x batches of experts: keep it bounded
            _TABLES.clear()
        _TABLES[key] = torch.tensor(rows, dtype=torch.int64).to(device)
    return _TABLES[key]


def grouped_launch(x: torch.Tensor, routing: Routing, experts, bits: int, act_bits: int,
                   out_format: FloatFormat, gather: bool) -> torch.Tensor:
    """y [tokens * top_k, parts * N] for x [M, K]: `experts` [E][parts] of live (weight_packed,
    weight_scale, weight_shape), or None for an expert this process does not hold. Every output
    on the device, nothing read back: the slow rows exact, the canonical NaN for a row of x
    holding inf or NaN, a weight row holding a non-finite scale, and every output of a layer
    not held or whose weight_shape disagrees."""
    device, k = x.device, x.shape[1]
    parts = len(experts[0])
    n = next(b for layers in experts for b in layers if b is not None)[0].shape[0]
    limbs, e_r, bad = [], [], []
    for rows in x.split(layer.rows_per_launch(k, n, act_bits)):  # int32 offsets
        quantized = quantize(rows, act_bits)
        for into, part in zip((limbs, e_r, bad), quantized, strict=True):
            into.append(part)
    limbs = limbs[0] if len(limbs) == 1 else torch.cat(limbs, 1)
    e_r, bad = torch.cat(e_r), torch.cat(bad)
    rows_total = routing.tokens * routing.top_k
    y = torch.empty((rows_total, parts * n), dtype=torch_dtype(out_format), device=device)
    block_rows, block_expert, used = blocks(routing, BLOCK_M)
    grid = (block_expert.numel(), parts * triton.cdiv(n, BLOCK_N))
    slow = torch.empty(grid, dtype=torch.int8, device=device)  # each program's flag
    args = (limbs, e_r, bad, routing.token, block_rows, block_expert, used, table(experts, device),
            y.view(BIT_VIEW[out_format.width]), slow, rows_total, n, k, limbs.stride(0),
            limbs.stride(1), y.stride(0))
    grouped_kernel[grid](*args, **grouped_constants(bits, act_bits, k, out_format, parts, gather))
    grouped_finish_kernel[grid](*args, **grouped_finish_constants(bits, act_bits, k, out_format,
                                                                  parts, gather))
    return y


class _TritonGroupedKernel:
    """grouped_kernel: every routed expert's rows of one projection in one launch, reading the
    layers' live buffers. As a layer's kernel (kernel="triton-grouped"): one expert, every row."""

    name, family, layout, min_rows = "triton-grouped", "triton", "triton-grouped", 0
    auto, grouped, reads, auto_grouped = False, True, "buffers", True
    act_limbs = dataflow.GROUP_ACT_LIMBS

    def available(self, device: torch.device) -> Fit:
        return layer.GROUP.available(device)

    def eligible(self, rows: int, weights: Weights) -> Fit:
        return int8_limbs_hold(weights.act_bits, self.act_limbs)

    def prepare(self, weights: Weights) -> None:
        return None

    def run(self, x, weights: Weights, prepared: None, out_format: FloatFormat):
        """y, every output (as the other Triton kernels give it): one expert, every row."""
        shape = torch.tensor([weights.n, weights.k]).to(x.device)  # the Weights hold no shape
        one = route(torch.zeros((x.shape[0], 1), dtype=torch.int64, device=x.device), 1)
        return grouped_launch(x, one, [[(weights.packed, weights.scale, shape)]], weights.bits,
                              weights.act_bits, out_format, gather=True)

    def run_grouped(self, x, routing: Routing, experts, bits: int, act_bits: int,
                    out_format: FloatFormat, gather: bool, workspace=None):
        """(y [tokens * top_k, parts * N], None): grouped_launch's y, where `experts` [E] holds
        every expert's parts' live buffers (weight_packed, weight_scale, weight_shape),
        type-checked, or None for one not held here; routed row r reads row routing.token[r]
        of x where `gather`, else row r. Nothing is read back. (`workspace` is the CPU's: CUDA's
        caching allocator keeps its memory from one call to the next.)"""
        refuse_unheld(self.name, act_bits, self.act_limbs)
        return grouped_launch(x, routing, experts, bits, act_bits, out_format, gather), None


GROUPED = _TritonGroupedKernel()
