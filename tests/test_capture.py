"""Issue 50, proven without a GPU: the GPU forward of a layer and of an MoE layer's experts is one
torch custom op each, whose wrapper reads nothing back (FakeTensorMode with fake CUDA tensors:
a read raises there), whose make_fx graph holds only exactness ops and shape ops, and which
torch.compile traces whole; the op bodies read nothing back either (the Triton interpreter,
its reads counted), and their slow rows and NaN rows, made on the device, are exact at every
scale spread. What only a GPU can show (capture, replay, timing) is bench/gpu_check.py's."""

from __future__ import annotations

import itertools
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from exactness import ExactLinear, PackedInt4Linear, dataflow, moe, ops
from exactness.contract import BFLOAT16, GROUP_SIZE, act_qmax
from exactness.formats import pack_weights
from exactness.glue import BLOCKS
from exactness.kernels import REGISTRY
from exactness.suite.cases import LinearCase
from exactness.suite.counterexamples import check_bits
from exactness.suite.paths import device_of, require, run
from exactness.suite.strategies import linear_cases, scale_bits
from tests.test_modules import folded_case, needs_triton

pytestmark = pytest.mark.stage("reliability")  # make verify's stage

KIMI = ((7168, 2048), (2048, 7168))  # gate/up and down: (K, N)
# what a graph of the forward may hold besides the exactness ops: views of x and its shape
SHAPE_OPS = {"detach", "view", "_unsafe_view", "reshape", "alias", "sym_size"}


def fake_layer(k: int, n: int, act_bits: int, bits: int = 4) -> torch.nn.Module:
    """A layer on a fake CUDA device (inside an active FakeTensorMode): no GPU, no data."""
    if bits == 4:
        return PackedInt4Linear(k, n, act_bits, device="cuda")
    return ExactLinear(k, n, act_bits, bits=bits, device="cuda")


def test_a_plain_cpu_forward_calls_the_ops_body_and_a_traced_one_the_op(monkeypatch):
    """An eager CPU forward skips the op's dispatch (0.3 ms a call: docs/PERFORMANCE.md) and
    gives the op's bits; under a dispatch mode (make_fx's), a fake tensor or torch.compile the
    forward is the op itself, so a trace holds exactness::linear."""
    from exactness import modules

    layer = ExactLinear.from_weight(torch.randn(40, 64))
    x = torch.randn(3, 64).bfloat16()
    calls = []
    op = ops.linear
    monkeypatch.setattr(ops, "linear", lambda *args: calls.append(1) or op(*args))
    y = layer(x)
    assert calls == [] and modules.plainly_on_the_cpu(x)
    weights = layer.weights()
    y_op = op(x, weights.packed, weights.scale, 64, layer.bits, layer.act_bits, torch.bfloat16,
              "cpu", None)
    assert torch.equal(y.view(torch.int16), y_op.view(torch.int16))
    with FakeTensorMode():
        assert not modules.plainly_on_the_cpu(torch.empty(3, 64))
    graph = make_fx(lambda t: layer(t))(x).graph
    assert any("exactness.linear" in str(node.target) for node in graph.nodes), graph


@pytest.mark.parametrize("act_bits", [4, 8, 16, 32])
@pytest.mark.parametrize("k, n", KIMI, ids=["gate-up", "down"])
def test_the_layer_forward_runs_on_fake_cuda_tensors(act_bits, k, n):
    """No read of the device anywhere in the forward: on fake CUDA tensors any read raises
    (DataDependentOutputException), and the forward runs to its end, at Kimi's sizes, 4- and
    8-bit weights, decode and prefill, 2-D and 3-D x."""
    with FakeTensorMode():
        for bits in (4, 8):
            layer = fake_layer(k, n, act_bits, bits)
            for shape in ((1, k), (128, k), (2, 3, k)):
                y = layer(torch.empty(shape, dtype=torch.bfloat16, device="cuda"))
                assert y.shape == (*shape[:-1], n) and y.is_cuda and y.dtype == torch.bfloat16


def fake_experts(experts: int = 4, hidden: int = 7168, inter: int = 2048, act_bits: int = 16,
                 held=None) -> list:
    """An MoE layer's experts on the fake CUDA device; those not in `held` are held elsewhere."""
    held = range(experts) if held is None else held
    return [SimpleNamespace(
        gate_proj=PackedInt4Linear(hidden, inter, act_bits, device="cuda"),
        up_proj=PackedInt4Linear(hidden, inter, act_bits, device="cuda"),
        down_proj=PackedInt4Linear(inter, hidden, act_bits, device="cuda"))
        if e in held else SimpleNamespace(**{name: moe.RemoteLinear(name, 1, 1) for name in (
            "gate_proj", "up_proj", "down_proj")}) for e in range(experts)]


def never():
    raise AssertionError("the per-expert loop ran")


