"""The production layer against the reference, bit for bit, on every path available here."""

import copy
import io
import warnings
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from exactness import ExactLinear, PackedInt4Linear, ops
from exactness.contract import BFLOAT16, FLOAT32, FORMATS, ContractValueError, ShapeError
from exactness.dataflow import act_limbs, activation_limbs
from exactness.formats import bits_to_tensor, pack_weights, tensor_to_bits, torch_dtype
from exactness.kernels import REGISTRY, KernelUnavailableError, registry
from exactness.kernels.cpu import vnni, vnni_calls, vnni_check, vnni_layout, vnni_library
from exactness.kernels.registry import no
from exactness.kernels.triton import group as triton_group
from exactness.kernels.triton import layer as triton_layer
from exactness.kernels.triton import quantize as triton_quantize
from exactness.suite.cases import LinearCase, load_vectors
from exactness.suite.counterexamples import check_bits
from exactness.suite.paths import (
    BACKENDS,
    available_paths,
    device_of,
    held_act_bits,
    layer_for,
    refused_here,
    require,
    run,
    triton_device,
)
from exactness.suite.reference import quantize_activations
from exactness.suite.strategies import (
    INT8_KERNEL_ACT_BITS,
    KIMI_SHAPES,
    activation_bits,
    final_rounding_at_the_top,
    final_rounding_near_ties,
    linear_cases,
    scale_bits,
    seeds,
)

pytestmark = pytest.mark.stage("equivalence")  # make verify's stage

LAYER_PATHS = [p for p in available_paths() if p in BACKENDS]  # the layer as its plan picks
# each build of the C kernel, asked for by name: the plan takes one of them (or neither)
C_LIMB_PATHS = [p for p in ("vnni-limbs", "avx2-limbs") if p in available_paths()]
KERNELS = [kernel.name for kernel in REGISTRY]
TRITON_DEVICE = triton_device() or "cpu"  # the suite's device (exactness.suite.device)
needs_triton = pytest.mark.skipif("triton" not in LAYER_PATHS,
                                  reason="Triton needs a GPU or EXACTNESS_DEVICE=interpret")


def check_path(case, path):
    check_bits(case, path, run(case, path), run(case, "reference"))


def holding(case, paths) -> list[str]:
    """The `paths` that hold `case` (32-bit activations: no Triton kernel does yet, and a test
    below checks that it says so)."""
    held = available_paths(case)
    return [path for path in paths if path in held]


def skip_unless_here(path: str) -> None:
    """Each path is a test id on every machine (a mutant's killer names it); one that cannot run
    here skips, saying why, and one refused where it should run fails (paths.require)."""
    require(path)


# make verify's vectors stage: these three, and tests/test_vectors.py (the oracle, the reference)


@pytest.mark.stage("vectors")
@pytest.mark.parametrize("path", KERNELS)
def test_vectors_through_the_layer(path):
    """The contract's independent vectors through each kernel forced (triton-folded on each
    vector grown to a shape its GEMM takes)."""
    skip_unless_here(path)
    held = 0
    for vector in load_vectors():
        case, rows, cols = folded_case(vector) if path == "triton-folded" else (
            vector, slice(None), slice(None))
        if path not in available_paths(case):  # vnni-spans: 16-bit activations only
            continue
        check_bits(case, path, run(case, path), vector.expected[rows][:, cols],
                   source="vectors")
        held += 1
    assert held >= 9, f"{path} held only {held} of the vectors"


@pytest.mark.stage("vectors")
@pytest.mark.parametrize("path", BACKENDS)
def test_vectors_through_the_backend(path):
    """The contract's vectors through the layer as its plan picks, on each backend that holds
    them."""
    skip_unless_here(path)
    held = 0
    for case in load_vectors():
        if path in available_paths(case):  # where one of its kernels holds the vector
            check_bits(case, path, run(case, path), case.expected, source="vectors")
            held += 1
    assert held >= 36, f"the {path} backend held only {held} of the vectors"


@pytest.mark.stage("vectors")
def test_no_kernel_is_refused_where_it_should_run():
    """A C kernel this machine has what it needs for, but whose build or start-up self-check
    failed: every check of it would skip on the machine where it matters."""
    assert refused_here() == []


# what each kernel is checked on: wide is Python integers, the Triton kernels are interpreted;
# each at the activation widths it holds (held_act_bits)
EQUIVALENCE_CASES = {
    # two tiles of 16 rows and a tail; groups in pairs and an odd one over
    "amx": linear_cases(max_k=256, max_n=40, max_rows=40, act_bits_=held_act_bits("amx")),
    "vnni-spans": linear_cases(max_k=256, max_n=40, max_rows=20, w_bits=4, act_bits_=16),
    "triton-group": linear_cases(max_k=128, max_n=40, max_rows=20,
                                 act_bits_=held_act_bits("triton-group")),
    "wide": linear_cases(max_k=128, max_n=16, max_rows=6),
}


@pytest.mark.parametrize("path", [k for k in KERNELS if k != "triton-folded"])
@given(data=st.data())
def test_path_matches_reference(path, data):
    """Each kernel forced, at every batch size, against the reference. (triton-folded:
    test_triton_folded_path_matches_reference.)"""
    skip_unless_here(path)
    case = data.draw(EQUIVALENCE_CASES.get(path, linear_cases(
        max_k=256, max_n=40, max_rows=20, act_bits_=held_act_bits(path))), label="case")
    check_path(case, path)


