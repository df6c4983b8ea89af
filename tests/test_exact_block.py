"""The exact block (exactness.moe, block "exact", issue 68): each of its roundings tied to the
contract's RNE, its h the same bits in any company, KimiMoE's and the converters' modes. The
block against its step-by-step reference (exactness.suite.moe_reference), in any batch and on
both devices, is tests/test_moe.py's and tests/test_devices.py's (moe_cases draws the block)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from exactness import glue
from exactness.contract import BFLOAT16, FLOAT16, FLOAT32, ContractValueError, ExactnessError
from exactness.formats import tensor_to_bits
from exactness.kimi import ExactExperts
from exactness.suite.moe_reference import rne
from exactness.suite.strategies import seeds
from tests.test_moe import kimi_moe

pytestmark = pytest.mark.stage("equivalence")  # make verify's stage

TARGETS = {torch.bfloat16: BFLOAT16, torch.float16: FLOAT16}


@st.composite
def near_midpoints(draw, fmt):
    """float64 values within a few float64 ulps of a midpoint of `fmt`'s (where a rounding
    through fp32 lands on the midpoint and then rounds to even), or anywhere."""
    if draw(st.booleans()):
        return draw(st.floats(allow_nan=False, width=64))
    pattern = draw(st.integers(0, (1 << fmt.width) - 1))
    if (pattern >> fmt.mant_bits) & fmt.exp_max_field == fmt.exp_max_field:
        pattern = 0
    dtype = torch.bfloat16 if fmt is BFLOAT16 else torch.float16
    value = float(torch.tensor([pattern], dtype=torch.int32).to(torch.int16).view(dtype)
                  .double())
    top = math.frexp(value)[1] - 1 if value else fmt.quantum_min
    ulp = max(top - (fmt.precision - 1), fmt.quantum_min)
    mid = value + math.copysign(2.0 ** (ulp - 1), value or 1.0)  # half an ulp above |value|
    for _ in range(draw(st.integers(0, 3))):
        mid = math.nextafter(mid, draw(st.sampled_from((math.inf, -math.inf))))
    return mid


@pytest.mark.parametrize("dtype", list(TARGETS), ids=["bfloat16", "float16"])
def test_the_blocks_one_rounding_is_the_contracts_rne(dtype):
    """round_float64 (the block's last step) against formats.round_scaled, at the midpoints
    where torch's own double -> bf16 / fp16 rounds twice."""
    fmt = TARGETS[dtype]

    @given(st.lists(near_midpoints(fmt), min_size=1, max_size=64))
    def check(values):
        got = tensor_to_bits(glue.round_float64(torch.tensor(values, dtype=torch.float64), dtype))
        assert got.tolist() == [rne(v, fmt) for v in values], values

    check()


@pytest.mark.parametrize("dtype", list(TARGETS), ids=["bfloat16", "float16"])
def test_torchs_own_conversion_rounds_twice_where_the_block_does_not(dtype):
    """The planted bug the property above catches: torch's .to() of a float64 just above a
    midpoint (1 + half an ulp + 2**-40) gives the even neighbour below; RNE gives the one
    above."""
    fmt = TARGETS[dtype]
    value = 1 + 2.0 ** -fmt.precision + 2.0 ** -40
    t = torch.tensor([value], dtype=torch.float64)
    assert tensor_to_bits(t.to(dtype))[0] != rne(value, fmt)
    assert tensor_to_bits(glue.round_float64(t, dtype))[0] == rne(value, fmt)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32],
                         ids=["bfloat16", "float16", "float32"])
def test_the_blocks_nan_is_the_canonical_one_whatever_made_it(dtype):
    """inf - inf gives a NaN whose sign depends on the machine and the operands' order (x86's
    is negative): the block's one rounding makes every NaN the canonical quiet NaN, so that the
    CPU and a GPU give the same bits."""
    t = torch.tensor([math.inf, -math.inf, 1.0, math.nan], dtype=torch.float64)
    invalid = t[:1] + t[1:2]  # this machine's own NaN
    values = torch.cat([invalid, -invalid, torch.tensor([math.nan, -math.nan, 1.5],
                                                        dtype=torch.float64)])
    got = tensor_to_bits(glue.round_float64(values, dtype)).tolist()
    fmt = {torch.bfloat16: BFLOAT16, torch.float16: FLOAT16, torch.float32: FLOAT32}[dtype]
    assert got == [rne(v, fmt) for v in values.tolist()]
    assert got[:4] == [fmt.inf_bits | (1 << (fmt.mant_bits - 1))] * 4


