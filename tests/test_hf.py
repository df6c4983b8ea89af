"""transformers' own Kimi K2 (DeepseekV3) and K2.5 models with exact experts: loaded from
checkpoints that compressed-tensors' compressor wrote, every expert projection bit for bit
against the reference, and refused checkpoints refused through every way in."""

import json

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from exactness import PackedInt4Linear, hf
from exactness.formats import tensor_to_bits
from exactness.kimi import (
    SHARED_OR_DENSE,
    ExactExperts,
    KimiCheckpointError,
    KimiConversionError,
    convert_kimi_to_exact,
)
from exactness.suite.peers.kimi_check import check_checkpoint
from exactness.suite.reference import reference_linear
from tests.hf_checkpoints import TINY, checkpoint_tensors, tiny_model, write
from tests.test_kimi import MALFORMED_HEADERS, MALFORMED_JSON, rewrite_tensor, set_key

pytestmark = pytest.mark.stage("reliability")  # make verify's stage

LAYOUTS = {"k2": False, "k25": True}


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module", params=LAYOUTS)
def checkpoint(request, model, tmp_path_factory):
    return write(tmp_path_factory.mktemp(request.param), model, k25=LAYOUTS[request.param])


def projections(model) -> dict[str, PackedInt4Linear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, PackedInt4Linear)}


def test_from_pretrained_holds_the_checkpoints_int4_tensors_as_stored(checkpoint, model):
    exact = hf.from_pretrained(checkpoint)
    stored = checkpoint_tensors(model)
    layers = projections(exact)
    routed = TINY["n_routed_experts"] * 3 * (TINY["num_hidden_layers"] - 1)
    assert len(layers) == routed
    for name, layer in layers.items():
        for key in ("weight_packed", "weight_scale", "weight_shape"):
            assert torch.equal(getattr(layer, key), stored[f"{name}.{key}"]), (name, key)
    # what stays bf16 is transformers' own, loaded as the checkpoint has it
    assert isinstance(exact.model.layers[1].mlp.experts, ExactExperts)
    assert torch.equal(exact.lm_head.weight, model.lm_head.weight)
    assert torch.equal(exact.model.layers[1].mlp.shared_experts.gate_proj.weight,
                       model.model.layers[1].mlp.shared_experts.gate_proj.weight)
    assert isinstance(exact.model.layers[0].mlp.gate_proj, torch.nn.Linear)


@pytest.mark.parametrize("act_bits", [16, 32])
def test_every_expert_projection_is_bit_identical_to_the_reference(checkpoint, act_bits):
    exact = hf.from_pretrained(checkpoint, act_bits)
    g = torch.Generator().manual_seed(0)
    for name, layer in projections(exact).items():
        x = torch.randn(3, layer.in_features, generator=g).bfloat16()
        want = reference_linear(tensor_to_bits(x), "bfloat16", layer.weight_packed.numpy(),
                                tensor_to_bits(layer.weight_scale), act_bits=act_bits)
        assert layer.act_bits == act_bits
        assert (tensor_to_bits(layer(x)) == want).all(), name


def test_greedy_generation_runs_and_a_rows_logits_ignore_its_batch(checkpoint):
    exact = hf.from_pretrained(checkpoint)
    ids = torch.randint(0, TINY["vocab_size"], (3, 6), generator=torch.Generator().manual_seed(1))
    out = exact.generate(ids[:1], max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 10)
    with torch.no_grad():
        batch, alone = exact(ids).logits, exact(ids[1:2]).logits
    assert torch.equal(batch[1:2], alone)


def test_auto_model_for_causal_lm_loads_kimi_k2_with_exact_experts(tmp_path, model):
    hf.register()
    exact = AutoModelForCausalLM.from_pretrained(write(tmp_path, model))
    assert isinstance(exact.model.layers[1].mlp.experts, ExactExperts)


def kimi_k25_model(text_model):
    """transformers' own Kimi_K25ForConditionalGeneration (a tiny vision tower), its text model
    the weights of `text_model`: names under model.language_model, as K2.5 runs."""
    from transformers.models.kimi_k25.configuration_kimi_k25 import Kimi_K25Config
    from transformers.models.kimi_k25.modeling_kimi_k25 import Kimi_K25ForConditionalGeneration

    vision = dict(patch_size=14, pos_emb_height=4, pos_emb_width=4, num_attention_heads=2,
                  num_hidden_layers=1, hidden_size=64, intermediate_size=128)
    config = Kimi_K25Config(text_config={"model_type": "deepseek_v3", **TINY},
                            vision_config=vision, projection_hidden_size=64,
                            tie_word_embeddings=False)
    model = Kimi_K25ForConditionalGeneration(config).to(torch.bfloat16).eval()
    text = model.model.language_model
    text.rotary_emb = type(text.rotary_emb)(text.config)  # fp32, as computed (see tiny_model)
    model.model.language_model.load_state_dict(text_model.model.state_dict())
    model.lm_head.load_state_dict(text_model.lm_head.state_dict())
    return model


def test_convert_a_transformers_model_in_place(checkpoint, model, monkeypatch):
    """convert_kimi_to_exact on transformers' own model (K2: DeepseekV3ForCausalLM; K2.5:
    Kimi_K25ForConditionalGeneration): the fused experts become ExactExperts, built on meta
    (no memory) and loaded from the shards; the bf16 rest is left as it was, and only the
    shared and dense MLP's projections are listed so; the logits are from_pretrained's."""
    import copy

    built, like = [], ExactExperts.like

    def building(*args, **kwargs):
        experts = like(*args, **kwargs)
        built.append({t.device.type for t in experts.buffers()})
        return experts

    monkeypatch.setattr(ExactExperts, "like", building)
    k25 = "kimi_k25" in (checkpoint / "config.json").read_text()
    target = kimi_k25_model(model) if k25 else copy.deepcopy(model)
    report = convert_kimi_to_exact(target, checkpoint)
    assert report.routed_loaded == TINY["n_routed_experts"] * 3
    assert built and all(devices == {"meta"} for devices in built)
    assert report.left_bf16 and all(SHARED_OR_DENSE.search(n) for n in report.left_bf16)
    ids = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        assert torch.equal(target(input_ids=ids).logits,
                           hf.from_pretrained(checkpoint)(ids).logits)


