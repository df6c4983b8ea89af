"""A checkpoint the plugin cannot serve exactly fails vLLM's engine start with exactness's typed
error, naming the tensor or the config field; a config with other bits or asymmetric scales is
refused by name, never served lossy. Each starts a real engine (tests/vllm/engine.py)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.vllm import engine, kimi_tiny

EXPERT = "model.layers.2.mlp.experts.3"


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    return kimi_tiny.write(tmp_path_factory.mktemp("good") / "model", tokenizer=False)


def copy(good, tmp_path):
    target = tmp_path / "model"
    target.mkdir()
    for f in good.iterdir():
        (target / f.name).write_bytes(f.read_bytes())
    return target


def edit_tensor(model, name: str, change) -> None:
    """Tensor `name` of the checkpoint replaced by change(it), or removed where that is None."""
    index_file = model / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    shard = model / index["weight_map"][name]
    tensors = load_file(str(shard))
    new = change(tensors.pop(name))
    if new is None:
        del index["weight_map"][name]
        index_file.write_text(json.dumps(index))
    else:
        tensors[name] = new
    save_file(tensors, str(shard))


def edit_config(model, change, part=("config_groups", "group_0", "weights")) -> None:
    path = model / "config.json"
    config = json.loads(path.read_text())
    at = config["quantization_config"]
    for key in part:
        at = at[key]
    change(at)
    path.write_text(json.dumps(config))


def quantized_shared_experts(model) -> None:
    edit_config(model, lambda c: c.update(ignore=[i for i in c["ignore"] if "shared" not in i]),
                part=())


def with_inf(t: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    t[5, 1] = math.inf
    return t


CASES = {
    "a missing scale": (lambda m: edit_tensor(m, f"{EXPERT}.up_proj.weight_scale", lambda t: None),
                        "KimiCheckpointError", f"{EXPERT}.up_proj.weight_scale: missing"),
    "a wrong shape": (lambda m: edit_tensor(m, f"{EXPERT}.down_proj.weight_packed",
                                            lambda t: t[:, :-1].contiguous()),
                      "ShapeError", f"{EXPERT}.down_proj.weight_packed: shape (256, 15)"),
    "scales of groups of 64": (lambda m: edit_tensor(m, f"{EXPERT}.gate_proj.weight_scale",
                                                     lambda t: t[:, ::2].contiguous()),
                               "ShapeError", f"{EXPERT}.gate_proj.weight_scale: shape (128, 4)"),
    "a non-finite scale": (lambda m: edit_tensor(m, f"{EXPERT}.gate_proj.weight_scale", with_inf),
                           "NonFiniteError", f"{EXPERT}.gate_proj.weight_scale"),
    "a config of group 64": (lambda m: edit_config(m, lambda w: w.update(group_size=64)),
                             "RefusedConfigError", "weights.group_size = 64, expected 32"),
    "a config of 8 bits": (lambda m: edit_config(m, lambda w: w.update(num_bits=8)),
                           "RefusedConfigError", "weights.num_bits = 8, expected 4"),
    "asymmetric scales": (lambda m: edit_config(m, lambda w: w.update(symmetric=False)),
                          "RefusedConfigError", "weights.symmetric = False, expected True"),
    "a quantized Linear beside the experts": (quantized_shared_experts, "KimiCheckpointError",
                                              "shared_experts.gate_up_proj: quantized in the "
                                              "checkpoint"),
}


@pytest.mark.parametrize("case", CASES)
def test_a_checkpoint_it_cannot_serve_exactly_fails_the_start_naming_why(case, good, tmp_path):
    spoil, error, names = CASES[case]
    model = copy(good, tmp_path)
    spoil(model)
    done = engine.run(model, tmp_path / "out")
    assert done.returncode != 0
    assert error in done.stderr and names in done.stderr, done.stderr[-3000:]