@pytest.mark.parametrize("act_bits", [4, 8, 16])
@pytest.mark.parametrize("tokens", [1, 16, 128])
def test_the_moe_call_runs_on_fake_cuda_tensors(act_bits, tokens):
    """The grouped MoE call on fake CUDA tensors, at Kimi's sizes, T = 1, 16 and 128, top-8:
    one exactness::moe_experts op, no read, the per-expert loop never run; experts held
    elsewhere too (a token routed there is the op's NaN under a trace); in both blocks."""
    with FakeTensorMode():
        for held, block in itertools.product((None, (0, 2)), BLOCKS):
            experts = fake_experts(4, act_bits=act_bits, held=held)
            x = torch.empty((tokens, 7168), dtype=torch.bfloat16, device="cuda")
            ids = torch.empty((tokens, 2), dtype=torch.int64, device="cuda")
            weights = torch.empty((tokens, 2), dtype=torch.float32, device="cuda")
            y = moe.experts_forward(experts, torch.nn.functional.silu, x, ids, weights,
                                    torch.bfloat16, never, block)
            assert y.shape == (tokens, 7168) and y.is_cuda and y.dtype == torch.bfloat16


def graph_targets(fn, *args) -> list[str]:
    """The targets of a make_fx(tracing_mode="fake") graph's calls, as "namespace.op"."""
    graph = make_fx(fn, tracing_mode="fake")(*args)
    names = []
    for node in graph.graph.nodes:
        if node.op == "call_function":
            packet = getattr(node.target, "_overloadpacket", node.target)
            names.append(f"{getattr(packet, '_qualified_op_name', str(packet))}")
    return names


def only_exactness_and_shapes(names: list[str], ops: set[str]) -> None:
    assert set(ops) <= {name.replace("::", ".") for name in names}, names
    others = [name for name in names if not name.startswith("exactness::")]
    assert all(name.split("::")[-1] in SHAPE_OPS or name.endswith("getitem")
               for name in others), others


@pytest.mark.parametrize("act_bits", [8, 16, 32])
def test_the_layer_graph_holds_its_op_and_shape_ops_alone(act_bits):
    """make_fx's graph of a forward: exactness::linear and views, no _local_scalar_dense and
    no copy to the CPU (a planted .item() is a mutant these tests kill)."""
    with FakeTensorMode():
        layer = fake_layer(7168, 2048, act_bits)
        x = torch.empty((2, 3, 7168), dtype=torch.bfloat16, device="cuda")
    only_exactness_and_shapes(graph_targets(layer, x), {"exactness.linear"})


def test_the_moe_graph_holds_its_op_and_shape_ops_alone():
    with FakeTensorMode():
        experts = fake_experts(3, hidden=256, inter=64)
        x = torch.empty((5, 256), dtype=torch.bfloat16, device="cuda")
        ids = torch.empty((5, 2), dtype=torch.int64, device="cuda")
        weights = torch.empty((5, 2), dtype=torch.float32, device="cuda")

    def call(x, ids, weights):
        return moe.experts_forward(experts, torch.nn.functional.silu, x, ids, weights,
                                   torch.bfloat16, never)

    only_exactness_and_shapes(graph_targets(call, x, ids, weights), {"exactness.moe_experts"})


