"""Kimi hooks on checkpoints the tests write in the real format (compressed-tensors' compressor)."""

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from exactness import PackedInt4Linear
from exactness.contract import ExactnessError
from exactness.formats import bits_to_tensor, float_bits, tensor_to_bits
from exactness.kimi import (
    KimiCheckpoint,
    KimiCheckpointError,
    KimiConfig,
    KimiK25,
    KimiModel,
    convert_kimi_to_exact,
)
from exactness.kimi import checkpoint as kimi_checkpoint
from exactness.suite.reference import reference_linear
from tests.cli import main_here
from tests.kimi_checkpoints import join_safetensors, split_safetensors, write_checkpoint

pytestmark = pytest.mark.stage("reliability")  # make verify's stage

SMALL = dict(hidden_size=64, moe_intermediate_size=32, intermediate_size=128, n_routed_experts=4,
             num_experts_per_tok=2, num_hidden_layers=2)


def reference_output(layer: PackedInt4Linear, x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, layer.in_features)
    y = reference_linear(tensor_to_bits(x2), "bfloat16", layer.weight_packed.numpy(),
                         float_bits(layer.weight_scale).numpy(), act_bits=layer.act_bits)
    return bits_to_tensor(y, "bfloat16").reshape(*x.shape[:-1], layer.out_features)


def experts(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, PackedInt4Linear)}


@pytest.mark.parametrize("k25, single_file", [(False, False), (True, False), (False, True)],
                         ids=["k2-thinking", "k2.5", "single-file"])
def test_checkpoint_loads_and_matches_the_reference(tmp_path, k25, single_file):
    ckpt = write_checkpoint(tmp_path / "ckpt", k25=k25, shards=3, single_file=single_file)
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
     KimiCheckpointError, r"up_proj: weight_scale has 64 non-finite"),
], ids=["scale-missing", "packed-int64", "packed-too-short", "scale-nan"])
def test_bad_tensors_name_the_tensor_and_the_file(tmp_path, change, error, match):
    ckpt = corrupt(tmp_path, change)
    model = KimiModel(KimiConfig(**SMALL))
    before = {n: type(m) for n, m in model.named_modules()}
    with pytest.raises(error, match=match):
        convert_kimi_to_exact(model, ckpt)
    assert {n: type(m) for n, m in model.named_modules()} == before  # nothing half converted


BAD_AT = {"first": "model.layers.1.mlp.experts.0.gate_proj",
          "middle": "model.layers.1.mlp.experts.2.up_proj",
          "last": "model.layers.1.mlp.experts.3.down_proj"}


@pytest.mark.parametrize("where", BAD_AT)
def test_a_bad_tensor_in_any_expert_leaves_the_model_as_it_was(tmp_path, where):
    """All or nothing, wherever the bad tensor is: the first projection checked, a middle one,
    or the last. The model is compared buffer by buffer, its module objects by identity."""
    name = BAD_AT[where]
    ckpt = corrupt(tmp_path, lambda c: rewrite_tensor(
        c, f"{name}.weight_scale", torch.full((64 if "down" in name else 32, 1 if "down" in name
                                               else 2), float("inf"), dtype=torch.bfloat16)))
    model = KimiModel(KimiConfig(**SMALL))  # its routed experts reused: loaded in place
    before = snapshot(model)
    with pytest.raises(KimiCheckpointError, match=name.rpartition(".")[2]):
        convert_kimi_to_exact(model, ckpt)
    assert_unchanged(model, before)


@pytest.mark.parametrize("act_bits", [4, 8, 16, 32])
@pytest.mark.parametrize("dense_bits", [None, 4, 8])
def test_every_conversion_option_computes_at_its_setting(tmp_path, act_bits, dense_bits):
    """convert_kimi_to_exact(act_bits, dense_bits): every routed projection computes at
    act_bits, and every shared or dense one (with dense_bits) is from_weight's at those bits,
    against the reference at that setting. The model's own exact layers (built at 16 bits) are
    not kept at another act_bits."""
    from exactness import ExactLinear
    from exactness.suite.reference import oracle_quantize_weight

    ckpt = write_checkpoint(tmp_path / "ckpt")
    model = KimiModel(KimiConfig(**SMALL))
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Linear):
                module.weight.copy_(torch.randn_like(module.weight) * 0.05)
    dense = {n: m.weight.detach().clone() for n, m in model.named_modules()
             if isinstance(m, nn.Linear)}
    report = convert_kimi_to_exact(model, ckpt, act_bits=act_bits, dense_bits=dense_bits)
    assert len(report.left_bf16) == (len(dense) if dense_bits is None else 0)
    assert report.dense_converted == (0 if dense_bits is None else len(dense))
    x = {64: torch.randn(3, 64).bfloat16(), 32: torch.randn(3, 32).bfloat16(),
         128: torch.randn(3, 128).bfloat16()}
    for name, layer in model.named_modules():
        if not isinstance(layer, PackedInt4Linear | ExactLinear):
            continue
        want_bits = 4 if name not in dense else dense_bits
        assert (layer.act_bits, layer.bits) == (act_bits, want_bits), name
        xin = x[layer.in_features]
        want = reference_linear(tensor_to_bits(xin), "bfloat16", layer.weight_packed.numpy(),
                                float_bits(layer.weight_scale).numpy(), act_bits=act_bits,
                                w_bits=want_bits)
        assert (tensor_to_bits(layer(xin)) == want).all(), name
        if name in dense:  # from_weight's own quantization of the bf16 weight
            q, scales = oracle_quantize_weight(tensor_to_bits(dense[name]), "bfloat16",
                                               dense_bits)
            assert (float_bits(layer.weight_scale).numpy() == np.array(scales)).all(), name
    assert sum(isinstance(m, ExactLinear) for m in model.modules()) == (
        0 if dense_bits is None else len(dense))


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


