"""Loading Kimi checkpoints: streamed through safetensors' mapping, each check once, memory-mapped
weights (mmap=True), expert-parallel subsets (experts=, rank/world), progress; on both K2
layouts (KimiModel's per-expert modules and transformers' fused experts)."""

import copy
import hashlib
import json

import numpy as np
import pytest
import torch

from exactness import PackedInt4Linear, hf, kimi, modules
from exactness.formats import tensor_to_bits
from exactness.kimi import (
    KimiCheckpoint,
    KimiCheckpointError,
    KimiConfig,
    KimiConversionError,
    KimiModel,
    convert_kimi_to_exact,
    expert_parallel,
)
from exactness.kimi import checkpoint as kimi_checkpoint
from exactness.moe import MissingExpertError, RemoteLinear
from tests.hf_checkpoints import tiny_model, write
from tests.kimi_checkpoints import join_safetensors, split_safetensors, write_checkpoint
from tests.test_kimi import SMALL, assert_unchanged, reference_output, snapshot

pytestmark = pytest.mark.stage("reliability")  # make verify's stage


def projections(model) -> dict[str, torch.nn.Module]:
    return {n: m for n, m in model.named_modules() if isinstance(m, PackedInt4Linear)}


def mapped_files(tensor: torch.Tensor) -> set[str]:
    """The files whose mappings hold the tensor's first byte (/proc/self/maps)."""
    found = set()
    with open("/proc/self/maps") as maps:
        for line in maps:
            span, *_, path = line.split(maxsplit=5) if len(line.split()) == 6 else (
                line.split()[0], "")
            lo, hi = (int(v, 16) for v in span.split("-"))
            if lo <= tensor.data_ptr() < hi:
                found.add(path.strip())
    return found


def digest(directory) -> str:
    return hashlib.sha256(b"".join(f.read_bytes() for f in sorted(
        directory.glob("*.safetensors")))).hexdigest()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("kimi") / "ckpt")


@pytest.fixture(scope="module", params=["k2", "k25"])
def hf_checkpoint(request, tmp_path_factory):
    return write(tmp_path_factory.mktemp(request.param), tiny_model(), k25=request.param == "k25")


def hf_experts(model) -> dict:
    return {n: m for n, m in model.named_modules() if isinstance(m, kimi.ExactExperts)}


# --------------------------------------------------------------------------- streaming


def test_each_scale_is_checked_once_and_each_shard_released_after_its_last_tensor(
        checkpoint, monkeypatch):
    """One finite check per scale (none by the layer's load: the tensors are installed as
    checked), the tensors read in file order, shard by shard, each shard's mapping dropped
    after its last tensor, so the process never holds two shards' pages."""
    checks, events = [], []
    real_check, real_release = kimi_checkpoint.check_finite_tensor, KimiCheckpoint.release
    real_map = KimiCheckpoint.map_tensor
    monkeypatch.setattr(kimi_checkpoint, "check_finite_tensor", lambda t, name: (
        checks.append(name), real_check(t, name))[1])
    monkeypatch.setattr(modules, "check_finite_tensor", lambda t, name: checks.append("layer"))
    monkeypatch.setattr(KimiCheckpoint, "release", lambda self, file: (
        events.append(("release", file)), real_release(self, file))[1])
    monkeypatch.setattr(KimiCheckpoint, "map_tensor", lambda self, shard, name, where: (
        events.append(("read", shard.path.name, shard.tensors[name].begin)),
        real_map(self, shard, name, where))[1])
    report = convert_kimi_to_exact(KimiModel(KimiConfig(**SMALL)), checkpoint)
    assert checks == ["weight_scale"] * report.routed_loaded == ["weight_scale"] * 12
    reads = [e[1:] for e in events if e[0] == "read"]
    assert reads == sorted(reads) and len(reads) == 36
    files = [e[1] for e in events if e[0] == "release"]
    assert files == sorted({r[0] for r in reads})  # each once, after its last read
    for i, event in enumerate(events):
        if event[0] == "release":
            assert all(e[1] != event[1] for e in events[i + 1:] if e[0] == "read")


