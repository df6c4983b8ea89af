"""Bad input: a clear, typed error that names the argument and the first bad index."""

import itertools

import numpy as np
import pytest
import torch

from exactness import ExactLinear, PackedInt4Linear
from exactness.contract import (
    BFLOAT16,
    ContractTypeError,
    ContractValueError,
    NonFiniteError,
    ShapeError,
    act_qmax,
    float_format,
    weight_range,
)
from exactness.formats import decode, pack_weights, tensor_to_bits, unpack_weights
from exactness.kernels import REGISTRY
from exactness.suite.cases import load_vectors
from exactness.suite.paths import BACKENDS, available_paths, device_of, layer_for, require
from exactness.suite.reference import reference_linear

pytestmark = pytest.mark.stage("reliability")  # make verify's stage

X = np.full((2, 64), 0x3F80)  # bf16 1.0
PACKED = pack_weights(np.ones((3, 64), np.int64), 4)
SCALES = np.full((3, 2), 0x3C00)


def call(x=X, packed=PACKED, scales=SCALES, **kw):
    return reference_linear(x, "bfloat16", packed, scales, **kw)


def test_good_input_passes():
    assert call().shape == (2, 3)


@pytest.mark.parametrize("bad", [0x7F80, 0xFF80, 0x7FC1, 0xFFC1])  # +-inf, a NaN, a negative NaN
def test_a_non_finite_activation_gives_its_row_the_canonical_nan(bad):
    """Contract v1.2, section 3: every output of that row is the canonical quiet NaN, and the
    other rows are what they are without it."""
    x = X.copy()
    x[1, 5] = x[1, 9] = bad
    got = call(x=x)
    assert (got[1] == BFLOAT16.nan_bits).all(), got
    np.testing.assert_array_equal(got[0], call()[0])
    assert issubclass(NonFiniteError, ValueError)  # what a strict layer raises


def test_a_non_finite_scale_gives_its_weight_row_the_canonical_nan():
    """Contract v1.2, section 2: a non-finite scale that reaches a forward (written in place
    after loading) gives every output of its weight row the canonical NaN."""
    s = SCALES.copy()
    s[2, 1] = 0x7F80
    got = call(scales=s)
    assert (got[:, 2] == BFLOAT16.nan_bits).all(), got
    np.testing.assert_array_equal(got[:, :2], call()[:, :2])


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


@pytest.mark.parametrize("act_bits", [0, 2, 12, 24, 64, None])
def test_act_bits_outside_4_8_16_32(act_bits):
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


@pytest.mark.parametrize("call_, says", [
    (lambda: pack_weights(np.zeros(8, np.int64), 4), r"^weights to pack must be 2-D \[N, K\], "
                                                     r"got shape \(8,\)$"),
    (lambda: pack_weights(np.zeros((2, 12), np.int64), 4), r"^K=12 is not a multiple of 8 "
                                                           r"\(4-bit packing\)$"),
    (lambda: unpack_weights(np.zeros(3, np.int32), 8), r"^packed weights must be 2-D \[N, K/4\], "
                                                       r"got \(3,\)$"),
    (lambda: unpack_weights(np.zeros((2, 2), np.int32), 4, k=24),
     r"^packed weights of shape \(2, 2\) hold K=16, not 24$"),
])
def test_packing_shapes_are_refused_saying_which(call_, says):
    with pytest.raises(ShapeError, match=says):
        call_()


def test_decode_refuses_non_finite():
    with pytest.raises(NonFiniteError, match="^bfloat16 pattern 0x7f80 is not finite$"):
        decode(0x7F80, float_format("bfloat16"))


def test_a_non_finite_weight_for_from_weight_names_it():
    w = torch.randn(2, 64)
    w[1, 40] = float("nan")
    with pytest.raises(NonFiniteError, match=r"^weight has 1 non-finite value\(s\); the first at "
                                             r"index \(1, 40\)$"):
        ExactLinear.from_weight(w)


# --------------------------------------------------------------------------- the layer


@pytest.mark.parametrize("path", [*BACKENDS, *(k.name for k in REGISTRY
                                               if k.name != "triton-folded")])