def test_an_fp32_times_an_fp32_is_exact_in_float64():
    """Why the block's terms y * w are exact in float64: 24 + 24 significant bits fit in 53,
    and the products of fp32's extremes stay inside float64's normal range."""
    assert 2 * FLOAT32.precision <= 53
    smallest = 2.0 ** FLOAT32.quantum_min
    largest = float(torch.finfo(torch.float32).max)
    assert smallest * smallest >= 2.0 ** -1022 and math.isfinite(largest * largest)


@given(st.integers(1, 40), st.integers(1, 3), seeds)
def test_the_exact_blocks_h_gives_each_element_the_same_bits_anywhere(rows, width, seed):
    """h of one row alone is its row of a batch (float64 SiLU differs between torch's vector
    and scalar paths too), and it is RNE_fp32(silu(gate) * up) computed in float64."""
    i = 32 * width
    g = torch.Generator().manual_seed(seed)
    gate, up = torch.randn(rows, i, generator=g) * 4, torch.randn(rows, i, generator=g)
    both = glue.exact_activation(torch.nn.functional.silu, gate, up)
    r = rows // 2
    alone = glue.exact_activation(torch.nn.functional.silu, gate[r:r + 1], up[r:r + 1])
    assert torch.equal(alone.view(torch.int32)[0], both.view(torch.int32)[r])
    h64 = glue.on_vector_path(torch.nn.functional.silu, gate.double()) * up.double()
    want = [rne(float(v), FLOAT32) for v in h64.flatten()]
    assert tensor_to_bits(both).flatten().tolist() == want


def test_the_blocks_are_named_and_a_wrong_name_refused():
    assert ExactExperts(2, 64, 32, torch.nn.SiLU()).block == "exact"
    assert ExactExperts(2, 64, 32, torch.nn.SiLU(), block="transformers").block == "transformers"
    with pytest.raises(ContractValueError, match="block must be one of"):
        ExactExperts(2, 64, 32, torch.nn.SiLU(), block="fp32")


@pytest.mark.parametrize("act_bits", [16, 32])
def test_the_kimi_moe_exact_block_rounds_routed_and_shared_once(act_bits):
    """KimiMoE's exact block: the routed experts' exact block and the shared experts added in
    float64, rounded once; the grouped call gives its loop's bits, and differs from the
    transformers block's."""
    block = kimi_moe(act_bits=act_bits)
    assert block.block == "exact"
    x = torch.from_numpy(np.random.default_rng(2).standard_normal((7, 64))).bfloat16()
    chosen, weights = block.gate(x)
    routed = block.per_expert(x, chosen, weights)
    assert routed.dtype == torch.float64
    want = glue.round_float64(routed + block.shared_experts(x).double(), torch.bfloat16)
    got = block(x)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    block.grouped = False
    assert torch.equal(block(x).view(torch.int16), got.view(torch.int16))
    block.block = "transformers"
    assert not torch.equal(block(x).view(torch.int16), got.view(torch.int16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bfloat16", "float32"])
@given(st.integers(1, 6), st.integers(1, 5), seeds, st.data())
def test_the_exact_weighted_sum_is_a_float64_sum_rounded_once(dtype, tokens, experts, seed,
                                                               data):
    """weighted_sum in the exact block against Python floats (IEEE float64): each token's
    y * w added in the loops' order (experts ascending, then slots), then the contract's RNE.
    With fp32 outputs, a sum kept in fp32 differs at once."""
    from exactness.kernels.routing import route
    from exactness.suite.strategies import routings

    top_k = data.draw(st.integers(1, experts))
    ids = torch.from_numpy(data.draw(routings(tokens, experts, top_k)))
    try:
        routing = route(ids, experts, check=True)
    except ExactnessError:
        return  # a refused routing: tests/test_moe.py's
    g = torch.Generator().manual_seed(seed)
    routed = int(routing.routed)
    rows = torch.randn(routed, 8, generator=g) * 2.0 ** torch.randint(-20, 20, (routed, 8),
                                                                      generator=g)
    weights = torch.rand(tokens, top_k, generator=g)
    got = tensor_to_bits(glue.weighted_sum(rows, routing, weights, dtype, "exact"))
    pairs = routing.pair[:routed].tolist()
    want = []
    for token in range(tokens):
        mine = sorted((int(ids[token, p % top_k]), p % top_k, r) for r, p in enumerate(pairs)
                      if p // top_k == token)
        sums = [0.0] * 8
        for _, slot, r in mine:
            for c in range(8):
                sums[c] += float(rows[r, c]) * float(weights[token, slot])
        want.append([rne(v, {torch.bfloat16: BFLOAT16, torch.float32: FLOAT32}[dtype])
                     for v in sums])
    assert got.tolist() == want
