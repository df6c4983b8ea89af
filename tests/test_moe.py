"""One exact call per MoE layer (exactness.moe): the grouped kernels against the reference and the
per-expert loops, bit for bit, for any routing; the block's batch invariance; what the grouped
call does with what it cannot compute; one read-back per call on the GPU's path."""

import re
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from exactness import ExactLinear, PackedInt4Linear, glue, moe, ops
from exactness.contract import (
    BFLOAT16,
    ContractTypeError,
    ContractValueError,
    ExactnessError,
    NonFiniteError,
    ShapeError,
)
from exactness.formats import bits_to_tensor, finite_mask, pack_weights, tensor_to_bits
from exactness.kernels import REGISTRY, KernelUnavailableError, registry
from exactness.kernels.cpu import vnni, vnni_library
from exactness.kernels.registry import no
from exactness.kernels.routing import route
from exactness.kimi import ExactExperts, KimiConfig, KimiMoE, KimiRouter
from exactness.suite.cases import LinearCase, MoECase
from exactness.suite.counterexamples import check_bits
from exactness.suite.moe_reference import exact_block
from exactness.suite.paths import available_paths, device_of, grouped_paths, held_act_bits, run
from exactness.suite.strategies import (
    moe_cases,
    routed_cases,
    routings,
    seeds,
)
from tests.test_modules import skip_unless_here

pytestmark = pytest.mark.stage("equivalence")  # make verify's stage

GROUPED = [kernel.name for kernel in REGISTRY if kernel.grouped]
BACKEND_OF = {kernel.name: kernel.family for kernel in REGISTRY if kernel.grouped}
ALL_BACKENDS = ("cpu", "triton")


