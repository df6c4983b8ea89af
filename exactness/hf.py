"""The transformers integration: DeepseekV3 / Kimi K2 (K2 Thinking) and Kimi K2.5 with exact
routed experts; everything else (attention, router, shared experts, the dense MLP, lm_head)
stays transformers' own, in bf16.

- `ExactExperts` takes the place of transformers' fused `DeepseekV3Experts` with the same call,
  `experts(hidden_states, top_k_index, top_k_weights)`. Each expert's gate, up and down
  projection is a `PackedInt4Linear`, holding the checkpoint's tensors as they are stored.
- `from_pretrained(path)` builds the model on the meta device, swaps in exact experts, and
  loads every tensor from the shards through the Kimi reader (kimi.KimiCheckpoint): checked
  against the headers first, the int4 words never decoded. A checkpoint tensor that no module
  takes, or a module no tensor fills, raises KimiCheckpointError.
- `register()` maps the `kimi_k2` model type to DeepseekV3 for transformers' Auto classes, so
  that `AutoModelForCausalLM.from_pretrained(path)` loads exact experts too.

K2.5 loads as its text model (`DeepseekV3ForCausalLM` over `language_model.*`); the vision
tower's tensors are left on disk and listed in the model's `exactness_skipped`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

from .contract import DEFAULT_ACT_BITS
from .kimi import (
    PACKED_KEYS,
    ExactExperts,
    KimiCheckpoint,
    KimiCheckpointError,
    by_projection,
    check_mmap_device,
    install,
    is_fused_experts,
    local_experts,
    make_remote,
    register_experts,
    replace_module,
    routed_reads,
)
from .modules import PackedInt4Linear

K25_TEXT = "language_model."  # where K2.5's checkpoint keeps its text model


def text_config(raw: dict, where: str) -> DeepseekV3Config:
    """The DeepseekV3 config of a Kimi K2 (`kimi_k2`, flat) or K2.5 (`text_config`) config.json;
    quantization_config is the reader's, not transformers' (which would decompress)."""
    text = raw.get("text_config", raw) if raw.get("model_type") == "kimi_k25" else raw
    fields = {k: v for k, v in text.items()
              if k not in ("quantization_config", "model_type", "architectures", "auto_map")}
    try:
        return DeepseekV3Config(**fields)
    except (TypeError, ValueError) as e:
        raise KimiCheckpointError(f"{where}: not a DeepseekV3 text config ({e})") from e


def from_pretrained(path: str | Path, act_bits: int = DEFAULT_ACT_BITS, *, device="cpu",
                    dtype: torch.dtype = torch.bfloat16,
                    experts: Callable[[int, int], bool] | None = None, rank: int | None = None,
                    world: int | None = None, mmap: bool = False,
                    progress: bool | None = None, block: str = "exact") -> DeepseekV3ForCausalLM:
    """A Kimi K2 / K2.5 checkpoint (compressed-tensors pack-quantized experts) as transformers'
    DeepseekV3ForCausalLM with exact routed experts. Every header is checked first, then each
    tensor streams from the mapped shards to `device`, checked as it is read; raises
    KimiCheckpointError naming the file and tensor for anything it cannot load as stored.
    `experts=`, `rank=`/`world=`, `mmap=`, `progress=` and `block=` as in
    kimi.convert_kimi_to_exact; the experts held elsewhere are listed in the model's
    `exactness_remote`."""
    checkpoint = KimiCheckpoint(path)
    try:
        prefix = K25_TEXT if checkpoint.raw_config.get("model_type") == "kimi_k25" else ""
        config = text_config(checkpoint.raw_config, str(checkpoint.dir / "config.json"))
        local = local_experts(experts, rank, world, checkpoint.config.n_routed_experts)
        check_mmap_device(mmap, device)
        with torch.device("meta"):
            model = DeepseekV3ForCausalLM(config).to(dtype)
        routed, parents, remote = {}, {}, []
        for name, module in list(model.named_modules()):
            if is_fused_experts(module):
                new = ExactExperts.like(module, act_bits, device="meta", block=block)
                replace_module(model, name, new)
                register_experts(name, new, parents, routed)
        if local is not None:
            remote = make_remote(routed, local, parents, {})
        state, skipped = _read_state(model, checkpoint, prefix, routed, remote, device, mmap,
                                     progress)
    finally:
        checkpoint.close()
    for name, layer in routed.items():
        install(layer, state.pop(name))
    model.load_state_dict(state, strict=False, assign=True)  # every key: _read_state
    _materialize_rotary(model, config, device)
    model.exactness_skipped, model.exactness_remote = skipped, remote
    return model.to(device).eval()


def _read_state(model: nn.Module, checkpoint: KimiCheckpoint, prefix: str,
                routed: dict[str, PackedInt4Linear], remote: list[str], device, mmap: bool,
                progress: bool | None) -> tuple[dict, list[str]]:
    """Every persistent tensor of `model` from the checkpoint, in one stream: {projection: its
    three tensors} for the `routed` layers (kimi.routed_reads), {key: tensor} for the rest, each
    checked against its header before any is read. And the checkpoint's names outside `prefix`
    (K2.5's vision tower). Raises for a tensor missing or left over (those of `remote` experts
    are left on disk on purpose)."""
    wanted = {}
    for name, tensor in model.state_dict().items():
        module, _, key = name.rpartition(".")
        if module in routed and key in PACKED_KEYS:
            continue
        stored = prefix + name
        if stored not in checkpoint.weight_map:
            raise KimiCheckpointError(f"{checkpoint.index_file}: {stored!r}: missing, but the "
                                      f"model has {name!r}")
        shard, entry = checkpoint.entry(stored)
        if entry.shape != tuple(tensor.shape):
            raise KimiCheckpointError(f"{shard.path}: {stored!r}: shape {entry.shape}, the "
                                      f"model's {name} is {tuple(tensor.shape)}")
        wanted[name] = stored
    taken = set(wanted.values())
    for name in list(routed) + [f"{e}.{p}_proj" for e in remote for p in ("gate", "up", "down")]:
        for key in PACKED_KEYS:
            try:
                taken.add(checkpoint.name_for(prefix + name, key))
            except KimiCheckpointError:
                if name in routed:
                    raise
    left = sorted(n for n in checkpoint.weight_map if n not in taken and n.startswith(prefix))
    if left:
        raise KimiCheckpointError(f"{checkpoint.index_file}: {len(left)} tensors no module of "
                                  f"the model takes, e.g. {left[:3]}")
    reads, check = routed_reads(checkpoint, {prefix + n: layer for n, layer in routed.items()})
    tensors = checkpoint.stream({**reads, **wanted}, device=device, mapped=mmap,
                                progress=progress,
                                check=lambda key, t: check(key, t) if key in reads else None)
    state = {name.removeprefix(prefix): three for name, three in by_projection(
        {key: tensors.pop(key) for key in reads}).items()}
    state.update(tensors)
    return state, sorted(n for n in checkpoint.weight_map if not n.startswith(prefix))


def _materialize_rotary(model: nn.Module, config: DeepseekV3Config, device) -> None:
    """The rotary embedding's buffers are computed, not stored: built again off the meta
    device. Any other tensor still on meta is an error, never a silent placeholder."""
    with torch.device(device):
        model.model.rotary_emb = type(model.model.rotary_emb)(config)
    left = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if left:
        raise KimiCheckpointError(f"no tensor loaded for {left[:3]} ({len(left)} in all)")


class KimiK2Config(DeepseekV3Config):
    """Kimi K2 / K2 Thinking's `kimi_k2`: a DeepseekV3."""

    model_type = "kimi_k2"


class ExactKimiK2ForCausalLM(DeepseekV3ForCausalLM):
    """What AutoModelForCausalLM builds for `kimi_k2` once `register()` ran: exact experts."""

    config_class = KimiK2Config

    @classmethod
    def from_pretrained(cls, path, *args, act_bits: int = DEFAULT_ACT_BITS, device="cpu",
                        **kwargs) -> DeepseekV3ForCausalLM:
        options = ("dtype", "experts", "rank", "world", "mmap", "progress", "block")
        return from_pretrained(path, act_bits, device=device,
                               **{k: v for k, v in kwargs.items() if k in options})


def register() -> None:
    """Map `kimi_k2` to DeepseekV3 in transformers' AutoConfig and AutoModelForCausalLM."""
    AutoConfig.register("kimi_k2", KimiK2Config, exist_ok=True)
    AutoModelForCausalLM.register(KimiK2Config, ExactKimiK2ForCausalLM, exist_ok=True)