def snapshot(model: nn.Module) -> tuple[dict, dict]:
    """The model's modules (by identity) and a copy of its state_dict."""
    return (dict(model.named_modules()),
            {k: v.clone() for k, v in model.state_dict().items()})


def assert_unchanged(model: nn.Module, before: tuple[dict, dict]) -> None:
    modules, state = before
    assert dict(model.named_modules()) == modules  # the same module objects
    now = model.state_dict()
    assert now.keys() == state.keys()
    for key, value in state.items():
        assert now[key].dtype == value.dtype and torch.equal(now[key], value), key


def fail_after_the_checks(monkeypatch, fault):
    """Calls fault(checkpoint) once every routed projection of the model has passed its checks,
    so what fails is a read of the load itself."""
    check = KimiCheckpoint.check_packed
    checked = []

    def check_then_fault(self, layer, name):
        check(self, layer, name)
        checked.append(name)
        if len(checked) == 12:  # SMALL's routed projections
            fault(self)

    monkeypatch.setattr(KimiCheckpoint, "check_packed", check_then_fault)


def truncate_the_second_shard(checkpoint):
    """Cut the second shard just past its header: its tensors' bytes are gone."""
    file = checkpoint.dir / "model-00002-of-00002.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[:8 + int.from_bytes(data[:8], "little") + 64])


@pytest.mark.parametrize("fault", ["truncated-shard", "os-error"])
def test_a_read_failing_after_the_checks_leaves_the_model_untouched(tmp_path, monkeypatch, fault):
    ckpt = write_checkpoint(tmp_path / "ckpt")
    model = KimiModel(KimiConfig(**SMALL))  # routed experts already PackedInt4Linear: reused
    before = snapshot(model)
    if fault == "truncated-shard":
        fail_after_the_checks(monkeypatch, truncate_the_second_shard)
        match = r"model-00002-of-00002.safetensors: .*truncated"
    else:
        reads, real_open = [], kimi_checkpoint.safe_open

        class FailingDisk:  # safetensors' handle, on a disk that fails at the third read
            def __init__(self, path, framework):
                self.handle = real_open(path, framework)

            def get_tensor(self, name):
                reads.append(name)
                if len(reads) == 3:  # two tensors read, then the disk fails
                    raise OSError(5, "Input/output error")
                return self.handle.get_tensor(name)

        fail_after_the_checks(monkeypatch, lambda c: monkeypatch.setattr(
            kimi_checkpoint, "safe_open", FailingDisk))
        match = r"model-0000\d-of-00002.safetensors: .*Input/output error"
    with pytest.raises(KimiCheckpointError, match=match):
        convert_kimi_to_exact(model, ckpt)
    assert_unchanged(model, before)


def set_key(file: Path, path: str | tuple, value):
    """Set (or, with value DELETE, remove) the key `path` (dotted, or a tuple of keys) of a JSON
    file."""
    data = json.loads(file.read_text())
    *parents, last = path.split(".") if isinstance(path, str) else path
    node = data
    for key in parents:
        node = node[key]
    if value is DELETE:
        del node[last]
    else:
        node[last] = value
    file.write_text(json.dumps(data))


DELETE = object()
GROUP = "quantization_config.config_groups.group_0"