def test_layer_non_finite_x_gives_nan_rows_or_raises_when_strict(path):
    """Every path gives a row of x holding an inf or a NaN the canonical NaN in every output, in
    each dtype, and the other rows their own bits (contract v1.2). A strict layer raises
    instead, with the count and the first index. (triton-folded shares the Triton path.)"""
    require(path)
    act16 = next(case for case in load_vectors() if case.act_bits == 16)  # every kernel holds it
    for bad, dtype in itertools.product([float("inf"), float("-inf"), float("nan")],
                                        [torch.bfloat16, torch.float16, torch.float32]):
        case_layer = layer_for(act16, path, device_of(path))
        x = torch.randn(3, case_layer.in_features).to(dtype).to(device_of(path))
        clean = case_layer(x[1:2])
        x[2, 7] = x[0, 1] = bad
        y = tensor_to_bits(case_layer(x))
        nan = float_format(y_dtype(case_layer, dtype)).nan_bits
        assert (y[[0, 2]] == nan).all(), (path, bad, dtype, y)
        assert (y[1] == tensor_to_bits(clean)[0]).all(), (path, bad, dtype)
        case_layer.strict = True
        with pytest.raises(NonFiniteError, match=r"x has 2 non-finite value\(s\); the first at "
                                                 r"index \(0, 1\)"):
            case_layer(x)


def y_dtype(layer, x_dtype: torch.dtype) -> torch.dtype:
    return layer.out_dtype or x_dtype


def test_layer_wrong_last_dim_and_dtypes():
    layer = PackedInt4Linear(64, 4)
    with pytest.raises(ShapeError, match="in_features=64"):
        layer(torch.randn(2, 32))
    for dtype in (torch.float64, torch.int32, torch.float8_e4m3fn):
        with pytest.raises(ContractTypeError, match="dtype must be one of"):
            layer(torch.zeros(2, 64, dtype=dtype))


@pytest.mark.parametrize("path", [p for p in available_paths() if p in ("cpu", "triton")])
def test_layer_empty_batch_and_non_contiguous_input(path):
    device = device_of(path)
    layer = ExactLinear.from_weight(torch.randn(4, 64), backend=path).to(device)
    assert layer(torch.randn(0, 64, device=device)).shape == (0, 4)
    assert layer(torch.randn(2, 0, 64, device=device)).shape == (2, 0, 4)
    def randn(*shape):
        return torch.randn(*shape, device=device)

    for x in (randn(64, 6).t(), randn(6, 128)[:, ::2],  # transposed, strided
              randn(2, 3, 64).transpose(0, 1), randn(1, 64).expand(5, 64)):
        assert torch.equal(layer(x), layer(x.contiguous()))


def test_layer_constructor_arguments():
    with pytest.raises(ShapeError, match="multiple of 32, got 48"):
        PackedInt4Linear(48, 4)
    with pytest.raises(ContractValueError, match="act_bits"):
        PackedInt4Linear(64, 4, act_bits=12)
    with pytest.raises(ContractValueError, match="bits must be one of"):
        ExactLinear(64, 4, bits=2)
    with pytest.raises(ContractValueError, match="group_size must be 32"):
        ExactLinear.from_weight(torch.randn(4, 64), group_size=64)
    for out_features in (0, True, 2.0):
        with pytest.raises(ShapeError, match="out_features must be a positive integer"):
            PackedInt4Linear(64, out_features)


def corrupt(key, value):
    layer = PackedInt4Linear(64, 4)
    sd = layer.state_dict()
    sd[key] = value
    return layer, sd


@pytest.mark.parametrize("key, value, error, match", [
    ("weight_packed", torch.zeros(4, 8, dtype=torch.int64), ContractTypeError,
     "weight_packed: dtype torch.int64"),
    ("weight_packed", torch.zeros(4, 4, dtype=torch.int32), ShapeError,
     r"weight_packed: shape \(4, 4\), expected \(4, 8\)"),
    ("weight_scale", torch.zeros(4, 2, dtype=torch.float16), ContractTypeError,
     "weight_scale: dtype torch.float16"),
    ("weight_scale", torch.tensor([[1.0, 1.0]] * 3 + [[1.0, float("inf")]]).bfloat16(),
     NonFiniteError, r"weight_scale has 1 non-finite value\(s\); the first at index \(3, 1\)"),
    ("weight_shape", torch.tensor([4, 32]), ShapeError, r"weight_shape: \[4, 32\]"),
    ("weight_shape", torch.tensor([4.0, 64.0]), ContractTypeError, "weight_shape: dtype"),
])
def test_corrupt_buffers_name_the_key(key, value, error, match):
    layer, sd = corrupt(key, value)
    with pytest.raises(error, match=match):
        layer.load_state_dict(sd)


