"""Bad input: a clear, typed error that names the argument and the first bad index."""

import numpy as np
import pytest

from exactness.contract import (
    ContractTypeError,
    ContractValueError,
    NonFiniteError,
    ShapeError,
    act_qmax,
    float_format,
    weight_range,
)
from exactness.formats import decode, pack_weights, unpack_weights
from exactness.reference import reference_linear

X = np.full((2, 64), 0x3F80)  # bf16 1.0
PACKED = pack_weights(np.ones((3, 64), np.int64), 4)
SCALES = np.full((3, 2), 0x3C00)


def call(x=X, packed=PACKED, scales=SCALES, **kw):
    return reference_linear(x, "bfloat16", packed, scales, **kw)


def test_good_input_passes():
    assert call().shape == (2, 3)


@pytest.mark.parametrize("bad", [0x7F80, 0xFF80, 0x7FC1])  # +inf, -inf, NaN
def test_non_finite_activation_counts_and_locates(bad):
    x = X.copy()
    x[1, 5] = x[1, 9] = bad
    with pytest.raises(NonFiniteError, match=r"x has 2 non-finite value\(s\); the first at index "
                                             r"\(1, 5\)"):
        call(x=x)
    assert issubclass(NonFiniteError, ValueError)


def test_non_finite_scale_names_the_tensor():
    s = SCALES.copy()
    s[2, 1] = 0x7F80
    with pytest.raises(NonFiniteError, match=r"weight_scale .* \(2, 1\)"):
        call(scales=s)


def test_k_not_a_multiple_of_32():
    with pytest.raises(ShapeError, match="multiple of 32, got 48"):
        call(x=np.zeros((1, 48), np.int64))


def test_wrong_shapes_name_the_tensor():
    with pytest.raises(ShapeError, match="weight_packed has shape"):
        call(packed=PACKED[:, :4])
    with pytest.raises(ShapeError, match="weight_scale has shape"):
        call(scales=SCALES[:2])
    with pytest.raises(ShapeError, match="2-D"):
        call(x=X[0])


@pytest.mark.parametrize("bits", [2, 3, 16, True, "4"])
def test_weight_bits_outside_4_and_8(bits):
    with pytest.raises(ContractValueError, match="bits must be one of"):
        weight_range(bits)


@pytest.mark.parametrize("act_bits", [0, 2, 12, 32, None])
def test_act_bits_outside_4_8_16(act_bits):
    with pytest.raises(ContractValueError, match="act_bits must be one of"):
        act_qmax(act_bits)
    with pytest.raises(ContractValueError, match="act_bits"):
        call(act_bits=act_bits)


def test_unknown_dtype():
    with pytest.raises(ContractTypeError, match="dtype must be one of"):
        float_format("float64")


def test_packed_weights_must_be_int32():
    with pytest.raises(ContractTypeError, match="int32"):
        unpack_weights(PACKED.astype(np.int64), 4)


def test_weight_out_of_range_names_the_index():
    q = np.zeros((2, 8), np.int64)
    q[1, 3] = 8
    with pytest.raises(ContractValueError, match=r"q\[1, 3\] = 8 is outside \[-8, 7\]"):
        pack_weights(q, 4)


def test_decode_refuses_non_finite():
    with pytest.raises(NonFiniteError):
        decode(0x7F80, float_format("bfloat16"))
