"""Packing and float formats against their real peers: compressed-tensors, numpy and torch."""

import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import (
    pack_to_int32,
    unpack_from_int32,
)
from hypothesis import given
from hypothesis import strategies as st

from exactness.contract import BFLOAT16, FLOAT16, FLOAT32, FORMATS
from exactness.formats import (
    CHECK_STEP,
    bits_to_tensor,
    check_finite_tensor,
    decode,
    decode_array,
    pack_weights,
    rne_shift_right,
    round_scaled,
    round_scaled_array,
    split_scales,
    tensor_to_bits,
    torch_dtype,
    unpack_weights,
    zero_word,
)
from exactness.suite.strategies import int_weights, scaled_integers, seeds

pytestmark = pytest.mark.stage("reference")  # make verify's stage

# --------------------------------------------------------------------------- packing


@st.composite
def weights_and_bits(draw):
    bits = draw(st.sampled_from((4, 8)))
    n, k = draw(st.integers(1, 6)), 32 * draw(st.integers(1, 8))
    return draw(int_weights(n, k, bits)), bits


@given(weights_and_bits())
def test_pack_matches_compressed_tensors(case):
    q, bits = case
    ours = pack_weights(q, bits)
    theirs = pack_to_int32(torch.from_numpy(q).to(torch.int8), bits).numpy()
    np.testing.assert_array_equal(ours, theirs)


@given(weights_and_bits())
def test_unpack_matches_compressed_tensors(case):
    q, bits = case
    packed = pack_to_int32(torch.from_numpy(q).to(torch.int8), bits)
    theirs = unpack_from_int32(packed, bits, torch.Size(q.shape)).numpy()
    np.testing.assert_array_equal(unpack_weights(packed.numpy(), bits, q.shape[1]), theirs)
    np.testing.assert_array_equal(theirs, q)


def test_pack_layout_by_hand():
    # element k at bits 4*(k % 8): k = 0..7 -> nibbles 0..7 (q = -8..-1), word 0x76543210
    q = np.arange(-8, 8).reshape(1, 16)
    words = pack_weights(q, 4).view(np.uint32)
    assert [hex(w) for w in words[0]] == ["0x76543210", "0xfedcba98"]
    assert pack_weights(q, 4)[0, 1] < 0  # top nibble >= 8: a negative int32


# --------------------------------------------------------------------------- decoding


def test_decode_every_16bit_pattern_matches_torch():
    for fmt in (BFLOAT16, FLOAT16):
        bits = np.arange(2**16, dtype=np.int64)
        values = bits_to_tensor(bits, fmt).double().numpy()
        finite = np.isfinite(values)
        m, e = decode_array(bits[finite], fmt)
        np.testing.assert_array_equal(np.ldexp(m.astype(np.float64), e), values[finite])
        assert finite.sum() == 2**16 - 2 * 2**fmt.mant_bits  # all but inf and NaN


@given(st.sampled_from([BFLOAT16, FLOAT16, FLOAT32]), st.data())
def test_decode_matches_torch(fmt, data):
    bits = data.draw(st.integers(0, 2**fmt.width - 1).filter(
        lambda b: (b >> fmt.mant_bits) & fmt.exp_max_field != fmt.exp_max_field))
    m, e = decode(bits, fmt)
    assert math.ldexp(m, e) == bits_to_tensor(np.array([bits]), fmt).double().item()
    assert (m, e) == tuple(int(v[0]) for v in decode_array(np.array([bits]), fmt))


def test_decode_signed_zero_and_subnormal():
    assert decode(0x8000, BFLOAT16) == (0, -133)
    assert decode(0x0001, BFLOAT16) == (1, -133)  # smallest bf16 subnormal: 2**-133
    assert decode(0x0080, BFLOAT16) == (128, -133)  # smallest normal: 2**-126
    assert decode(0x0001, FLOAT16) == (1, -24)


# --------------------------------------------------------------------------- rounding

# (m, e) where m * 2**e is a float64 (|m| < 2**53, e in the normal range): torch's
# float64 -> float32 and numpy's float64 -> float16 conversions are correctly rounded there.
wide_ints = st.tuples(st.integers(-(2**63) + 1, 2**63 - 1), st.integers(-400, 300))


@given(scaled_integers(FLOAT32))
def test_round_fp32_matches_torch(me):
    m, e = me
    want = tensor_to_bits(torch.tensor([math.ldexp(m, e)], dtype=torch.float64).float())[0]
    assert round_scaled(m, e, FLOAT32) == want


