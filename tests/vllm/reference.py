"""What the tests compare an engine's captured MoE calls with: exactness's own experts, built
from the checkpoint's files by this process (not from vLLM's tensors), and the exact block's
step-by-step reference (exactness.suite.moe_reference)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from exactness.contract import BFLOAT16
from exactness.formats import tensor_to_bits
from exactness.kimi.experts import ExactExperts
from exactness.suite.cases import MoECase
from exactness.suite.moe_reference import exact_block

LAYER = re.compile(r"layers\.(\d+)\.mlp\.experts$")


def checkpoint_tensors(model: Path) -> dict[str, torch.Tensor]:
    index = json.loads((model / "model.safetensors.index.json").read_text())
    tensors = {}
    for shard in sorted(set(index["weight_map"].values())):
        tensors.update(load_file(str(model / shard)))
    return tensors


def experts_bytes(model: Path) -> int:
    """The checkpoint's bytes of routed-expert words and scales (the int4 format's bulk)."""
    return sum(t.nbytes for n, t in checkpoint_tensors(model).items()
               if ".experts." in n and n.endswith(("weight_packed", "weight_scale")))


def layers_experts(model: Path, layers: list[int], block: str,
                   act_bits: int = 16) -> dict[int, ExactExperts]:
    """Each of `layers`' routed experts as exactness loads them from the checkpoint's files."""
    config = json.loads((model / "config.json").read_text())
    tensors = checkpoint_tensors(model)
    made = {}
    for layer in layers:
        prefix = f"model.layers.{layer}.mlp.experts."
        made[layer] = ExactExperts(config["n_routed_experts"], config["hidden_size"],
                                   config["moe_intermediate_size"], torch.nn.functional.silu,
                                   act_bits, block=block)
        made[layer].load_state_dict({n[len(prefix):]: t for n, t in tensors.items()
                                     if n.startswith(prefix)})
    return made


def captures(directory: Path) -> list[dict]:
    """The calls captured in `directory`, in the order they were made."""
    return [torch.load(p) | {"file": p.name} for p in sorted(directory.glob("*.pt"))]


def layer_of(call: dict) -> int:
    return int(LAYER.search(call["layer"]).group(1))


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def step_by_step(experts: ExactExperts, call: dict) -> np.ndarray:
    """The exact block's output bits for a captured call, by the suite's Python reference."""
    e = len(experts)
    gate_up = torch.cat([torch.cat([x.gate_proj.weight_packed, x.up_proj.weight_packed])
                         for x in experts]).numpy()
    gate_up_scales = tensor_to_bits(torch.cat([torch.cat([x.gate_proj.weight_scale,
                                                          x.up_proj.weight_scale])
                                               for x in experts]))
    down = torch.cat([x.down_proj.weight_packed for x in experts]).numpy()
    down_scales = tensor_to_bits(torch.cat([x.down_proj.weight_scale for x in experts]))
    case = MoECase(tensor_to_bits(call["x"]), BFLOAT16, experts[0].gate_proj.act_bits,
                   call["ids"].to(torch.int64).numpy(), call["weights"].numpy(), e,
                   (gate_up, gate_up_scales), (down, down_scales), "exact")
    return exact_block(case)
