"""32-bit activations (contract v1.1): the correctly rounded product where a row quantizes
losslessly, on every path that holds them, and a typed refusal from every kernel that does not."""

import math
import warnings
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from exactness import ExactLinear
from exactness.contract import BFLOAT16, FORMATS
from exactness.formats import bits_to_tensor, pack_weights, tensor_to_bits, torch_dtype
from exactness.kernels import REGISTRY, KernelUnavailableError, registry
from exactness.kernels.cpu import vnni
from exactness.kernels.registry import FallbackWarning
from exactness.kernels.routing import route
from exactness.moe import projection
from exactness.suite.cases import LinearCase
from exactness.suite.counterexamples import check_bits
from exactness.suite.paths import available_paths, device_of, held_act_bits, layer_for, run
from exactness.suite.reference import quantize_activations
from exactness.suite.strategies import activation_bits, int_weights, scale_bits
from tests.test_modules import skip_unless_here

pytestmark = pytest.mark.stage("equivalence")  # make verify's stage
# the kernels that hold 32-bit activations: the group kernels (four limbs) and the CPU's wide ones
HOLD_32_BITS = ("vnni-limbs", "vnni-grouped", "avx2-limbs", "avx2-grouped", "float64-gemm",
                "int64-matmul", "triton-group", "triton-grouped", "wide")