@given(scaled_integers(FLOAT16))
def test_round_fp16_matches_numpy(me):
    m, e = me
    with np.errstate(over="ignore"):  # overflow to inf is what we compare
        want = int(np.array([math.ldexp(m, e)]).astype(np.float16).view(np.uint16)[0])
    assert round_scaled(m, e, FLOAT16) == want


@given(scaled_integers(BFLOAT16, max_bits=24, exponents=(-160, 100)))
def test_round_bf16_matches_torch_from_exact_fp32(me):
    m, e = me
    value = math.ldexp(m, e)
    as_fp32 = torch.tensor([value], dtype=torch.float64).float()
    if as_fp32.double().item() != value:  # not exact in fp32: torch would round twice
        return
    assert round_scaled(m, e, BFLOAT16) == tensor_to_bits(as_fp32.bfloat16())[0]


@given(st.sampled_from([BFLOAT16, FLOAT16, FLOAT32]), st.lists(wide_ints, min_size=1,
                                                                max_size=64))
def test_round_array_matches_scalar(fmt, mes):
    m = np.array([v[0] for v in mes], dtype=np.int64)
    e = np.array([v[1] for v in mes], dtype=np.int64)
    got = round_scaled_array(m, e, fmt)
    assert got.tolist() == [round_scaled(int(a), int(b), fmt) for a, b in mes]


@given(st.sampled_from(list(FORMATS.values())), seeds)
def test_round_array_matches_scalar_near_ties(fmt, seed):
    """Ties and their neighbours, where a missing sticky bit or half-up rounding shows."""
    rng = np.random.default_rng(seed)
    shift = rng.integers(1, 40, 256)
    n = rng.integers(2 ** (fmt.precision - 1), 2**fmt.precision, 256)
    m = (n << shift) + (np.int64(1) << (shift - 1)) + rng.integers(-1, 2, 256)
    e = rng.integers(-200, 100, 256)
    got = round_scaled_array(m, e, fmt)
    assert got.tolist() == [round_scaled(int(a), int(b), fmt) for a, b in zip(m, e, strict=True)]


@given(st.lists(st.tuples(st.integers(0, 2**63 - 1), st.integers(0, 63)), min_size=1,
                max_size=32), st.booleans())
def test_rne_shift_right_rounds_half_to_even_at_every_shift(pairs, on_torch):
    """Every shift its callers may pass, 0 (no rounding at all) and 63 included, on numpy and
    torch; the callers select only some lanes, so this is the only check of the rest."""
    a = np.array([p[0] for p in pairs], np.int64)
    s = np.array([p[1] for p in pairs], np.int64)
    got = rne_shift_right(*((torch.from_numpy(a), torch.from_numpy(s)) if on_torch else (a, s)))
    want = [round(Fraction(int(x), 2**int(k))) for x, k in pairs]  # Fraction rounds half to even
    assert np.asarray(got).tolist() == want


@pytest.mark.parametrize("fmt", list(FORMATS.values()), ids=lambda f: f.name)
def test_bits_to_tensor_stays_on_the_tensors_device(fmt):
    """A tensor of patterns is converted where it lies (a GPU's, or here the meta device, which
    holds no values and so fails any copy through numpy)."""
    patterns = torch.tensor([0, 1, fmt.sign_bit, fmt.sign_bit | 1, fmt.inf_bits])
    got = bits_to_tensor(patterns.to("meta"), fmt)
    assert got.device.type == "meta" and got.dtype == torch_dtype(fmt)
    assert (tensor_to_bits(bits_to_tensor(patterns, fmt)) == patterns.numpy()).all()


def test_rounding_examples():
    assert round_scaled(0, 5, BFLOAT16) == 0x0000  # an exact zero is +0.0
    assert round_scaled(0x181, 0, BFLOAT16) == 0x43C0  # 385 = 384 + 1: tie -> even (384)
    assert round_scaled(0x183, 0, BFLOAT16) == 0x43C2  # 387 = 386 + 1: tie -> even (388)
    assert round_scaled(1, -134, BFLOAT16) == 0x0000  # half the smallest subnormal: tie -> 0
    assert round_scaled(3, -135, BFLOAT16) == 0x0001  # 0.75 of it rounds up to the subnormal
    assert round_scaled(-1, -135, BFLOAT16) == 0x8000  # a nonzero value underflows to -0.0
    assert round_scaled(255, 120, BFLOAT16) == 0x7F7F  # largest finite bf16, exactly
    assert round_scaled(511, 119, BFLOAT16) == 0x7F80  # rounds past it: +inf
    assert round_scaled(-(2**200), 0, FLOAT32) == 0xFF800000


