"""The layer as a serving stack and a hostile user drive it (issue 20): weights written through
any door are seen at the next forward, buffers no kernel can read and inputs no kernel can take
get a typed error, every path is exact at every K, and the slow rows run in bounded blocks."""

import os
import sys

import numpy as np
import pytest
import torch
from torch import nn

from exactness import PackedInt4Linear
from exactness.contract import (
    ContractTypeError,
    ContractValueError,
    NonFiniteError,
    ShapeError,
    float_format,
)
from exactness.dataflow import certified_spread
from exactness.formats import bits_to_tensor, pack_weights, tensor_to_bits
from exactness.kernels import REGISTRY, wide
from exactness.suite.paths import device_of, require
from exactness.suite.reference import reference_linear

pytestmark = pytest.mark.stage("reliability")  # make verify's stage

N, K, M = 16, 96, 3
KERNELS = [kernel.name for kernel in REGISTRY if kernel.name != "triton-folded"]  # (M > 16)


def checkpoint(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    q = rng.integers(-8, 8, (N, K))
    scales = 0x3C00 + rng.integers(0, 256, (N, K // 32))
    return {"weight_packed": torch.from_numpy(pack_weights(q, 4)),
            "weight_scale": bits_to_tensor(scales, "bfloat16"),
            "weight_shape": torch.tensor([N, K])}


def layer_of(weights: dict, kernel: str | None = None) -> PackedInt4Linear:
    """A layer of `weights` forced onto `kernel`, on the device that kernel runs on (the suite's
    device for the Triton kernels); its forward takes x from any device (a test's X)."""
    family = next((k.family for k in REGISTRY if k.name == kernel), "cpu")
    layer = PackedInt4Linear(K, N, kernel=kernel,
                             backend="triton" if family == "triton" else "auto")
    layer.load_state_dict(weights)
    device = device_of(kernel) if kernel else "cpu"
    if device != "cpu":
        layer.to(device).register_forward_pre_hook(lambda module, args: tuple(
            a.to(module.weight_packed.device) for a in args))
    return layer


def here(kernel: str) -> PackedInt4Linear:
    """A layer forced onto `kernel`, or a skip that says why it does not run here."""
    require(kernel)
    return layer_of(checkpoint(0), kernel)


X = torch.randn(M, K, generator=torch.Generator().manual_seed(1)).bfloat16()


def bits(y: torch.Tensor) -> np.ndarray:
    return tensor_to_bits(y)


# ------------------------------------------------------------------ 1. weights through any door

def through_data_copy(layer, new):  # vLLM's weight_loader: param.data.copy_(loaded)
    layer.weight_packed.data.copy_(new["weight_packed"])
    layer.weight_scale.data.copy_(new["weight_scale"])


def through_numpy_views(layer, new):
    layer.weight_packed.numpy()[:] = new["weight_packed"].numpy()
    layer.weight_scale.view(torch.int16).numpy()[:] = new["weight_scale"].view(torch.int16).numpy()


def through_reassignment(layer, new):
    device = layer.weight_packed.device
    layer.weight_packed = new["weight_packed"].clone().to(device)
    layer.weight_scale = new["weight_scale"].clone().to(device)


def through_parameters(layer, new):  # how vLLM registers a quantized layer's weights
    device = layer.weight_packed.device
    layer.weight_packed = nn.Parameter(new["weight_packed"].clone().to(device),
                                       requires_grad=False)
    layer.weight_scale = nn.Parameter(new["weight_scale"].clone().to(device),
                                      requires_grad=False)


def through_in_place_ops(layer, new):
    with torch.no_grad():
        layer.weight_packed.copy_(new["weight_packed"])
        layer.weight_scale.copy_(new["weight_scale"])


DOORS = [through_data_copy, through_numpy_views, through_reassignment, through_parameters,
         through_in_place_ops]


@pytest.mark.parametrize("door, kernel", [
    pytest.param(door, kernel, id=f"{door.__name__}-{kernel}") for kernel in KERNELS
    for door in DOORS  # a CUDA tensor has no numpy view: that door is the CPU's
    if not (door is through_numpy_views and device_of(kernel) == "cuda")])
def test_weights_written_through_any_door_are_seen_at_the_next_forward(kernel, door):
    layer = here(kernel)
    before = bits(layer(X))
    new = checkpoint(1)
    want = bits(layer_of(new, kernel)(X))
    assert (want != before).any()  # the write changes the output: a stale layer is caught
    door(layer, new)
    assert (bits(layer(X)) == want).all()
    door(layer, checkpoint(0))  # and back: nothing cached from the second weights either
    assert (bits(layer(X)) == before).all()


def changed(kind: str) -> dict:
    """checkpoint(0) with one kind of change: the words alone ("packed"); every scale doubled,
    which moves each row's emin and leaves its factors ("emin"); each row's largest scale
    doubled, which moves a factor and leaves emin ("factors"); one scale pushed past the
    certified spread, which turns a fast row slow ("slow")."""
    new = checkpoint(0)
    scales = new["weight_scale"].view(torch.int16).clone()
    if kind == "packed":
        new["weight_packed"] = checkpoint(1)["weight_packed"]
    elif kind == "emin":
        scales += 1 << 7  # the exponent field
    elif kind == "factors":
        largest = scales.argmax(1)  # a group above emin (3 groups over 2 binades), or any
        scales[torch.arange(N), largest] += 1 << 7
    else:  # past the row's largest exponent by more than the certified spread
        scales[0, 0] = scales[0].max() + ((certified_spread(K, 4, 16) + 1) << 7)
    new["weight_scale"] = scales.view(torch.bfloat16)
    assert (kind == "slow") == (not layer_of(new).certificate.fast.all())
    return new


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("kind", ["packed", "emin", "factors", "slow"])
def test_each_kind_of_weight_change_is_seen_on_every_path(kernel, kind):
    """Whatever a write changes (words, emin, factors, a row's speed), the next forward has
    the new weights' bits on every kernel: no derived data outlives the part it came from."""
    layer = here(kernel)
    before = bits(layer(X))
    new = changed(kind)
    want = bits(layer_of(new, kernel)(X))
    assert (want != before).any()
    through_data_copy(layer, new)
    assert (bits(layer(X)) == want).all()


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_non_finite_scale_written_in_place_gives_its_row_nan(kernel):
    """Contract v1.2: every output of that weight row is the canonical NaN at every forward
    after the write, the other rows unchanged, on every path; a strict layer refuses it, again
    at every forward (never cached)."""
    require(kernel)
    layer = here(kernel)
    before = bits(layer(X))
    layer.weight_scale.data[3, 1] = float("nan")
    for _ in range(2):
        after = bits(layer(X))
        assert (after[:, 3] == float_format(X.dtype).nan_bits).all()
        assert (np.delete(after, 3, axis=1) == np.delete(before, 3, axis=1)).all()
    layer.strict = True
    for _ in range(2):
        with pytest.raises(NonFiniteError, match="weight_scale"):
            layer(X)


def test_the_hook_serving_stacks_call_after_loading_rebuilds_the_derived_data():
    layer = layer_of(checkpoint(0))
    layer(X)
    new = checkpoint(1)
    through_data_copy(layer, new)
    layer.process_weights_after_loading()
    assert (bits(layer(X)) == bits(layer_of(new)(X))).all()
    layer.weight_scale.data[0, 0] = float("inf")
    layer.process_weights_after_loading()  # a NaN row (contract v1.2), or strict: refused
    assert (bits(layer(X))[:, 0] == float_format(X.dtype).nan_bits).all()
    layer.strict = True
    with pytest.raises(NonFiniteError, match="weight_scale"):
        layer.process_weights_after_loading()


# ------------------------------------------------------------------ 2. buffers no kernel can read

def wrong(name: str, value) -> dict:
    return {name: value}


G = K // 32
REASSIGNED = {
    "scale-too-many-groups": (wrong("weight_scale", torch.ones(N, G + 1).bfloat16()), ShapeError),
    "scale-too-few-rows": (wrong("weight_scale", torch.ones(N - 1, G).bfloat16()), ShapeError),
    "scale-float32": (wrong("weight_scale", torch.ones(N, G)), ContractTypeError),
    "scale-float16": (wrong("weight_scale", torch.ones(N, G).half()), ContractTypeError),
    "packed-too-short": (wrong("weight_packed", torch.zeros(N, K // 8 - 1, dtype=torch.int32)),
                         ShapeError),
    "packed-int64": (wrong("weight_packed", torch.zeros(N, K // 8, dtype=torch.int64)),
                     ContractTypeError),
    "packed-strided": (wrong("weight_packed", torch.zeros(K // 8, N, dtype=torch.int32).t()),
                       ContractValueError),
    "packed-on-meta": (wrong("weight_packed", torch.zeros(N, K // 8, dtype=torch.int32,
                                                          device="meta")), ContractValueError),
    "shape-says-other": (wrong("weight_shape", torch.tensor([N, K + 32])), ShapeError),
    "not-a-tensor": (wrong("weight_scale", [[1.0] * G] * N), ContractTypeError),
}


@pytest.mark.parametrize("kernel", [None, "int8-gemm", "wide"])
@pytest.mark.parametrize("case", REASSIGNED, ids=str)
def test_buffers_reassigned_to_what_no_kernel_reads_are_refused(case, kernel):
    layer = layer_of(checkpoint(0), kernel)
    layer(X)  # after a warm-up, with its derived data built
    (name, value), = REASSIGNED[case][0].items()
    if isinstance(value, torch.Tensor):
        layer._buffers[name] = value  # a plain assignment of a list would be refused by torch
    else:
        object.__setattr__(layer, "_buffers", {**layer._buffers, name: value})
    with pytest.raises(REASSIGNED[case][1], match=name):
        layer(X)


# ------------------------------------------------------------------ 3. inputs no kernel can read

def test_x_on_the_meta_device_is_refused():
    layer = layer_of(checkpoint(0))
    layer(X)
    with pytest.raises(ContractValueError, match="meta"):
        layer(torch.empty(M, K, dtype=torch.bfloat16, device="meta"))


def test_a_trace_gives_the_eager_bits_or_a_clear_error():
    layer = layer_of(checkpoint(0))
    layer(X)  # warm: the trace would otherwise see the derived data being built
    try:
        traced = torch.jit.trace(layer, X, check_trace=False)
    except ContractValueError as e:
        assert "trace" in str(e)
        return
    other = torch.randn(M, K, generator=torch.Generator().manual_seed(2)).bfloat16()
    assert (bits(traced(other)) == bits(layer(other))).all()


def test_a_layer_built_and_run_under_inference_mode():
    want = bits(layer_of(checkpoint(0))(X))
    with torch.inference_mode():
        layer = layer_of(checkpoint(0))
        assert (bits(layer(X)) == want).all()
        layer.weight_scale.mul_(2)
        assert (bits(layer(X)) != want).any()
        layer.weight_scale.div_(2)
        assert (bits(layer(X)) == want).all()
    assert (bits(layer(X)) == want).all()  # and outside it, later


# ------------------------------------------------------------------ 4. exact at every K

def test_the_int8_gemm_path_is_exact_past_two_to_the_17_products():
    """All weights -1, scales 1.0, x = -32767: each int8 x int8 GEMM over K = 2**17 sums past
    int32 unless K is split (the output came out with the wrong sign)."""
    k = 2**17
    weights = {"weight_packed": torch.from_numpy(pack_weights(np.full((8, k), -1), 4)),
               "weight_scale": torch.ones(8, k // 32, dtype=torch.bfloat16),
               "weight_shape": torch.tensor([8, k])}
    x = torch.full((2, k), -32767.0)
    want = reference_linear(bits(x), "float32", weights["weight_packed"].numpy(),
                            bits(weights["weight_scale"]))
    for kernel in ("int8-gemm", "int64-matmul"):  # and its peer, with no int32 step at all
        layer = PackedInt4Linear(k, 8, kernel=kernel)
        layer.load_state_dict(weights)
        y = layer(x)
        assert (y > 0).all() and (bits(y) == want).all(), kernel


# ------------------------------------------------------------------ 5. slow rows in blocks

def test_slow_rows_run_in_bounded_blocks_of_rows(monkeypatch):
    """One weight row whose scales span more exponents than any fast path holds: the wide kernel
    computes that row only, never more than BLOCK_ROWS rows of x at a time, and exactly."""
    weights = checkpoint(0)
    scale = weights["weight_scale"].clone()
    scale[5, 0], scale[5, 1] = 2.0**100, 2.0**-100
    weights["weight_scale"] = scale
    layer = layer_of(weights)
    assert layer.certificate.slow_rows.tolist() == [5]
    seen = []
    quantize = wide.quantized

    def spy(x, act_bits):
        seen.append(x.shape[0])
        return quantize(x, act_bits)

    monkeypatch.setattr(wide, "quantized", spy)
    x = torch.randn(2 * wide.BLOCK_ROWS + 3, K, generator=torch.Generator().manual_seed(3))
    y = layer(x.bfloat16())
    assert seen and max(seen) <= wide.BLOCK_ROWS and sum(seen) == x.shape[0]
    want = reference_linear(bits(x.bfloat16()), "bfloat16", weights["weight_packed"].numpy(),
                            bits(scale))
    assert (bits(y) == want).all()


# ------------------------------------------------------------------ 4. the GPU family's host reads

DEVICE_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


def test_the_triton_forward_reads_nothing_back(monkeypatch):
    """Issues 40 and 50: a Triton-family forward (here under the interpreter) makes no read of
    the device in the package's own code: no .item(), .tolist(), .cpu(), bool() or torch.equal
    of a tensor; the slow rows and the NaN rows are the device's. Writes to the weights, a
    non-finite scale included, change nothing of that."""
    require("triton-group")
    layer = here("triton-group")
    layer(X)  # the plan, weight_shape's one check
    reads = []

    def spying(name, original):
        def spy(*args, **kwargs):
            caller = sys._getframe(1).f_code
            if f"{os.sep}exactness{os.sep}" in caller.co_filename:
                reads.append((name, caller.co_name))
            return original(*args, **kwargs)
        return spy

    for name in DEVICE_READS:
        monkeypatch.setattr(torch.Tensor, name, spying(name, getattr(torch.Tensor, name)))
    monkeypatch.setattr(torch, "equal", spying("equal", torch.equal))
    layer(X)
    through_data_copy(layer, checkpoint(1))
    layer.weight_scale.data[3, 1] = float("nan")
    y = layer(X)
    monkeypatch.undo()
    assert reads == []
    assert (bits(y)[:, 3] == float_format(X.dtype).nan_bits).all()
