"""The precision report stays honest: its truth is exact, the exact path is exactly one rounding
away from it where activations quantize losslessly, and the bf16 path really errs."""

from fractions import Fraction

import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st

from exactness.contract import BFLOAT16, FLOAT32
from exactness.formats import decode, float_bits, tensor_to_bits
from exactness.suite.precision import correctly_rounded, errors, exact_truth, outputs, qat_layer
from exactness.suite.strategies import seeds


def test_the_truth_is_the_exact_rational_product():
    layer = qat_layer(64, 3, seed=1)
    x = torch.randn(2, 64).bfloat16()
    t, e = exact_truth(x, layer)
    from exactness.formats import unpack_weights

    q = unpack_weights(layer.weight_packed.numpy(), 4)
    s = [[Fraction(m) * Fraction(2) ** ex for m, ex in (decode(int(b), BFLOAT16) for b in row)]
         for row in float_bits(layer.weight_scale).numpy()]
    for r, row in enumerate(tensor_to_bits(x)):
        xs = [Fraction(m) * Fraction(2) ** ex for m, ex in (decode(int(b), BFLOAT16) for b in row)]
        for n in range(3):
            want = sum(xs[k] * int(q[n, k]) * s[n][k // 32] for k in range(64))
            assert Fraction(t[r][n]) * Fraction(2) ** int(e[r, n]) == want


@given(seeds, st.sampled_from([torch.bfloat16, torch.float32]))
def test_exact_path_is_one_rounding_from_the_truth_on_lossless_inputs(seed, out_dtype):
    """bf16 rows whose elements all lie within 2**7 of the row's amax quantize losslessly at
    act_bits 16, so the only error left is the final rounding: at most half an ulp, RNE."""
    g = torch.Generator().manual_seed(seed)
    layer = qat_layer(128, 16, seed=seed % 1000)
    x = (1 + torch.rand(4, 128, generator=g)) * torch.randint(-1, 2, (4, 128), generator=g)
    x = (x * 2.0 ** torch.randint(-6, 1, (4, 128), generator=g)).bfloat16()
    layer.out_dtype = out_dtype
    y = layer(x)
    assert correctly_rounded(y, exact_truth(x, layer), FLOAT32 if out_dtype == torch.float32
                             else BFLOAT16)


def test_the_bf16_path_errs_on_generated_data():
    layer = qat_layer(256, 32, seed=3)
    x = torch.randn(8, 256).bfloat16()
    truth = exact_truth(x, layer)
    ys = outputs(x, layer)
    bf16 = errors(ys["bf16 (dequantize, bf16 matmul)"], truth, BFLOAT16)
    assert bf16.rel_mean > 0 and bf16.norm > 0
    exact = errors(ys["exact a16, fp32 out"], truth, FLOAT32)
    assert exact.norm < bf16.norm
    assert np.isfinite(bf16.rel).all()


def test_the_32_bit_path_is_the_correctly_rounded_product_on_ordinary_activations():
    """v1.1: N(0, 1) bf16 rows lose nothing at act_bits 32, so every output is RNE of the truth:
    at most half an ulp, where the 16-bit path is not."""
    layer = qat_layer(256, 32, seed=4)
    x = torch.randn(8, 256, generator=torch.Generator().manual_seed(4)).bfloat16()
    truth = exact_truth(x, layer)
    ys = outputs(x, layer)
    a32 = errors(ys["exact a32, fp32 out"], truth, FLOAT32)
    assert a32.rounded == 1.0 and a32.ulp_max <= 0.5
    assert errors(ys["exact a16, fp32 out"], truth, FLOAT32).rounded < 1.0