def test_torch_int64_to_bf16_rounds_twice():
    """Why the final rounding is done from the exact integer: int64 -> fp32 -> bf16 is wrong."""
    m = 2**24 + 2**16 + 1  # just above a bf16 tie: correct rounding goes up
    assert round_scaled(m, 0, BFLOAT16) == 0x4B81  # 2**24 + 2**17
    assert tensor_to_bits(torch.tensor([m]).to(torch.bfloat16))[0] == 0x4B80  # torch: 2**24


@pytest.mark.parametrize("bits", [4, 8])
def test_zero_word_packs_zero_weights(bits):
    assert zero_word(bits) == int(pack_weights(np.zeros((1, 32 // bits), np.int64), bits)[0, 0])
    assert (unpack_weights(np.full((1, 1), zero_word(bits), np.int32), bits) == 0).all()


@pytest.mark.parametrize("on_torch", [False, True])
def test_split_scales_where_scales_are_zero(on_torch):
    """A zero scale (+0 or -0) takes shift 0, so a row's spread is that of its nonzero scales
    alone; an all-zero row has emin 0; the others emin their least exponent (1.0 = 128 * 2**-7)."""
    one, two, zero, minus_zero = 0x3F80, 0x4000, 0x0000, 0x8000
    bits = np.array([[one, zero, two, minus_zero], [zero, minus_zero, zero, zero],
                     [one, zero, one, zero]])
    ms, shift, emin, spread = (np.asarray(v) for v in split_scales(
        torch.from_numpy(bits) if on_torch else bits))
    assert ms.tolist() == [[128, 0, 128, 0], [0, 0, 0, 0], [128, 0, 128, 0]]
    assert shift.tolist() == [[0, 0, 1, 0], [0, 0, 0, 0], [0, 0, 0, 0]]
    assert emin.tolist() == [-7, 0, -7] and spread.tolist() == [1, 0, 0]


@pytest.mark.parametrize("on_torch", [False, True])
def test_int16_views_of_the_patterns_decode_as_int64_ones(on_torch):
    """A bf16 tensor's bits viewed as int16 (`scale.view(torch.int16)`) hold the negative
    numbers' patterns as negative integers: decoded and split, they give what the int64 patterns
    give, with no narrow integer on the way (split_scales' 2**62 does not fit int16)."""
    patterns = np.array([0x3F80, 0xBF80, 0x8000, 0x0001, 0x8001, 0x7F7F, 0xFF7F])
    as16 = patterns.astype(np.uint16).view(np.int16)
    view = torch.from_numpy(as16) if on_torch else as16
    m, e = (np.asarray(v) for v in decode_array(view, BFLOAT16))
    assert m.tolist() == [128, -128, 0, 1, -1, 255, -255]
    assert e.tolist() == [-7, -7, -133, -133, -133, 120, 120]
    for got, want in zip(split_scales(view.reshape(1, -1)), split_scales(patterns.reshape(1, -1)),
                         strict=True):
        assert np.asarray(got).tolist() == want.tolist()


@pytest.mark.parametrize("at", [0, CHECK_STEP - 1, CHECK_STEP, 2 * CHECK_STEP + 4])
@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
def test_a_finite_check_in_steps_finds_a_bad_value_at_every_step_edge(at, value):
    """check_finite_tensor runs the CPU in steps of CHECK_STEP elements: a non-finite value at
    either edge of a step, or in the last part step, is found and named, in a non-contiguous
    view too; an all-finite tensor of the same size passes."""
    from exactness.contract import NonFiniteError

    t = torch.full((2, CHECK_STEP + 3), 1.5, dtype=torch.bfloat16)
    check_finite_tensor(t, "t")
    t.view(-1)[at] = value
    index = (at // t.shape[1], at % t.shape[1])
    with pytest.raises(NonFiniteError, match=rf"t has 1 non-finite value\(s\); the first at "
                                             rf"index \({index[0]}, {index[1]}\)"):
        check_finite_tensor(t, "t")
    with pytest.raises(NonFiniteError, match=rf"index \({index[1]}, {index[0]}\)"):
        check_finite_tensor(t.t(), "t")