def test_a_file_safetensors_refuses_is_named(tmp_path):
    """Two tensors over the same bytes: the header check here takes each alone, safetensors
    refuses the file; its refusal comes as a KimiCheckpointError naming the file."""
    ckpt = write_checkpoint(tmp_path / "ckpt", single_file=True)
    file = ckpt / "model.safetensors"
    header, payload = split_safetensors(file.read_bytes())
    names = sorted(k for k in header if k.endswith("weight_shape"))
    header[names[1]]["data_offsets"] = header[names[0]]["data_offsets"]
    file.write_bytes(join_safetensors(header, payload))
    model = KimiModel(KimiConfig(**SMALL))
    before = snapshot(model)
    with pytest.raises(KimiCheckpointError, match=r"model.safetensors: safetensors refuses it"):
        convert_kimi_to_exact(model, ckpt)
    assert_unchanged(model, before)


def test_a_shard_cut_short_under_the_reader_is_an_error_not_a_crash(checkpoint, tmp_path):
    """The size is looked at again before each tensor: a shard cut after its header was read is
    named, never read through the mapping (which would be a SIGBUS), and one grown is too."""
    for cut, says in ((-64, "truncated"), (64, "grown")):
        ckpt = write_checkpoint(tmp_path / f"ckpt{cut}")
        reader = KimiCheckpoint(ckpt)
        name = f"{SMALL_NAME}.weight_packed"
        shard, _ = reader.entry(name)
        data = shard.path.read_bytes()
        shard.path.write_bytes(data[:cut] if cut < 0 else data + bytes(cut))
        with pytest.raises(KimiCheckpointError, match=rf"{shard.path.name}: tensor .*the file "
                                                      rf"was {says} under the reader"):
            reader.read(name)


SMALL_NAME = "model.layers.1.mlp.experts.2.up_proj"


# --------------------------------------------------------------------------- mmap=True


def test_mmap_leaves_the_int4_tensors_file_backed_and_copy_on_write(checkpoint):
    before = digest(checkpoint)
    copied, mapped = (KimiModel(KimiConfig(**SMALL)) for _ in range(2))
    convert_kimi_to_exact(copied, checkpoint)
    report = convert_kimi_to_exact(mapped, checkpoint, mmap=True)
    assert report.routed_loaded == 12
    x = torch.randn(5, 64).bfloat16()
    for name, layer in projections(mapped).items():
        for key in ("weight_packed", "weight_scale"):
            files = mapped_files(getattr(layer, key))
            assert any(f.endswith(".safetensors") for f in files), (name, key, files)
            assert not mapped_files(getattr(projections(copied)[name], key)) & files
        xin = x if layer.in_features == 64 else x[:, :32]
        want = reference_output(layer, xin)
        assert np.array_equal(tensor_to_bits(layer(xin)), tensor_to_bits(want)), name
        assert np.array_equal(tensor_to_bits(projections(copied)[name](xin)), tensor_to_bits(want))
    layer = projections(mapped)[SMALL_NAME]
    layer.weight_scale.mul_(2)  # a write: to this process's copy of the page only
    layer.weight_packed.zero_()
    assert digest(checkpoint) == before
    fresh = KimiModel(KimiConfig(**SMALL))
    convert_kimi_to_exact(fresh, checkpoint, mmap=True)
    assert torch.equal(projections(fresh)[SMALL_NAME].weight_scale,
                       projections(copied)[SMALL_NAME].weight_scale)


def test_mmap_through_from_pretrained_maps_every_tensor(hf_checkpoint):
    copied = hf.from_pretrained(hf_checkpoint)
    mapped = hf.from_pretrained(hf_checkpoint, mmap=True)
    tensors = dict(mapped.state_dict())
    assert all(any(f.endswith(".safetensors") for f in mapped_files(t))
               for t in tensors.values())
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        assert torch.equal(copied(ids).logits, mapped(ids).logits)


def test_mmap_is_the_cpus_only(checkpoint, hf_checkpoint):
    with pytest.raises(KimiConversionError, match="mmap=True .* onto the CPU, not meta"):
        convert_kimi_to_exact(KimiModel(KimiConfig(**SMALL)), checkpoint, mmap=True,
                              device="meta")
    with pytest.raises(KimiConversionError, match="mmap=True .* onto the CPU, not cuda"):
        hf.from_pretrained(hf_checkpoint, mmap=True, device="cuda")


