"""The plugin in vLLM's real engine (LLM), on a tiny Kimi-format checkpoint: vLLM alone refuses
it on a CPU without AMX; with `quantization="exactness"` it generates, and every MoE call's bits
(captured inside the engine) equal exactness's own experts loaded from the files, and the exact
block's step-by-step reference, in eager and compiled mode and in both blocks."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tests.vllm import engine, kimi_tiny, reference

MODES = [("eager", "exact"), ("compiled", "exact"), ("eager", "transformers"),
         ("compiled", "transformers"), ("avx2", "exact")]  # avx2: eager, the AVX2 build forced
KERNELS = {"avx2": "avx2-grouped"}  # EXACTNESS_KERNEL of a mode: every x86-64 CPU's build


def has_amx() -> bool:
    return torch.cpu._is_amx_tile_supported()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return kimi_tiny.write(tmp_path_factory.mktemp("kimi") / "model")


@pytest.fixture(scope="module")
def runs(model, tmp_path_factory):
    """Each engine's run, started on first use and kept: {(mode, block): its directory}."""
    made = {}

    def get(mode: str, block: str):
        if (mode, block) not in made:
            out = tmp_path_factory.mktemp(f"{mode}-{block}")
            args = ["--block", block] + (["--compile"] if mode == "compiled" else [])
            kernel = {"EXACTNESS_KERNEL": KERNELS[mode]} if mode in KERNELS else {}
            done = engine.run(model, out, *args, env={"VLLM_DISABLE_COMPILE_CACHE": "1",
                                                      **kernel})
            assert done.returncode == 0, done.stderr[-6000:]
            made[mode, block] = out
        return mode, block, made[mode, block]
    return get


@pytest.fixture(params=MODES, ids=["-".join(m) for m in MODES])
def run(request, runs):
    """One engine's run (tests/vllm/engine.py): (mode, block, its output directory)."""
    return runs(*request.param)


def test_vllm_alone_refuses_kimis_int4_experts_on_a_cpu_without_amx(model, tmp_path):
    """The gap the plugin fills: vLLM's own WNA16 MoE backends need AMX (and quantize x to int8)
    or zentorch. Where the CPU has AMX, vLLM serves it, lossy: this test then shows that."""
    done = engine.run(model, tmp_path, "--no-quantization")
    if has_amx():
        assert done.returncode == 0, done.stderr[-4000:]
    else:
        assert done.returncode != 0
        assert "No WNA16 MoE backend supports the deployment configuration" in done.stderr


def test_the_engine_generates_greedily(run):
    _, _, out = run
    result = json.loads((out / "result.json").read_text())
    assert [len(t) for t in result["mixed"]] == [engine.NEW_TOKENS] * len(engine.MIXED)
    assert [len(t) for t in result["alone"]] == [engine.NEW_TOKENS]


def test_every_moe_call_in_the_engine_equals_exactness_own_experts(run, model):
    """Every captured call (each MoE layer, prefill and decode steps, both phases): the plugin's
    output bits equal the per-expert loop of exactness's experts loaded from the checkpoint's
    files, on the captured hidden states, ids and weights; in the exact block, also the suite's
    step-by-step Python reference, on each layer's first call."""
    _, block, out = run
    experts = reference.layers_experts(model, kimi_tiny.routed_experts_layers(), block)
    calls = reference.captures(out / "alone") + reference.captures(out / "mixed")
    layers_seen, stepped = set(), set()
    for call in calls:
        layer = reference.layer_of(call)
        layers_seen.add(layer)
        assert call["out"].abs().sum() > 0, call["file"]  # data, not zeros
        want = experts[layer].per_expert(call["x"], call["ids"], call["weights"])
        same = reference.bits(call["out"]) == reference.bits(want)
        assert same.all(), (f"{call['file']} ({call['layer']}, {tuple(call['x'].shape)}): "
                            f"{int((~same).sum())} outputs differ from the loop")
        if block == "exact" and layer not in stepped:
            stepped.add(layer)
            got = reference.bits(call["out"]).numpy().astype(np.int64) & 0xFFFF
            assert (got == reference.step_by_step(experts[layer], call)).all(), call["file"]
    assert layers_seen == set(kimi_tiny.routed_experts_layers())
    steps = 1 + engine.NEW_TOKENS - 1  # a prefill, then one decode step per token after it
    assert len(calls) == 2 * steps * len(layers_seen)


def test_a_requests_moe_rows_have_the_same_bits_alone_and_among_others(run):
    """Batch invariance in the engine. Every row of every call among requests of other
    lengths, run again alone through the engine's own layer (engine.replay_rows), has the same
    bits. And wherever a prompt's hidden states reach an MoE layer with the same bits alone as
    among the others, its outputs there are the same. (vLLM's bf16 layers before the experts
    are not batch invariant on the CPU, so that happens for a few rows only: it must for some.)"""
    _, _, out = run
    alone, mixed = reference.captures(out / "alone"), reference.captures(out / "mixed")
    for m in mixed:
        same = reference.bits(m["out"]) == reference.bits(m["rows_alone"])
        assert same.all(), (m["file"], int((~same).sum()))
    matched = 0
    for a, m in zip(alone, mixed, strict=True):
        assert a["layer"] == m["layer"]
        rows_m = {bytes(r.view(torch.uint8).numpy()): i for i, r in enumerate(m["x"])}
        for i, row in enumerate(a["x"]):
            j = rows_m.get(bytes(row.view(torch.uint8).numpy()))
            if j is not None:
                matched += 1
                assert torch.equal(reference.bits(a["out"][i]), reference.bits(m["out"][j])), \
                    (a["file"], m["file"], i, j)
    assert matched >= 1


def test_the_experts_hold_the_checkpoints_int4_bytes_and_no_more(run, model):
    """Memory: every routed-expert tensor the engine holds (vLLM's stacked parameters and the
    plugin's views, counted by storage) is the checkpoint's words and scales, plus the 16-byte
    weight_shapes: vLLM's two [E, 2] int64 a layer, and the two the views share."""
    _, _, out = run
    held = json.loads((out / "result.json").read_text())["experts_bytes"]
    config = json.loads((model / "config.json").read_text())
    layers = len(kimi_tiny.routed_experts_layers())
    shapes = layers * (2 * config["n_routed_experts"] + 2) * 16
    assert held - shapes == reference.experts_bytes(model)


@pytest.mark.parametrize("block", ["exact", "transformers"])
def test_the_compiled_graph_calls_the_exact_op(runs, block):
    """In vLLM's default (compiled) mode the experts are the custom op, traced into Dynamo's
    graph through its fake, with no graph break (TORCH_LOGS=graph_code,graph_breaks)."""
    _, _, out = runs("compiled", block)
    log = (out / "engine.log").read_text()
    code = [line for line in log.splitlines() if "[__graph_code]" in line]
    assert any("torch.ops.exactness.stacked_experts(" in line for line in code)
    assert "[__graph_breaks]" not in log
