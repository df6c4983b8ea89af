"""One exact call per projection of an MoE layer: every routed expert's gate and up in one grouped
kernel call, SiLU(gate) * up, every routed expert's down in a second call, then the weighted sum
over each token's experts. What happens between the calls is the block's glue (exactness.glue):
"exact" (fp32 projections, float64 glue, one rounding of the block) or "transformers".

Either way the bits are those of the per-expert loop each integration keeps as its reference
(`kimi.ExactExperts.per_expert`, `kimi.KimiMoE.per_expert`; in the transformers block,
transformers' own loop). The contract is per row, so an expert's layer gives a row the same bits
in any company. `weighted_sum` adds a token's contributions in that loop's order (experts
ascending, then slots).

Where the grouped call meets anything unusual it runs the per-expert loop instead, with that
loop's own checks and errors, so the two never differ, errors and NaN rows included. That covers a
non-finite input of either projection, a non-finite scale written in place, an expert whose layers
differ from the others' in widths, a forced per-layer kernel, and no grouped kernel here (a
warning says why, once).

On the CPU the grouped kernel reads each routed expert's live buffers in place, after the checks
a layer's forward makes (exactness.modules), and derives the scales' factors per block as it
goes; it reports the slow rows and the non-finite scales it met. On the GPU it reads every
expert's live buffers through a table of their addresses and derives the factors as it goes. No data
is kept there that a write could leave stale, and nothing is read back between the launches. One
read-back at the end says whether the per-expert loop must run instead: a non-finite input, a
scale spread no fast kernel holds, a non-finite scale, a wrong weight_shape or an expert id out
of range or repeated for a token.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable, Sequence

import torch
from torch import nn

from .contract import FLOAT32, ContractValueError, ExactnessError, NonFiniteError, ShapeError
from .formats import float_format, torch_dtype
from .glue import activation, check_block, exact_activation, weighted_sum
from .kernels import REGISTRY, KernelUnavailableError, Plan, plan_grouped
from .kernels.registry import ENV, by_name, capturing, warn_fallback
from .kernels.routing import Routing, refused, route
from .kernels.wide import splice_slow_rows
from .modules import ExactLayer, no_backward, traced


class Workspace(threading.local):
    """A thread's buffers for its grouped calls on the CPU, kept from one call to the next. glibc
    maps an allocation past 32 MiB afresh each time, and at T = 1024 the page faults of the
    grouped call's buffers cost as much as its arithmetic (docs/PERFORMANCE.md). They stay, each
    the size of the largest call so far; `clear()` frees them. A buffer holds until the next use
    of its slot on the same thread, so nothing that reads one escapes experts_forward."""

    def __init__(self):
        self.buffers: dict[str, torch.Tensor] = {}

    def get(self, slot: str, shape: tuple, dtype: torch.dtype, device) -> torch.Tensor:
        size = math.prod(shape) * dtype.itemsize
        buffer = self.buffers.get(slot)
        if buffer is None or buffer.numel() < size or buffer.device != torch.device(device):
            buffer = self.buffers[slot] = torch.empty(size, dtype=torch.uint8, device=device)
        return buffer[:size].view(dtype).view(shape)

    def clear(self) -> None:
        self.buffers.clear()


WORKSPACE = Workspace()


class MissingExpertError(ExactnessError, LookupError):
    """A token routed to an expert this process does not hold (a load with `experts=`)."""


class RemoteLinear(nn.Module):
    """A routed projection that another rank holds (a load with `experts=`): no tensors, and a
    forward raises MissingExpertError naming it. The grouped call runs the per-expert loop when
    a token routes to one, so that the error is this one."""

    def __init__(self, name: str, in_features: int, out_features: int):
        super().__init__()
        self.name, self.in_features, self.out_features = name, in_features, out_features

    def extra_repr(self) -> str:
        return f"{self.name}, in_features={self.in_features}, out_features={self.out_features}"

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        raise MissingExpertError(f"{self.name}: a token is routed to this expert, which this "
                                 f"process does not hold (loaded with experts=): send the "
                                 f"token to the rank that holds it")


def experts_forward(experts: Sequence[nn.Module], act_fn: Callable, x: torch.Tensor,
                    top_k_index: torch.Tensor, top_k_weights: torch.Tensor, dtype: torch.dtype,
                    per_expert: Callable[[], torch.Tensor],
                    block: str = "transformers") -> torch.Tensor:
    """The routed experts' weighted sum [T, H] in `dtype`, by the grouped kernels, with the glue
    of `block` (see the module's doc); `per_expert()` is the reference loop, with the same
    block, run where they cannot."""
    check_block(block)
    layers = [(e.gate_proj, e.up_proj, e.down_proj) for e in experts]
    local = _local(layers)
    if torch.jit.is_tracing() or x.dim() != 2 or not x.shape[0] or local is None:
        return per_expert()  # the layers raise, or there is no grouped path for them
    chosen = plan(layers, x)
    if chosen is None:
        return per_expert()
    if top_k_index.dim() != 2 or top_k_index.shape[0] != x.shape[0] \
            or top_k_weights.shape != top_k_index.shape:
        raise ShapeError(f"hidden_states {tuple(x.shape)}, top_k_index "
                         f"{tuple(top_k_index.shape)} and top_k_weights "
                         f"{tuple(top_k_weights.shape)} disagree on tokens or top_k")
    if chosen.kernel.reads == "buffers":
        out = _on_device(layers, act_fn, x, top_k_index, top_k_weights, dtype, block)
    else:
        out = _on_cpu(chosen.kernel, layers, act_fn, x, top_k_index, top_k_weights, dtype, block)
    if out is None:
        return per_expert()
    if x.requires_grad and torch.is_grad_enabled():
        out = no_backward(x, out)
    return out


def _on_cpu(kernel, layers, act_fn, x, top_k_index, top_k_weights, dtype, block):
    """The CPU's grouped call: each routed expert's layers checked and read in place, a refused
    id raised; None where the loop must run instead (other widths, a non-finite input or scale:
    the loop gives their NaN rows, or a strict layer's error)."""
    routing = route(top_k_index, len(layers), check=True)
    exact = block == "exact"
    out_format = FLOAT32 if exact else None  # None: the layers' own
    try:
        gate_and_up = _project(kernel, [parts[:2] for parts in layers], x, routing, True,
                               WORKSPACE, out_format)
        if gate_and_up is None:
            return None
        inter = gate_and_up.shape[1] // 2
        h = (exact_activation if exact else activation)(
            act_fn, gate_and_up[:, :inter], gate_and_up[:, inter:],
            WORKSPACE.get("h", (gate_and_up.shape[0], inter), gate_and_up.dtype, x.device))
        rows = _project(kernel, [parts[2:] for parts in layers], h, routing, False, WORKSPACE,
                        out_format)
    except NonFiniteError:  # the loop raises it with its own index, or does not need the row
        return None
    return None if rows is None else weighted_sum(rows, routing, top_k_weights, dtype, block)


def _on_device(layers, act_fn, x, top_k_index, top_k_weights, dtype, block):
    """The GPU's grouped call (and the interpreter's): one exactness::moe_experts op, nothing
    read back, so a CUDA graph captures it. None (the loop) for strict layers (v1's rule reads)
    and experts of other widths; in an eager call, the loop also for a token routed to an
    expert held elsewhere, which raises MissingExpertError (under a capture or a trace: NaN)."""
    held = [e for e, parts in enumerate(layers) if _exact(parts)]
    if not (_consistent([parts[:2] for parts in layers], held)
            and _consistent([parts[2:] for parts in layers], held)) \
            or any(layer.strict for e in held for layer in layers[e]):
        return None
    if len(held) < len(layers) and not (traced(x) or capturing(x)) and bool(
            torch.isin(top_k_index, torch.tensor(held, device=top_k_index.device),
                       invert=True).logical_and(top_k_index < len(layers)).any()):
        return None  # a read, where experts are held elsewhere only: the loop raises
    first = layers[held[0]][0]
    x, out_format = first.checked_input(x, x.device)
    none = torch.empty(0, dtype=torch.int32, device=x.device) if len(held) < len(layers) else None
    buffers = [b for parts in layers for layer in parts
               for b in (layer.checked_buffers() if _exact(parts) else (none, none, none))]
    if any(b.device != x.device for b in buffers):
        raise ContractValueError(f"x is on {x.device}, an expert's buffers elsewhere: move one")
    exact = block == "exact"
    args = (x.detach(), top_k_index, top_k_weights, buffers, first.bits, first.act_bits,
            torch.float32 if exact else torch_dtype(out_format), dtype)
    if act_fn is nn.functional.silu or isinstance(act_fn, nn.SiLU):
        return moe_experts(*args, exact)
    return device_experts(*args, act_fn, exact)  # the op's body, with an activation it does
    # not name


@torch.library.custom_op("exactness::moe_experts", mutates_args=())
def moe_experts(x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                buffers: list[torch.Tensor], bits: int, act_bits: int, out_dtype: torch.dtype,
                dtype: torch.dtype, exact_block: bool = False) -> torch.Tensor:
    """An MoE layer's routed experts with SiLU, [T, H] in `dtype` (device_experts)."""
    return device_experts(x, top_k_index, top_k_weights, buffers, bits, act_bits, out_dtype,
                          dtype, nn.functional.silu, exact_block)


@moe_experts.register_fake
def _(x, top_k_index, top_k_weights, buffers, bits, act_bits, out_dtype, dtype,
      exact_block=False):
    return x.new_empty(x.shape, dtype=dtype)  # down's outputs are the hidden size, x's


def device_experts(x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                   buffers: list[torch.Tensor], bits: int, act_bits: int,
                   out_dtype: torch.dtype, dtype: torch.dtype, act_fn: Callable,
                   exact_block: bool = False) -> torch.Tensor:
    """[T, H] in `dtype` by the grouped kernel that reads buffers: `buffers` holds each expert's
    gate, up and down (weight_packed, weight_scale, weight_shape), empty for an expert not held;
    the projections' outputs in `out_dtype`, the glue the exact block's where `exact_block`.
    Launches at fixed shapes only (the routing padded to tokens * top_k rows, as vLLM's
    moe_align_block_size pads it): a row of x holding inf or NaN, a token routed to an expert
    not held, and one with a refused id (outside [0, E], or an expert named twice) give the
    canonical NaN, made on the device (the CPU's call raises for a refused id)."""
    if x.shape[0] == 0:  # no token: nothing to launch
        return x.new_empty(x.shape, dtype=dtype)
    kernel = by_name(REGISTRY, "triton-grouped")
    experts = len(buffers) // 9
    layers = [[None if buffers[9 * e + 3 * p].numel() == 0 else
               tuple(buffers[9 * e + 3 * p:9 * e + 3 * p + 3]) for p in range(3)]
              for e in range(experts)]
    routing = route(top_k_index, experts, check=False)
    out_format = float_format(out_dtype)
    gate_and_up, _ = kernel.run_grouped(x, routing, [parts[:2] for parts in layers], bits,
                                        act_bits, out_format, gather=True)
    inter = gate_and_up.shape[1] // 2
    h = (exact_activation if exact_block else activation)(act_fn, gate_and_up[:, :inter],
                                                          gate_and_up[:, inter:])
    routed = torch.arange(h.shape[0], device=h.device) < routing.routed
    h = torch.where(routed[:, None], h, 0)  # rows of no expert: never computed, never data
    rows, _ = kernel.run_grouped(h, routing, [parts[2:] for parts in layers], bits, act_bits,
                                 out_format, gather=False)
    out = weighted_sum(rows, routing, top_k_weights, dtype,
                       "exact" if exact_block else "transformers")
    out_of_range, repeated = refused(top_k_index.to(torch.int64), experts)
    return out.masked_fill((out_of_range | repeated).any(dim=1)[:, None], float("nan"))


def projection(layers: Sequence[Sequence[nn.Module]], x: torch.Tensor, routing: Routing,
               gather: bool, kernel=None) -> torch.Tensor:
    """One grouped projection, exact: y [rows, parts * N] for `layers` [E][parts] (parts of one
    shape: gate and up, or down), routed row r reading row routing.token[r] of x where `gather`,
    else row r; part p of row r at columns p * N .. p * N + N. rows: the routed rows (the CPU's
    kernel) or tokens * top_k (the GPU's, whose rows past the routed ones are not data). By
    `kernel` (default: the plan's), each routed expert's layers where a grouped call cannot."""
    if kernel is None:
        chosen = plan(layers, x)
        if chosen is None:
            return _project_per_expert(layers, x, routing, gather)
        kernel = chosen.kernel
    y = _project(kernel, layers, x, routing, gather)
    return _project_per_expert(layers, x, routing, gather) if y is None else y


def _exact(parts) -> bool:
    return all(isinstance(layer, ExactLayer) for layer in parts)


def _local(layers):
    """The first expert's layers that are exact here (not RemoteLinear), or None."""
    return next((parts for parts in layers if _exact(parts)), None)


def plan(layers, x: torch.Tensor) -> Plan | None:
    """The grouped kernel that experts' `layers` [E][parts] take for x, or None where the
    per-expert loop runs: a kernel forced on a layer or by EXACTNESS_KERNEL (honoured layer by
    layer), or none here (a warning says why, once). A grouped kernel asked for by
    EXACTNESS_KERNEL that cannot run raises."""
    forced = os.environ.get(ENV) or None
    if forced and not by_name(REGISTRY, forced).grouped:
        return None
    local = _local(layers)
    if local is None or any(layer.kernel for layer in local):
        return None
    family = local[0].family(x)
    try:
        return plan_grouped(REGISTRY, family, x.device, local[0].act_bits, forced)
    except KernelUnavailableError as e:
        if forced:
            raise
        warn_fallback("the grouped MoE kernel", str(e),
                      "each expert's layers run one by one instead", stacklevel=4)
        return None


def _widths(layer) -> tuple:
    return (layer.in_features, layer.out_features, layer.bits, layer.act_bits, layer.out_dtype,
            layer.backend, layer.kernel)


def _consistent(layers, experts: Sequence[int]) -> bool:
    """Whether every expert in `experts` is exact and has the first one's widths, every part
    alike: what one grouped call needs (an expert held elsewhere is not exact here)."""
    if not all(_exact(layers[e]) for e in experts):
        return False
    want = _widths(layers[experts[0]][0])
    return all(_exact(layers[e]) and all(_widths(layer) == want for layer in layers[e])
               for e in experts)


def _project(kernel, layers, x: torch.Tensor, routing: Routing, gather: bool, workspace=None,
             out_format=None):
    """y as `projection` gives it (in `workspace` where given; in `out_format` where given, else
    the layers'), or None where the experts differ in widths or the loop must give a non-finite
    scale's NaN rows. A kernel that reads layers
    (the CPU's): each routed expert's buffers checked and read in place, its slow rows spliced
    in from `wide` (as a layer's forward), a non-finite x raised. One that reads buffers (the
    GPU's): every output on the device, nothing read back (grouped_launch)."""
    if kernel.reads == "buffers":
        held = [e for e, parts in enumerate(layers) if _exact(parts)]
        if not _consistent(layers, held):
            return None
        first = layers[held[0]][0]
        x, out_format = first.checked_input(x, x.device, out_format and torch_dtype(out_format))
        buffers = [[layer.checked_buffers() for layer in parts] if _exact(parts)
                   else [None] * len(parts) for parts in layers]
        if any(b[0].device != x.device for parts in buffers for b in parts if b is not None):
            raise ContractValueError(f"x is on {x.device}, an expert's buffers elsewhere: move "
                                     f"one")
        return kernel.run_grouped(x, routing, buffers, first.bits, first.act_bits, out_format,
                                  gather, workspace)[0]
    offsets = routing.offsets.tolist()
    experts = [e for e in range(routing.experts) if offsets[e + 1] > offsets[e]]
    if experts and not _consistent(layers, experts):
        return None
    first = layers[experts[0]][0] if experts else _local(layers)[0]
    x, out_format = first.checked_input(x, x.device, out_format and torch_dtype(out_format))
    if not experts:
        return x.new_empty((0, len(layers[0]) * first.out_features), dtype=torch_dtype(
            out_format))
    weights = {e: [layer.weights() for layer in layers[e]] for e in experts}  # buffer checks
    if any(w.packed.device != x.device for e in experts for w in weights[e]):
        raise ContractValueError(f"x is on {x.device}, an expert's buffers elsewhere: move one")
    items = [None] * routing.experts
    for e in experts:
        items[e] = [(w, kernel.prepare(w)) for w in weights[e]]
    y, _ = kernel.run_grouped(x, routing, items, first.bits, first.act_bits, out_format, gather,
                              workspace)
    found = {e: [prepared.found() for _, prepared in items[e]] for e in experts}
    if any(nan.numel() for e in experts for _, nan in found[e]):
        return None  # a non-finite scale written in place: the loop's NaN rows
    for e in experts:  # the slow rows of each expert, from `wide` (as a layer's forward)
        for p, (w, (slow, _)) in enumerate(zip(weights[e], found[e], strict=True)):
            if slow.numel():
                rows = slice(offsets[e], offsets[e + 1])
                source = x[routing.token[rows]] if gather else x[rows]
                splice_slow_rows(y, source, w, slow, out_format, rows, p * first.out_features)
    return y


def _project_per_expert(layers, x: torch.Tensor, routing: Routing, gather: bool) -> torch.Tensor:
    """`projection`'s y by each routed expert's layers, one by one, over its own rows."""
    offsets = routing.offsets.tolist()
    first = (_local(layers) or layers[0])[0]
    n, dtype = first.out_features, getattr(first, "out_dtype", None) or x.dtype
    y = torch.zeros((routing.tokens * routing.top_k, len(layers[0]) * n), dtype=dtype,
                    device=x.device)
    for e in range(routing.experts):
        rows = slice(offsets[e], offsets[e + 1])
        if rows.start < rows.stop:
            source = x[routing.token[rows]] if gather else x[rows]
            for p, layer in enumerate(layers[e]):
                y[rows, p * n:(p + 1) * n] = layer(source)
    return y