MALFORMED_JSON = dict(argnames="file, change, match", argvalues=[
    ("config.json", "{", r"config.json: not valid JSON"),
    ("config.json", "[1, 2]", r"config.json: expected a JSON object, got a list"),
    ("config.json", ("text_config", 5), r"config.json: text_config: expected a JSON object"),
    ("config.json", ("quantization_config", "int4"),
     r"config.json: quantization_config: expected a JSON object"),
    ("config.json", ("quantization_config.config_groups", ["group_0"]),
     r"config.json: quantization_config.config_groups: expected a JSON object"),
    ("config.json", (f"{GROUP}.weights", 5),
     r"config.json: quantization_config.config_groups.group_0.weights: expected a JSON object"),
    ("config.json", (f"{GROUP}.weights.num_bits", 4.0),
     r"config.json: .*group_0.weights.num_bits = 4.0, expected 4"),
    ("config.json", (f"{GROUP}.weights.symmetric", 1),
     r"config.json: .*group_0.weights.symmetric = 1, expected True"),
    ("config.json", ("hidden_size", "64"), r"config.json: hidden_size: expected an int"),
    ("config.json", ("hidden_size", DELETE), r"config.json: hidden_size: missing"),
    ("config.json", ("moe_intermediate_size", 48),
     r"config.json: moe_intermediate_size: 48 is not a multiple of 32"),
    ("config.json", ("norm_topk_prob", "yes"), r"config.json: norm_topk_prob: expected a bool"),
    ("model.safetensors.index.json", "not json", r"index.json: not valid JSON"),
    ("model.safetensors.index.json", ("weight_map", DELETE),
     r"index.json: weight_map: missing"),
    ("model.safetensors.index.json", ("weight_map", ["a.safetensors"]),
     r"index.json: weight_map: expected a JSON object"),
    ("model.safetensors.index.json", (("weight_map", f"{NAME}.weight_packed"), 5),
     rf"index.json: weight_map.{NAME}.weight_packed: expected a shard file name"),
], ids=["config-not-json", "config-a-list", "text-config-not-an-object",
        "quant-config-a-string", "config-groups-a-list", "weights-a-number", "num-bits-a-float",
        "symmetric-an-int", "hidden-size-a-string", "hidden-size-missing",
        "moe-size-not-a-multiple-of-32", "norm-topk-prob-a-string", "index-not-json",
        "weight-map-missing", "weight-map-a-list", "shard-name-an-int"])


@pytest.mark.parametrize(**MALFORMED_JSON)
def test_malformed_json_is_refused_naming_the_file_and_the_key(tmp_path, file, change, match):
    ckpt = write_checkpoint(tmp_path / "bad")
    if isinstance(change, str):
        (ckpt / file).write_text(change)
    else:
        set_key(ckpt / file, *change)
    with pytest.raises(KimiCheckpointError, match=match):
        KimiCheckpoint(ckpt)


def header_length_zero(data: bytes) -> bytes:
    return bytes(8) + data[8:]


def header_not_json(data: bytes) -> bytes:
    length = int.from_bytes(data[:8], "little")
    return data[:8] + b"\xff" * length + data[8 + length:]


def edit_header(edit):
    def change(data: bytes) -> bytes:
        header, payload = split_safetensors(data)
        edit(header)
        return join_safetensors(header, payload)
    return change


def first_tensor(header: dict) -> dict:
    return header[next(k for k in sorted(header) if k != "__metadata__")]


MALFORMED_HEADERS = dict(argnames="change, match", argvalues=[
    (header_length_zero, r"model.safetensors: header: not valid JSON"),
    (header_not_json, r"model.safetensors: header: not valid JSON"),
    (edit_header(lambda h: first_tensor(h).update(data_offsets=[0, 10**9])),
     r"model.safetensors: tensor .*: data_offsets \[0, 1000000000\] run past the end"),
    (edit_header(lambda h: first_tensor(h).update(dtype="I33")),
     r"model.safetensors: tensor .*: unknown dtype 'I33'"),
    (edit_header(lambda h: first_tensor(h).update(shape=[3, "4"])),
     r"model.safetensors: tensor .*: shape \[3, '4'\] is not a list of sizes"),
    (edit_header(lambda h: first_tensor(h).update(shape=[1])),
     r"model.safetensors: tensor .*: data_offsets hold \d+ bytes for shape \[1\] of I32"),
    (edit_header(lambda h: h.update({"x": []})), r"model.safetensors: tensor 'x': expected"),
], ids=["length-zero", "not-json", "offsets-past-the-end", "unknown-dtype", "shape-not-ints",
        "size-not-shape", "entry-not-an-object"])


@pytest.mark.parametrize(**MALFORMED_HEADERS)
def test_malformed_safetensors_headers_are_refused(tmp_path, change, match):
    ckpt = write_checkpoint(tmp_path / "bad", single_file=True)
    file = ckpt / "model.safetensors"
    file.write_bytes(change(file.read_bytes()))
    with pytest.raises(KimiCheckpointError, match=match):
        KimiCheckpoint(ckpt)


