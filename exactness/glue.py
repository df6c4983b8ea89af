"""What an MoE block computes between its exact projections, one of two blocks (BLOCKS):

- "exact": gate, up and down come out in fp32, each rounded once from its exact value; SiLU
  and the product in float64, h rounded once to fp32; each expert's weighted output exact in
  float64 (an fp32 times an fp32), the sum of a token's experts in float64, and the block
  rounded once to the model's dtype (round_float64). docs/KIMI.md, "The exact block".
- "transformers": transformers' bits: gate, up and down rounded to the output dtype,
  SiLU(gate) * up in it, each expert's weighted output rounded to it and added in it.

Every step gives an element the same bits whatever rows share the call (batch invariance), and
reads nothing back on a GPU. exactness.moe calls these between its grouped kernel calls, and
`exact_block_loop` is the exact block one expert at a time, the reference it is checked
against (the suite's own, step by step from the contract, is exactness.suite.moe_reference).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import nn

from .contract import ContractValueError
from .kernels.routing import Routing

# torch runs an elementwise function on vectors of up to 64 16-bit lanes (two AVX-512 registers
# a step), and the elements past the last whole step on a scalar path. In one block of at most
# torch's GRAIN_SIZE elements it runs on one thread, from the block's start: so in blocks of
# GRAIN_SIZE elements, padded to a multiple of VECTOR_STEP, every element takes the vector path.
VECTOR_STEP, GRAIN_SIZE = 64, 32768
CHUNK = 2**22  # the activation's elements a step, into a workspace: each temporary < 32 MiB
BLOCKS = ("exact", "transformers")  # what the glue between the exact projections computes in


def check_block(block: object) -> str:
    if block not in BLOCKS:
        raise ContractValueError(f"block must be one of {BLOCKS}, got {block!r}")
    return block


def activation(act_fn: Callable, gate: torch.Tensor, up: torch.Tensor,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """act_fn(gate) * up in their dtype, as transformers computes it, each element's bits the same
    whatever rows share the call (into `out` where given). torch's vector and scalar paths of SiLU
    give the same bf16 and fp16 results for every input (tests/test_moe.py checks every pattern),
    so those run in steps of CHUNK elements; not fp32 ones, so fp32 runs every element on the
    vector path (VECTOR_STEP)."""
    if gate.dtype != torch.float32:
        if out is None:
            return act_fn(gate) * up
        step = max(1, CHUNK // gate.shape[1])
        for start in range(0, gate.shape[0], step):
            rows = slice(start, start + step)
            torch.mul(act_fn(gate[rows]), up[rows], out=out[rows])
        return out
    return on_vector_path(act_fn, gate) * up


def exact_activation(act_fn: Callable, gate: torch.Tensor, up: torch.Tensor,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """The exact block's h: act_fn(gate) * up in float64 from fp32 gate and up, rounded once to
    fp32 (into `out` where given). Each element's bits are the same whatever rows share the
    call: on the CPU every element takes the vector path (on_vector_path). In steps of CHUNK
    elements, so that the float64 temporaries stay small."""
    if out is None:
        out = torch.empty(gate.shape, dtype=torch.float32, device=gate.device)
    step = max(1, CHUNK // max(1, gate.shape[1]))
    for start in range(0, gate.shape[0], step):
        rows = slice(start, start + step)
        g = gate[rows].to(torch.float64)
        h = (on_vector_path(act_fn, g) if g.device.type == "cpu" else act_fn(g)) \
            * up[rows].to(torch.float64)
        out[rows] = h.to(torch.float32)  # the one rounding of h (RNE)
    return out


def on_vector_path(fn: Callable, t: torch.Tensor) -> torch.Tensor:
    """fn(t) elementwise, every element on torch's vector path: torch's vector and scalar paths
    of SiLU differ in fp32 and float64, and which an element takes depends on its place in the
    call. In blocks of GRAIN_SIZE elements (one thread each, from the block's start), padded to
    a multiple of VECTOR_STEP, none is left to the scalar path."""
    flat = t.contiguous().view(-1)
    padded = nn.functional.pad(flat, (0, -flat.numel() % VECTOR_STEP))
    out = torch.empty_like(padded)
    for start in range(0, padded.numel(), GRAIN_SIZE):
        out[start:start + GRAIN_SIZE] = fn(padded[start:start + GRAIN_SIZE])
    return out[:flat.numel()].view(t.shape)


def round_float64(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A float64 tensor rounded once (RNE) to `dtype`. torch rounds a double to bf16 or fp16
    through fp32, twice, which can land on the wrong side of a midpoint; here the fp32 step
    rounds to odd (an inexact result takes the neighbour whose last bit is 1), which keeps
    every bit the second rounding needs (fp32 has at least 2 bits more than bf16 and fp16,
    at every exponent). A NaN comes out as the canonical quiet NaN: an invalid operation's NaN
    (inf - inf) takes its sign from the CPU or GPU and from the order a compiler put the
    operands in. Elementwise, on any device; tied to formats.round_scaled by
    tests/test_exact_block.py."""
    if dtype in (torch.float64, torch.float32):
        rounded = t.to(dtype)
    else:
        nearest = t.to(torch.float32)
        inexact = nearest.to(torch.float64) != t
        even = (nearest.view(torch.int32) & 1) == 0
        toward = torch.where(t > nearest.to(torch.float64), math.inf, -math.inf).to(
            torch.float32)
        odd = torch.where(inexact & even & nearest.isfinite(),
                          torch.nextafter(nearest, toward), nearest)
        rounded = odd.to(dtype)
    return torch.where(rounded.isnan(), math.nan, rounded)


def weighted_sum(rows: torch.Tensor, routing: Routing, top_k_weights: torch.Tensor,
                 dtype: torch.dtype, block: str = "transformers") -> torch.Tensor:
    """[T, H] in `dtype`: for each token, sum over its pairs of row * weight, added one by one
    into zeros, experts ascending and then slots (the per-expert loops' index_add_ order). The
    transformers block rounds each term to `dtype` and adds in it; the exact block forms each
    term in float64 (exact for fp32 rows and weights), adds in float64 and rounds the sum once
    to `dtype`. `rows` [R, H] holds the routed rows in routing order (R >= the routed rows; any
    past them are never read). Nothing is read back."""
    tokens, top_k = routing.tokens, routing.top_k
    pairs = tokens * top_k
    row_of = torch.empty(pairs, dtype=torch.int64, device=rows.device)
    row_of[routing.pair] = torch.arange(pairs, device=rows.device)
    # a token's slots in the loops' order; pairs of no expert last, to add nothing
    order = torch.argsort(routing.key, dim=1, stable=True)
    row = row_of.view(tokens, top_k).gather(1, order)
    routed = row < routing.routed
    weight = top_k_weights.gather(1, order)
    exact = block == "exact"
    sums = torch.float64 if exact else dtype
    out = torch.zeros((tokens, rows.shape[1]), dtype=sums, device=rows.device)
    if not rows.shape[0]:  # no pair names an expert
        return out.to(dtype)
    if exact:
        weight = weight.to(torch.float64)
    for j in range(top_k):
        picked = rows.index_select(0, torch.where(routed[:, j], row[:, j], 0))
        term = picked * weight[:, j, None]  # exact block: float64 by promotion, exact
        out += torch.where(routed[:, j, None], term.to(sums), 0)
    return round_float64(out, dtype) if exact else out


def exact_block_loop(experts: Sequence[nn.Module], act_fn: Callable, x: torch.Tensor,
                     ids: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The exact block one routed expert at a time, each over its own tokens: the reference the
    grouped call's exact block is checked against. ids [T, top_k] (checked by the caller; an id
    of len(experts) names no expert), weights [T, top_k]; [T, H] in `dtype`."""
    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    for e in torch.unique(ids).tolist():
        if e == len(experts):
            continue
        token, slot = torch.where(ids == e)
        expert, rows = experts[e], x[token]
        gate = expert.gate_proj(rows, out_dtype=torch.float32)
        up = expert.up_proj(rows, out_dtype=torch.float32)
        y = expert.down_proj(exact_activation(act_fn, gate, up), out_dtype=torch.float32)
        out.index_add_(0, token, y.to(torch.float64) * weights[token, slot, None].to(
            torch.float64))  # exact: an fp32 times an fp32
    return round_float64(out, dtype)