def examples(backend: str, share: int, most: int):
    """A property's examples on `backend`: the profile's, divided by `share`, at most `most`
    (the thorough profile's 2000 would take an hour of interpreted Triton)."""
    cost = 3 if backend == "triton" else 1
    return settings(max_examples=max(10 // cost, min(
        settings.default.max_examples // (share * cost), most // cost)))


# --------------------------------------------------------------------------- one projection

@pytest.mark.parametrize("path", GROUPED)
def test_grouped_projection_matches_reference(path):
    """A grouped call (every expert's routed rows, gate and up as two parts or one projection)
    against the reference of all the experts' outputs, each row's routed ones kept: empty
    experts, one expert in every token, padded slots, slots in any order, slow rows."""
    skip_unless_here(path)

    @examples(BACKEND_OF[path], 1, 1200)
    @given(routed_cases(max_experts=5, max_rows=12, act_bits_=held_act_bits(path)))
    def check(case):
        check_bits(case, path, run(case, path), run(case, "reference"))

    check()


@pytest.mark.parametrize("path", GROUPED)
def test_grouped_projection_at_kimis_k_with_one_expert_taking_every_token(path):
    """K = 7168 (Kimi's gate and up), two experts of two parts, the second taking every token
    and the first none; bf16 scales over two binades. On the CPU 24 tokens: the span kernel's
    rows (vnni.SPAN_MIN_ROWS)."""
    skip_unless_here(path)
    rng = np.random.default_rng(0)
    rows, k, n = (vnni.SPAN_MIN_ROWS if path == "vnni-grouped" else 2), 7168, 2 * 2 * 64
    q = rng.integers(-8, 8, (n, k))
    x = rng.integers(0x3C00, 0x4000, (rows, k)) | (rng.integers(0, 2, (rows, k)) << 15)
    case = LinearCase(x, BFLOAT16, q, pack_weights(q, 4),
                      0x3C00 + rng.integers(0, 256, (n, k // 32)), 16, BFLOAT16, 4,
                      routing=np.ones((rows, 1), np.int64), experts=2, parts=2)
    check_bits(case, path, run(case, path), run(case, "reference"))


# --------------------------------------------------------------------------- the whole block

def load(layer, packed: np.ndarray, scales: np.ndarray) -> None:
    layer.load_state_dict({"weight_packed": torch.from_numpy(np.ascontiguousarray(packed)),
                           "weight_scale": bits_to_tensor(scales, "bfloat16"),
                           "weight_shape": torch.tensor([layer.out_features,
                                                         layer.in_features])})


def experts_of(case, backend: str = "cpu") -> ExactExperts:
    """transformers' experts module, exact, holding `case`'s weights (cases.MoECase)."""
    experts = ExactExperts(case.experts, case.hidden, case.inter, torch.nn.SiLU(),
                           case.act_bits, block=case.block)
    (gate_up, gate_up_scales), (down, down_scales) = case.gate_up, case.down
    i, h = case.inter, case.hidden
    for e, expert in enumerate(experts):
        load(expert.gate_proj, gate_up[2 * i * e:2 * i * e + i], gate_up_scales[2 * i * e:][:i])
        load(expert.up_proj, gate_up[2 * i * e + i:2 * i * (e + 1)],
             gate_up_scales[2 * i * e + i:][:i])
        load(expert.down_proj, down[h * e:h * (e + 1)], down_scales[h * e:h * (e + 1)])
    set_backend(experts, backend)
    return experts


def set_backend(module, backend: str) -> None:
    """Every exact layer of `module` on `backend`, the module moved to where that backend runs
    (the suite's device: exactness.suite.device)."""
    for layer in module.modules():
        if hasattr(layer, "backend"):
            layer.backend = backend
    module.to(device_of(backend) or "cpu")


def on(module, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """`tensors` moved to `module`'s device."""
    device = next(module.buffers()).device
    return tuple(t.to(device) for t in tensors)


def inputs(case, module=None):
    """x, top_k_index and top_k_weights of `case`, on `module`'s device where given."""
    tensors = (bits_to_tensor(case.x_bits, case.x_format), torch.from_numpy(case.routing),
               torch.from_numpy(case.top_k_weights))
    return tensors if module is None else on(module, *tensors)


def outcome(call):
    """The output's bits, or the error it raised (its type and message)."""
    try:
        return tensor_to_bits(call()), None
    except ExactnessError as e:
        return None, (type(e).__name__, str(e))


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_grouped_experts_match_transformers_loop(backend):
    """transformers' experts module (ExactExperts), in either block: one grouped call per
    projection gives the bits of its per-expert loop (in the transformers block, transformers'
    own loop over the exact layers), errors included; in the exact block, those of its
    step-by-step reference (suite.moe_reference) too. On a difference, each projection is
    checked against the reference, and the first that differs is written as a counterexample
    file."""
    skip_unless_backend(backend)
    cases = moe_cases(act_bits_=held_act_bits(backend))  # triton: not 32 bits (test_act32.py)
    examples(backend, 2, 600)(given(cases)(lambda case: check_experts(backend, case)))()


def check_experts(backend: str, case) -> None:
    experts = experts_of(case, backend)
    grouped = outcome(lambda: experts(*inputs(case, experts)))
    set_backend(experts, "cpu")
    loop = outcome(lambda: experts.per_expert(*inputs(case)))
    if grouped[1] or loop[1]:
        assert grouped[1] == loop[1]
        return
    if not (grouped[0] == loop[0]).all():
        explain(case, grouped_path(backend))
        raise AssertionError(f"{case!r}: the grouped call differs from the loop, though each "
                             f"projection matches the reference: the activation or the "
                             f"weighted sum")
    if case.block == "exact":
        assert_same_bits(grouped[0], exact_block(case), case.x_format, case)


def assert_same_bits(got: np.ndarray, want: np.ndarray, fmt, case) -> None:
    """Bit for bit, any NaN for a NaN (the reference's is the canonical one)."""
    nan_got, nan_want = ~finite_mask(got, fmt), ~finite_mask(want, fmt)
    nan_got &= (got & ((1 << fmt.mant_bits) - 1)) != 0
    nan_want &= (want & ((1 << fmt.mant_bits) - 1)) != 0
    same = np.where(nan_want, nan_got, got == want)
    if not same.all():
        t, c = map(int, np.argwhere(~same)[0])
        raise AssertionError(f"{case!r}: the exact block's output ({t}, {c}) is {got[t, c]:#x}, "
                             f"its reference's {want[t, c]:#x} ({int((~same).sum())} differ)")


def grouped_path(backend: str) -> str:
    return next(name for name, family in BACKEND_OF.items() if family == backend)


def skip_unless_backend(backend: str) -> None:
    skip_unless_here(grouped_path(backend))


def explain(case, path: str) -> None:
    """Each projection of `case` on `path` against the reference (check_bits writes the first
    that differs as a counterexample file and raises)."""
    gate_up = case.gate_up_case()
    check_bits(gate_up, path, run(gate_up, path), run(gate_up, "reference"))
    t, top_k = case.routing.shape
    up_and_gate = bits_to_tensor(run(gate_up, "reference"), case.inner_format)
    i = case.inter
    step = glue.exact_activation if case.block == "exact" else glue.activation
    h = [], []
    for token in range(t):
        for slot in range(top_k):
            e = int(case.routing[token, slot])
            if e < case.experts:
                block = up_and_gate[token, slot * 2 * i:(slot + 1) * 2 * i]
                h[0].append(step(torch.nn.functional.silu, block[None, :i], block[None, i:])[0])
                h[1].append(e)
    if h[0]:
        down = case.down_case(tensor_to_bits(torch.stack(h[0])), np.array(h[1]))
        check_bits(down, path, run(down, path), run(down, "reference"))


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_a_tokens_output_does_not_depend_on_the_other_tokens(backend):
    """The block's batch invariance: token t alone (its own routing) gives its row of the
    batch, in any order of the batch."""
    skip_unless_backend(backend)
    examples(backend, 3, 300)(given(moe_cases(max_tokens=6), st.data())(
        lambda case, data: check_batch_invariance(backend, case, data)))()


def check_batch_invariance(backend: str, case, data) -> None:
    experts = experts_of(case, backend)
    x, ids, weights = inputs(case, experts)
    batch = outcome(lambda: experts(x, ids, weights))
    if batch[1]:
        return
    order = torch.from_numpy(np.random.default_rng(data.draw(seeds)).permutation(x.shape[0]))
    order = order.to(x.device)
    shuffled = tensor_to_bits(experts(x[order], ids[order], weights[order]))
    assert (shuffled == batch[0][order.cpu().numpy()]).all()
    t = data.draw(st.integers(0, x.shape[0] - 1))
    alone = outcome(lambda: experts(x[t:t + 1], ids[t:t + 1], weights[t:t + 1]))
    assert alone[1] is None and (alone[0][0] == batch[0][t]).all()


def kimi_moe(seed: int = 0, hidden: int = 64, inter: int = 32, experts: int = 6,
             top_k: int = 3, act_bits: int = 16) -> KimiMoE:
    """exactness.kimi's MoE block with random weights: exact routed experts, shared experts
    and router in bf16 (fp32 for the router's bias)."""
    config = KimiConfig(hidden_size=hidden, moe_intermediate_size=inter, n_routed_experts=experts,
                        num_experts_per_tok=top_k, exact_act_bits=act_bits)
    block = KimiMoE(config)
    rng = np.random.default_rng(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.from_numpy(rng.standard_normal(p.shape) * 0.2).to(p.dtype))
    for expert in block.experts:
        for layer in (expert.gate_proj, expert.up_proj, expert.down_proj):
            n, k = layer.out_features, layer.in_features
            load(layer, pack_weights(rng.integers(-8, 8, (n, k)), 4),
                 0x3C00 + rng.integers(0, 256, (n, k // 32)))
    return block


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_kimi_moe_grouped_matches_its_per_expert_loop(backend):
    skip_unless_backend(backend)
    block = kimi_moe()
    set_backend(block, backend)
    x = torch.from_numpy(np.random.default_rng(1).standard_normal((9, 64))).bfloat16()
    grouped = block(*on(block, x))
    block.grouped = False
    set_backend(block, "cpu")
    assert (tensor_to_bits(grouped) == tensor_to_bits(block(x))).all()
    assert torch.count_nonzero(grouped) > 0


def spy_grouped(monkeypatch) -> list:
    """The C grouped kernel's calls, as they come: (x's shape, whether it got moe.WORKSPACE)."""
    calls, real = [], vnni.GROUPED.run_grouped
    monkeypatch.setattr(type(vnni.GROUPED), "run_grouped", lambda self, *a: (
        calls.append((a[0].shape, a[7] is moe.WORKSPACE)), real(*a))[1])
    return calls


def test_the_models_take_the_grouped_call_by_default(monkeypatch):
    """KimiMoE and ExactExperts run their experts through one grouped call per projection."""
    calls = spy_grouped(monkeypatch)
    skip_unless_here("vnni-grouped")
    block = kimi_moe()
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0)).bfloat16()
    grouped = block(x)
    assert len(calls) == 2  # gate and up, then down
    assert ExactExperts(2, 64, 32, torch.nn.SiLU()).grouped
    block.grouped = False  # transformers' loop, and no grouped call
    assert torch.equal(block(x), grouped) and len(calls) == 2
    block.grouped = True  # gate and up of two widths: the grouped call runs the loop instead
    for expert in block.experts:  # (every expert: one no token routes to is never read)
        expert.gate_proj.act_bits = 8
    other = block(x)
    block.grouped = False
    assert torch.equal(other, block(x)) and len(calls) == 2


@pytest.mark.parametrize("act_bits", [16, 32])
def test_ordinary_calls_never_fall_back_to_the_loop(monkeypatch, act_bits):
    """The grouped call and the per-expert loop give the same bits, so only the path taken tells
    them apart: every ordinary call takes exactly two grouped calls and never the loop. Padding
    slots, a token routed nowhere, slow rows, int32 ids, an fp32 x, a gradient, one token."""
    skip_unless_here("vnni-grouped")
    calls = spy_grouped(monkeypatch)

    def loop(*args):
        raise AssertionError("the per-expert loop ran")

    experts = experts_of(zero_case(3))
    experts.per_expert = loop
    for layer in (layer for e in experts for layer in (e.gate_proj, e.up_proj, e.down_proj)):
        layer.act_bits = act_bits
    scale = experts[1].up_proj.weight_scale  # slow rows: a spread of 64
    scale.data.copy_(bits_to_tensor(np.where(np.arange(scale.numel()).reshape(scale.shape) % 2,
                                             0x3F80, 0x1F80), "bfloat16"))
    g = torch.Generator().manual_seed(act_bits)
    x = torch.randn(4, 64, generator=g)
    ids = torch.tensor([[0, 1], [1, 3], [3, 3], [2, 0]], dtype=torch.int32)
    weights = torch.rand(4, 2, generator=g)
    for x_, ids_, w_ in ((x.bfloat16(), ids, weights), (x, ids, weights),
                         (x.bfloat16().requires_grad_(), ids, weights),
                         (x[:1].bfloat16(), ids[:1], weights[:1])):
        calls.clear()
        moe.WORKSPACE.clear()
        y = experts(x_, ids_, w_)
        assert len(calls) == 2 and all(kept for _, kept in calls), calls  # gate/up, down
        want = ExactExperts.per_expert(experts, x_.detach(), ids_, w_)
        assert (tensor_to_bits(y.detach()) == tensor_to_bits(want)).all()
        assert torch.count_nonzero(y) > 0
        # the CPU's buffers are the workspace's: h holds the routed rows' activations, and the
        # next call of the same size allocates nothing
        kept = {slot: b.data_ptr() for slot, b in moe.WORKSPACE.buffers.items()}
        routed = int((ids_ < 3).sum())
        assert set(kept) == {"x", "y", "h"}
        assert moe.WORKSPACE.buffers["h"].numel() == routed * 32 * x_.dtype.itemsize
        experts(x_, ids_, w_)
        assert kept == {slot: b.data_ptr() for slot, b in moe.WORKSPACE.buffers.items()}


def test_the_loop_runs_where_the_grouped_call_has_no_path(monkeypatch):
    """Under jit tracing, for an x not [tokens, hidden] and for no tokens, experts_forward hands
    the call to the per-expert loop (whose result or error it returns as it is)."""
    experts = experts_of(zero_case(2))
    loop = object()

    def call(x, ids):
        return moe.experts_forward(experts, experts.act_fn, x, ids, torch.ones(ids.shape),
                                   torch.bfloat16, lambda: loop)

    ids = torch.tensor([[0, 1], [1, 0]])
    assert call(torch.ones(1, 2, 64).bfloat16(), ids) is loop
    assert call(torch.ones(0, 64).bfloat16(), ids[:0]) is loop
    assert call(torch.ones(2, 64).bfloat16(), ids) is not loop
    monkeypatch.setattr(torch.jit, "is_tracing", lambda: True)
    assert call(torch.ones(2, 64).bfloat16(), ids) is loop


@pytest.mark.parametrize("ids, weights", [([[0, 1], [1, 0], [0, 1]], [[1, 1]] * 3),
                                          ([[0, 1], [1, 0]], [[1, 1, 1]] * 2),
                                          ([0, 1], [1, 1])],
                         ids=["tokens", "top_k", "one-dimensional"])
def test_routing_that_disagrees_with_x_is_a_typed_error(ids, weights):
    experts = experts_of(zero_case(2))
    ids, weights = torch.tensor(ids), torch.tensor(weights, dtype=torch.float32)
    says = (f"hidden_states (2, 64), top_k_index {tuple(ids.shape)} and top_k_weights "
            f"{tuple(weights.shape)} disagree on tokens or top_k")
    with pytest.raises(ShapeError, match=re.escape(says)):
        experts(torch.ones(2, 64).bfloat16(), ids, weights)


def test_an_expert_no_token_routes_to_is_never_read(monkeypatch):
    """As in the per-expert loop, an expert without rows is never read, nor its widths taken:
    no token routes to expert 0, which has a broken weight_shape, then another act_bits. The
    grouped call still runs, twice, with the loop's bits."""
    skip_unless_here("vnni-grouped")
    calls = spy_grouped(monkeypatch)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(5)).bfloat16()
    ids, weights = torch.tensor([[1, 2], [2, 3], [1, 3]]), torch.rand(3, 2)
    for broken in ("weight_shape", "act_bits"):
        experts = experts_of(zero_case(3))
        if broken == "weight_shape":
            experts[0].down_proj.weight_shape.data.copy_(torch.tensor([64, 31]))
        else:
            for layer in (experts[0].gate_proj, experts[0].up_proj, experts[0].down_proj):
                layer.act_bits = 8
        want = experts.per_expert(x, ids, weights)
        calls.clear()
        assert (tensor_to_bits(experts(x, ids, weights)) == tensor_to_bits(want)).all()
        assert len(calls) == 2 and torch.count_nonzero(want) > 0, broken


# --------------------------------------------------------------------------- routing

@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("ids, says", [([[0, 5]], r"outside \[0, 4\]"),
                                       ([[-1, 0]], r"outside \[0, 4\]"),
                                       ([[2, 2]], "names expert 2 twice for token 0")],
                         ids=["past-padding", "negative", "repeated"])
def test_refused_routing_is_a_typed_error_on_both_paths(backend, ids, says):
    """The loop and the CPU's grouped call raise, naming the id; the GPU's call, which reads
    nothing back, gives the token's outputs the canonical NaN, and the other tokens their bits."""
    skip_unless_backend(backend)
    experts = experts_of(zero_case(4, tokens=2), backend)
    x, weights, routing = on(experts, torch.ones(2, 64).bfloat16(), torch.ones(2, 2),
                             torch.tensor([*ids, [0, 1]]))
    with pytest.raises(ContractValueError, match=says):
        experts.per_expert(x, routing, weights)
    if backend == "cpu":
        with pytest.raises(ContractValueError, match=says):
            experts(x, routing, weights)
        return
    y = tensor_to_bits(experts(x, routing, weights))
    assert (y[0] == BFLOAT16.nan_bits).all()
    assert (y[1] == tensor_to_bits(experts.per_expert(x[1:], routing[1:], weights[1:]))).all()


def zero_case(experts: int, tokens: int = 1) -> MoECase:
    """All-one weights and unit scales: only the shapes matter to the tests that take it."""
    packed = pack_weights(np.ones((2 * 32 * experts, 64), np.int64), 4)
    down = pack_weights(np.ones((64 * experts, 32), np.int64), 4)
    return MoECase(np.zeros((tokens, 64), np.int64), BFLOAT16, 16,
                   np.zeros((tokens, 1), np.int64), np.ones((tokens, 1), np.float32), experts,
                   (packed, np.full((packed.shape[0], 2), 0x3F80)),
                   (down, np.full((down.shape[0], 1), 0x3F80)))


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_padding_slots_and_tokens_routed_nowhere_add_nothing(backend):
    """transformers' padding id E (expert parallelism) routes a slot nowhere; a token routed
    nowhere gets zeros, a NaN in it harms nothing (no expert reads it), and a call routing
    nothing at all is zeros."""
    skip_unless_backend(backend)
    experts = experts_of(zero_case(3), backend)
    x = torch.randn(3, 64).bfloat16()
    x[2, 5] = float("nan")
    x, ids, ones = on(experts, x, torch.tensor([[0, 3], [3, 3], [3, 3]]), torch.ones(3, 2))
    y = experts(x, ids, ones)
    assert torch.equal(y, experts.per_expert(x, ids, ones))
    assert bool((y[1:] == 0).all()) and bool((y[0] != 0).any())
    assert torch.equal(experts(x[1:], ids[1:], ones[1:]), torch.zeros_like(y[1:]))


@given(st.integers(1, 6), st.integers(1, 5), st.data())
def test_routing_sorts_the_pairs_by_expert_and_counts_them(tokens, experts, data):
    top_k = data.draw(st.integers(1, experts))
    ids = torch.from_numpy(data.draw(routings(tokens, experts, top_k)))
    routing = route(ids, experts)
    flat = ids.reshape(-1)
    experts_of_rows = flat[routing.pair]
    assert (experts_of_rows[1:] >= experts_of_rows[:-1]).all()  # expert order
    same = experts_of_rows[1:] == experts_of_rows[:-1]
    assert (routing.pair[1:][same] > routing.pair[:-1][same]).all()  # then token, slot
    counts = torch.bincount(flat, minlength=experts + 1)
    assert routing.offsets.tolist() == [0, *counts.cumsum(0).tolist()]
    assert int(routing.bad) == 0


def test_routing_counts_refused_ids_where_it_may_not_read_them():
    ids = torch.tensor([[0, 0], [1, 9], [2, -3]])
    assert int(route(ids, 3, check=False).bad) == 3
    with pytest.raises(ContractValueError, match="outside"):
        route(ids, 3)
    # the meta device holds no values: routing there proves no step reads one back
    meta = route(ids.to("meta"), 3, check=False)
    assert {t.device.type for t in (meta.key, meta.pair, meta.offsets, meta.bad)} == {"meta"}


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.int16])
def test_routing_takes_any_integer_ids_and_gives_int64(dtype):
    """vLLM's topk_ids are int32; the grouped kernels read int64 (docs/MUTMUT.md)."""
    ids = torch.tensor([[2, 0], [1, 3], [0, 2]])
    want, got = route(ids, 3), route(ids.to(dtype), 3)
    for name in ("key", "pair", "offsets"):
        assert getattr(got, name).dtype == torch.int64
        assert torch.equal(getattr(got, name), getattr(want, name))


@pytest.mark.parametrize("ids, error, says", [
    ([[0, 1]], ShapeError, r"\[tokens, top_k\] tensor, got list"),
    (torch.tensor([0, 1]), ShapeError, r"got torch.Size\(\[2\]\)"),
    (torch.zeros(2, 2, 1, dtype=torch.int64), ShapeError, r"got torch.Size\(\[2, 2, 1\]\)"),
    (torch.zeros(2, 2), ContractTypeError, "integer expert ids, got torch.float32"),
    (torch.zeros(2, 2, dtype=torch.bool), ContractTypeError, "got torch.bool"),
    (torch.zeros(2, 2, dtype=torch.complex64), ContractTypeError, "got torch.complex64"),
])
def test_routing_of_a_wrong_shape_or_type_is_a_typed_error(ids, error, says):
    with pytest.raises(error, match=says):
        route(ids, 4)


# --------------------------------------------------------------------------- what it cannot do

@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_a_non_finite_input_gives_the_loops_nan_rows_or_its_error(backend):
    """An inf in x, and an inf met by down (gate and up overflowed): the grouped call takes the
    loop where it meets either, so its NaN rows are the loop's bits (contract v1.2), and with
    strict layers it raises what the loop raises."""
    skip_unless_backend(backend)
    experts = experts_of(zero_case(2), backend)
    ids, weights = torch.tensor([[1, 0], [0, 2]]), torch.ones(2, 2)
    x = torch.randn(2, 64).bfloat16()
    x[1, 7] = float("inf")
    huge = torch.full((2, 64), 3e38).bfloat16()
    for inputs_ in ((x, ids, weights), (huge, ids, weights)):
        inputs_ = on(experts, *inputs_)
        got, want = (tensor_to_bits(call(*inputs_)) for call in (experts, experts.per_expert))
        assert (got == want).all() and not finite_mask(got[1], BFLOAT16).any()
    for layer in experts.modules():
        if isinstance(layer, PackedInt4Linear):
            layer.strict = True
    for inputs_ in ((x, ids, weights), (huge, ids, weights)):
        inputs_ = on(experts, *inputs_)
        errors = []
        for call in (experts, experts.per_expert):
            with pytest.raises(NonFiniteError) as raised:
                call(*inputs_)
            errors.append(str(raised.value))
        assert errors[0] == errors[1]


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_slow_rows_and_writes_through_any_door_are_seen(backend):
    """An expert whose scales spread wider than any fast kernel holds (its slow rows come from
    `wide`), and weights written in place between calls (param.data.copy_): the call gives the
    bits of a fresh copy's loop, which derives everything from the weights as they are now."""
    import copy

    skip_unless_backend(backend)
    experts = experts_of(zero_case(3), backend)
    x, ids, weights = on(experts, torch.randn(4, 64).bfloat16(),
                         torch.tensor([[0, 1], [1, 2], [2, 0], [1, 0]]), torch.rand(4, 2))
    scale = experts[1].up_proj.weight_scale
    scale.data.copy_(bits_to_tensor(np.where(np.arange(scale.numel()).reshape(scale.shape) % 2,
                                             0x3F80, 0x1F80), "bfloat16"))  # 2**-64: spread 64
    assert experts[1].up_proj.certificate.slow_rows.numel()
    for _ in range(2):
        y = experts(x, ids, weights)
        fresh = copy.deepcopy(experts)  # (a copy holds the same buffers)
        set_backend(fresh, "cpu")
        assert torch.equal(y.cpu(), fresh.per_expert(*(t.cpu() for t in (x, ids, weights))))
        experts[2].down_proj.weight_packed.data.copy_(
            torch.from_numpy(pack_weights(np.full((64, 32), -3), 4)))


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_experts_of_other_widths_run_the_loop(backend):
    skip_unless_backend(backend)
    experts = experts_of(zero_case(2), backend)
    experts[1].down_proj.act_bits = 8
    x, ids, weights = torch.randn(2, 64).bfloat16(), torch.tensor([[0, 1], [1, 0]]), \
        torch.ones(2, 2)
    y = experts(*on(experts, x, ids, weights))
    set_backend(experts, "cpu")
    assert torch.equal(y.cpu(), experts.per_expert(x, ids, weights))


def test_no_grouped_kernel_here_warns_once_and_runs_the_loop(monkeypatch):
    x, ids, weights = torch.randn(2, 64).bfloat16(), torch.tensor([[0, 1], [1, 0]]), \
        torch.ones(2, 2)
    want = experts_of(zero_case(2)).per_expert(x, ids, weights)
    for build in vnni_library.BUILDS:
        monkeypatch.setattr(build, "status", lambda: (None, no("the CPU lacks avx512_vnni")))
    registry.warn_fallback.cache_clear()
    registry.warn_fallback.cache_clear()
    monkeypatch.setattr(ops, "PLANS", {})  # (the forwards' plans: new ones, without C)
    experts = experts_of(zero_case(2))
    with pytest.warns(registry.FallbackWarning, match="grouped MoE kernel is not used.*lacks"):
        assert torch.equal(experts(x, ids, weights), want)
    with warnings.catch_warnings():
        warnings.simplefilter("error", registry.FallbackWarning)
        experts(x, ids, weights)  # once
    registry.warn_fallback.cache_clear()
    registry.warn_fallback.cache_clear()


def test_the_workspace_keeps_a_buffer_per_slot_and_grows_it():
    """A slot's buffer serves every call that fits it (same memory), grows for one that does
    not, and follows the device; each slot is its own."""
    space = moe.Workspace()
    a = space.get("y", (4, 8), torch.bfloat16, "cpu")
    assert (a.shape, a.dtype, a.device.type) == ((4, 8), torch.bfloat16, "cpu")
    assert space.get("y", (2, 16), torch.bfloat16, "cpu").data_ptr() == a.data_ptr()
    assert space.get("y", (16,), torch.float32, "cpu").data_ptr() == a.data_ptr()  # 64 bytes
    assert space.get("x", (4, 8), torch.bfloat16, "cpu").data_ptr() != a.data_ptr()
    bigger = space.get("y", (5, 8), torch.bfloat16, "cpu")
    assert bigger.shape == (5, 8) and space.buffers["y"].numel() == 80
    meta = space.get("y", (5, 8), torch.bfloat16, "meta")
    assert meta.device.type == "meta" and space.buffers["y"].device.type == "meta"
    space.clear()
    assert not space.buffers and not moe.Workspace().buffers


def test_the_weighted_sum_and_routing_stay_on_the_device_of_the_rows():
    """weighted_sum makes every tensor on the rows' device (meta here: nothing is computed,
    nothing is read back)."""
    routing = route(torch.tensor([[0, 1], [1, 2]], device="meta"), 3)
    rows = torch.empty(4, 8, dtype=torch.bfloat16, device="meta")
    out = glue.weighted_sum(rows, routing, torch.empty(2, 2, device="meta"), torch.float32)
    assert (out.shape, out.dtype, out.device.type) == ((2, 8), torch.float32, "meta")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_activation_writes_into_the_buffer_it_is_given(dtype):
    g = torch.Generator().manual_seed(7)
    gate, up = (torch.randn(3, 64, generator=g).to(dtype) for _ in range(2))
    out = torch.full((3, 64), float("nan"), dtype=dtype)
    assert glue.activation(torch.nn.functional.silu, gate, up, out) is out
    assert torch.equal(out, torch.nn.functional.silu(gate) * up)


def test_a_forced_kernel_is_honoured_never_swapped(monkeypatch):
    """EXACTNESS_KERNEL naming a layer's kernel runs each expert's layers with it; naming a
    grouped kernel that cannot run here raises."""
    experts = experts_of(zero_case(2))
    x, ids, weights = torch.randn(2, 64).bfloat16(), torch.tensor([[0, 1], [1, 0]]), \
        torch.ones(2, 2)
    want = experts(x, ids, weights)
    monkeypatch.setenv("EXACTNESS_KERNEL", "int64-matmul")
    monkeypatch.setattr(type(vnni.GROUPED), "run_grouped", None)  # would fail if called
    assert torch.equal(experts(x, ids, weights), want)
    monkeypatch.setenv("EXACTNESS_KERNEL", "triton-grouped")
    if "triton-grouped" not in available_paths():
        with pytest.raises(KernelUnavailableError, match="triton-grouped"):
            experts(x, ids, weights)
    else:  # on the suite's device: the C kernel, the default, would fail if called
        experts.to(device_of("triton-grouped"))
        assert torch.equal(experts(*on(experts, x, ids, weights)).cpu(), want)


def test_no_gradient_is_cut_silently():
    experts = experts_of(zero_case(2))
    x = torch.randn(2, 64).bfloat16().requires_grad_()
    y = experts(x, torch.tensor([[0, 1], [1, 0]]), torch.ones(2, 2))
    with pytest.raises(ContractValueError, match="no gradient"):
        y.sum().backward()


# --------------------------------------------------------------------------- the GPU's path

SYNCS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy,
         torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__float__,
         torch.Tensor.__index__, torch.equal, torch.Tensor.nonzero, torch.nonzero, torch.unique,
         torch.Tensor.unique, torch.masked_select, torch.Tensor.masked_select}


class CountReads(torch.overrides.TorchFunctionMode):
    """Counts the calls that would wait for a GPU (a read of a device tensor on the host, or a
    result whose shape depends on the data), outside the Triton interpreter's own launches."""

    def __init__(self):
        super().__init__()
        self.reads, self.launching = [], False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in SYNCS and not self.launching:
            self.reads.append(getattr(func, "__name__", str(func)))
        if func is torch.Tensor.__getitem__ and any(
                isinstance(a, torch.Tensor) and a.dtype == torch.bool for a in _flat(args[1:])):
            self.reads.append("boolean index")
        return func(*args, **(kwargs or {}))


def _flat(args):
    for a in args:
        yield from (_flat(a) if isinstance(a, tuple | list) else (a,))


def counting_reads(monkeypatch) -> CountReads:
    """A CountReads that leaves out the Triton interpreter's own launches (it copies to and from
    its "device")."""
    from triton.runtime import interpreter

    counter = CountReads()
    launch = interpreter.GridExecutor.__call__

    def launching(self, *args, **kwargs):
        counter.launching = True
        try:
            return launch(self, *args, **kwargs)
        finally:
            counter.launching = False

    monkeypatch.setattr(interpreter.GridExecutor, "__call__", launching)
    return counter


def test_the_gpu_path_reads_nothing_back(monkeypatch):
    """The MoE call's wrapper reads nothing, in the exact block (inside the op a torch function
    mode sees nothing: tests/test_capture.py calls the op's body as a function)."""
    skip_unless_backend("triton")
    block = kimi_moe()
    set_backend(block, "triton")
    x, = on(block, torch.randn(7, 64).bfloat16())
    chosen, weights = block.gate(x)
    counter = counting_reads(monkeypatch)
    experts = block.experts
    with counter:
        y = moe.experts_forward(experts, torch.nn.functional.silu, x, chosen, weights,
                                block.sums, lambda: pytest.fail("the loop ran"), block.block)
    assert counter.reads == [], counter.reads
    set_backend(block, "cpu")
    assert torch.equal(y.cpu(), block.per_expert(x.cpu(), chosen.cpu(), weights.cpu()))


def test_the_plan_never_takes_a_grouped_kernel_for_a_layer_unasked():
    """A grouped kernel is a layer's kernel only when asked for by name (one expert, every
    row: test_modules checks each so); a grouped kernel a backend at least (the CPU's, one a
    build of the C kernel)."""
    assert [k.name for k in REGISTRY if k.grouped and k.auto] == []
    assert set(BACKEND_OF.values()) == set(ALL_BACKENDS)
    assert set(grouped_paths()) <= set(GROUPED)


# --------------------------------------------------------------------------- the activation

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_silu_takes_the_same_bits_on_torchs_vector_and_scalar_paths(dtype):
    """What lets `glue.activation` call SiLU on 16-bit outputs directly: every finite pattern
    gives the same bits alone (torch's scalar path) and in a long tensor (its vector path)."""
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    x = bits.view(dtype)
    x = x[torch.isfinite(x)]
    vector = torch.nn.functional.silu(x)
    scalar = torch.cat([torch.nn.functional.silu(x[i:i + 1]) for i in range(x.numel())])
    assert torch.equal(vector.view(torch.int16), scalar.view(torch.int16))


@given(st.integers(1, 40), st.integers(1, 3), seeds)
def test_the_fp32_activation_gives_each_element_the_same_bits_anywhere(rows, width, seed):
    """fp32 SiLU differs in the last bit between torch's paths, so `activation` runs every
    element on the vector path: a row's bits do not depend on the rows around it."""
    i = 32 * width
    g = torch.Generator().manual_seed(seed)
    gate, up = torch.randn(rows, i, generator=g) * 4, torch.randn(rows, i, generator=g)
    both = tensor_to_bits(glue.activation(torch.nn.functional.silu, gate, up))
    r = rows // 2
    alone = tensor_to_bits(glue.activation(torch.nn.functional.silu, gate[r:r + 1], up[r:r + 1]))
    assert (alone[0] == both[r]).all()


def test_the_fp32_activation_is_silu_of_gate_times_up():
    """On whole vectors (64 elements a row) every element takes torch's vector path anyway, so
    `activation` gives act_fn(gate) * up's bits exactly (mutmut: `/ up` went unseen)."""
    g = torch.Generator().manual_seed(3)
    gate, up = torch.randn(5, 128, generator=g) * 4, torch.randn(5, 128, generator=g)
    want = torch.nn.functional.silu(gate) * up
    got = glue.activation(torch.nn.functional.silu, gate, up)
    assert (tensor_to_bits(got) == tensor_to_bits(want)).all()


@pytest.mark.parametrize("act_bits", [16, 32])
@pytest.mark.parametrize("way", ["grouped", "no grouped kernel here", "experts of two widths"])
def test_a_projection_without_a_kernel_plans_its_own(monkeypatch, act_bits, way):
    """moe.projection(kernel=None) takes the plan's grouped kernel, or each expert's layers
    where no grouped kernel runs here or the experts differ in widths, with the bits of each
    expert's own layer either way; a routing of padding alone gives no rows."""
    skip_unless_here("vnni-grouped")
    torch.manual_seed(act_bits)
    layers = [[ExactLinear.from_weight(torch.randn(16, 64), act_bits=act_bits),
               ExactLinear.from_weight(torch.randn(16, 64), act_bits=act_bits)]
              for _ in range(3)]
    x = torch.randn(4, 64).bfloat16()
    ids = torch.tensor([[0, 2], [1, 3], [2, 1], [0, 1]])  # 3: no expert
    routing = route(ids, 3)
    if way == "no grouped kernel here":
        for build in vnni_library.BUILDS:
            monkeypatch.setattr(build, "status", lambda: (None, no("no C compiler")))
        monkeypatch.setattr(ops, "PLANS", {})  # the forwards' plans, made without C
    if way == "experts of two widths":
        for layer in layers[2]:
            layer.act_bits = 8
    loops = []
    real = moe._project_per_expert
    monkeypatch.setattr(moe, "_project_per_expert", lambda *a: (loops.append(1), real(*a))[1])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", registry.FallbackWarning)
        y = moe.projection(layers, x, routing, gather=True)
    assert len(loops) == (way != "grouped")
    in_order = x[routing.token[:int(routing.routed)]]  # without gather: x in routing order
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", registry.FallbackWarning)
        ungathered = moe.projection(layers, in_order, routing, gather=False)
    assert (tensor_to_bits(ungathered[:len(in_order)]) == tensor_to_bits(y[:len(in_order)])).all()
    for row, pair in enumerate(routing.pair[:int(routing.routed)].tolist()):
        t, slot = divmod(pair, 2)
        parts = layers[int(ids[t, slot])]
        want = torch.cat([layer(x[t:t + 1]) for layer in parts], dim=1)
        assert (tensor_to_bits(y[row:row + 1]) == tensor_to_bits(want)).all(), (row, pair)
    if way == "grouped":  # routed nowhere: no rows, in the layers' output dtype
        for layer in (layer for parts in layers for layer in parts):
            layer.out_dtype = torch.float32
        nowhere = moe.projection(layers, x, route(torch.full((4, 2), 3), 3), gather=True)
        assert nowhere.shape == (0, 32) and nowhere.dtype == torch.float32


@pytest.mark.parametrize("far", [False, True], ids=["near", "far-below"])
@pytest.mark.parametrize("norm", [True, False])
def test_the_kimi_router_chooses_and_weighs_as_transformers_does(norm, far):
    """KimiRouter against transformers' own DeepseekV3TopkRouter (noaux_tc, one group), same
    weights and bias: the same experts for every token, and the same weights (fp32 sums in
    another order: within a few ulps; the router is not under the contract)."""
    from transformers.models.deepseek_v3.configuration_deepseek_v3 import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    config = KimiConfig(hidden_size=64, n_routed_experts=8, num_experts_per_tok=3,
                        norm_topk_prob=norm, routed_scaling_factor=2.5)
    ours = KimiRouter(config)
    theirs = DeepseekV3TopkRouter(DeepseekV3Config(
        hidden_size=64, n_routed_experts=8, num_experts_per_tok=3, n_group=1, topk_group=1,
        norm_topk_prob=norm, routed_scaling_factor=2.5))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        ours.weight.copy_(torch.randn(8, 64, generator=g).bfloat16())
        ours.e_score_correction_bias.copy_(torch.randn(8, generator=g) * 0.3)
        theirs.weight.copy_(ours.weight.float())
        theirs.e_score_correction_bias.copy_(ours.e_score_correction_bias)
    x = torch.randn(20, 64, generator=g).bfloat16()
    if far:  # every logit near -64: scores of 1e-28, where the normaliser's 1e-20 matters
        with torch.no_grad():
            ours.weight.fill_(-1)
            theirs.weight.fill_(-1)
        x = torch.ones(20, 64).bfloat16()
    chosen, weights = ours(x)
    _, their_weights, their_chosen = theirs(x)
    order, their_order = chosen.argsort(dim=-1), their_chosen.argsort(dim=-1)
    assert torch.equal(chosen.gather(-1, order), their_chosen.gather(-1, their_order))
    torch.testing.assert_close(weights.gather(-1, order), their_weights.gather(-1, their_order),
                               rtol=1e-6, atol=0)


@pytest.mark.filterwarnings("ignore::exactness.kernels.registry.FallbackWarning")  # at 32 bits
@pytest.mark.parametrize("act_bits", [16, 32])
def test_the_kimi_moe_block_adds_its_shared_experts_to_the_routed_sum(act_bits):
    """KimiMoE = its routed experts' weighted sum + its shared experts, added in block.sums
    (float64 in the exact block, fp32 in the transformers one) and rounded once to x's dtype,
    for x of any leading dimensions."""
    block = kimi_moe(act_bits=act_bits)
    x = torch.from_numpy(np.random.default_rng(2).standard_normal((2, 3, 64))).bfloat16()
    flat = x.reshape(-1, 64)
    for kind in glue.BLOCKS:
        block.block = kind
        want = block.per_expert(flat, *block.gate(flat)) + block.shared_experts(flat).to(
            block.sums)
        want = glue.round_float64(want, torch.bfloat16).reshape(2, 3, 64)
        assert torch.equal(block(x).view(torch.int16), want.view(torch.int16))
    assert torch.count_nonzero(block.shared_experts(flat)) > 0


def test_exact_experts_keep_their_width_device_and_loop():
    """ExactExperts passes act_bits and device to every projection of every expert, and with
    grouped = False its forward is transformers' own loop (per_expert)."""
    from transformers.models.deepseek_v3.configuration_deepseek_v3 import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Experts

    fused = DeepseekV3Experts(DeepseekV3Config(hidden_size=64, moe_intermediate_size=32,
                                               n_routed_experts=3))
    meta = ExactExperts(3, 64, 32, torch.nn.SiLU(), act_bits=8, device="meta")
    like = ExactExperts.like(fused, 8, device="meta")
    layers = [p for experts in (meta, like) for e in experts
              for p in (e.gate_proj, e.up_proj, e.down_proj)]
    assert len(layers) == 18 and (like[2].down_proj.in_features, like[2].down_proj.out_features) \
        == (32, 64)
    assert {layer.act_bits for layer in layers} == {8}
    assert {layer.weight_packed.device.type for layer in layers} == {"meta"}
    block = kimi_moe()
    experts = block.experts
    x = torch.from_numpy(np.random.default_rng(4).standard_normal((6, 64))).bfloat16()
    chosen, weights = block.gate(x)
    loop = ExactExperts(len(experts), 64, 32, torch.nn.SiLU(), grouped=False)
    for e, expert in enumerate(experts):
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(loop[e], name).load_state_dict(getattr(expert, name).state_dict())
    y = loop(x, chosen, weights)
    assert torch.equal(y, loop.per_expert(x, chosen, weights)) and torch.count_nonzero(y) > 0


def test_a_kimi_decoder_layer_adds_its_mlp_to_x():
    from exactness.kimi import KimiDecoderLayer

    layer = KimiDecoderLayer(KimiConfig(hidden_size=64, moe_intermediate_size=32,
                                        n_routed_experts=4, num_experts_per_tok=2,
                                        first_k_dense_replace=0), 0)
    layer.mlp = kimi_moe(experts=4, top_k=2)
    x = torch.from_numpy(np.random.default_rng(5).standard_normal((3, 64))).bfloat16()
    assert torch.equal(layer(x), x + layer.mlp(x))