def test_span_kernel_at_the_int32_edge():
    """Every weight -8 and every activation +Qa: every sum as large as its bound allows.
    Scales 510 and 255 (c = 510, 255): unshifted blocks, where a chain of a 510 group sums
    16 * 32767 * 8 * 510, just under 2**31 (both chains together would wrap). Scales 255 and one
    1020 (c = 1020: a chain would wrap): spans in that block, one group each, as a group sums
    32 * 32767 * 8 * 255, also just under 2**31. Scales 1.0 and one 2**12: f = 1, so groups
    share spans until the wide one."""
    skip_unless_here("vnni-spans")
    m, k, n = 4, 256, 20
    x = np.full((m, k), 0x46FFFE00, np.int64)  # fp32 32767.0: e_r = 0, qa = Qa
    q = np.full((n, k), -8, np.int64)
    alternating = np.tile([0x43FF, 0x437F], (n, k // 64))  # 510, 255
    for scales, unshifted, one_group_spans in (
            (alternating, [1, 1], True), (alternating | 0x8000, [1, 1], True),  # and negated
            (one_wide_group(n, k, 0x437F, 0x447F), [0, 1], True),  # 255, 1020
            (one_wide_group(n, k, 0x3F80, 0x4580), [0, 1], False)):  # 1.0, 2**12
        case = LinearCase(x, FLOAT32, q, pack_weights(q, 4), scales, 16, FLOAT32, 4)
        check_path(case, "vnni-spans")
        layer = layer_for(case, "vnni-spans")
        _, _, ends, kinds = vnni_calls.span_scales_of(layer.prepared("vnni-spans"))
        assert kinds.tolist() == unshifted
        assert bool(ends[0].all()) == one_group_spans


@pytest.mark.parametrize("chain", ["k0-k2", "k1-k3"])
@pytest.mark.parametrize("factor", [510, 516], ids=["at-the-limit", "one-step-past"])
def test_span_bounds_attacked_one_chain_at_a_time(chain, factor):
    """A bound that holds for a group can fail for one of its parts: here the span kernel's two
    int32 chains (bytes 0, 2 and 1, 3 of each lane's word, both nibbles), loaded one at a time,
    every weight of the loaded chain -8 and every activation +Qa. Read in place, a word's byte t
    holds k 2 t and 2 t + 1 of its 8, so a chain is k 0, 1, 4, 5 or 2, 3, 6, 7 of each 8. With
    factors 255 and 510 the loaded chain sums 16 * 32767 * 8 * 510, just under 2**31: the block
    stays unshifted. With 255 and 516 (one step past) a chain would wrap, and the block must
    take spans."""
    skip_unless_here("vnni-spans")
    m, k, n = 4, 64, 16
    x = np.full((m, k), 0x46FFFE00, np.int64)  # fp32 32767.0: e_r = 0, qa = Qa
    loaded = np.isin(np.arange(k) % 8, (0, 1, 4, 5) if chain == "k0-k2" else (2, 3, 6, 7))
    q = np.where(loaded, -8, 0) * np.ones((n, 1), np.int64)
    scales = np.tile([0x437F, 0x43FF if factor == 510 else 0x4401], (n, 1))  # 255; 510 or 516
    case = LinearCase(x, FLOAT32, q, pack_weights(q, 4), scales, 16, FLOAT32, 4)
    check_path(case, "vnni-spans")
    layer = layer_for(case, "vnni-spans")
    assert vnni_calls.span_scales_of(layer.prepared("vnni-spans"))[3].tolist() == [
        int(factor == 510)]


@pytest.mark.parametrize("edge", [-9, -8, 7, 8])
def test_the_c_layout_chosen_from_the_weights_range_at_its_edges(edge):
    """8-bit weights every one of which fits 4 bits take the derived layout's nibbles; one
    weight just past either end of [-8, 7] takes its bytes (read in place, 8-bit words are
    always bytes). Weights at each edge, just inside and just outside, on every C path."""
    skip_unless_here("vnni-limbs")
    rng = np.random.default_rng(edge + 9)
    m, k, n = 5, 64, 16
    q = rng.integers(-8, 8, (n, k))
    q[3, 17] = edge
    x = rng.integers(0x3C00, 0x4000, (m, k)) | (rng.integers(0, 2, (m, k)) << 15)
    case = LinearCase(x, BFLOAT16, q, pack_weights(q, 8), 0x3C00 + rng.integers(0, 256, (n, 2)),
                      8, BFLOAT16, 8)
    for path in ("vnni-limbs", "vnni-grouped"):
        check_path(case, path)
    derived = vnni_layout.NativeWeights(torch.from_numpy(q), torch.ones(n, 2, dtype=torch.int32))
    assert derived.nibbles == (-8 <= edge <= 7)  # the derived layout's choice (the self-checks')


def one_wide_group(n: int, k: int, scale: int, wide: int) -> np.ndarray:
    """Scale bits `scale` everywhere but `wide` in the first row's last group."""
    scales = np.full((n, k // 32), scale)
    scales[0, -1] = wide
    return scales


@given(linear_cases(max_k=128, max_n=20, max_rows=4, w_bits=4, act_bits_=16))
def test_rows_agree_across_the_kernel_switch(case):
    """A row's bits are the same whether its batch takes the limb kernel or the span kernel, and
    whichever kernels the plan takes for a few rows and for a batch here (on a Xeon with AMX
    the batch may take `amx`)."""
    skip_unless_here("vnni-spans")
    x = bits_to_tensor(case.x_bits, case.x_format)
    batch = x.repeat(-(-vnni.SPAN_MIN_ROWS // x.shape[0]), 1)
    alone = tensor_to_bits(layer_for(case, "vnni-limbs")(x))
    spans = tensor_to_bits(layer_for(case, "vnni-spans")(batch))
    assert (spans[:x.shape[0]] == alone).all()
    layer = layer_for(case, "cpu")
    limbs = next(k.name for k in (vnni.LIMBS, vnni.AVX2_LIMBS) if k.auto)  # emulated: unasked
    assert layer.plan(x).kernel.name == limbs  # fewer rows than SPAN_MIN_ROWS
    assert (tensor_to_bits(layer(x)) == alone).all()
    assert (tensor_to_bits(layer(batch))[:x.shape[0]] == alone).all()


def test_each_c_build_is_in_use_where_the_cpu_has_it():
    for build in vnni_library.BUILDS:
        if not build.missing_features():
            assert build.library() is not None, build.status()[1]


def test_the_plan_takes_the_avx2_kernel_where_vnni_is_missing_and_says_so(monkeypatch):
    """On a CPU without AVX-512 VNNI (EPYC Rome, Milan) the plan takes the AVX2 build, the right
    kernel there: no warning (issue 75), and plan(x) names what the CPU lacks. A refused
    AVX-512 build on a CPU that has the ISA is a real fallback: its one warning says why and
    what runs instead."""
    skip_unless_here("avx2-limbs")
    monkeypatch.setattr(vnni_library.AVX512, "emulated", lambda: False)  # as a user's machine
    w, x = torch.randn(40, 64), torch.randn(3, 64).bfloat16()
    for why, lacks in (("the CPU lacks avx512_vnni", ["avx512_vnni"]),
                       ("its self-check failed on cpu_kernel_avx512.c", [])):
        monkeypatch.setattr(vnni_library.AVX512, "status", lambda why=why: (None, no(why)))
        monkeypatch.setattr(vnni_library.AVX512, "missing_features", lambda lacks=lacks: lacks)
        monkeypatch.setattr(ops, "PLANS", {})  # the forwards' plans, made on this machine
        registry.warn_fallback.cache_clear()
        layer = ExactLinear.from_weight(w)
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            plan = layer.plan(x)
        fallbacks = [str(m.message) for m in said if m.category is registry.FallbackWarning]
        if lacks:
            assert fallbacks == []
        else:
            assert fallbacks == [f"the C kernel (AVX-512 VNNI) is not used: {why}; its AVX2 "
                                 f"build runs instead"]
        assert plan.kernel.name == "avx2-limbs"
        assert ("vnni-limbs", why) in plan.passed_over
        wide = ExactLinear.from_weight(w, kernel="wide")
        assert torch.equal(layer(x).view(torch.int16), wide(x).view(torch.int16))
    registry.warn_fallback.cache_clear()


def test_no_compiler_or_cache_means_no_c_kernel_not_a_crash(tmp_path, monkeypatch):
    in_the_way = tmp_path / "a-file"
    in_the_way.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(in_the_way))  # the cache cannot be created
    for build in vnni_library.BUILDS:
        monkeypatch.setenv("XDG_CACHE_HOME", str(in_the_way))
        monkeypatch.delenv("CC", raising=False)
        assert build.load() is None
        assert "no writable cache" in build.build()[1].why
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
        assert build.load("this is not C") is None
        assert f"failed on cpu_kernel_{build.name}.c" in build.build("this is not C")[1].why
        monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
        assert "no C compiler" in build.build("int x;")[1].why


def test_the_self_check_names_what_failed():
    """The verdict names the check and its input, not only that it failed."""
    skip_unless_here("vnni-limbs")
    from exactness.suite.mutants.run import CATALOGUE, mutated_c_kernel

    verdict = vnni_check.self_check(mutated_c_kernel(next(
        m for m in CATALOGUE if m.name == "vnni-rounding-ties-up"), vnni_library.AVX512))
    assert not verdict and "self-check failed on" in verdict.why and "float" in verdict.why


def int_mm_through_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """An int8 GEMM as some backends run it, through fp32: exact only while its sums stay
    within fp32's 24-bit significand."""
    return (a.float() @ b.float()).to(torch.int32)


MACHINES = {  # what this CPU would not do, simulated: (the C kernel's status, torch._int_mm)
    "no-c-kernel": (no("no C compiler"), None, "int8-gemm"),
    "no-c-kernel-int-mm-inexact": (no("no C compiler"), int_mm_through_fp32, "float64-gemm"),
}


def without_the_c_kernel(monkeypatch, status) -> None:
    """Every build of the C kernel refused with `status`, its warning silenced."""
    for build in vnni_library.BUILDS:
        monkeypatch.setattr(build, "status", lambda: (None, status))
    monkeypatch.setattr(vnni, "warn_fallback", lambda *why: None)


@pytest.mark.parametrize("machine", MACHINES)
def test_every_cpu_path_the_plan_takes_on_another_machine(machine, monkeypatch):
    """The layer's own plan on CPUs this one is not: without the C kernel (no compiler:
    int8-gemm), and with a torch._int_mm that is not exact (float64-gemm, which no machine here
    picks). The plan picks the path such a machine would, and it gives the reference's bits, at
    K past fp32's exact sums (where an inexact _int_mm shows)."""
    from exactness.kernels.cpu import gemm

    status, int_mm, want = MACHINES[machine]
    without_the_c_kernel(monkeypatch, status)
    if int_mm is not None:
        monkeypatch.setattr(torch, "_int_mm", int_mm)
    gemm.int_mm_exact.cache_clear()
    monkeypatch.setattr(ops, "PLANS", {})  # the forwards' plans, made on this machine
    try:
        @settings(max_examples=max(10, settings.default.max_examples // 3))
        @given(linear_cases(max_k=2048, max_n=8, max_rows=4, min_k=1024,
                            act_bits_=INT8_KERNEL_ACT_BITS))
        def check(case):
            layer = layer_for(case, "cpu")
            x = bits_to_tensor(case.x_bits, case.x_format)
            check_bits(case, want, tensor_to_bits(layer(x)), run(case, "reference"))
            assert layer.plan(x).kernel.name == want

        check()
    finally:
        gemm.int_mm_exact.cache_clear()


def test_the_int64_matmul_takes_what_float64_cannot_hold(monkeypatch):
    """Without the C kernel or an exact _int_mm, K = 18432 at spread 12 could pass 2**53 in the
    float64 GEMMs: the plan says so and takes the int64 matmul, with the reference's bits."""
    from exactness.kernels.cpu import gemm

    without_the_c_kernel(monkeypatch, no("no C compiler"))
    monkeypatch.setattr(torch, "_int_mm", int_mm_through_fp32)
    gemm.int_mm_exact.cache_clear()
    monkeypatch.setattr(ops, "PLANS", {})  # the forwards' plans, made on this machine
    try:
        rng = np.random.default_rng(7)
        n, k = 2, 18432
        q = rng.integers(-8, 8, (n, k))
        scales = np.full((n, k // 32), 0x3C00)
        scales[:, 0] = 0x4200  # 2**-7 and 2**5: spread 12, the certified limit
        x = rng.integers(0x3F00, 0x4000, (2, k)) | (rng.integers(0, 2, (2, k)) << 15)
        case = LinearCase(x, BFLOAT16, q, pack_weights(q, 4), scales, 16, BFLOAT16, 4)
        layer = layer_for(case, "cpu")
        plan = layer.plan(bits_to_tensor(x, BFLOAT16))
        assert plan.kernel.name == "int64-matmul"
        assert any(name == "float64-gemm" and "2**53" in why for name, why in plan.passed_over)
        check_bits(case, "int64-matmul", tensor_to_bits(layer(bits_to_tensor(x, BFLOAT16))),
                   run(case, "reference"))
    finally:
        gemm.int_mm_exact.cache_clear()



def test_a_fallback_from_the_c_kernel_warns_once_saying_why(monkeypatch):
    layer = ExactLinear.from_weight(torch.randn(8, 64))
    x = torch.randn(2, 64)
    monkeypatch.setattr(vnni_library.AVX512, "status",
                        lambda: (None, no("the CPU lacks avx512_vnni")))
    monkeypatch.setattr(vnni_library.AVX2, "status", lambda: (None, no("the CPU lacks avx2")))
    monkeypatch.setattr(ops, "PLANS", {})  # the forwards' plans, made on this machine
    registry.warn_fallback.cache_clear()
    with pytest.warns(registry.FallbackWarning, match=r"\(AVX2\) is not used: the CPU lacks avx2; "
                                                      "a slower exact CPU kernel runs instead"):
        plan = layer.plan(x)
    assert plan.kernel.name in ("int8-gemm", "int64-matmul")
    assert ("avx2-limbs", "the CPU lacks avx2") in plan.passed_over
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        layer(x)  # once: no second warning
    registry.warn_fallback.cache_clear()


def test_the_plan_names_its_kernel_and_a_forced_one_is_never_swapped(monkeypatch):
    layer = ExactLinear.from_weight(torch.randn(8, 64), bits=8)
    x = torch.randn(30, 64)
    chosen = layer.plan(x)
    assert str(chosen).startswith(f"{chosen.kernel.name}: {chosen.why}") and chosen.why
    with pytest.raises(KernelUnavailableError, match="16-bit activations and 4-bit weights"):
        ExactLinear.from_weight(torch.randn(8, 64), bits=8, kernel="vnni-spans")(x)
    with pytest.raises(ContractValueError, match="no kernel named 'nope'"):
        ExactLinear.from_weight(torch.randn(8, 64), kernel="nope")
    monkeypatch.setenv("EXACTNESS_KERNEL", "wide")
    assert layer.plan(x).kernel.name == "wide" and "EXACTNESS_KERNEL" in layer.plan(x).why
    wide = layer(x)
    monkeypatch.delenv("EXACTNESS_KERNEL")
    assert torch.equal(wide, layer(x))


def folded_case(case: LinearCase) -> tuple[LinearCase, np.ndarray, np.ndarray]:
    """`case` grown to a shape the forward sends through triton_folded.linear_folded (rows
    repeated to FOLDED_MIN_ROWS, weight rows to a multiple of 8), with the rows and outputs of
    `case` each of its rows and outputs repeats. A failure's file replays through that path."""
    m, k, n = case.shape
    rows = np.arange(max(m, triton_layer.FOLDED_MIN_ROWS)) % m
    cols = np.arange(-(-n // 8) * 8) % n
    return LinearCase(case.x_bits[rows], case.x_format, case.q[cols], case.weight_packed[cols],
                      case.scale_bits[cols], case.act_bits, case.out_format, case.w_bits,
                      name=case.name), rows, cols


@needs_triton
@settings(max_examples=max(10, settings.default.max_examples // 2))  # each example is 64 rows
@given(linear_cases(max_k=128, max_n=40, max_rows=20, act_bits_=INT8_KERNEL_ACT_BITS))
def test_triton_folded_path_matches_reference(case):
    case, _, _ = folded_case(case)
    check_path(case, "triton-folded")
    assert layer_for(case, "triton").plan(bits_to_tensor(case.x_bits, case.x_format)).kernel \
        is triton_layer.FOLDED, "the Triton plan does not take linear_folded at this shape"


@needs_triton
@settings(max_examples=max(10, settings.default.max_examples // 3))  # the kernels, no reference
@given(linear_cases(max_k=256, max_n=24, max_rows=5, act_bits_=held_act_bits("triton-group")),
       st.integers(2, 8))
def test_the_group_kernels_k_split_changes_no_bit(case, slices):
    """The group kernel's T summed over slices of K (integer atomics, then combine_kernel's
    rounding) has the whole launch's bits, at any number of slices (the layer's own split is
    checked against the reference by every Triton test: the interpreter splits small launches)."""
    layer = layer_for(case, "triton", TRITON_DEVICE)
    x = bits_to_tensor(case.x_bits, case.x_format).to(TRITON_DEVICE)
    limbs, e_r, _ = triton_quantize.quantize(x, case.act_bits)
    gpu = triton_layer.gpu_weights(layer.weights(), x.device)
    args = (limbs, e_r, layer.weight_packed, *gpu, case.w_bits,
            torch_dtype(case.out_format))
    whole = tensor_to_bits(triton_group.linear(*args, slices=1))
    assert (tensor_to_bits(triton_group.linear(*args, slices=slices)) == whole).all()


@needs_triton
@settings(max_examples=max(10, settings.default.max_examples // 3))  # the kernel, no layer
@given(linear_cases(max_k=256, max_n=1, max_rows=17,
                    act_bits_=held_act_bits("triton-group")), st.integers(1, 4),
       st.sampled_from([512, 2048]))
def test_the_quantize_kernel_at_any_slicing_and_tile(case, slices, tile):
    """quantize_kernel's limbs and row exponents are the contract's (reference, dataflow) at any
    slicing of K and any tile: every slice finds the row exponents itself, the first stores
    them, and the flags of non-finite rows."""
    x = bits_to_tensor(case.x_bits, case.x_format).to(TRITON_DEVICE)
    qa, e_r = quantize_activations(case.x_bits, case.x_format, case.act_bits)
    limbs, got_e_r, nonfinite = triton_quantize.quantize(x, case.act_bits, slices, tile)
    exact = bool((limbs.cpu() == activation_limbs(torch.from_numpy(qa), case.act_bits)).all()
                 and (got_e_r.cpu().numpy() == e_r).all())
    x[-1, -1] = float("inf")
    again = triton_quantize.quantize(x, case.act_bits, slices, tile)
    flags = nonfinite.tolist() + again[2].tolist()
    assert exact and flags == [0] * (2 * len(x) - 1) + [1]  # one line: one failure to shrink


@needs_triton
@settings(max_examples=max(10, settings.default.max_examples // 6))  # up to 9 launches each
@given(linear_cases(max_k=96, max_n=24, max_rows=9, act_bits_=held_act_bits("triton-group")),
       st.integers(1, 4))
def test_launches_in_blocks_of_rows_match_reference(case, block):
    """Past int32 offsets (triton_layer.rows_per_launch) a forward launches blocks of rows;
    with the limit shrunk to `block` rows a launch, the bits are still the reference's."""
    m, k, n = case.shape
    limit = block * max(act_limbs(case.act_bits) * k, n)
    with mock.patch.object(triton_layer, "INT32_OFFSETS", limit):
        assert triton_layer.rows_per_launch(k, n, case.act_bits) == block
        check_path(case, "triton")


@needs_triton
@pytest.mark.parametrize("path", ["triton-group", "triton"])
def test_the_triton_kernels_at_8_bit_weights(path):
    """8-bit weights take two words a group: every group's words, at K past one group, against
    the reference (the equivalence property draws them a quarter of the time)."""
    rng = np.random.default_rng(11)
    q = rng.integers(-128, 128, (12, 160))
    x = rng.integers(0x3F00, 0x4000, (3, 160)) | (rng.integers(0, 2, (3, 160)) << 15)
    scales = 0x3C00 + rng.integers(0, 256, (12, 5))
    for act_bits in (8, 16, 32):
        if act_bits in held_act_bits(path):  # triton-folded: up to 16 bits
            check_path(LinearCase(x, BFLOAT16, q, pack_weights(q, 8), scales, act_bits,
                                  BFLOAT16, 8), path)


@needs_triton
def test_a_non_finite_x_in_a_later_block_of_rows_is_nan_or_counted_in_x():
    layer = ExactLinear.from_weight(torch.randn(24, 64), backend="triton").to(TRITON_DEVICE)
    x = torch.randn(13, 64, device=TRITON_DEVICE)
    want = tensor_to_bits(layer(x[:11]))
    x[11, 3] = x[12, 0] = float("nan")
    with mock.patch.object(triton_layer, "INT32_OFFSETS", 5 * 2 * 64):  # 5 rows a launch
        y = tensor_to_bits(layer(x))
        assert (y[11:] == 0x7FC00000).all() and (y[:11] == want).all()
        layer.strict = True
        with pytest.raises(ValueError, match=r"2 non-finite value\(s\); the first at index "
                                             r"\(11, 3\)"):
            layer(x)


@needs_triton
def test_the_gpu_checks_tile_table_runs(capsys):
    """bench/gpu_check.py's tile table, small and under the interpreter (a device run is scarce,
    so the script it runs is run here first): every tile of triton_group.TUNING_TILES, with tails
    both ways, gives the default launch's bits."""
    from bench.gpu_check import tiles

    assert tiles(shapes=((64, 20),), batches=(19,), device=TRITON_DEVICE,
                 timer=lambda fn: 0.1) == 0
    assert "DIFFERENT" not in capsys.readouterr().out


@needs_triton
def test_the_gpu_checks_non_finite_check_runs():
    """bench/gpu_check.py's non-finite x, under the interpreter: NaN rows, or refused with the
    count by a strict layer."""
    from bench.gpu_check import nonfinite_rows

    assert nonfinite_rows(TRITON_DEVICE)


@needs_triton
def test_the_gpu_checks_two_paths_agree():
    """bench/gpu_check.py's side-by-side of the group kernel and linear_folded, small and under
    the interpreter: both run, with the same bits."""
    from bench.gpu_check import both_paths, kimi_on

    layer, _ = kimi_on(64, 24, TRITON_DEVICE)
    x = torch.randn(20, 64, device=TRITON_DEVICE).bfloat16()
    group, folded, same = both_paths(layer, x, timer=lambda fn: (fn(), 0.1)[1])
    assert same and folded.endswith("digits)")


@pytest.mark.parametrize("path", ["vnni-limbs", "avx2-limbs", "int8-gemm", "triton-group"])
@given(final_rounding_near_ties())
def test_final_rounding_near_ties(path, case):
    """One rounding from the exact integer: rounding through fp32 first would round twice."""
    skip_unless_here(path)
    check_path(case, path)


@given(final_rounding_at_the_top())
def test_final_rounding_at_the_top_of_the_range(case):
    """Vectors of outputs at and past fp16's largest finite value: an overflow is infinity, and
    no fast rounding may encode it as anything else."""
    for path in holding(case, [*LAYER_PATHS, *C_LIMB_PATHS]):
        check_path(case, path)


@given(linear_cases(max_k=96, max_n=8, max_rows=3), st.data())
def test_wide_spread_rows_stay_exact(case, data):
    """Scale exponents across the whole bf16 range: certified slow rows take the exact path."""
    case.scale_bits = data.draw(scale_bits(case.shape[2], case.shape[1] // 32, kind="spread"))
    case.scale_bits[0, 0], case.scale_bits[0, -1] = 0x0001, 0x7E00
    for path in [*holding(case, [*LAYER_PATHS, *C_LIMB_PATHS]), "wide"]:
        check_path(case, path)


@st.composite
def kimi_cases(draw, act_bits: int, path: str, rows: int | None = None):
    k, n = draw(st.sampled_from(KIMI_SHAPES))
    rng = np.random.default_rng(draw(seeds))
    q = rng.integers(-8, 8, (n, k))
    q[:, : draw(st.sampled_from((0, 32)))] = -8  # a group at the bound
    rows = rows or draw(st.sampled_from((1, 3) if path == "triton" else (1, 17, 300)))
    return LinearCase(draw(activation_bits(rows, k, BFLOAT16, act_bits)), BFLOAT16, q,
                      pack_weights(q, 4), draw(scale_bits(n, k // 32, kind="qat")), act_bits,
                      BFLOAT16)


@pytest.mark.parametrize(("path", "act_bits"), [(path, act_bits) for path in BACKENDS
                                                 for act_bits in held_act_bits(path)])
def test_full_kimi_sizes(path, act_bits):
    skip_unless_here(path)
    @settings(max_examples=1, derandomize=True, database=None)
    @given(kimi_cases(act_bits, path))
    def full_size(case):
        check_path(case, path)

    full_size()


@needs_triton
def test_full_kimi_size_triton_folded():
    """A full Kimi layer through linear_folded (16-bit activations, FOLDED_MIN_ROWS rows)."""
    @settings(max_examples=1, derandomize=True, database=None)
    @given(kimi_cases(16, "triton", rows=triton_layer.FOLDED_MIN_ROWS))
    def full_size(case):
        check_path(case, "triton-folded")

    full_size()


def test_dense_mlp_input_size_18432():
    rng = np.random.default_rng(3)
    w = torch.from_numpy(rng.standard_normal((64, 18432)).astype(np.float32))
    x = torch.from_numpy(rng.standard_normal((5, 18432)).astype(np.float32)).bfloat16()
    for bits in (4, 8):
        layer = ExactLinear.from_weight(w, bits=bits)
        case = LinearCase(tensor_to_bits(x), BFLOAT16, None, layer.weight_packed.numpy(),
                          tensor_to_bits(layer.weight_scale), 16, BFLOAT16, bits)
        check_bits(case, "cpu", tensor_to_bits(layer(x)), run(case, "reference"))


# --------------------------------------------------------------------------- metamorphic


@given(linear_cases(max_k=128, max_n=16, max_rows=12), st.randoms(use_true_random=False))
def test_batch_and_permutation_invariance(case, random):
    """A row's bits depend on that row alone: not on the others, their order, or the batch size."""
    for path in holding(case, LAYER_PATHS):
        layer = layer_for(case, path)
        x = bits_to_tensor(case.x_bits, case.x_format)
        whole = tensor_to_bits(layer(x))
        order = list(range(x.shape[0]))
        random.shuffle(order)
        # the rows shuffled, under a leading dimension (one call for both: a third fewer calls
        # of the interpreted Triton kernels, the test's time)
        shuffled = tensor_to_bits(layer(x[order].reshape(1, *x.shape)))
        assert shuffled.shape == (1, *whole.shape) and (shuffled[0] == whole[order]).all()
        r = random.randrange(x.shape[0])
        assert (tensor_to_bits(layer(x[r:r + 1])) == whole[r:r + 1]).all()


def test_determinism_across_runs():
    case = load_vectors()[7]
    for path in LAYER_PATHS:
        first = run(case, path)
        assert all((run(case, path) == first).all() for _ in range(3))


# --------------------------------------------------------------------------- from_weight


@given(st.sampled_from((4, 8)), st.sampled_from(list(FORMATS.values())), seeds, st.data())
def test_from_weight_matches_the_oracle_quantizer(bits, fmt, seed, data):
    """At every magnitude the format holds, its subnormals too: down to groups whose scale must
    be a subnormal bf16 (amax below 7 * 2**-126), and an all-zero group."""
    from exactness.suite.reference import oracle_quantize_weight

    rng = np.random.default_rng(seed)
    top = 2 ** (fmt.exp_bits - 1) - 4  # randn * 2**top stays finite
    exponent = data.draw(st.integers(fmt.quantum_min + 2, top) | st.integers(-140, -120)
                         .filter(lambda e: e >= fmt.quantum_min), label="exponent")
    w = torch.from_numpy(rng.standard_normal((3, 64)) * 2.0**exponent).to(torch_dtype(fmt))
    w[0, :32] = 0
    layer = ExactLinear.from_weight(w, bits=bits)
    want_q, want_scale = oracle_quantize_weight(tensor_to_bits(w), fmt, bits)
    assert (tensor_to_bits(layer.weight_scale) == np.array(want_scale)).all()
    assert (layer.weight_packed.numpy() == pack_weights(np.array(want_q), bits)).all()


@pytest.mark.parametrize("fmt", [BFLOAT16, FLOAT32], ids=lambda f: f.name)
@pytest.mark.parametrize("bits", [4, 8])
def test_quantize_weight_at_a_groups_edges(fmt, bits):
    """Groups random magnitudes miss (mutmut found them, docs/MUTMUT.md): one whose largest
    element is the format's least subnormal, and ones holding elements more than 2**40 below
    their scale, whose q is 0 however the remainder was shifted. Integer arrays come back."""
    from exactness.quantize import quantize_weight
    from exactness.suite.reference import oracle_quantize_weight

    w_bits = np.zeros((2, 96), np.int64)  # +0.0 everywhere
    w_bits[0, :32:3] = 1  # the least subnormal, and its negative
    w_bits[0, 1:32:3] = 1 | fmt.sign_bit
    tiny = tensor_to_bits(torch.tensor([2.0**-60, -(2.0**-100), 2.0**-126]).to(torch_dtype(fmt)))
    w_bits[:, 32:35] = tensor_to_bits(torch.tensor([1.0, -3.0, 0.5]).to(torch_dtype(fmt)))
    w_bits[:, 35:38] = tiny
    w_bits[1, 64:67] = tiny  # and a group of only tiny ones
    q, scale = quantize_weight(w_bits, fmt, bits)
    assert q.dtype == scale.dtype == np.int64
    want_q, want_scale = oracle_quantize_weight(w_bits, fmt, bits)
    assert (scale == np.array(want_scale)).all() and (q == np.array(want_q)).all()
    assert (scale[0, 0] != 0) and (q[:, 35:38] == 0).all()  # not the trivial answer


def test_from_weight_error_is_within_half_a_step():
    w = torch.randn(16, 64)
    layer = ExactLinear.from_weight(w, bits=8)
    scale = layer.weight_scale.float().repeat_interleave(32, dim=1)
    from exactness.formats import unpack_weights

    q = torch.from_numpy(unpack_weights(layer.weight_packed.numpy(), 8, 64)).float()
    assert ((q * scale - w).abs() <= scale / 2).all() and q.abs().max() <= 127


# --------------------------------------------------------------------------- the module's state


def test_state_dict_is_exactly_the_checkpoint_keys():
    layer = PackedInt4Linear(64, 8)
    keys = layer.state_dict().keys()
    assert list(keys) == ["weight_packed", "weight_scale", "weight_shape"]
    sd = layer.state_dict()
    assert sd["weight_packed"].dtype == torch.int32 and sd["weight_packed"].shape == (8, 8)
    assert sd["weight_scale"].dtype == torch.bfloat16 and sd["weight_scale"].shape == (8, 2)


@pytest.mark.parametrize("path", ["cpu", pytest.param("triton", marks=needs_triton)])
def test_derived_data_is_rebuilt_when_the_weights_change(path):
    case = load_vectors()[0]
    layer = layer_for(case, path)
    x = bits_to_tensor(case.x_bits, case.x_format)
    before = tensor_to_bits(layer(x))
    with torch.no_grad():
        layer.weight_scale.mul_(2)  # in place: every output doubles exactly
    doubled = tensor_to_bits(layer(x).float() / 2)
    assert (tensor_to_bits(layer(x)) != before).any()
    assert (tensor_to_bits(bits_to_tensor(doubled, FLOAT32).to(x.dtype)) == before).all()
    sd = {k: v.clone() for k, v in layer.state_dict().items()}
    sd["weight_scale"] /= 2
    layer.load_state_dict(sd)
    assert (tensor_to_bits(layer(x)) == before).all()


@pytest.mark.parametrize("path", ["cpu", pytest.param("triton", marks=needs_triton)])
def test_copies_and_pickles_rebuild_the_derived_data(path):
    """After a forward the layer holds its kernels' derived data (on the CPU, ctypes pointers);
    a deep copy or a pickle of it must still work and give the same bits."""
    case = load_vectors()[0]
    layer = layer_for(case, path)
    x = bits_to_tensor(case.x_bits, case.x_format)
    before = tensor_to_bits(layer(x))
    buffer = io.BytesIO()
    torch.save(layer, buffer)
    buffer.seek(0)
    for copy_ in (copy.deepcopy(layer), torch.load(buffer, weights_only=False)):
        assert (tensor_to_bits(copy_(x)) == before).all()


@pytest.mark.parametrize("cast", [torch.nn.Module.half, torch.nn.Module.float,
                                  torch.nn.Module.double, lambda m: m.to(torch.float16),
                                  lambda m: m.type(torch.float32)])
def test_a_cast_of_the_model_keeps_the_buffers(cast):
    """half(), float(), to(dtype) cast every floating buffer, type() every buffer; the
    checkpoint's buffers are the format itself (the bf16 scales, the int32 words) and stay as
    they are, so the outputs' bits do not move."""
    case = load_vectors()[0]
    layer = layer_for(case, "cpu")
    x = bits_to_tensor(case.x_bits, case.x_format)
    before = tensor_to_bits(layer(x))
    buffers = {name: b.clone() for name, b in layer.named_buffers()}
    cast(layer)
    for name, buffer in layer.named_buffers():
        assert buffer.dtype == buffers[name].dtype and torch.equal(buffer, buffers[name]), name
    assert (tensor_to_bits(layer(x)) == before).all()


def test_a_backward_through_the_layer_raises():
    """With x requiring grad the forward gives the same bits, and a backward is refused rather
    than the graph cut silently (no gradient would reach what lies upstream)."""
    layer = ExactLinear.from_weight(torch.randn(8, 64))
    x = torch.randn(3, 64, requires_grad=True)
    y = layer(x)
    assert y.requires_grad and torch.equal(y.detach(), layer(x.detach()))
    with pytest.raises(ContractValueError, match=r"^the exact layers define no gradient: x "
                       r"required grad, and a backward reached PackedInt4Linear/ExactLinear "
                       r"\(run them under torch\.no_grad\(\), or detach x\)$"):
        (y * 2).sum().backward()
    with torch.no_grad():
        assert not layer(x).requires_grad


def test_a_trace_of_the_layer_is_refused_saying_why(monkeypatch):
    layer = ExactLinear.from_weight(torch.randn(8, 64))
    monkeypatch.setattr(torch.jit, "is_tracing", lambda: True)
    with pytest.raises(ContractValueError, match=r"^the exact layers cannot be traced by "
                       r"torch\.jit\.trace: their kernels write the output where the tracer "
                       r"does not see it, so a trace would replay uninitialised memory; call the "
                       r"layer eagerly$"):
        layer(torch.randn(2, 64))


@pytest.mark.parametrize("backend", ["cpu", pytest.param("triton", marks=needs_triton)])
def test_the_loading_hook_plans_decode_and_prefill_and_keeps_no_tensor(backend):
    """process_weights_after_loading (vLLM's hook) plans the kernels a forward of 1 and of 128
    rows takes on this backend, and the layer holds no tensor but its three buffers after it
    (the kernels read them in place)."""
    layer = PackedInt4Linear(64, 8, backend=backend, device=device_of(backend))
    ops.PLANS.clear()
    layer.process_weights_after_loading()
    assert {key[2] for key in ops.PLANS} == {1, 128}
    assert {key[0] for key in ops.PLANS} == {backend}
    assert not [v for v in vars(layer).values() if isinstance(v, torch.Tensor)]


def test_plan_refuses_the_x_a_forward_refuses_and_counts_rows_as_it_does():
    layer = PackedInt4Linear(64, 8)
    for bad in (torch.tensor(1.0), torch.empty(3, 0), torch.empty(3, 65)):
        with pytest.raises(ShapeError, match="x.shape\\[-1\\] must be in_features=64"):
            layer.plan(bad)
    for shape in ((2, 12, 64), (3, 8, 1, 64), (1, 1, 64)):  # rows: every dim but the last
        rows = int(np.prod(shape[:-1]))
        assert str(layer.plan(torch.empty(shape))) == str(layer.plan(torch.empty(rows, 64)))


@needs_triton
def test_gpu_weights_are_the_live_scales_certificate():
    layer = PackedInt4Linear(64, 8, backend="triton", device=TRITON_DEVICE)
    layer.weight_scale.data.fill_(2.0)
    factor, _, emin = triton_layer.gpu_weights(layer.weights(), torch.device(TRITON_DEVICE))
    assert torch.equal(factor, layer.certificate.factor) and (emin == layer.certificate.emin).all()
    layer.weight_scale.data[:, 1] = 4.0  # a write: the next call's factors are the new scales'
    again = triton_layer.gpu_weights(layer.weights(), torch.device(TRITON_DEVICE))
    assert torch.equal(again[0], layer.certificate.factor)
    assert not torch.equal(layer.certificate.factor, factor)


def test_an_empty_x_runs_no_kernel_and_keeps_the_output_dtype(monkeypatch):
    """No row: no op, no plan and no kernel run, and y [..., 0, N] in the output's dtype on
    x's device, as a forward with rows would give."""
    layer = PackedInt4Linear(64, 8)
    wide = PackedInt4Linear(64, 8, out_dtype=torch.float32)
    monkeypatch.setattr(ops, "forward", mock.Mock(side_effect=AssertionError("planned")))
    for x in (torch.empty(0, 64, dtype=torch.bfloat16), torch.empty(2, 0, 64, dtype=torch.float16)):
        assert layer(x).shape == (*x.shape[:-1], 8) and layer(x).dtype == x.dtype
        assert wide(x).shape == (*x.shape[:-1], 8) and wide(x).dtype == torch.float32


def test_the_repr_names_the_widths_the_backend_and_a_forced_kernel():
    assert repr(PackedInt4Linear(64, 8)) == ("PackedInt4Linear(in_features=64, out_features=8, "
                                             "bits=4, act_bits=16, backend=auto)")
    forced = ExactLinear(64, 8, 8, bits=8, backend="cpu", kernel="wide")
    assert repr(forced) == ("ExactLinear(in_features=64, out_features=8, bits=8, act_bits=8, "
                            "backend=cpu, kernel=wide)")


@pytest.mark.parametrize("kernel", KERNELS)
def test_the_layer_holds_nothing_but_its_buffers_after_a_forward(kernel):
    """Issue 40: no copy of the buffers and no layout beside them. After a forward on any kernel
    the layer's tensors are its three buffers, and derived_nbytes is 0."""
    require(kernel)
    layer = PackedInt4Linear(64, 16, kernel=kernel, device=device_of(kernel),
                             backend="triton" if kernel.startswith("triton") else "auto")
    layer.weight_scale.data.fill_(1.0)
    rows = 32 if kernel == "triton-folded" else 2
    layer(torch.randn(rows, 64, device=device_of(kernel)))
    held = [v for v in vars(layer).values() if isinstance(v, torch.Tensor)]
    assert not held and layer.derived_nbytes() == 0
    assert {name for name, _ in layer.named_buffers()} == {"weight_packed", "weight_scale",
                                                           "weight_shape"}


def test_the_leading_dims_of_x_are_rows_and_come_back():
    layer = PackedInt4Linear(64, 8)
    x = torch.randn(2, 3, 64).bfloat16()
    y = layer(x)
    assert y.shape == (2, 3, 8)
    assert torch.equal(y.view(torch.int16), layer(x.reshape(6, 64)).view(2, 3, 8).view(torch.int16))
    one = layer(x[0, 0])  # a 1-D x is one row
    assert one.shape == (8,) and torch.equal(one.view(torch.int16), y[0, 0].view(torch.int16))


def test_the_certificate_in_the_widths_it_promises():
    """factor is ms << (es - emin) as int32 on fast rows and 0 on slow ones (the fast kernels'
    work on a slow row, overwritten by wide's, stays small); an empty scale certifies nothing."""
    from exactness.formats import split_scales
    from exactness.modules import certify

    scale = torch.tensor([[1.0, 2.0**5], [1.0, 2.0**30], [-3.0, 0.0]]).bfloat16()
    cert = certify(scale, 64, 4, 16)
    assert cert.fast.tolist() == [True, False, True] and cert.slow_rows.tolist() == [1]
    ms, shift, _, _ = split_scales(tensor_to_bits(scale))
    assert cert.factor.dtype == torch.int32
    assert cert.factor.tolist() == [(ms[0] << shift[0]).tolist(), [0, 0],
                                    (ms[2] << shift[2]).tolist()]
    assert cert.fast_spread == 5
    flat = certify(torch.tensor([[1.0, 1.0], [1.0, 2.0**30]]).bfloat16(), 64, 4, 16)
    assert flat.fast_spread == 0  # a slow row's spread is no fast row's
    empty = certify(torch.empty(0, 2, dtype=torch.bfloat16), 64, 4, 16)
    assert empty.fast_spread == 0 and empty.factor.shape == (0, 2)


def test_from_weight_refuses_what_is_no_matrix():
    for bad in (torch.randn(64), torch.randn(2, 8, 64), [[1.0] * 64]):
        with pytest.raises(ShapeError, match=r"^weight must be a 2-D tensor \[out_features, "
                           r"in_features\]$"):
            ExactLinear.from_weight(bad)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_weight_shape_int32_or_int64(dtype):
    layer = PackedInt4Linear(64, 2)
    sd = layer.state_dict()
    sd["weight_shape"] = torch.tensor([2, 64], dtype=dtype)
    layer.load_state_dict(sd)


def test_layer_keeps_no_float_copy_of_the_weight():
    layer = PackedInt4Linear(64, 8)
    layer(torch.randn(2, 64))
    tensors = [*layer.buffers(), *vars(layer).values()]
    floats = [t for t in tensors if isinstance(t, torch.Tensor) and t.is_floating_point()]
    assert all(t is layer.weight_scale for t in floats)


@pytest.mark.parametrize("kernel", ["vnni-limbs", "avx2-limbs"])
def test_the_vnni_self_check_passes_in_this_process(kernel):
    """The self-check's Python side (the derived layout it compares against, its twins) as this
    process has it, on each build: first_run's child imports its own."""
    skip_unless_here(kernel)
    build = registry.by_name(REGISTRY, kernel).build
    verdict = vnni_check.self_check(build.library(), build)
    assert verdict, verdict.why


@pytest.mark.parametrize("kernel", ["vnni-limbs", "avx2-limbs"])
def test_the_vnni_self_check_refuses_a_broken_layout(kernel):
    """Had the kernel's layout been wrong at start-up, the layer would not have trusted it."""
    from exactness.suite.mutants.run import CATALOGUE, applied

    skip_unless_here(kernel)
    build = registry.by_name(REGISTRY, kernel).build
    lib = build.library()
    broken = (("vnni-rows-interleaved-wrong", "vnni-scale-of-the-neighbour-group")
              if build.derived else ("avx2-limbs-twin-in-natural-order",))
    for name in broken:
        with applied(next(m for m in CATALOGUE if m.name == name)):
            assert not vnni_check.self_check(lib, build)
    assert vnni_check.self_check(lib, build)


# --------------------------------------------------------------------------- the layers' options


def test_every_constructor_option_is_kept_and_used():
    """PackedInt4Linear and from_weight pass every option on: out_dtype, backend and kernel
    (mutmut found them unchecked)."""
    w = torch.randn(16, 64)
    x = torch.randn(3, 64).bfloat16()
    packed = PackedInt4Linear(64, 16, 8, out_dtype=torch.float32, backend="cpu", kernel="wide")
    dense = ExactLinear.from_weight(w, 4, act_bits=8, out_dtype=torch.float32, backend="cpu",
                                    kernel="wide")
    for layer in (packed, dense):
        assert (layer.act_bits, layer.out_dtype, layer.backend, layer.kernel) == (
            8, torch.float32, "cpu", "wide")
        assert layer(x).dtype == torch.float32 and layer.plan(x).kernel.name == "wide"
    assert dense.weight_packed.device == w.device


@pytest.mark.parametrize(("weight", "match"), [
    (torch.randn(64), r"weight must be a 2-D tensor \[out_features, in_features\]"),
    ([[0.0] * 64], r"weight must be a 2-D tensor \[out_features, in_features\]"),
    (torch.randn(4, 48), r"weight.shape\[1\] \(in_features\) must be a positive multiple of 32")])
def test_from_weight_names_what_is_wrong_with_the_weight(weight, match):
    with pytest.raises(ContractValueError, match=match):
        ExactLinear.from_weight(weight)


def test_a_width_changed_after_a_forward_is_used_by_the_next():
    """The derived data is kept for the widths it was derived at: a layer whose act_bits changes
    between forwards computes at the new width, never from the old width's data."""
    layer = ExactLinear.from_weight(torch.randn(8, 64))
    x = torch.randn(2, 64).bfloat16()
    for act_bits in (16, 4, 8, 16):
        layer.act_bits = act_bits
        want = run(LinearCase(tensor_to_bits(x), BFLOAT16, None, layer.weight_packed.numpy(),
                              tensor_to_bits(layer.weight_scale), act_bits, BFLOAT16), "reference")
        assert (tensor_to_bits(layer(x)) == want).all(), act_bits


def test_the_certificate_summary_counts_each_kind_of_row():
    scales = torch.full((3, 2), 1.0, dtype=torch.bfloat16)
    scales[1, 0] = 2.0**100  # a spread past every limit: a slow row
    layer = PackedInt4Linear(64, 3)
    layer.load_state_dict({"weight_packed": layer.weight_packed, "weight_scale": scales,
                           "weight_shape": layer.weight_shape})
    assert layer.certificate.summary() == {"rows": 3, "fast_rows": 2, "slow_rows": 1,
                                           "max_spread": 100, "spread_limit": 12, "nan_rows": 0}
    layer.weight_scale[2, 1] = float("nan")  # written in place after loading
    assert layer.certificate.summary()["nan_rows"] == 1


@needs_triton
def test_the_plan_counts_rows_over_every_leading_dimension():
    """x [1, 63, K] is 63 rows, one short of the folded GEMM's FOLDED_MIN_ROWS; [1, 64, K] is
    64 rows: the plan counts rows over all leading dimensions, not along one of them."""
    layer = ExactLinear.from_weight(torch.randn(16, 64), backend="triton").to(TRITON_DEVICE)
    assert triton_layer.FOLDED_MIN_ROWS == 64
    for shape, kernel in (((1, 63, 64), triton_layer.GROUP), ((1, 64, 64), triton_layer.FOLDED),
                          ((4, 16, 64), triton_layer.FOLDED)):
        assert layer.plan(torch.zeros(shape, device=TRITON_DEVICE)).kernel is kernel


def test_every_kernel_has_what_the_protocol_names():
    """Each kernel of REGISTRY answers every member of registry.Kernel, and each grouped one
    those of GroupedKernel too (reads: "layers" or "buffers"): the protocol is what a kernel is
    asked for, all of it."""
    from exactness.kernels import GroupedKernel, Kernel

    def members(protocol) -> set[str]:
        names = set(getattr(protocol, "__annotations__", {}))
        return names | {n for n, v in vars(protocol).items() if callable(v) and n[0] != "_"}

    for kernel in REGISTRY:
        missing = {n for n in members(Kernel) if not hasattr(kernel, n)}
        if kernel.grouped:
            missing |= {n for n in members(GroupedKernel) if not hasattr(kernel, n)}
            assert kernel.reads in ("layers", "buffers"), kernel.name
        assert not missing, (kernel.name, missing)
    assert {"run", "prepare", "available", "eligible", "act_limbs"} <= members(Kernel)
    assert {"run_grouped", "reads"} <= members(GroupedKernel)


@given(seed=seeds, groups=st.sampled_from([1, 2, 3, 8, 40]), most_shift=st.integers(0, 12),
       ms_max=st.sampled_from([1, 3, 255]))
def test_the_c_span_scales_are_their_python_twin(seed, groups, most_shift, ms_max):
    """cpu_vnni.c's span scales (span_block_scales, per block in C) against
    vnni_layout.span_scales: every f, rsh, span end and block kind (the self-check compares
    layers read in place too). Small factors make unshifted blocks and long spans; shifts end
    them; rows of zeros, of extreme weights and of odd factors beside them."""
    skip_unless_here("vnni-spans")
    g = torch.Generator().manual_seed(seed)
    n, k = 37, 32 * groups
    q = torch.randint(-8, 8, (n, k), generator=g)
    q[1] = -8  # every chain at its largest sum
    ms = torch.randint(-ms_max, ms_max + 1, (n, groups), generator=g, dtype=torch.int32)
    shift = torch.randint(0, most_shift + 1, ms.shape, generator=g, dtype=torch.int32)
    ms[2] = 0
    ms[3] |= 1
    derived = vnni_layout.NativeWeights(q, ms << shift)
    want = vnni_layout.span_scales(derived.c, derived.w, k)
    for name, a, b in zip(("f", "rsh", "ends", "unshifted"), vnni_calls.span_scales_of(derived),
                          want, strict=True):
        assert torch.equal(a, b), name