def test_quantized_input_activations_are_refused(tmp_path):
    ckpt = write_checkpoint(tmp_path / "w4a8")
    set_key(ckpt / "config.json", f"{GROUP}.input_activations",
            {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
             "dynamic": True})
    with pytest.raises(KimiCheckpointError,
                       match=r"config.json: .*group_0.input_activations: .*not supported"):
        KimiCheckpoint(ckpt)


def test_a_routed_linear_with_a_bias_is_refused(tmp_path):
    ckpt = write_checkpoint(tmp_path / "ckpt")
    model = KimiModel(KimiConfig(**SMALL, use_exact_generators=False))
    model.model.layers[1].mlp.experts[2].up_proj = nn.Linear(64, 32, dtype=torch.bfloat16)
    before = snapshot(model)
    with pytest.raises(ValueError, match=rf"{NAME}: .*bias") as caught:
        convert_kimi_to_exact(model, ckpt)
    assert isinstance(caught.value, ExactnessError)
    assert_unchanged(model, before)


@pytest.mark.parametrize("wrap", [lambda m: nn.ModuleDict({"backbone": m}),
                                  lambda m: m.model.layers[0]], ids=["prefixed", "no-experts"])
def test_a_model_matching_no_routed_expert_is_refused(tmp_path, wrap):
    ckpt = write_checkpoint(tmp_path / "ckpt")
    model = wrap(KimiModel(KimiConfig(**SMALL)))
    with pytest.raises(ValueError, match=r"no module .* routed expert.* the checkpoint has 12"
                       ) as caught:
        convert_kimi_to_exact(model, ckpt)
    assert isinstance(caught.value, ExactnessError)


# --------------------------------------------------------------------------- the CLI


def kimi_cli(capsys, directory, *args) -> subprocess.CompletedProcess:
    """`python -m exactness kimi DIRECTORY ARGS` in this process (the test below runs it as a
    command)."""
    return main_here(capsys, "kimi", str(directory), *args)


def test_cli_passes_on_a_good_checkpoint(tmp_path):
    ckpt = write_checkpoint(tmp_path / "ok", k25=True)
    done = subprocess.run([sys.executable, "-m", "exactness", "kimi", str(ckpt), "--experts",
                           "1", "2"], capture_output=True, text=True,
                          cwd=Path(__file__).parent.parent)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "PASSED" in done.stdout and "outputs compared bit for bit" in done.stdout
    assert "experts                           2" in done.stdout


def test_cli_fails_clearly_on_a_corrupted_checkpoint(tmp_path, capsys):
    ckpt = corrupt(tmp_path, lambda c: rewrite_tensor(
        c, f"{NAME}.weight_scale", torch.full((32, 2), float("inf"), dtype=torch.bfloat16)))
    done = kimi_cli(capsys, ckpt)
    assert done.returncode == 1 and "FAILED" in done.stdout
    assert f"{NAME}" in done.stdout and ".safetensors" in done.stdout
    assert "non-finite" in done.stdout


def assert_one_line_failure(done, *names):
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr, done.stderr
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("FAILED: "), done.stdout
    for name in names:
        assert name in lines[0]


@pytest.mark.parametrize("file, text, key", [
    ("config.json", "{", "config.json"),
    ("model.safetensors.index.json", '{"weight_map": 3}', "weight_map"),
], ids=["config-not-json", "weight-map-not-an-object"])
def test_cli_fails_in_one_line_on_malformed_json(tmp_path, capsys, file, text, key):
    ckpt = write_checkpoint(tmp_path / "bad")
    (ckpt / file).write_text(text)
    assert_one_line_failure(kimi_cli(capsys, ckpt), file, key)


def test_cli_fails_in_one_line_on_a_malformed_header(tmp_path, capsys):
    ckpt = write_checkpoint(tmp_path / "bad", single_file=True)
    (ckpt / "model.safetensors").write_bytes(header_not_json(
        (ckpt / "model.safetensors").read_bytes()))
    assert_one_line_failure(kimi_cli(capsys, ckpt), "model.safetensors", "header")


@pytest.mark.parametrize("tokens", ["0", "-1"])
def test_cli_refuses_non_positive_tokens(tmp_path, capsys, tokens):
    ckpt = write_checkpoint(tmp_path / "ok")
    done = kimi_cli(capsys, ckpt, "--tokens", tokens)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stdout + done.stderr
    assert f"--tokens: must be a positive integer, got {tokens}" in done.stderr


# --------------------------------------------------------------------------- what mutmut found


