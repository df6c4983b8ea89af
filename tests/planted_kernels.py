"""Outside kernels with planted bugs, as `python -m exactness check` factories: each must be
refuted on the property its bug breaks (tests/test_check.py), which shows the check can fail."""

from __future__ import annotations

import itertools

import torch

from exactness.suite.peers.kernels import compressed_tensors_bf16, exact16
from exactness.suite.precision import dequantize


def _dequantized_fp32(weight_packed, weight_scale, weight_shape):
    """q * scale in fp32, for the w4a16 computation: x times it, one rounding to bf16."""
    return dequantize(weight_packed, weight_scale, torch.float32)


def one_ulp_off(weight_packed, weight_scale, weight_shape, act_bits=16):
    """The exact layer, its output (0, 0) one ulp away (its bit pattern plus one)."""
    layer = exact16(weight_packed, weight_scale, weight_shape, act_bits)

    def run(x):
        y = layer(x)
        y.view(torch.int16)[0, 0] += 1
        return y

    return run


def batch_dependent(weight_packed, weight_scale, weight_shape):
    """fp32 weights for one row, weights rounded to bf16 first for a batch: a kernel that picks
    its path by M."""
    w = _dequantized_fp32(weight_packed, weight_scale, weight_shape)

    def run(x):
        weights = w if x.shape[0] == 1 else w.bfloat16().float()
        return (x.float() @ weights.t()).bfloat16()

    return run


def nondeterministic(weight_packed, weight_scale, weight_shape):
    """Every other call sums the groups in another order (split-K with atomics, in effect)."""
    w = _dequantized_fp32(weight_packed, weight_scale, weight_shape)
    calls = itertools.count()

    def run(x):
        if next(calls) % 2:
            return (x.float() @ w.t()).bfloat16()
        k = x.shape[1]
        halves = [x.float()[:, s] @ w[:, s].t() for s in (slice(k // 2, k), slice(0, k // 2))]
        return (halves[0].bfloat16().float() + halves[1]).bfloat16()

    return run


def nan_with_its_sign_set(weight_packed, weight_scale, weight_shape, act_bits=16):
    """The exact layer, each NaN it gives negated: NaN rows, but not the canonical NaN."""
    layer = exact16(weight_packed, weight_scale, weight_shape, act_bits)

    def run(x):
        y = layer(x)
        words = y.view(torch.int16)
        words[torch.isnan(y)] |= -(2**15)
        return y

    return run


def nan_swallowed(weight_packed, weight_scale, weight_shape):
    """transformers' path, with the non-finite inputs zeroed first."""
    run = compressed_tensors_bf16(weight_packed, weight_scale, weight_shape)
    return lambda x: run(torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0))


def k_tail_dropped(weight_packed, weight_scale, weight_shape):
    """A kernel that steps K by 64: the last group of an odd count is never read."""
    w = _dequantized_fp32(weight_packed, weight_scale, weight_shape)
    k = w.shape[1] // 64 * 64
    return lambda x: (x[:, :k].float() @ w[:, :k].t()).bfloat16()



def correctly_rounded(weight_packed, weight_scale, weight_shape):
    """No bug at all: the correctly rounded true product in bf16 (truth.py), a row holding inf or
    NaN all NaN. The sound kernel the files of the planted ones must pass on."""
    import numpy as np

    from exactness.contract import BFLOAT16
    from exactness.formats import (
        bits_to_tensor,
        finite_mask,
        float_bits,
        tensor_to_bits,
        unpack_weights,
    )
    from exactness.suite.truth import correctly_rounded_bits, true_product

    n, k = (int(v) for v in weight_shape)
    q = unpack_weights(weight_packed.numpy(), 4, k)
    scales = float_bits(weight_scale).numpy()

    def run(x):
        bits = tensor_to_bits(x)
        bad = ~finite_mask(bits, BFLOAT16).all(axis=1)
        t, e = true_product(np.where(bad[:, None], 0, bits), BFLOAT16, q, scales)
        y = bits_to_tensor(correctly_rounded_bits(t, e, BFLOAT16), BFLOAT16)
        y[torch.from_numpy(bad)] = float("nan")
        return y

    return run
