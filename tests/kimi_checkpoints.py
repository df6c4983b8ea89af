"""Kimi-format checkpoints written by the tests themselves, in the real layout: the int4 tensors
by compressed-tensors' own compressor (so the format is the peer's), several shards, an index,
a config.json with the quantization_config (K2 Thinking flat, or K2.5 nested)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from safetensors.torch import save_file

from exactness.kimi.checkpoint import KIMI_QUANTIZATION_CONFIG
from tests.shards import write_shards

SCHEME = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
    num_bits=4, type="int", symmetric=True, strategy="group", group_size=32))
QUANT_CONFIG = KIMI_QUANTIZATION_CONFIG


def compressed(w: torch.Tensor) -> dict:
    """w [N, K] as compressed-tensors writes a routed-expert projection: int4 group-32, QAT-like
    bf16 scales (the group's max over 7)."""
    n, k = w.shape
    w = w.bfloat16()
    scale = (w.float().abs().view(n, k // 32, 32).amax(-1) / 7).clamp(min=1e-8).bfloat16()
    return {key: t.contiguous() for key, t in PackedQuantizationCompressor.compress(
        {"weight": w, "weight_scale": scale}, SCHEME).items()}


def compressed_projection(n: int, k: int, generator: torch.Generator) -> dict:
    """A random routed-expert projection, compressed."""
    return compressed(torch.randn(n, k, generator=generator) * 0.02)


def write_checkpoint(directory: Path, *, hidden: int = 64, inter: int = 32,
                     layers: dict[int, list[int]] | None = None, k25: bool = False,
                     shards: int = 2, seed: int = 0, dense: bool = True,
                     single_file: bool = False) -> Path:
    """single_file: one model.safetensors and no index (the reader lists its header instead)."""
    directory.mkdir(parents=True, exist_ok=True)
    layers = layers or {1: [0, 1, 2, 3]}
    prefix = "language_model." if k25 else ""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer, experts in layers.items():
        for e in experts:
            for proj, (n, k) in (("gate", (inter, hidden)), ("up", (inter, hidden)),
                                 ("down", (hidden, inter))):
                name = f"{prefix}model.layers.{layer}.mlp.experts.{e}.{proj}_proj"
                for key, t in compressed_projection(n, k, g).items():
                    tensors[f"{name}.{key}"] = t.contiguous()
        if dense:  # shared experts stay bf16 in the checkpoint
            for proj, (n, k) in (("gate", (inter, hidden)), ("up", (inter, hidden)),
                                 ("down", (hidden, inter))):
                tensors[f"{prefix}model.layers.{layer}.mlp.shared_experts.{proj}_proj.weight"] = (
                    torch.randn(n, k, generator=g) * 0.02).bfloat16()
    if single_file:
        save_file(tensors, str(directory / "model.safetensors"))
    else:
        write_shards(directory, tensors, shards)
    text = {"hidden_size": hidden, "moe_intermediate_size": inter, "intermediate_size": 2 * hidden,
            "n_routed_experts": max(e for ex in layers.values() for e in ex) + 1,
            "num_experts_per_tok": 2, "num_hidden_layers": max(layers) + 1,
            "first_k_dense_replace": 1, "quantization_config": QUANT_CONFIG}
    config = {"model_type": "kimi_k25", "text_config": text} if k25 else {
        "model_type": "kimi_k2", **text}
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def split_safetensors(data: bytes) -> tuple[dict, bytes]:
    """A safetensors file's header (parsed) and the bytes after it."""
    length = int.from_bytes(data[:8], "little")
    return json.loads(data[8:8 + length]), data[8 + length:]


def join_safetensors(header, payload: bytes) -> bytes:
    """The file with this header (any JSON value) before `payload`, length prefix made right."""
    raw = json.dumps(header).encode()
    return len(raw).to_bytes(8, "little") + raw + payload
