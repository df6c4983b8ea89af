"""Tiny Kimi K2 / K2.5 checkpoints made from transformers' own DeepseekV3ForCausalLM: every
tensor as the model has it (bf16), but the fused routed experts split per expert and int4
group-32 quantized by compressed-tensors' own compressor, in several shards with an index."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from tests.kimi_checkpoints import QUANT_CONFIG, compressed
from tests.shards import write_shards

TINY = dict(vocab_size=256, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
            n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
            first_k_dense_replace=1, n_group=1, topk_group=1, kv_lora_rank=32, q_lora_rank=64,
            qk_rope_head_dim=16, v_head_dim=32, qk_nope_head_dim=32,
            max_position_embeddings=128, tie_word_embeddings=False)


def tiny_model(seed: int = 0, fields: dict | None = None) -> DeepseekV3ForCausalLM:
    """transformers' DeepseekV3 of `fields` (default TINY), bf16, its experts given weights."""
    torch.manual_seed(seed)
    config = DeepseekV3Config(**(fields or TINY))
    model = DeepseekV3ForCausalLM(config).to(torch.bfloat16).eval()
    # the rotary frequencies stay fp32, as they are computed (a cast of the model rounds them)
    model.model.rotary_emb = type(model.model.rotary_emb)(config)
    with torch.no_grad():  # transformers leaves the experts uninitialised: give them weights
        for module in model.modules():
            if hasattr(module, "gate_up_proj"):
                module.gate_up_proj.normal_(0, 0.05)
                module.down_proj.normal_(0, 0.05)
    return model


def checkpoint_tensors(model: DeepseekV3ForCausalLM) -> dict[str, torch.Tensor]:
    """The model's state as Kimi's checkpoint stores it: experts.E.{gate,up,down}_proj int4."""
    tensors = {}
    for name, t in model.state_dict().items():
        if name.endswith("mlp.experts.gate_up_proj"):
            base, inter = name.removesuffix(".gate_up_proj"), t.shape[1] // 2
            for e in range(t.shape[0]):
                for proj, w in (("gate", t[e, :inter]), ("up", t[e, inter:])):
                    tensors.update({f"{base}.{e}.{proj}_proj.{k}": v
                                    for k, v in compressed(w).items()})
        elif name.endswith("mlp.experts.down_proj"):
            base = name.removesuffix(".down_proj")
            for e in range(t.shape[0]):
                tensors.update({f"{base}.{e}.down_proj.{k}": v
                                for k, v in compressed(t[e]).items()})
        else:
            tensors[name] = t.contiguous()
    return tensors


def write(directory: Path, model: DeepseekV3ForCausalLM, *, k25: bool = False,
          shards: int = 3, extra: dict | None = None) -> Path:
    """A K2 (`kimi_k2`, flat config) or K2.5 (`kimi_k25`, text under language_model.) layout."""
    directory.mkdir(parents=True, exist_ok=True)
    prefix = "language_model." if k25 else ""
    tensors = {prefix + n: t for n, t in checkpoint_tensors(model).items()} | (extra or {})
    write_shards(directory, tensors, shards)
    text = {**TINY, "quantization_config": QUANT_CONFIG}
    config = ({"model_type": "kimi_k25", "text_config": {"model_type": "deepseek_v3", **text}}
              if k25 else {"model_type": "kimi_k2", **text})
    (directory / "config.json").write_text(json.dumps(config))
    return directory