def test_the_check_in_process_names_the_file_of_a_corrupted_tensor(tmp_path, capsys):
    """The CLI's check, in this process (mutmut sees no subprocess): a tensor its layer refuses
    fails the check, naming the tensor's file and projection."""
    from exactness.suite.peers.kimi_check import check_checkpoint

    ckpt = corrupt(tmp_path, lambda c: rewrite_tensor(
        c, f"{NAME}.weight_scale", torch.full((32, 2), float("inf"), dtype=torch.bfloat16)))
    assert check_checkpoint(ckpt, tokens=1) == 1
    out = capsys.readouterr().out
    assert re.search(rf"model-0000\d-of-00002\.safetensors: {NAME}: .*non-finite", out), out


@pytest.mark.parametrize("act_bits", [16, 8])
def test_loading_keeps_the_tensors_it_read(tmp_path, monkeypatch, act_bits):
    """No second copy of a checkpoint's tensors: each routed layer holds the very tensors read
    from the shards (the model's own layers at their act_bits, new ones at another), and the
    checkpoint is closed after."""
    ckpt = write_checkpoint(tmp_path / "ckpt")
    streamed, closed = {}, []
    real_stream, real_close = KimiCheckpoint.stream, KimiCheckpoint.close
    monkeypatch.setattr(KimiCheckpoint, "stream", lambda self, wanted, **kw: streamed.setdefault(
        len(streamed), real_stream(self, wanted, **kw)))
    monkeypatch.setattr(KimiCheckpoint, "close", lambda self: (closed.append(1),
                                                               real_close(self))[1])
    model = KimiModel(KimiConfig(**SMALL))
    own = experts(model)
    report = convert_kimi_to_exact(model, ckpt, act_bits=act_bits)
    now = experts(model)
    (read,) = streamed.values()  # one stream of every routed tensor
    assert len(read) == 3 * report.routed_loaded == 3 * report.routed_converted == 3 * len(now)
    assert all((now[name] is own[name]) == (act_bits == 16) for name in now)
    for (name, key), tensor in read.items():
        assert getattr(now[name], key).data_ptr() == tensor.data_ptr(), (name, key)
    assert closed == [1]
    read = {}
    real_read = KimiCheckpoint.read_packed
    monkeypatch.setattr(KimiCheckpoint, "read_packed", lambda self, layer, name: read.setdefault(
        name, real_read(self, layer, name)))
    layer, checkpoint = PackedInt4Linear(64, 32), KimiCheckpoint(ckpt)
    checkpoint.load_packed(layer, NAME)
    checkpoint.close()
    assert all(getattr(layer, key).data_ptr() == tensor.data_ptr()
               for key, tensor in read[NAME].items())


def test_conversion_without_a_checkpoint_converts_in_place():
    """Without a checkpoint, each routed nn.Linear becomes a PackedInt4Linear on the model's
    device (its weights to be loaded later), nothing is read, and the model runs."""
    model = KimiModel(KimiConfig(**SMALL, use_exact_generators=False))
    report = convert_kimi_to_exact(model)
    routed = experts(model)
    assert report.routed_loaded == 0
    assert report.routed_converted == len(routed) == 4 * 3  # one MoE layer of 4 experts
    assert {t.device.type for layer in routed.values() for t in layer.buffers()} == {"cpu"}
    assert model(torch.randn(2, 64).bfloat16()).shape == (2, 64)


def test_a_wrong_dense_bits_names_itself():
    with pytest.raises(ValueError, match="dense_bits must be None, 4 or 8, got 5"):
        convert_kimi_to_exact(KimiModel(KimiConfig(**SMALL)), dense_bits=5)


def test_the_model_keeps_its_config_and_the_routers_dtype():
    """The config as given; the router's weight in bf16 as the checkpoint stores it (its bias
    in fp32)."""
    config = KimiConfig(**SMALL)
    model = KimiModel(config)
    assert model.config is config
    gate = model.model.layers[1].mlp.gate
    assert (gate.weight.dtype, gate.e_score_correction_bias.dtype) == (torch.bfloat16,
                                                                       torch.float32)


@pytest.mark.parametrize("value, kind", [(None, "null or nothing"), (True, "a bool"),
                                         (3, "a number"), (2.5, "a number"), ("s", "a string"),
                                         ([1], "a list"), ({}, "an object"),
                                         (b"x", "bytes")])
def test_a_json_value_is_named_by_its_kind(value, kind):
    from exactness.kimi import json_kind

    assert json_kind(value) == kind


def test_a_long_value_is_cut_to_sixty_characters():
    from exactness.kimi import brief

    assert brief("a" * 58) == repr("a" * 58)  # 60 characters with its quotes
    assert brief("a" * 59) == repr("a" * 59)[:57] + "..."
    assert len(brief("a" * 59)) == 60


def single_file(tmp_path, change=None) -> Path:
    """A one-file checkpoint, its model.safetensors passed through `change` (bytes -> bytes)."""
    ckpt = write_checkpoint(tmp_path / "one", single_file=True)
    if change is not None:
        file = ckpt / "model.safetensors"
        file.write_bytes(change(file.read_bytes()))
    return ckpt


