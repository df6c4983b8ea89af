"""The AVX2 build's own part of the C kernel's self-check (vnni_check.self_check calls it): that
build reads layers in place only, row by row (kernel_avx2.h), so each check is a layer as a
checkpoint holds it, its T taken unrounded (vnni_calls.accumulate_in_place) against int64
arithmetic on the certificate's factors, then rounded in the kernel against
formats.round_scaled_array, and its emin and flags against the certificate's.
"""

from __future__ import annotations

import torch

from ...contract import BFLOAT16, FLOAT16, FLOAT32
from ...formats import float_bits, round_scaled_array, torch_dtype
from ...quantize import quantize_activations
from ..certificate import certify
from ..registry import Fit, Weights, no, yes
from .vnni_calls import accumulate_in_place, grouped, linear
from .vnni_layout import InPlace, checkpoint_layer

# (weight bits, K, N): every tail of the kernel's 8 groups (4-bit: 4 chunks of 64 k, the last
# one half at K = 32 * odd; 8-bit: 8 chunks of 32 k), a partial last block of 16 rows
SHAPES = ((4, 32, 5), (4, 96, 21), (4, 256, 37), (4, 288, 16), (8, 32, 16), (8, 160, 21),
          (8, 256, 37))


def exact_t(qa: torch.Tensor, q: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """T [M, N] = sum_g (sum_k qa * q over group g) * factor[n, g], in int64."""
    m, k = qa.shape
    p = (qa.view(m, 1, k // 32, 32).long() * q.view(1, -1, k // 32, 32).long()).sum(-1)
    return (p * factor.long()).sum(-1)


def extreme_rows(m: int, k: int, fmt, g: torch.Generator) -> torch.Tensor:
    """x [m, K] of `fmt`: Gaussian rows, and a row whose every element is its largest (every
    limb at its extreme, +-Qa), and one of wide range."""
    x = torch.randn(m, k, generator=g)
    x[0] = torch.where(torch.rand(k, generator=g) < 0.5, -1.0, 1.0)
    if m > 1:
        x[1] *= torch.exp2(torch.randint(-14, 8, (k,), generator=g).float())  # fp16 holds it
    return x.to(torch_dtype(fmt))


def in_place_layers(lib, build, g: torch.Generator) -> Fit:
    """Layers read in place (vnni_layout.checkpoint_layer: weights at their extremes, scales of
    spreads up to 12, a zero, an infinite, a subnormal and a NaN scale, a row anywhere) at every
    width, 1 to 5 rows of x (tiles of one and two rows): T against int64 arithmetic, the fused
    rounding against round_scaled_array, emin and flags against the certificate; then a grouped
    call of three experts of two parts, rows gathered in another order, against each expert's
    own one-call path."""
    for bits, k, n in SHAPES:
        q, packed, scale = checkpoint_layer(bits, k, n, g)
        for act_bits in (4, 8, 16, 32):
            weights = Weights(packed, scale, n, k, bits, act_bits)
            cert = certify(scale, k, bits, act_bits)
            layer = InPlace(weights)
            fast = cert.fast & ~cert.nonfinite
            for m, fmt in ((1, BFLOAT16), (2, FLOAT16), (3, FLOAT32), (5, BFLOAT16)):
                x = extreme_rows(m, k, fmt, g)
                where = f"{bits}-bit words, K = {k}, {m} rows, act_bits {act_bits}, {fmt.name}"
                qa, e_r = quantize_activations(float_bits(x), fmt, act_bits)
                want = exact_t(torch.as_tensor(qa), q, cert.factor)
                got = accumulate_in_place(x, act_bits, layer, lib)[:, :n]
                if not torch.equal(got, want):
                    return no(f"its self-check failed on the accumulation ({where})")
                if not layer.agrees_with(cert):
                    return no(f"its self-check failed on the scales read in place: emin or "
                              f"flags ({where})")
                y = float_bits(linear(x, act_bits, layer, None, fmt, lib))
                rounded = round_scaled_array(want, torch.as_tensor(e_r)[:, None]
                                             + cert.emin[None, :], fmt)
                if not torch.equal(y[:, fast], rounded[:, fast]):
                    return no(f"its self-check failed on the fused rounding ({where})")
    for act_bits in (16, 8, 32):  # a grouped call against each expert's one-call path
        layers = []
        for _ in range(3):
            parts = []
            for _ in range(2):
                _, packed, scale = checkpoint_layer(4, 64, 20, g)
                parts.append((InPlace(Weights(packed, scale, 20, 64, 4, act_bits)), None))
            layers.append(parts)
        counts = [5, 4, 1]
        source = torch.randint(0, 7, (sum(counts),), generator=g)
        offsets = torch.tensor([0, *counts]).cumsum(0).tolist()
        x = torch.randn(7, 64, generator=g).bfloat16()
        got = grouped(x, act_bits, layers, [False] * 3, offsets, source, BFLOAT16, lib)
        for e, parts in enumerate(layers):
            rows = source[offsets[e]:offsets[e + 1]]
            for p, (layer, _) in enumerate(parts):
                want = linear(x[rows], act_bits, layer, None, BFLOAT16, lib)
                if not torch.equal(got[offsets[e]:offsets[e + 1], 20 * p:20 * p + 20], want):
                    return no(f"its self-check failed on a grouped call (exact_grouped, expert "
                              f"{e}, part {p}, act_bits {act_bits})")
    return yes("read in place")