class Wrapped(torch.nn.Module):
    """A model around the layer, as a serving stack compiles it."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, x):
        return self.layer(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], -1)


@pytest.mark.parametrize("backend", ["cpu", pytest.param("triton", marks=needs_triton)])
def test_torch_compile_traces_the_layer_whole_with_the_eager_bits(backend):
    """torch.compile(fullgraph=True) of a module that calls the layer: no graph break (one
    would raise), and the eager bits, NaN rows and slow rows included."""
    torch.manual_seed(1)
    device = device_of(backend)
    layer = ExactLinear.from_weight(torch.randn(24, 64), act_bits=16, backend=backend).to(device)
    scale = layer.weight_scale
    scale.data[3] = torch.tensor([2.0**-100, 2.0**80]).bfloat16()  # a slow row
    x = torch.randn(2, 5, 64).bfloat16().to(device)
    x[1, 2, 7] = float("inf")
    eager = Wrapped(layer)(x)
    compiled = torch.compile(Wrapped(layer), fullgraph=True, backend="eager")(x)
    assert torch.equal(compiled.view(torch.int16), eager.view(torch.int16))
    assert eager[1, 2].isnan().all() and not eager[0].isnan().any()


# --------------------------------------------------------------------------- the op bodies

def spread_case(draw, widest: bool):
    """A case whose scales spread wide: drawn from 0 to the widest bf16 allows (253), each
    row, or (widest) one row from the least subnormal to the largest normal."""
    case = draw(linear_cases(max_k=128, max_n=20, max_rows=18))
    n, groups = case.q.shape[0], case.q.shape[1] // GROUP_SIZE
    scales = draw(scale_bits(n, groups, "spread"))
    if widest and groups > 1:
        scales[0, 0], scales[0, -1] = 0x0001, 0x7F7F  # 2**-133 and the largest finite bf16
    return replace(case, scale_bits=scales)


@needs_triton
@pytest.mark.parametrize("path", ["triton-group", "triton-folded", "triton-grouped"])
def test_the_device_slow_rows_are_exact_at_every_spread(path):
    """finish_kernel's and grouped_kernel's multiword combine against the reference, at every
    spread a bf16 row can have, the widest included, every width and output format."""

    @settings(max_examples=12, deadline=None)
    @given(st.data(), st.booleans())
    def check(data, widest):
        case = spread_case(data.draw, widest)
        if path == "triton-folded":  # 64 rows on, N and K multiples of 8, two limbs at most
            case, _, _ = folded_case(replace(case, act_bits=min(case.act_bits, 16)))
        check_bits(case, path, run(case, path), run(case, "reference"))

    check()


def test_the_multiword_combine_holds_every_sum_it_is_given():
    """dataflow's bound for the device's slow rows: the worst T of Kimi's sizes and the widest
    contract widths, at every spread, fits WIDE_WORDS words, and the words' unnormalized sums
    their int64 (K up to 2**25)."""
    for k in (2048, 7168, 18432, 2**25):
        for w_bits, act_bits in ((4, 16), (8, 32)):
            assert dataflow.wide_words_needed(k, w_bits, act_bits) <= dataflow.WIDE_WORDS
        assert dataflow.wide_word_adds_hold(k)
    assert not dataflow.wide_word_adds_hold(2**63)
    assert act_qmax(32) * 2**7 * GROUP_SIZE * 255 < 2**62  # |P * ms| < 2**62: add_shifted's v


@pytest.mark.parametrize("path", [kernel.name for kernel in REGISTRY])
@pytest.mark.parametrize("sign", [1, -1])
def test_a_tie_broken_by_a_far_group_rounds_away_from_it(path, sign):
    """A slow row whose near group alone gives a bf16 tie (y = 257 * 2**92) and whose far group
    adds 2**-100: the exact sum is past the tie, so it rounds to 258 * 2**92, where a combine
    that dropped the far bits (a sticky bit lost) would round to even, 256 * 2**92."""
    require(path)
    x = np.zeros((1, 64), np.int64)
    x[0, 0], x[0, 1], x[0, 32] = 0x3F80, 0x3B80, 0x3F80  # 1, 2**-8 and 1 (bf16)
    q = np.zeros((1, 64), np.int64)
    q[0, 0] = q[0, 1] = q[0, 32] = sign
    scales = np.array([[0x7180, 0x0D80]])  # 2**100 and 2**-100: spread 200
    case = LinearCase(x, BFLOAT16, q, pack_weights(q, 4), scales, 16, BFLOAT16, 4)
    if path == "triton-folded":
        case, _, _ = folded_case(case)  # 64 rows, 8 weight rows: copies of these
    got = run(case, path)
    check_bits(case, path, got, run(case, "reference"))
    assert (got[:, 0] == (0x7181 if sign > 0 else 0xF181)).all()  # 258 * 2**92


@needs_triton
@pytest.mark.parametrize("act_bits", [8, 16, 32])
def test_the_op_bodies_read_nothing_back(monkeypatch, act_bits):
    """The ops' bodies (ops.forward, moe.device_experts: inside a custom op a torch function
    mode sees nothing, so they are called here as functions) under the interpreter, its own
    copies aside, a slow row, a non-finite scale and a non-finite row of x included: no .item(),
    .tolist(), bool(), nonzero() or other read, wherever it is made (test_moe's CountReads)."""
    from tests.test_moe import counting_reads, experts_of, zero_case

    counter = counting_reads(monkeypatch)
    torch.manual_seed(act_bits)
    device = device_of("triton")
    layer = ExactLinear.from_weight(torch.randn(24, 64), act_bits=act_bits,
                                    backend="triton").to(device)
    layer.weight_scale.data[3] = torch.tensor([2.0**-100, 2.0**80]).bfloat16()  # a slow row
    layer.weight_scale.data[5, 1] = float("inf")
    x = torch.randn(70, 64).bfloat16().to(device)  # from 64 rows: folded; below: the group
    x[2, 7] = float("nan")
    for rows in (x[:5], x):
        with counter:
            y = ops.forward(rows, layer.weight_packed, layer.weight_scale, 64, 4, act_bits,
                            torch.bfloat16, "triton", None)
        assert counter.reads == [], counter.reads
        assert y[2].isnan().all() and y[:, 5].isnan().all() and not y[0, :5].isnan().any()
    if act_bits == 32:
        return  # the grouped kernel carries up to 16 bits (test_act32.py)
    experts = experts_of(zero_case(3), "triton")
    buffers = [b for e in experts for layer in (e.gate_proj, e.up_proj, e.down_proj)
               for b in layer.checked_buffers()]
    ids = torch.tensor([[0, 2], [1, 3], [2, 1], [5, 0], [0, 0]], device=device)  # padding, refused
    for exact_block in (False, True):  # the exact block's glue reads nothing either
        with counter:
            y = moe.device_experts(x[:5], ids, torch.ones(5, 2, device=device), buffers, 4, 16,
                                   torch.float32 if exact_block else torch.bfloat16,
                                   torch.bfloat16, torch.nn.functional.silu, exact_block)
        assert counter.reads == [], counter.reads
        assert y[2].isnan().all() and y[3:].isnan().all() and not y[:2].isnan().any()