def payload_size(data: bytes) -> int:
    return len(split_safetensors(data)[1])


def add_empty_tensor(header: dict) -> None:
    end = max(e["data_offsets"][1] for k, e in header.items() if k != "__metadata__")
    header["empty"] = {"dtype": "I32", "shape": [0], "data_offsets": [end, end]}


@pytest.mark.parametrize("change, match", [
    (lambda d: d[:7], r"model.safetensors: truncated \(no safetensors header\)"),
    (lambda d: bytes(8), r"model.safetensors: header: not valid JSON"),
    (lambda d: (len(d) - 7).to_bytes(8, "little") + d[8:],
     r"model.safetensors: header claims \d+ bytes, the file has \d+: refusing the allocation"),
    (edit_header(lambda h: first_tensor(h).update(data_offsets=[8, 4])),
     r"tensor .*: data_offsets \[8, 4\] are not \[begin, end\]"),
    (edit_header(lambda h: first_tensor(h).update(data_offsets=[0, 4, 8])),
     r"tensor .*: data_offsets \[0, 4, 8\] are not \[begin, end\]"),
    (edit_header(lambda h: first_tensor(h).update(shape=[1], data_offsets=[4, 12])),
     r"tensor .*: data_offsets hold 8 bytes for shape \[1\] of I32"),
    (lambda d: join_safetensors([1], split_safetensors(d)[1]),
     r"model.safetensors: header: expected a JSON object, got a list"),
], ids=["seven-bytes", "eight-bytes", "header-one-past", "offsets-reversed", "offsets-three",
        "size-eight-bytes", "header-a-list"])
def test_a_shards_edges_are_refused_by_name(tmp_path, change, match):
    """Each edge of a shard's layout, one step past it, with the message naming what is wrong."""
    with pytest.raises(KimiCheckpointError, match=match):
        KimiCheckpoint(single_file(tmp_path, change))


def test_a_shards_edges_just_inside_are_read(tmp_path):
    """Just inside each edge: metadata first, an empty tensor, a shard whose header fills it
    (no data), and data ending at the file's very end all read; one byte past that end does
    not."""
    def change(data):
        header, payload = split_safetensors(data)
        header = {"__metadata__": {"format": "pt"}, **header}
        add_empty_tensor(header)
        return join_safetensors(header, payload)

    ckpt = KimiCheckpoint(single_file(tmp_path, change))
    assert ckpt.read("empty").shape == (0,) and ckpt.read("empty").dtype == torch.int32
    assert ckpt.read(f"{NAME}.weight_packed").shape == (32, 8)
    assert set(ckpt.routed_experts()) == {(1, e) for e in range(4)}

    sharded = write_checkpoint(tmp_path / "sharded")
    (sharded / "header-only.safetensors").write_bytes(join_safetensors(
        {"empty": {"dtype": "I32", "shape": [0], "data_offsets": [0, 0]}}, b""))
    set_key(sharded / "model.safetensors.index.json", ("weight_map", "empty"),
            "header-only.safetensors")
    assert KimiCheckpoint(sharded).read("empty").shape == (0,)

    def one_past(data):
        end = payload_size(data) + 1
        return edit_header(lambda h: first_tensor(h).update(
            data_offsets=[first_tensor(h)["data_offsets"][0], end]))(data)

    with pytest.raises(KimiCheckpointError, match=r"data_offsets \[\d+, \d+\] run past the end"):
        KimiCheckpoint(single_file(tmp_path / "past", one_past))


def test_a_shard_name_that_escapes_or_is_missing_names_itself(tmp_path):
    for name, match in (("../outside.safetensors", r"shard '../outside.safetensors' escapes"),
                        ("gone.safetensors", r"shard 'gone.safetensors' is missing"),
                        ("bad\x00name.safetensors", r"shard 'bad\\x00name.safetensors': not a "
                                                     r"usable file name \(.*null.*\)"),
                        ("x" * 300, r"shard 'x{56}\.\.\.: not a usable file name "
                                    r"\(File name too long\)")):
        ckpt = write_checkpoint(tmp_path / f"ckpt{len(match)}")
        set_key(ckpt / "model.safetensors.index.json", ("weight_map", f"{NAME}.weight_packed"),
                name)
        with pytest.raises(KimiCheckpointError, match=match):
            KimiCheckpoint(ckpt).read(f"{NAME}.weight_packed")


