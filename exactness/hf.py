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
    is_fused_experts,
    replace_module,
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
                    dtype: torch.dtype = torch.bfloat16) -> DeepseekV3ForCausalLM:
    """A Kimi K2 / K2.5 checkpoint (compressed-tensors pack-quantized experts) as transformers'
    DeepseekV3ForCausalLM with exact routed experts. Reads each tensor once; raises
    KimiCheckpointError naming the file and tensor for anything it cannot load as stored."""
    checkpoint = KimiCheckpoint(path)
    try:
        prefix = K25_TEXT if checkpoint.raw_config.get("model_type") == "kimi_k25" else ""
        config = text_config(checkpoint.raw_config, str(checkpoint.dir / "config.json"))
        with torch.device("meta"):
            model = DeepseekV3ForCausalLM(config).to(dtype)
        for name, module in list(model.named_modules()):
            if is_fused_experts(module):
                replace_module(model, name, ExactExperts.like(module, act_bits, device="meta"))
        state, skipped = _read_state(model, checkpoint, prefix)
    finally:
        checkpoint.close()
    model.load_state_dict(state, strict=True, assign=True)
    _materialize_rotary(model, config)
    model.exactness_skipped = skipped
    return model.to(device).eval()


def _read_state(model: nn.Module, checkpoint: KimiCheckpoint,
                prefix: str) -> tuple[dict, list[str]]:
    """Every persistent tensor of `model` from the checkpoint (routed projections checked by
    check_packed first, every other tensor against its header's shape), and the checkpoint's
    names outside `prefix` (K2.5's vision tower). Raises for a tensor missing or left over."""
    expected = model.state_dict()
    routed = {name: m for name, m in model.named_modules() if isinstance(m, PackedInt4Linear)}
    for name, layer in routed.items():  # all header checks before the first packed byte
        checkpoint.check_packed(layer, prefix + name)
    state, taken = {}, set()
    for name in expected:
        module, _, key = name.rpartition(".")
        stored = prefix + name
        if module in routed and key in PACKED_KEYS:
            stored = checkpoint.name_for(prefix + module, key)
        elif stored not in checkpoint.weight_map:
            raise KimiCheckpointError(f"{checkpoint.index_file}: {stored!r}: missing, but the "
                                      f"model has {name!r}")
        tensor = checkpoint.read(stored)
        if key not in PACKED_KEYS and tuple(tensor.shape) != tuple(expected[name].shape):
            raise KimiCheckpointError(f"{checkpoint.dir / checkpoint.weight_map[stored]}: "
                                      f"{stored!r}: shape {tuple(tensor.shape)}, the model's "
                                      f"{name} is {tuple(expected[name].shape)}")
        state[name] = tensor
        taken.add(stored)
    left = sorted(n for n in checkpoint.weight_map if n not in taken and n.startswith(prefix))
    if left:
        raise KimiCheckpointError(f"{checkpoint.index_file}: {len(left)} tensors no module of "
                                  f"the model takes, e.g. {left[:3]}")
    return state, sorted(n for n in checkpoint.weight_map if not n.startswith(prefix))


def _materialize_rotary(model: nn.Module, config: DeepseekV3Config) -> None:
    """The rotary embedding's buffers are computed, not stored: built again off the meta
    device. Any other tensor still on meta is an error, never a silent placeholder."""
    with torch.device("cpu"):
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
        return from_pretrained(path, act_bits, device=device)


def register() -> None:
    """Map `kimi_k2` to DeepseekV3 in transformers' AutoConfig and AutoModelForCausalLM."""
    AutoConfig.register("kimi_k2", KimiK2Config, exist_ok=True)
    AutoModelForCausalLM.register(KimiK2Config, ExactKimiK2ForCausalLM, exist_ok=True)
