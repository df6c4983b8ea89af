"""A tiny Kimi K2 checkpoint that vLLM can serve: transformers' DeepseekV3 with Kimi's
architecture (MLA, the noaux_tc router with its correction bias, shared experts, a dense first
layer), bf16 everywhere but the routed experts, which are int4 as Kimi ships them
(compressed-tensors' own compressor: tests/hf_checkpoints.py). A word-level tokenizer built with
the `tokenizers` package and a chat template, so that the server runs text in, text out.

vLLM's CPU attention wants MLA's head dimension 576 (kv_lora_rank 512 + qk_rope_head_dim 64),
and without "topk_method": "noaux_tc" it would not ask for the router's bias."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.hf_checkpoints import checkpoint_tensors, tiny_model
from tests.kimi_checkpoints import QUANT_CONFIG
from tests.shards import write_shards

VOCAB = 512
TINY = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
            n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
            first_k_dense_replace=1, n_group=1, topk_group=1, kv_lora_rank=512,
            q_lora_rank=64, qk_rope_head_dim=64, v_head_dim=32, qk_nope_head_dim=32,
            max_position_embeddings=256, tie_word_embeddings=False, routed_scaling_factor=2.827,
            norm_topk_prob=True, scoring_func="sigmoid", topk_method="noaux_tc",
            bos_token_id=0, eos_token_id=1, pad_token_id=2)
SPECIAL = ["<s>", "</s>", "<pad>", "<unk>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def routed_experts_layers() -> list[int]:
    return list(range(TINY["first_k_dense_replace"], TINY["num_hidden_layers"]))


def write(directory: Path, seed: int = 0, tokenizer: bool = True, **overrides) -> Path:
    """The checkpoint in `directory` (config.json, shards with an index, the tokenizer)."""
    directory.mkdir(parents=True, exist_ok=True)
    config = {**TINY, **overrides}
    model = tiny_model(seed, config)
    with torch.no_grad():  # transformers leaves the router's bias uninitialised too
        for module in model.modules():
            if hasattr(module, "e_score_correction_bias"):
                module.e_score_correction_bias.normal_(0, 0.01)
    tensors = checkpoint_tensors(model)
    tensors = {n: t for n, t in tensors.items() if "rotary_emb" not in n}
    write_shards(directory, tensors, 2)
    (directory / "config.json").write_text(json.dumps({
        "model_type": "kimi_k2", "architectures": ["DeepseekV3ForCausalLM"],
        "torch_dtype": "bfloat16", **config, "quantization_config": QUANT_CONFIG}))
    if tokenizer:
        write_tokenizer(directory)
    return directory


def write_tokenizer(directory: Path) -> None:
    """A word-level tokenizer: the special tokens, then w0, w1, ... up to the vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = SPECIAL + [f"w{i}" for i in range(VOCAB - len(SPECIAL))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(SPECIAL)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "pad_token": "<pad>", "unk_token": "<unk>", "chat_template": CHAT_TEMPLATE,
        "model_max_length": TINY["max_position_embeddings"]}))
