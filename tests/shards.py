"""Tensors written as a sharded safetensors checkpoint, as transformers names the files: the one
writer of the tests' checkpoints and bench/bench_load.py's (no import here a GPU machine lacks)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def write_shards(directory: Path, tensors: dict[str, torch.Tensor], shards: int) -> None:
    """`tensors` in `shards` files, model-0000i-of-0000n.safetensors (the sorted names dealt out
    in turn), and model.safetensors.index.json listing each tensor's file."""
    names, weight_map = sorted(tensors), {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n] for n in names[s::shards]}, str(directory / file))
        weight_map.update(dict.fromkeys(names[s::shards], file))
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}))
