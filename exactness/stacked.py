"""An MoE layer's routed experts held stacked, as serving stacks keep them (vLLM's fused MoE):
gate and up of every expert in one tensor, down in another, each expert's slice in the
checkpoint's own layout.

    w13_packed [E, 2 I, H / 8] int32   expert e's gate rows, then its up rows
    w13_scale  [E, 2 I, H / 32] bf16
    w2_packed  [E, H, I / 8] int32     expert e's down
    w2_scale   [E, H, I / 32] bf16

`stacked_experts` is one torch custom op over them, `exactness::stacked_experts`: the layer's
ExactExperts (kimi.experts) over views of the stacked tensors, so one grouped kernel call per
projection, the exact or the transformers block, and the per-expert loop where that one cannot
run. Nothing is copied: the views read the tensors in place, so a write into them (a weight
loader's copy_) is seen at the next call. The views are kept per layer name, keyed on everything
they are built from (the tensors' storage, shapes, strides, dtypes, device and the widths), and
built again when any of it changes.

EXACTNESS_CAPTURE=DIR writes each call's inputs and output to DIR, one file a call: how the
tests read the bits of every MoE layer inside a running engine (tests/vllm/).
"""

from __future__ import annotations

import itertools
import os
import threading
from pathlib import Path

import torch
from torch import nn

from .contract import DEFAULT_ACT_BITS, ContractTypeError, ShapeError, check_act_bits
from .glue import check_block
from .kimi.checkpoint import install
from .kimi.experts import ExactExperts

CAPTURE_ENV = "EXACTNESS_CAPTURE"
STACKED_KEYS = ("w13_packed", "w13_scale", "w2_packed", "w2_scale")

_VIEWS: dict[str, tuple[tuple, ExactExperts]] = {}  # layer name -> (its key, its experts)
_LOCK = threading.Lock()
_CALLS = itertools.count()


def stacked_shapes(experts: int, hidden: int, inter: int) -> dict[str, tuple]:
    """{stacked tensor: its shape} for `experts` experts of hidden size H, intermediate I."""
    return {"w13_packed": (experts, 2 * inter, hidden // 8),
            "w13_scale": (experts, 2 * inter, hidden // 32),
            "w2_packed": (experts, hidden, inter // 8),
            "w2_scale": (experts, hidden, inter // 32)}


def stacked_dtype(key: str) -> torch.dtype:
    """The format's dtype of a stacked tensor: int32 words, bf16 scales."""
    return torch.int32 if key.endswith("packed") else torch.bfloat16


def check_stacked(tensors: dict[str, torch.Tensor]) -> tuple[int, int, int]:
    """(E, H, I) of the stacked tensors, or a typed error naming the one that disagrees."""
    packed = tensors["w13_packed"]
    if packed.dim() != 3:
        raise ShapeError(f"w13_packed: shape {tuple(packed.shape)}, expected [E, 2 I, H / 8]")
    experts, hidden, inter = packed.shape[0], packed.shape[2] * 8, packed.shape[1] // 2
    for name, shape in stacked_shapes(experts, hidden, inter).items():
        t, want = tensors[name], stacked_dtype(name)
        if t.dtype != want:
            raise ContractTypeError(f"{name}: dtype {t.dtype}, expected {want}")
        if tuple(t.shape) != shape:
            raise ShapeError(f"{name}: shape {tuple(t.shape)}, expected {shape} (E={experts}, "
                             f"H={hidden}, I={inter})")
    return experts, hidden, inter


def experts_of(name: str, tensors: dict[str, torch.Tensor], act_bits: int = DEFAULT_ACT_BITS,
               block: str = "exact") -> ExactExperts:
    """Layer `name`'s ExactExperts over views of its stacked tensors (the module's doc): the
    ones kept for it, unless anything they were built from has changed."""
    key = view_key(tensors, act_bits, block)
    with _LOCK:
        kept = _VIEWS.get(name)
        if kept is not None and kept[0] == key:
            return kept[1]
    check_act_bits(act_bits)
    experts, hidden, inter = check_stacked(tensors)
    device = tensors["w13_packed"].device
    module = ExactExperts(experts, hidden, inter, nn.functional.silu, act_bits, device="meta",
                          block=check_block(block))
    # one weight_shape tensor per projection's shape, shared by every expert's layer
    gate_shape = torch.tensor([inter, hidden], dtype=torch.int64, device=device)
    down_shape = torch.tensor([hidden, inter], dtype=torch.int64, device=device)
    w13p, w13s, w2p, w2s = (tensors[k] for k in STACKED_KEYS)
    for e, expert in enumerate(module):
        for layer, rows in ((expert.gate_proj, slice(0, inter)),
                            (expert.up_proj, slice(inter, 2 * inter))):
            install(layer, {"weight_packed": w13p[e, rows], "weight_scale": w13s[e, rows],
                            "weight_shape": gate_shape})
        install(expert.down_proj, {"weight_packed": w2p[e], "weight_scale": w2s[e],
                                   "weight_shape": down_shape})
    with _LOCK:
        _VIEWS[name] = (key, module)
    return module


def view_key(tensors: dict[str, torch.Tensor], act_bits: int, block: str) -> tuple:
    """What a layer's views are built from: each stacked tensor's storage (kept alive by the
    views, so its address is not reused while they are kept), shape, strides, dtype and device,
    and the widths and block."""
    return tuple((t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device)
                 for t in (tensors[k] for k in STACKED_KEYS)) + (act_bits, block)


def forget(name: str | None = None) -> None:
    """Drop the views kept for layer `name` (every layer's where None)."""
    with _LOCK:
        if name is None:
            _VIEWS.clear()
        else:
            _VIEWS.pop(name, None)


@torch.library.custom_op("exactness::stacked_experts", mutates_args=())
def stacked_experts(x: torch.Tensor, top_k_ids: torch.Tensor, top_k_weights: torch.Tensor,
                    w13_packed: torch.Tensor, w13_scale: torch.Tensor, w2_packed: torch.Tensor,
                    w2_scale: torch.Tensor, act_bits: int, block: str, name: str) -> torch.Tensor:
    """The routed experts' weighted sum [T, H] in x's dtype: x [T, H], top_k_ids [T, top_k]
    (ids in [0, E], E for "no expert": a token's expert held by another rank), top_k_weights
    [T, top_k]; `name` names the layer (its views, its captures)."""
    tensors = dict(zip(STACKED_KEYS, (w13_packed, w13_scale, w2_packed, w2_scale), strict=True))
    experts = experts_of(name, tensors, act_bits, block)
    out = experts(x, top_k_ids, top_k_weights)
    capture(name, x, top_k_ids, top_k_weights, out)
    return out


@stacked_experts.register_fake
def _fake(x, top_k_ids, top_k_weights, w13_packed, w13_scale, w2_packed, w2_scale, act_bits,
          block, name):
    return torch.empty_like(x)


def capture(name: str, x, ids, weights, out) -> None:
    """Where EXACTNESS_CAPTURE names a directory: this call's inputs and output, in a file of
    its own (process id, call number), for the tests that check an engine's bits."""
    directory = os.environ.get(CAPTURE_ENV)
    if not directory:
        return
    path = Path(directory) / f"{os.getpid()}-{next(_CALLS):06d}.pt"
    torch.save({"layer": name, "x": x.detach().cpu(), "ids": ids.cpu(),
                "weights": weights.cpu(), "out": out.detach().cpu()}, path)
