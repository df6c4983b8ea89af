"""exactness.stacked: the routed experts held stacked as vLLM keeps them, one custom op. Its bits
are ExactExperts' own (each expert loaded on its own, not through the views), in both blocks;
the views read the stacked tensors in place (a write is seen, a new tensor rebuilds them); its
fake agrees with it (opcheck); a tensor it cannot read gets a typed error naming it. The op in
vLLM's engine is tests/vllm/'s (make test-vllm)."""

from __future__ import annotations

import pytest
import torch

from exactness import stacked
from exactness.contract import ContractTypeError, ShapeError
from exactness.kimi.experts import ExactExperts
from tests.kimi_checkpoints import compressed

pytestmark = pytest.mark.stage("equivalence")  # make verify's stage

E, H, I = 3, 64, 32


def expert_tensors(seed: int = 0) -> list[dict[str, dict[str, torch.Tensor]]]:
    """Each expert's checkpoint tensors: {proj: compressed-tensors' weight_packed, ...}."""
    g = torch.Generator().manual_seed(seed)
    return [{p: compressed(torch.randn(n, k, generator=g) * 0.05)
             for p, (n, k) in (("gate", (I, H)), ("up", (I, H)), ("down", (H, I)))}
            for _ in range(E)]


def stack(experts) -> dict[str, torch.Tensor]:
    """vLLM's stacked layout: gate's rows then up's for w13, down for w2."""
    return {"w13_packed": torch.stack([torch.cat([e["gate"]["weight_packed"],
                                                  e["up"]["weight_packed"]]) for e in experts]),
            "w13_scale": torch.stack([torch.cat([e["gate"]["weight_scale"],
                                                 e["up"]["weight_scale"]]) for e in experts]),
            "w2_packed": torch.stack([e["down"]["weight_packed"] for e in experts]),
            "w2_scale": torch.stack([e["down"]["weight_scale"] for e in experts])}


def loop(experts, block: str) -> ExactExperts:
    """The same experts loaded one by one (the reference: no views)."""
    module = ExactExperts(E, H, I, torch.nn.functional.silu, block=block)
    module.load_state_dict({f"{e}.{p}_proj.{k}": t.clone() for e, x in enumerate(experts)
                            for p, d in x.items() for k, t in d.items()})
    return module


def inputs(rows: int = 5, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, H, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(E + 1, generator=g)[:2] for _ in range(rows)]
                      or [torch.empty(0, 2, dtype=torch.int64)]).view(rows, 2).int()
    return x, ids, torch.rand(rows, 2, generator=g)


def call(t, x, ids, weights, block, name="layer"):
    return stacked.stacked_experts(x, ids, weights, t["w13_packed"], t["w13_scale"],
                                   t["w2_packed"], t["w2_scale"], 16, block, name)


def bits(t):
    return t.view(torch.int16)


@pytest.mark.parametrize("block", ["exact", "transformers"])
def test_the_stacked_op_gives_the_experts_own_bits(block):
    experts = expert_tensors()
    x, ids, weights = inputs()
    got = call(stack(experts), x, ids, weights, block, f"bits-{block}")
    want = loop(experts, block).per_expert(x, ids, weights)
    assert got.abs().sum() > 0
    assert torch.equal(bits(got), bits(want))


def test_the_views_read_the_stacked_tensors_in_place():
    """A write into a stacked tensor (a weight loader's copy_) is seen at the next call; a new
    tensor in its place rebuilds the views; neither is a copy."""
    experts, other = expert_tensors(0), expert_tensors(5)
    x, ids, weights = inputs()
    t = stack(experts)
    before = call(t, x, ids, weights, "exact", "in-place")
    t["w13_scale"].copy_(stack(other)["w13_scale"])  # up's and gate's scales of other experts
    mixed = [{"gate": {**e["gate"], "weight_scale": o["gate"]["weight_scale"]},
              "up": {**e["up"], "weight_scale": o["up"]["weight_scale"]}, "down": e["down"]}
             for e, o in zip(experts, other, strict=True)]
    after = call(t, x, ids, weights, "exact", "in-place")
    assert not torch.equal(bits(before), bits(after))
    assert torch.equal(bits(after), bits(loop(mixed, "exact").per_expert(x, ids, weights)))
    views = stacked.experts_of("in-place", t)
    assert views[1].up_proj.weight_scale.data_ptr() == t["w13_scale"][1, I:].data_ptr()
    t = stack(other)  # new storage: the views follow
    assert torch.equal(bits(call(t, x, ids, weights, "exact", "in-place")),
                       bits(loop(other, "exact").per_expert(x, ids, weights)))


@pytest.mark.parametrize("rows", [0, 1, 5])
def test_the_stacked_ops_fake_agrees_with_it(rows):
    x, ids, weights = inputs(rows)
    t = stack(expert_tensors())
    results = torch.library.opcheck(stacked.stacked_experts, (
        x, ids, weights, t["w13_packed"], t["w13_scale"], t["w2_packed"], t["w2_scale"], 16,
        "exact", f"opcheck-{rows}"))
    assert set(results.values()) == {"SUCCESS"}, results


def test_the_stacked_op_traces_on_fake_cuda_tensors():
    """Under a trace (vLLM's torch.compile) the op's fake sizes its output, on any device."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    shapes = stacked.stacked_shapes(E, H, I)
    with FakeTensorMode():
        fake = {k: torch.empty(s, dtype=torch.int32 if k.endswith("packed") else torch.bfloat16,
                               device="cuda") for k, s in shapes.items()}
        x = torch.empty(7, H, dtype=torch.bfloat16, device="cuda")
        ids = torch.zeros(7, 2, dtype=torch.int32, device="cuda")
        out = call(fake, x, ids, torch.empty(7, 2, device="cuda"), "exact")
    assert out.shape == (7, H) and out.dtype == torch.bfloat16 and out.device.type == "cuda"


@pytest.mark.parametrize("name, change, error, message", [
    ("w13_scale", lambda t: t.half(), ContractTypeError, "w13_scale: dtype torch.float16"),
    ("w2_packed", lambda t: t[:, :, :-1], ShapeError, "w2_packed: shape (3, 64, 3)"),
    ("w13_packed", lambda t: t[0], ShapeError, "w13_packed: shape (64, 8)"),
])
def test_a_stacked_tensor_it_cannot_read_is_named(name, change, error, message):
    t = stack(expert_tensors())
    t[name] = change(t[name])
    x, ids, weights = inputs()
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        call(t, x, ids, weights, "exact", f"bad-{name}")
