"""The custom ops' fake implementations agree with the ops (issue 69). A trace (torch.compile,
make_fx, a serving stack's graphs) sizes everything after exactness::linear and
exactness::moe_experts by what their fakes say, so torch.library.opcheck runs each for real and
on fake tensors and compares dtype, shape and strides, over x dtypes, out dtypes, widths and
shapes, an empty batch included. Each comparison is shown to catch a planted fake."""

from __future__ import annotations

import itertools

import pytest
import torch

from exactness import ExactLinear, moe, ops
from tests.test_modules import needs_triton

pytestmark = pytest.mark.stage("reliability")  # make verify's stage

FLOATS = (torch.bfloat16, torch.float16, torch.float32)
WIDTHS = ((4, 4), (4, 8), (4, 16), (8, 16), (4, 32))  # (bits, act_bits)


def opcheck(op, args) -> None:
    """torch.library.opcheck's every test passed (it raises naming the first that failed)."""
    results = torch.library.opcheck(op, args)
    assert set(results.values()) == {"SUCCESS"}, results


def linear_args(x_dtype, out_dtype, bits: int, act_bits: int, rows: int, family: str) -> tuple:
    torch.manual_seed(rows + 7 * bits + act_bits)
    layer = ExactLinear.from_weight(torch.randn(24, 64), bits=bits, act_bits=act_bits)
    x = torch.randn(rows, 64).to(x_dtype)
    return (x, layer.weight_packed, layer.weight_scale, 64, bits, act_bits, out_dtype, family,
            None)


def linear_cases(full: bool):
    """Every x dtype with every out dtype, every width, decode, prefill and no rows; `full`:
    each pair of dtypes and each width at every batch (the C kernels'), else each once (the
    interpreter's)."""
    if full:
        return [(x, out, WIDTHS[0], rows) for x, out, rows in
                itertools.product(FLOATS, FLOATS, (0, 1, 5))] + \
            [(torch.bfloat16, torch.float32, width, rows) for width, rows in
             itertools.product(WIDTHS, (0, 1, 5))]
    return [(x, out, WIDTHS[i % len(WIDTHS)], (0, 1, 5)[i % 3])
            for i, (x, out) in enumerate(itertools.product(FLOATS, FLOATS))] + \
        [(torch.bfloat16, torch.bfloat16, width, 3) for width in WIDTHS]


@pytest.mark.parametrize("x_dtype, out_dtype, width, rows", linear_cases(full=True))
def test_the_linear_ops_fake_agrees_with_the_cpu_kernels(x_dtype, out_dtype, width, rows):
    opcheck(ops.linear, linear_args(x_dtype, out_dtype, *width, rows, "cpu"))


@needs_triton
@pytest.mark.parametrize("x_dtype, out_dtype, width, rows", linear_cases(full=False))
def test_the_linear_ops_fake_agrees_with_the_triton_kernels(x_dtype, out_dtype, width, rows):
    opcheck(ops.linear, linear_args(x_dtype, out_dtype, *width, rows, "triton"))


def moe_args(x_dtype, out_dtype, dtype, bits: int, act_bits: int, tokens: int,
             exact_block: bool = False) -> tuple:
    """moe_experts' arguments: 3 experts (hidden 64, intermediate 32), top-2; the exact block's
    glue (projections in fp32) or transformers'."""
    torch.manual_seed(tokens + 7 * bits + act_bits)
    buffers = []
    for _ in range(3):
        for n, k in ((32, 64), (32, 64), (64, 32)):  # gate, up, down
            layer = ExactLinear.from_weight(torch.randn(n, k), bits=bits, act_bits=act_bits)
            buffers += layer.checked_buffers()
    ids = torch.stack([torch.randperm(3)[:2] for _ in range(tokens)]) if tokens else \
        torch.empty((0, 2), dtype=torch.int64)
    weights = torch.rand(tokens, 2)
    return (torch.randn(tokens, 64).to(x_dtype), ids, weights, buffers, bits, act_bits,
            out_dtype, dtype, exact_block)


@needs_triton
@pytest.mark.parametrize("x_dtype, out_dtype, dtype, width, tokens, exact_block", [
    (torch.bfloat16, torch.bfloat16, torch.bfloat16, (4, 16), 5, False),
    (torch.float16, torch.float16, torch.float32, (4, 8), 1, False),
    (torch.float32, torch.bfloat16, torch.float16, (8, 16), 3, False),
    (torch.bfloat16, torch.float32, torch.bfloat16, (4, 32), 2, False),
    (torch.bfloat16, torch.bfloat16, torch.bfloat16, (4, 16), 0, False),
    (torch.bfloat16, torch.float32, torch.bfloat16, (4, 32), 3, True),
    (torch.float16, torch.float32, torch.float32, (4, 16), 1, True)])
def test_the_moe_ops_fake_agrees_with_the_grouped_kernel(x_dtype, out_dtype, dtype, width,
                                                         tokens, exact_block):
    opcheck(moe.moe_experts, moe_args(x_dtype, out_dtype, dtype, *width, tokens, exact_block))


@pytest.mark.parametrize("planted", ["dtype", "shape", "strides"])
def test_a_fake_that_disagrees_is_caught(planted, monkeypatch):
    """Planted fakes: the x dtype for the out dtype, the in features for the out, an output
    laid out by columns."""
    def fake(x, weight_packed, weight_scale, in_features, bits, act_bits, out_dtype, *rest):
        n, m = weight_packed.shape[0], x.shape[0]
        if planted == "dtype":
            return x.new_empty((m, n), dtype=x.dtype)
        if planted == "shape":
            return x.new_empty((m, in_features), dtype=out_dtype)
        return x.new_empty((n, m), dtype=out_dtype).t()

    monkeypatch.setattr(ops.linear, "_abstract_fn", fake)
    with pytest.raises(Exception, match=f"test_faketensor failed.*{planted[:5].capitalize()}"):
        opcheck(ops.linear, linear_args(torch.float16, torch.float32, 4, 16, 5, "cpu"))