# --------------------------------------------------------------------------- experts=


@pytest.mark.parametrize("experts, world, blocks", [
    (384, 8, [range(48 * r, 48 * r + 48) for r in range(8)]),
    (10, 3, [range(0, 4), range(4, 7), range(7, 10)]),
    (4, 1, [range(4)]),
])
def test_expert_parallel_places_experts_as_vllm_does(experts, world, blocks):
    for rank, block in enumerate(blocks):
        local = expert_parallel(rank, world, experts)
        assert [e for e in range(experts) if local(7, e)] == list(block)


@pytest.mark.parametrize("kwargs, match", [
    (dict(rank=2, world=2), "rank 2 is not below world 2"),
    (dict(rank=0, world=0), "world must be an int >= 1"),
    (dict(rank=-1, world=2), "rank must be an int >= 0"),
    (dict(rank=True, world=2), "rank must be an int >= 0, got True"),
    (dict(rank=0), "rank= and world= go together"),
    (dict(experts=lambda layer, e: True, rank=0, world=2), "not both"),
    (dict(experts=[0, 1]), "experts= takes a predicate"),
])
def test_a_wrong_subset_is_refused_by_name(checkpoint, kwargs, match):
    model = KimiModel(KimiConfig(**SMALL))
    with pytest.raises(KimiConversionError, match=match):
        convert_kimi_to_exact(model, checkpoint, **kwargs)


def route_to(model: KimiModel, experts: list[int]) -> None:
    """Make the router choose `experts` for every token (its correction bias)."""
    gate = model.model.layers[1].mlp.gate
    with torch.no_grad():
        gate.e_score_correction_bias.copy_(torch.tensor(
            [10.0 if e in experts else -10.0 for e in range(SMALL["n_routed_experts"])]))


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "per-expert"])
@pytest.mark.parametrize("mmap", [False, True], ids=["copied", "mmap"])
def test_a_rank_loads_its_experts_and_refuses_tokens_for_the_others(checkpoint, grouped, mmap):
    """Rank 1 of 2 holds experts 2 and 3: it reads only their tensors, the others are
    RemoteLinear and named in the report; tokens routed to its own experts give the full model's
    bits, a token routed to another's raises MissingExpertError naming the expert."""
    full = KimiModel(KimiConfig(**SMALL))
    part = copy.deepcopy(full)  # the same shared experts and dense MLP
    whole = convert_kimi_to_exact(full, checkpoint)
    report = convert_kimi_to_exact(part, checkpoint, rank=1, world=2, mmap=mmap)
    assert report.remote_experts == [f"model.layers.1.mlp.experts.{e}" for e in (0, 1)]
    assert report.routed_loaded == report.routed_converted == 6
    assert report.bytes_read == whole.bytes_read // 2
    remote = {n for n, m in part.named_modules() if isinstance(m, RemoteLinear)}
    assert remote == {f"model.layers.1.mlp.experts.{e}.{p}_proj" for e in (0, 1)
                      for p in ("gate", "up", "down")}
    for model in (full, part):
        model.model.layers[1].mlp.grouped = grouped
    x = torch.randn(5, 64).bfloat16()
    route_to(full, [2, 3])
    route_to(part, [2, 3])
    with torch.no_grad():
        assert np.array_equal(tensor_to_bits(full(x)), tensor_to_bits(part(x)))
        route_to(part, [1, 3])
        with pytest.raises(MissingExpertError, match=r"model.layers.1.mlp.experts.1.gate_proj"):
            part(x)


def test_a_predicate_takes_any_subset_and_the_fused_layout_too(hf_checkpoint):
    """experts= with transformers' fused experts (from_pretrained): the even experts here; the
    odd ones left on disk, listed in exactness_remote; the grouped call and transformers' loop
    both give the full model's bits for tokens routed here, and both refuse a token routed to
    an odd expert."""
    full = hf.from_pretrained(hf_checkpoint)
    part = hf.from_pretrained(hf_checkpoint, experts=lambda layer, e: e % 2 == 0)
    assert part.exactness_remote == [f"model.layers.1.mlp.experts.{e}" for e in (1, 3, 5, 7)]
    (name, mine), = hf_experts(part).items()
    theirs = hf_experts(full)[name]
    x = torch.randn(4, 256).bfloat16()
    weights = torch.rand(4, 2).bfloat16()
    here, there = torch.tensor([[0, 2], [4, 6], [6, 0], [2, 8]]), torch.tensor([[0, 3]] * 4)
    for grouped in (True, False):
        mine.grouped = theirs.grouped = grouped
        with torch.no_grad():
            assert np.array_equal(tensor_to_bits(mine(x, here, weights)),
                               tensor_to_bits(theirs(x, here, weights)))
            with pytest.raises(MissingExpertError, match=r"mlp.experts.3.gate_proj"):
                mine(x, there, weights)


