"""Kimi hooks on checkpoints the tests write in the real format (compressed-tensors' compressor)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from exactness import PackedInt4Linear
from exactness.formats import bits_to_tensor, float_bits, tensor_to_bits
from exactness.kimi import (
    KimiCheckpointError,
    KimiConfig,
    KimiK25,
    KimiModel,
    convert_kimi_to_exact,
)
from exactness.suite.reference import reference_linear
from tests.kimi_checkpoints import write_checkpoint

SMALL = dict(hidden_size=64, moe_intermediate_size=32, intermediate_size=128, n_routed_experts=4,
             num_experts_per_tok=2, num_hidden_layers=2)


def reference_output(layer: PackedInt4Linear, x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, layer.in_features)
    y = reference_linear(tensor_to_bits(x2), "bfloat16", layer.weight_packed.numpy(),
                         float_bits(layer.weight_scale).numpy(), act_bits=layer.act_bits)
    return bits_to_tensor(y, "bfloat16").reshape(*x.shape[:-1], layer.out_features)


def experts(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, PackedInt4Linear)}


@pytest.mark.parametrize("k25", [False, True], ids=["k2-thinking", "k2.5"])
def test_checkpoint_loads_and_matches_the_reference(tmp_path, k25):
    ckpt = write_checkpoint(tmp_path / "ckpt", k25=k25, shards=3)
    model = (KimiK25 if k25 else KimiModel)(KimiConfig(**SMALL))
    report = convert_kimi_to_exact(model, ckpt)
    assert report.routed_converted == report.routed_loaded == 12
    assert len(report.left_bf16) == 6  # shared experts and the dense MLP stay bf16
    stored = {}
    for f in ckpt.glob("*.safetensors"):
        stored.update(load_file(str(f)))
    x = torch.randn(5, 64).bfloat16()
    for name, layer in experts(model).items():
        for key in ("weight_packed", "weight_scale"):  # zero conversion: the stored bits
            assert torch.equal(getattr(layer, key), stored[f"{name}.{key}"])
        xin = x if layer.in_features == 64 else torch.randn(5, 32).bfloat16()
        assert torch.equal(layer(xin).view(torch.int16), reference_output(layer, xin).view(
            torch.int16))
    assert report.bytes_read == sum(t.numel() * t.element_size() for n, t in stored.items()
                                    if ".experts." in n)


def test_routed_experts_exact_shared_and_dense_stay_bf16():
    model = KimiModel(KimiConfig(**SMALL))
    assert isinstance(model.model.layers[1].mlp.experts[0].gate_proj, PackedInt4Linear)
    assert type(model.model.layers[1].mlp.shared_experts.up_proj) is nn.Linear
    assert type(model.model.layers[0].mlp.down_proj) is nn.Linear
    off = KimiModel(KimiConfig(**SMALL, use_exact_generators=False))
    assert not experts(off)
    assert experts(KimiModel(KimiConfig(**SMALL, exact_act_bits=8)))[
        "model.layers.1.mlp.experts.0.up_proj"].act_bits == 8


def test_end_to_end_moe_forward_equals_the_reference(tmp_path, monkeypatch):
    ckpt = write_checkpoint(tmp_path / "ckpt")
    torch.manual_seed(0)
    model = KimiModel(KimiConfig(**SMALL))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.05)
    convert_kimi_to_exact(model, ckpt, dense_bits=8)
    x = torch.randn(7, 64).bfloat16()
    got = model(x)
    monkeypatch.setattr(PackedInt4Linear, "forward", reference_output)
    want = model(x)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert torch.count_nonzero(got) > 0
    monkeypatch.undo()
    assert torch.equal(model(x[3:4]).view(torch.int16), got[3:4].view(torch.int16))


def test_full_size_layer(tmp_path):
    """hidden 7168, moe intermediate 2048: loading reads the packed bytes, and they are exact."""
    ckpt = write_checkpoint(tmp_path / "full", hidden=7168, inter=2048, layers={1: [0, 1]},
                            dense=False, shards=2)
    cfg = KimiConfig(hidden_size=7168, moe_intermediate_size=2048, intermediate_size=128,
                     n_routed_experts=2, num_experts_per_tok=1, num_hidden_layers=2)
    model = KimiModel(cfg)
    model.model.layers[0].mlp = nn.Identity()  # the dense layer is not under test here
    report = convert_kimi_to_exact(model, ckpt)
    packed = sum(m.weight_packed.numel() * 4 + m.weight_scale.numel() * 2 + 16
                 for m in experts(model).values())
    assert report.routed_loaded == 6 and report.bytes_read == packed
    assert report.peak_rss_growth <= 1.5 * packed  # in place: no second copy of the experts
    layer = model.model.layers[1].mlp.experts[1].down_proj
    x = torch.randn(2, 2048).bfloat16()
    assert torch.equal(layer(x).view(torch.int16), reference_output(layer, x).view(torch.int16))


# --------------------------------------------------------------------------- bad checkpoints


def corrupt(tmp_path, change):
    ckpt = write_checkpoint(tmp_path / "bad")
    change(ckpt)
    return ckpt


def rewrite_tensor(ckpt: Path, name: str, value):
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    file = ckpt / index[name]
    tensors = load_file(str(file))
    if value is None:
        del tensors[name]
    else:
        tensors[name] = value
    save_file(tensors, str(file))
    return file


NAME = "model.layers.1.mlp.experts.2.up_proj"


@pytest.mark.parametrize("change, error, match", [
    (lambda c: rewrite_tensor(c, f"{NAME}.weight_scale", None), KimiCheckpointError,
     r"weight_scale"),
    (lambda c: rewrite_tensor(c, f"{NAME}.weight_packed", torch.zeros(32, 8, dtype=torch.int64)),
     KimiCheckpointError, r"model-0000\d-of-00002.safetensors: .*up_proj: weight_packed: dtype"),
    (lambda c: rewrite_tensor(c, f"{NAME}.weight_packed", torch.zeros(32, 4, dtype=torch.int32)),
     KimiCheckpointError, r"up_proj: weight_packed: shape \(32, 4\)"),
    (lambda c: rewrite_tensor(c, f"{NAME}.weight_scale", torch.full((32, 2), float("nan"),
                                                                     dtype=torch.bfloat16)),
     KimiCheckpointError, r"up_proj.*non-finite"),
])
def test_bad_tensors_name_the_tensor_and_the_file(tmp_path, change, error, match):
    ckpt = corrupt(tmp_path, change)
    model = KimiModel(KimiConfig(**SMALL))
    before = {n: type(m) for n, m in model.named_modules()}
    with pytest.raises(error, match=match):
        convert_kimi_to_exact(model, ckpt)
    assert {n: type(m) for n, m in model.named_modules()} == before  # nothing half converted


def edit_json(file: Path, edit):
    data = json.loads(file.read_text())
    edit(data)
    file.write_text(json.dumps(data))


def escape(ckpt):
    edit_json(ckpt / "model.safetensors.index.json",
              lambda d: d["weight_map"].update({f"{NAME}.weight_packed": "../../etc/passwd"}))


def truncate(ckpt):
    f = sorted(ckpt.glob("*.safetensors"))[0]
    f.write_bytes(f.read_bytes()[:-100])


def absurd_header(ckpt):
    f = sorted(ckpt.glob("*.safetensors"))[0]
    f.write_bytes((2**60).to_bytes(8, "little") + f.read_bytes()[8:])


def not_int4(ckpt):
    edit_json(ckpt / "config.json", lambda d: d["quantization_config"]["config_groups"][
        "group_0"]["weights"].update({"num_bits": 8}))


@pytest.mark.parametrize("change, match", [
    (escape, r"escapes"),
    (truncate, r"safetensors: .*(tensor|unreadable|truncated)"),
    (absurd_header, r"header claims 1152921504606846976 bytes"),
    (not_int4, r"weights.num_bits = 8, expected 4"),
])
def test_bad_files_are_refused_clearly(tmp_path, change, match):
    ckpt = corrupt(tmp_path, change)
    model = KimiModel(KimiConfig(**SMALL))
    with pytest.raises(KimiCheckpointError, match=match):
        convert_kimi_to_exact(model, ckpt)
    assert not experts(model)["model.layers.1.mlp.experts.0.gate_proj"].weight_scale.any()


# --------------------------------------------------------------------------- the CLI


def kimi_cli(directory, *args):
    return subprocess.run([sys.executable, "-m", "exactness", "kimi", str(directory), *args],
                          capture_output=True, text=True, cwd=Path(__file__).parent.parent)


def test_cli_passes_on_a_good_checkpoint(tmp_path):
    ckpt = write_checkpoint(tmp_path / "ok", k25=True)
    done = kimi_cli(ckpt, "--experts", "1", "2")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "PASSED" in done.stdout and "outputs compared bit for bit" in done.stdout
    assert "experts                           2" in done.stdout


def test_cli_fails_clearly_on_a_corrupted_checkpoint(tmp_path):
    ckpt = corrupt(tmp_path, lambda c: rewrite_tensor(
        c, f"{NAME}.weight_scale", torch.full((32, 2), float("inf"), dtype=torch.bfloat16)))
    done = kimi_cli(ckpt)
    assert done.returncode == 1 and "FAILED" in done.stdout
    assert f"{NAME}" in done.stdout and ".safetensors" in done.stdout
    assert "non-finite" in done.stdout