def test_missing_key_is_reported():
    layer, sd = corrupt("weight_scale", None)
    del sd["weight_scale"]
    with pytest.raises(RuntimeError, match="Missing key.*weight_scale"):
        layer.load_state_dict(sd)


@pytest.mark.parametrize("x", ["x", [[0.0] * 64], np.zeros((2, 64), np.float32)],
                         ids=["str", "list", "ndarray"])
def test_an_x_that_is_no_tensor_is_named_by_its_type(x):
    layer = PackedInt4Linear(64, 8)
    with pytest.raises(ContractTypeError, match=rf"^x must be a torch\.Tensor, got "
                                                rf"{type(x).__name__}$"):
        layer(x)
    with pytest.raises(ContractTypeError, match=r"^x must be a torch\.Tensor"):
        layer.plan(x)


def test_a_weight_shape_written_in_place_is_named_at_the_next_forward():
    """A write that bypasses load_state_dict (a serving stack's copy_) is checked when read."""
    layer = PackedInt4Linear(64, 4)
    layer.weight_shape.copy_(torch.tensor([4, 32]))
    for call in (layer, layer.plan):
        with pytest.raises(ShapeError, match=r"^weight_shape: \[4, 32\], but the layer is "
                                             r"\[4, 64\]$"):
            call(torch.randn(2, 64))


def test_what_the_loader_and_the_constructor_refuse_is_named_exactly():
    layer = PackedInt4Linear(64, 4)
    sd = layer.state_dict()
    with pytest.raises(ContractTypeError, match=r"^weight_scale must be a torch\.Tensor, got "
                                                r"list$"):
        layer.load_state_dict({**sd, "weight_scale": [[1.0, 1.0]] * 4})
    with pytest.raises(ShapeError, match=r"^weight_scale: shape \(4, 3\), expected \(4, 2\)"):
        layer.load_state_dict({**sd, "weight_scale": torch.ones(4, 3, dtype=torch.bfloat16)})
    with pytest.raises(RuntimeError, match=r'Unexpected key\(s\) in state_dict: "bias"'):
        layer.load_state_dict({**sd, "bias": torch.zeros(4)})
    with pytest.raises(ContractValueError, match=r"^backend must be one of \('auto', 'cpu', "
                                                 r"'triton'\), got 'gpu'$"):
        PackedInt4Linear(64, 4, backend="gpu")


def test_a_non_finite_scale_written_in_place_is_nan_or_named_when_strict():
    """Its weight row's outputs are the canonical NaN at the next forward (contract v1.2), the
    others unchanged; a strict layer names it instead."""
    layer = PackedInt4Linear(64, 4)
    x = torch.randn(2, 64)
    before = tensor_to_bits(layer(x))  # derived once: the write below must be seen
    layer.weight_scale[1, 0] = float("inf")
    after = tensor_to_bits(layer(x))
    assert (after[:, 1] == float_format("float32").nan_bits).all()
    assert (after[:, [0, 2, 3]] == before[:, [0, 2, 3]]).all()
    layer.strict = True
    with pytest.raises(NonFiniteError, match=r"^weight_scale has 1 non-finite value\(s\); the "
                                             r"first at index \(1, 0\)"):
        layer(x)


def test_a_non_finite_scale_in_a_slow_row_is_nan_too():
    """A row whose other scales spread past every fast kernel (a slow row, from `wide`): its
    NaN scale gives its outputs NaN as well, and the other rows keep their bits."""
    scales = torch.full((3, 2), 1.0, dtype=torch.bfloat16)
    scales[1, 0] = 2.0**100
    layer = PackedInt4Linear(64, 3, kernel="vnni-limbs" if "vnni-limbs" in available_paths()
                             else None)
    layer.load_state_dict({"weight_packed": torch.randint(-2**31, 2**31 - 1, (3, 8),
                                                          dtype=torch.int32),
                           "weight_scale": scales, "weight_shape": layer.weight_shape})
    x = torch.randn(2, 64)
    before = tensor_to_bits(layer(x))
    assert layer.certificate.slow_rows.tolist() == [1]
    layer.weight_scale[1, 1] = float("nan")
    after = tensor_to_bits(layer(x))
    assert (after[:, 1] == float_format("float32").nan_bits).all()
    assert (after[:, [0, 2]] == before[:, [0, 2]]).all()