def test_convert_without_a_checkpoint_builds_on_the_models_device(model):
    """Without a checkpoint the fused experts' ExactExperts are built where the model is (not
    on meta, as for loading), so the converted model runs at once."""
    import copy

    target = copy.deepcopy(model)
    report = convert_kimi_to_exact(target)
    assert report.routed_loaded == 0 and report.routed_converted == TINY["n_routed_experts"] * 3
    assert {t.device.type for t in (*target.parameters(), *target.buffers())} == {"cpu"}
    with torch.no_grad():
        assert target(input_ids=torch.tensor([[5, 6, 7]])).logits.isfinite().all()


def test_the_cli_checks_a_transformers_written_checkpoint(checkpoint, capsys):
    assert check_checkpoint(checkpoint, tokens=2) == 0
    assert "PASSED" in capsys.readouterr().out


# --------------------------------------------------------------------------- refused

def damaged(directory, name, change):
    """The checkpoint with tensor `name` changed by change(tensor) -> tensor, or None: dropped
    from its shard and the index (the model's tensor is then missing, not misplaced)."""
    from safetensors.torch import load_file

    index_file = directory / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    key = next(k for k in index["weight_map"] if k.endswith(name))
    new = change(load_file(str(directory / index["weight_map"][key]))[key])
    rewrite_tensor(directory, key, new)
    if new is None:
        del index["weight_map"][key]
        index_file.write_text(json.dumps(index))


REFUSED = {
    "inf-scale": ("layers.1.mlp.experts.3.up_proj.weight_scale",
                  lambda t: t.index_fill(1, torch.tensor([0]), float("inf")), "weight_scale"),
    "fp16-scale": ("layers.1.mlp.experts.0.down_proj.weight_scale", lambda t: t.half(),
                   "dtype"),
    "packed-too-short": ("layers.1.mlp.experts.2.gate_proj.weight_packed",
                         lambda t: t[:, :-1].contiguous(), "shape"),
    "attention-missing": ("layers.0.self_attn.o_proj.weight", lambda t: None, "missing"),
    "norm-of-another-shape": ("model.norm.weight", lambda t: t[:-1].contiguous(), "shape"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_a_bad_checkpoint_is_refused_by_from_pretrained(tmp_path, model, case):
    name, change, says = REFUSED[case]
    directory = write(tmp_path, model)
    damaged(directory, name, change)
    with pytest.raises(KimiCheckpointError, match=says):
        hf.from_pretrained(directory)


@pytest.mark.parametrize(**MALFORMED_JSON)
def test_malformed_json_is_refused_by_from_pretrained(tmp_path, model, file, change, match):
    """test_kimi's malformed config.json and index, through from_pretrained."""
    directory = write(tmp_path, model)
    if isinstance(change, str):
        (directory / file).write_text(change)
    else:
        set_key(directory / file, *change)
    with pytest.raises(KimiCheckpointError, match=match):
        hf.from_pretrained(directory)


@pytest.mark.parametrize(**MALFORMED_HEADERS)
def test_malformed_headers_are_refused_by_from_pretrained(tmp_path, model, change, match):
    """test_kimi's malformed safetensors headers, in one shard of the transformers checkpoint."""
    directory = write(tmp_path, model)
    file = sorted(directory.glob("*.safetensors"))[0]
    file.write_bytes(change(file.read_bytes()))
    # this shard's name, and its first tensor's dtype (bf16 here, not int32)
    match = match.replace("model.safetensors", r"\.safetensors").replace(" of I32", " of ")
    with pytest.raises(KimiCheckpointError, match=match):
        hf.from_pretrained(directory)


def test_a_tensor_no_module_takes_is_refused(tmp_path, model):
    extra = {"model.layers.1.mlp.experts.99.gate_proj.weight": torch.zeros(2, 2).bfloat16()}
    with pytest.raises(KimiCheckpointError, match="no module of the model takes"):
        hf.from_pretrained(write(tmp_path, model, extra=extra))


def test_a_model_matching_no_routed_expert_is_refused(checkpoint):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(KimiConversionError, match="nothing would be converted"):
        convert_kimi_to_exact(model, checkpoint)


def test_every_projection_is_on_the_device_asked_for(checkpoint):
    exact = hf.from_pretrained(checkpoint, device="cpu")
    devices = {t.device.type for t in (*exact.parameters(), *exact.buffers())}
    assert devices == {"cpu"}
    with torch.no_grad():
        assert np.isfinite(exact(torch.tensor([[1, 2]])).logits.float().numpy()).all()


def test_layers_build_on_meta_and_under_a_device_context():
    """No data is made for a layer built on meta (K2 builds 69,120 of them before loading)."""
    with torch.device("meta"):
        experts = ExactExperts(4, 64, 32, torch.nn.SiLU())
    explicit = PackedInt4Linear(64, 32, device="meta")
    assert {b.device.type for b in (*experts.buffers(), *explicit.buffers())} == {"meta"}
    assert len(list(experts)) == len(experts) == 4
    zeros = PackedInt4Linear(64, 32)  # on the CPU: zero weights until a checkpoint loads
    assert (zeros(torch.ones(2, 64)) == 0).all()