def test_converting_transformers_fused_experts_takes_a_subset_too(tmp_path):
    """convert_kimi_to_exact on transformers' own model: the new ExactExperts hold the local
    experts and RemoteLinear for the others; the model's outputs for tokens routed here are
    from_pretrained's, and a token routed elsewhere is refused."""
    model = tiny_model()
    hf_checkpoint = write(tmp_path, model)
    report = convert_kimi_to_exact(model, hf_checkpoint, rank=1, world=2)
    assert report.remote_experts == [f"model.layers.1.mlp.experts.{e}" for e in range(4)]
    (name, experts), = hf_experts(model).items()
    assert isinstance(experts[0].up_proj, RemoteLinear)
    assert isinstance(experts[4].up_proj, PackedInt4Linear)
    loaded = hf_experts(hf.from_pretrained(hf_checkpoint, rank=1, world=2))[name]
    x, weights = torch.randn(3, 256).bfloat16(), torch.rand(3, 2).bfloat16()
    with torch.no_grad():
        ids = torch.tensor([[4, 7], [5, 6], [7, 8]])
        assert np.array_equal(tensor_to_bits(experts(x, ids, weights)),
                              tensor_to_bits(loaded(x, ids, weights)))
        with pytest.raises(MissingExpertError, match=r"mlp.experts.0.gate_proj"):
            experts(x, torch.tensor([[0, 4]] * 3), weights)


def test_a_subset_through_auto_and_rank_world_on_the_fused_layout(hf_checkpoint):
    model = hf.ExactKimiK2ForCausalLM.from_pretrained(hf_checkpoint, rank=0, world=4)
    assert model.exactness_remote == [f"model.layers.1.mlp.experts.{e}" for e in range(2, 8)]
    assert sum(isinstance(m, PackedInt4Linear) for m in model.modules()) == 2 * 3


# --------------------------------------------------------------------------- progress


def test_progress_shows_on_request_and_stays_off_otherwise(checkpoint, capsys):
    convert_kimi_to_exact(KimiModel(KimiConfig(**SMALL)), checkpoint, progress=True)
    shown = capsys.readouterr().err
    assert "exactness: loading" in shown and "36/36" in shown
    for progress in (False, None):  # None: off where stderr is no terminal, or the load small
        convert_kimi_to_exact(KimiModel(KimiConfig(**SMALL)), checkpoint, progress=progress)
        assert capsys.readouterr().err == ""


def test_a_failure_midway_through_the_stream_leaves_the_model_unchanged(tmp_path):
    """The last tensor streamed has a non-finite scale: every other is read by then, and the
    model is still exactly as it was."""
    ckpt = write_checkpoint(tmp_path / "ckpt")
    reader = KimiCheckpoint(ckpt)
    last = max(reader.weight_map, key=lambda n: (reader.weight_map[n], reader.entry(n)[1].begin)
               if n.endswith("weight_scale") else ("", -1))
    file = ckpt / reader.weight_map[last]
    header, payload = split_safetensors(file.read_bytes())
    begin, end = header[last]["data_offsets"]
    payload = payload[:begin] + bytes.fromhex("807f") * ((end - begin) // 2) + payload[end:]
    file.write_bytes(join_safetensors(header, payload))
    model = KimiModel(KimiConfig(**SMALL))
    before = snapshot(model)
    with pytest.raises(KimiCheckpointError, match=rf"{last.removesuffix('.weight_scale')}: "
                                                  rf"weight_scale has \d+ non-finite"):
        convert_kimi_to_exact(model, ckpt)
    assert_unchanged(model, before)
    assert json.loads((ckpt / "config.json").read_text())["n_routed_experts"] == 4