def test_tensor_names_with_and_without_the_k25_prefix(tmp_path):
    k2, k25 = (KimiCheckpoint(write_checkpoint(tmp_path / n, k25=n == "k25"))
               for n in ("k2", "k25"))
    assert k2.name_for(f"language_model.{NAME}", "weight_packed") == f"{NAME}.weight_packed"
    assert k25.name_for(NAME, "weight_packed") == f"language_model.{NAME}.weight_packed"
    with pytest.raises(KimiCheckpointError,
                       match=r"tensor 'x.weight_packed' is not in the checkpoint's weight_map"):
        k2.name_for("x", "weight_packed")


def test_a_dtype_the_reader_does_not_load_is_named(tmp_path):
    def as_f64(h):
        entry = first_tensor(h)
        begin, end = entry["data_offsets"]
        entry.update(dtype="F64", shape=[(end - begin) // 8])

    ckpt = KimiCheckpoint(single_file(tmp_path, edit_header(as_f64)))
    name = next(n for n in sorted(ckpt.weight_map))
    with pytest.raises(KimiCheckpointError, match=r"dtype F64, not one this reader loads "
                                                  r"\(I32, .*BF16.*\)"):
        ckpt.read(name)


def test_a_wrong_weight_shape_names_both_shapes(tmp_path):
    ckpt = corrupt(tmp_path, lambda c: rewrite_tensor(
        c, f"{NAME}.weight_shape", torch.tensor([32, 96], dtype=torch.int32)))
    with pytest.raises(KimiCheckpointError, match=r"weight_shape: \[32, 96\], but the layer is "
                                                  r"\[32, 64\]"):
        convert_kimi_to_exact(KimiModel(KimiConfig(**SMALL)), ckpt)


@pytest.mark.parametrize("value, ok", [(2.5, True), (3, True), (True, False), ("2.5", False),
                                       (float("inf"), False)])
def test_a_float_config_field_takes_finite_numbers_only(tmp_path, value, ok):
    ckpt = write_checkpoint(tmp_path / "ckpt")
    set_key(ckpt / "config.json", "routed_scaling_factor", value)
    if ok:
        assert KimiCheckpoint(ckpt).config.routed_scaling_factor == value
    else:
        with pytest.raises(KimiCheckpointError, match=rf"routed_scaling_factor: expected a "
                                                      rf"finite number, got {value!r}"):
            KimiCheckpoint(ckpt)


def test_the_report_counts_bytes_and_memory_as_it_says(monkeypatch):
    """Without a checkpoint nothing is read; peak_rss_growth is ru_maxrss's growth (KiB on
    Linux) in bytes."""
    import resource

    peaks = iter([1000, 3000])
    monkeypatch.setattr(resource, "getrusage", lambda who: type("U", (), {
        "ru_maxrss": next(peaks)}))
    report = convert_kimi_to_exact(KimiModel(KimiConfig(**SMALL)))
    assert report.bytes_read == 0 and report.peak_rss_growth == 2000 * 1024
    assert report.summary() == {"routed_converted": 12, "routed_loaded": 0,
                                "dense_converted": 0, "left_bf16": 6, "remote_experts": 0,
                                "bytes_read": 0, "peak_rss_growth": 2000 * 1024}


def test_k25s_wrapper_is_its_language_model():
    model = KimiK25(KimiConfig(**SMALL))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.05)
    x = torch.randn(2, 64).bfloat16()
    y = model(x)
    assert torch.equal(y, model.language_model(x)) and torch.count_nonzero(y - x) > 0


def test_only_a_module_with_both_fused_tensors_is_fused_experts():
    from exactness.kimi import is_fused_experts

    module = nn.Module()
    module.num_experts = 2
    module.gate_up_proj = nn.Parameter(torch.zeros(2, 64, 64))
    assert not is_fused_experts(module)
    module.down_proj = nn.Linear(32, 64)
    assert not is_fused_experts(module)
    module.down_proj = nn.Parameter(torch.zeros(2, 64, 32))
    assert is_fused_experts(module)


@pytest.mark.parametrize("k25, key, value, match", [
    (True, "hidden_size", 48, r"config.json: text_config.hidden_size: 48 is not a multiple of 32"),
    (True, "moe_intermediate_size", None,
     r"config.json: text_config.moe_intermediate_size: missing"),
    (False, "moe_intermediate_size", 0, r"moe_intermediate_size: 0 is not a multiple of 32"),
    (False, "moe_intermediate_size", -32, r"moe_intermediate_size: expected an int >= 0, got -32"),
    (False, "routed_scaling_factor", float("nan"),
     r"routed_scaling_factor: expected a finite number, got nan"),
    (False, "exact_act_bits", 5, r"config.json: exact_act_bits: .*5"),
    (False, "quantization_config", None,
     r"config.json: no quantization_config \(top level or text_config\)"),
    (False, "quantization_config.quant_method", "gptq",
     r"quantization_config.quant_method = 'gptq', expected 'compressed-tensors'"),
    (True, "quantization_config.quant_method", "gptq",
     r"text_config.quantization_config.quant_method = 'gptq'"),
], ids=["k25-hidden-48", "k25-moe-missing", "moe-zero", "moe-negative", "scaling-nan",
        "act-bits-5", "no-quantization", "quant-method", "k25-quant-method"])
def test_config_fields_are_refused_by_their_full_name(tmp_path, k25, key, value, match):
    """Each config field's error names the file and the field as it is nested (K2.5: under
    text_config), and the value it refused."""
    ckpt = write_checkpoint(tmp_path / "ckpt", k25=k25)
    path = (("text_config." if k25 else "") + key).split(".")
    set_key(ckpt / "config.json", tuple(path), DELETE if value is None else value)
    with pytest.raises(KimiCheckpointError, match=match) as raised:
        KimiCheckpoint(ckpt)
    assert str(raised.value).startswith(str(ckpt / "config.json"))


@pytest.mark.parametrize("edit, match", [
    (lambda c: (c / "config.json").unlink(), r"config.json: missing"),
    (lambda c: set_key(c / "config.json", "quantization_config.config_groups", {}),
     r"config.json: quantization_config.config_groups: missing or empty"),
    (lambda c: set_key(c / "config.json", GROUP, 5),
     r"config.json: quantization_config.config_groups.group_0: expected a JSON object, got a "
     r"number"),
    (lambda c: set_key(c / "config.json", f"{GROUP}.format", "dense"),
     r"group_0.format = 'dense', expected 'pack-quantized'"),
    (lambda c: set_key(c / "config.json", f"{GROUP}.output_activations", {"num_bits": 8}),
     r"group_0.output_activations: quantized activations are not supported"),
    (lambda c: (c / "model.safetensors.index.json").write_text("[]"),
     r"model.safetensors.index.json: expected a JSON object, got a list"),
    (lambda c: set_key(c / "model.safetensors.index.json",
                       ("weight_map", f"{NAME}.weight_packed"), ""),
     rf"weight_map.{NAME}.weight_packed: expected a shard file name, got ''"),
    (lambda c: (c / "model.safetensors.index.json").unlink(),
     r"model.safetensors.index.json: missing \(and no single model.safetensors\)"),
], ids=["no-config", "no-groups", "group-a-number", "group-format", "output-activations",
        "index-a-list", "shard-name-empty", "no-index"])
def test_config_and_index_errors_name_the_file_and_what_is_wrong(tmp_path, edit, match):
    ckpt = write_checkpoint(tmp_path / "ckpt")
    edit(ckpt)
    with pytest.raises(KimiCheckpointError, match=match) as raised:
        KimiCheckpoint(ckpt)
    assert str(raised.value).startswith(str(ckpt))


def test_a_group_takes_the_format_of_its_config_where_it_names_none(tmp_path):
    ckpt = write_checkpoint(tmp_path / "ckpt")
    set_key(ckpt / "config.json", f"{GROUP}.format", DELETE)
    assert KimiCheckpoint(ckpt).config.hidden_size == 64
    set_key(ckpt / "config.json", "quantization_config.format", "dense")
    with pytest.raises(KimiCheckpointError, match=r"group_0.format = 'dense'"):
        KimiCheckpoint(ckpt)
    one = KimiCheckpoint(single_file(tmp_path))
    assert one.index_file == one.dir / "model.safetensors"


def test_config_fields_just_inside_their_limits_are_taken(tmp_path):
    """A field of 0 where an int >= 0 is asked, and K2.5's quantization_config at the top level
    (some exports put it there)."""
    ckpt = write_checkpoint(tmp_path / "ckpt", k25=True)
    config = json.loads((ckpt / "config.json").read_text())
    config["quantization_config"] = config["text_config"].pop("quantization_config")
    config["text_config"]["first_k_dense_replace"] = 0
    (ckpt / "config.json").write_text(json.dumps(config))
    assert KimiCheckpoint(ckpt).config.first_k_dense_replace == 0


def test_a_json_key_that_would_break_the_line_is_quoted():
    from exactness.kimi import shown_key

    assert shown_key("group_0") == "group_0"
    assert shown_key("a\nb") == repr("a\nb")


def test_an_unreadable_json_file_is_named(tmp_path, monkeypatch):
    """A config.json that cannot be read (as root every file here reads: the read is made to
    fail) is refused naming the file and the reason."""
    ckpt = write_checkpoint(tmp_path / "ckpt")

    def refuse(path):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(Path, "read_bytes", refuse)
    with pytest.raises(KimiCheckpointError, match=r"config.json: unreadable \(\[Errno 13\] "
                                                  r"Permission denied\)"):
        KimiCheckpoint(ckpt)