def true_product_bits(case: LinearCase) -> np.ndarray:
    """RNE(sum_k x * s * q) in the output format, computed apart from the project's code: x and
    the scales decoded by torch into float64 (exact for all three formats), the sum in
    Fractions, the rounding by Python's half-to-even round() onto the output's grid."""
    fmt = case.out_format
    x = bits_to_tensor(case.x_bits, case.x_format).double().tolist()
    s = bits_to_tensor(case.scale_bits, BFLOAT16).double().tolist()
    out = np.zeros((len(x), case.q.shape[0]), np.int64)
    for r, row in enumerate(x):
        for n, q_n in enumerate(case.q.tolist()):
            y = sum(Fraction(row[k]) * Fraction(s[n][k // 32]) * q_n[k] for k in range(len(row)))
            if y == 0:
                continue  # +0.0
            e = y.numerator.bit_length() - y.denominator.bit_length()  # 2**e <= |y| < 2**(e+2)
            e -= abs(y) < Fraction(2) ** e
            quantum = max(e - fmt.mant_bits, fmt.quantum_min)
            value = round(y / Fraction(2) ** quantum) * Fraction(2) ** quantum  # -0.0 below
            exact = torch.tensor(math.copysign(float(value), y), dtype=torch.float64)
            out[r, n] = int(tensor_to_bits(exact.to(torch_dtype(fmt)).reshape(1))[0])
    return out


def lossless_rows(case: LinearCase) -> np.ndarray:
    """The rows whose every element is qa * 2**e_r exactly (nothing rounded by quantizing)."""
    qa, e_r = quantize_activations(case.x_bits, case.x_format, case.act_bits)
    x = bits_to_tensor(case.x_bits, case.x_format).double().numpy()
    back = np.array([[float(Fraction(int(v)) * Fraction(2) ** int(e)) for v in row]
                     for row, e in zip(qa, e_r, strict=True)])
    return np.flatnonzero((back == x).all(axis=1) & (x != 0).any(axis=1))


@st.composite
def lossless_cases(draw):
    """32-bit activations of moderate range ("normal": exponents within 2**8 of a centre), so
    most rows quantize losslessly; any output format, random weights and scales."""
    x_format = draw(st.sampled_from([FORMATS["bfloat16"], FORMATS["float16"], FORMATS["float32"]]))
    rows, k, n = draw(st.integers(1, 4)), draw(st.sampled_from((32, 64, 96))), draw(
        st.integers(1, 4))
    q = draw(int_weights(n, k, 4))
    return LinearCase(draw(activation_bits(rows, k, x_format, 32, kind="normal")), x_format, q,
                      pack_weights(q, 4), draw(scale_bits(n, k // 32)), 32,
                      draw(st.sampled_from(list(FORMATS.values()))), 4)


@given(lossless_cases())
def test_a_lossless_row_gives_the_correctly_rounded_true_product(case):
    """v1.1's promise: where quantizing x loses nothing, y is RNE of the true product, on every
    path that holds 32-bit activations."""
    rows = lossless_rows(case)
    assume(rows.size)
    want = true_product_bits(case)[rows]
    for path in available_paths(case):
        check_bits(case, path, run(case, path)[rows], want)


@pytest.mark.parametrize("path", [*HOLD_32_BITS, "cpu", "triton"])
def test_the_most_negative_32_bit_activations_on_every_path(path):
    """Rows whose largest magnitude is negative with every significand bit set: qa nearly -Qa,
    where qa - 0x808080 passes -2**31 (a limb split in int32 wraps there). In each format, with
    the row's other elements spread over 2**30 so that every limb is busy."""
    skip_unless_here(path)
    rng = np.random.default_rng(32)
    for fmt, top in ((BFLOAT16, 0xBFFF), (FORMATS["float16"], 0xBFFF),
                     (FORMATS["float32"], 0xBFFFFFFF)):  # just under -2
        x = tensor_to_bits(torch.from_numpy(rng.uniform(-1, 1, (3, 64)) * 2.0 ** rng.integers(
            -30, 1, (3, 64))).to(torch_dtype(fmt)))
        x[:, 5] = top
        q = rng.integers(-8, 8, (20, 64))
        case = LinearCase(x, fmt, q, pack_weights(q, 4), 0x3C00 + rng.integers(0, 512, (20, 2)),
                          32, BFLOAT16, 4)
        qa, _ = quantize_activations(case.x_bits, fmt, 32)
        assert (qa[:, 5] - 0x808080 < -(2**31)).all()
        check_bits(case, path, run(case, path), run(case, "reference"))


def test_the_true_product_check_can_fail():
    """At 16 bits a wide bf16 row loses bits, and the true product then differs somewhere."""
    x = np.array([[0x4700] + [0x3F81] * 31], np.int64)  # 32768 and 31 values 1 + 2**-7
    q = np.ones((1, 32), np.int64)
    case = LinearCase(x, BFLOAT16, q, pack_weights(q, 4), np.array([[0x3F80]]), 16, FORMATS[
        "float32"], 4)
    assert lossless_rows(case).size == 0
    assert (run(case, "reference") != true_product_bits(case)).any()
    case.act_bits = 32
    assert lossless_rows(case).tolist() == [0]
    assert (run(case, "reference") == true_product_bits(case)).all()


@pytest.mark.parametrize("kernel", [k.name for k in REGISTRY])
def test_a_kernel_holds_32_bits_or_refuses_them_by_name(kernel):
    """Every kernel either holds act_bits = 32 (then it gives the bits of `wide`, Python
    integers) or says through the registry why it cannot: never other bits."""
    torch.manual_seed(0)
    w, x = torch.randn(40, 96), torch.randn(5, 96)
    x[1, 3] = 2.0**-30  # a row whose smallest element fills the low limbs
    layer = ExactLinear.from_weight(w, act_bits=32, kernel=kernel)
    fit = next(k for k in REGISTRY if k.name == kernel).eligible(1, layer.weights())
    assert (32 in held_act_bits(kernel)) == fit.ok == (kernel in HOLD_32_BITS)
    if not fit.ok:  # the span kernel takes 16-bit words; the int8 GEMMs name their limbs
        why = "16-bit activations" if kernel == "vnni-spans" else "needs 4 int8 limbs"
        assert why in fit.why
        with pytest.raises(KernelUnavailableError, match=why):
            layer(torch.randn(2, 96))
    elif kernel in available_paths():
        want = ExactLinear.from_weight(w, act_bits=32, kernel="wide")(x)
        assert torch.equal(tensor_to_bits_t(layer(x)), tensor_to_bits_t(want))


def test_the_cpu_plan_at_32_bits_takes_the_c_kernel_and_says_why_not_the_others():
    """The C kernel carries four limbs; the int8 GEMMs carry two, and say so."""
    layer = ExactLinear.from_weight(torch.randn(8, 64), act_bits=32)
    plan = layer.plan(torch.randn(3, 64))
    c_kernels = [k.name for k in (vnni.LIMBS, vnni.AVX2_LIMBS)
                 if k.auto and k.name in available_paths()]
    assert plan.kernel.name == (c_kernels[0] if c_kernels else "float64-gemm")
    gemm = next(k for k in REGISTRY if k.name == "int8-gemm")
    assert "needs 4 int8 limbs, it carries at most 2" in gemm.eligible(3, layer.weights()).why


@pytest.mark.skipif("triton" not in available_paths(), reason="Triton needs a GPU or "
                    "EXACTNESS_DEVICE=interpret")
def test_the_triton_backend_takes_32_bits_through_the_group_kernel_at_any_rows():
    """The folded GEMM carries two limbs and says so; from its 64 rows on, the plan passes it
    over for the group kernel, which gives wide's bits."""
    torch.manual_seed(0)
    w, x = torch.randn(8, 64), torch.randn(64, 64)
    device = device_of("triton")
    layer = ExactLinear.from_weight(w, act_bits=32, backend="triton").to(device)
    plan = layer.plan(x.to(device))
    assert plan.kernel.name == "triton-group"
    assert "needs 4 int8 limbs, it carries at most 2" in dict(plan.passed_over)["triton-folded"]
    want = ExactLinear.from_weight(w, act_bits=32, kernel="wide")(x)
    assert torch.equal(tensor_to_bits_t(layer(x.to(device))), tensor_to_bits_t(want))


@pytest.mark.parametrize("grouped_limbs", [4, 2])
def test_an_moe_projection_at_32_bits_has_each_experts_bits(grouped_limbs, monkeypatch):
    """The C grouped kernel carries four limbs: one call, no warning. Where the grouped kernel
    carries two (as Triton's does), the projection warns once, naming the limbs, and runs each
    expert's layer. Either way, each routed row has its expert's own bits."""
    kernel = next((k for k in (vnni.GROUPED, vnni.AVX2_GROUPED)
                   if k.auto_grouped and k.name in available_paths()), vnni.GROUPED)
    skip_unless_here(kernel.name)
    for other in (vnni.GROUPED, vnni.AVX2_GROUPED):  # the plan's first C kernel: this one
        monkeypatch.setattr(other, "act_limbs", grouped_limbs)
    torch.manual_seed(0)
    layers = [[ExactLinear.from_weight(torch.randn(16, 64), act_bits=32)] for _ in range(3)]
    x = torch.randn(5, 64).bfloat16()
    ids = torch.tensor([[0, 2], [1, 0], [2, 3], [3, 1], [0, 1]])  # 3: no expert
    routing = route(ids, 3)
    registry.warn_fallback.cache_clear()  # once a process: another test may have said it already
    calls = []
    run_grouped = kernel.run_grouped
    monkeypatch.setattr(kernel, "run_grouped",
                        lambda *args, **kw: calls.append(1) or run_grouped(*args, **kw))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y = projection(layers, x, routing, gather=True)
    warned = any(issubclass(w.category, FallbackWarning) and "needs 4 int8 limbs, it carries "
                 "at most 2" in str(w.message) for w in caught)
    assert (warned, len(calls)) == ((False, 1) if grouped_limbs == 4 else (True, 0))
    pairs = routing.pair[:int(routing.routed)].tolist()
    for row, pair in enumerate(pairs):
        t, slot = divmod(pair, 2)
        want = layers[int(ids[t, slot])][0](x[t:t + 1])
        assert torch.equal(tensor_to_bits_t(y[row:row + 1]), tensor_to_bits_t(want))


def tensor_to_bits_t(t: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(tensor_to_bits(t))


def test_a_32_bit_layer_equals_the_reference_at_a_full_kimi_size():
    """7168 -> 2048 is test_full_kimi_sizes[cpu-32]; here the dense MLP's 18432 input."""
    rng = np.random.default_rng(5)
    q = rng.integers(-8, 8, (4, 18432))
    q[:, :32] = -8
    x = rng.standard_normal((2, 18432)).astype(np.float32)
    case = LinearCase(tensor_to_bits(torch.from_numpy(x).bfloat16()), BFLOAT16, q,
                      pack_weights(q, 4), np.full((4, 576), 0x3C00 + 3, np.int64), 32, BFLOAT16)
    layer = layer_for(case, "cpu")
    check_bits(case, "cpu", tensor_to_bits(layer(bits_to_tensor(case.x_bits, BFLOAT16))),
               run(case, "reference"))


@pytest.mark.parametrize("kernel", [k.name for k in REGISTRY if k.grouped])
def test_a_grouped_kernel_run_directly_refuses_what_its_limbs_do_not_hold(kernel, monkeypatch):
    """Past the plan (moe.projection(kernel=...)), a grouped kernel still refuses what it does
    not hold, rather than computing other bits: here, one made to carry two limbs."""
    grouped = next(k for k in REGISTRY if k.name == kernel)
    monkeypatch.setattr(grouped, "act_limbs", 2)
    routing = route(torch.zeros((2, 1), dtype=torch.int64), 1)
    with pytest.raises(KernelUnavailableError, match="needs 4 int8 limbs"):
        grouped.run_grouped(torch.randn(2, 64), routing, [None], 4, 32, BFLOAT16, True)
