"""The C kernel's self-check, its first run: in first_run's child process (check_avx512_file,
check_avx2_file: one per build), before the library runs in the caller. Every compiled pass
against its Python twin, then the one-call path against the passes: a build the compiler or the
CPU got wrong is refused, naming the check and its input.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ... import dataflow
from ...contract import BFLOAT16, FORMATS, act_qmax
from ...formats import bits_to_tensor, float_bits, round_scaled_array, torch_dtype
from ...quantize import quantize_activations
from ..certificate import certify
from ..registry import Fit, Weights, no, yes
from . import vnni_library
from .avx2_check import in_place_layers
from .vnni import SPAN_MIN_ROWS
from .vnni_calls import accumulate, grouped, linear, quantize, round_rows, span_scales_of
from .vnni_layout import (
    InPlace,
    NativeWeights,
    biased_limbs,
    checkpoint_layer,
    plain_limbs,
    span_order,
    span_scales,
)


def check_avx512_file(file: Path, digest: str) -> Fit:
    """In first_run's child: the AVX-512 build at `file` loaded (its bytes must match `digest`)
    and self-checked."""
    return check_file(vnni_library.AVX512, file, digest)


def check_avx2_file(file: Path, digest: str) -> Fit:
    """In first_run's child: the AVX2 build at `file`, likewise."""
    return check_file(vnni_library.AVX2, file, digest)


def check_file(build: vnni_library.Build, file: Path, digest: str) -> Fit:
    lib, why = build.load_file(file, digest)
    return self_check(lib, build) if lib is not None else why


def self_check(lib, build: vnni_library.Build = vnni_library.AVX512) -> Fit:
    """The compiled passes against their Python twins, in every format: the quantization (row
    exponents, limbs, span-order words), the accumulation against int64 arithmetic, the rounding
    (fused, and as a pass) against formats.round_scaled_array (ties, subnormals, overflow). A
    build that reads derived layers (the AVX-512 one) is checked through them and its layers read
    in place against them (derived_layers); the AVX2 build, through layers read in place alone
    (avx2_check.in_place_layers). The verdict names the check that failed and its input."""
    g = torch.Generator().manual_seed(0)
    layers = derived_layers if build.derived else in_place_layers
    for check in (quantization, layers, rounding):
        verdict = check(lib, build, g)
        if not verdict:
            return verdict
    return yes(f"{build.what}, self-checked")


def quantization(lib, build: vnni_library.Build, g: torch.Generator) -> Fit:
    """quantize_limbs against quantize.quantize_activations and the build's limbs' twin
    (vnni_layout.biased_limbs, or plain_limbs for the AVX2 build), and the span kernel's words
    against span_order where the build holds it: wide row ranges, a zero row, the largest
    finite value, every format and width."""
    for act_bits in (4, 8, 16, 32):
        for fmt in FORMATS.values():
            bits = torch.randint(0, 1 << fmt.width, (5, 64), generator=g)
            bits[1] >>= torch.randint(0, fmt.width, (64,), generator=g)  # wide row ranges
            bits = torch.where(((bits >> fmt.mant_bits) & fmt.exp_max_field) == fmt.exp_max_field,
                               bits & fmt.sign_bit, bits)  # finite only
            bits[2], bits[3, 5] = 0, fmt.inf_bits - 1  # a zero row, the largest finite value
            limbs, e_r = quantize(bits_to_tensor(bits, fmt), act_bits, lib)
            qa, want_e = quantize_activations(bits, fmt, act_bits)
            twin = biased_limbs(qa, act_bits) if build.derived else plain_limbs(qa, act_bits, 32)
            checks = [("row exponents", e_r, want_e), ("limbs", limbs, twin)]
            if act_bits <= 16 and build.spans:
                words, _ = quantize(bits_to_tensor(bits, fmt), act_bits, lib, words=True)
                checks.append(("span-order words", words, span_order(qa)))
            for what, got, want in checks:
                if not torch.equal(got, want):
                    return no(f"its self-check failed on the quantization's {what} "
                              f"(act_bits {act_bits}, {fmt.name} x)")
    return yes("quantized")


def derived_layers(lib, build: vnni_library.Build, g: torch.Generator) -> Fit:
    """Both accumulation kernels against int64 arithmetic (the worst case, random data, long and
    one-group spans, unshifted blocks), with the rounding fused; then the one-call path against
    those passes, and the layers read in place (prepare_block) against the derived layout and
    the certificate (certificate.certify). The span kernel's checks only where the build holds
    it."""
    has_spans = build.spans
    for act_bits in (4, 8, 16, 32):
        qmax = act_qmax(act_bits)
        # both layouts, every tail of a tile; the last three: long spans of groups, one-group
        # spans, unshifted blocks (shifts 0 and 1 only)
        for w_bits, m, q_max, ms_max, sh_max in (
                (4, 5, 8, 256, 12), (4, 6, 8, 256, 12), (4, 7, 8, 256, 12), (8, 7, 128, 256, 12),
                (4, 9, 2, 8, 12), (4, 3, 8, 256, 12), (4, 5, 8, 256, 1)):
            q = torch.randint(-q_max, q_max, (37, 256), generator=g)
            q[0] = -(2 ** (w_bits - 1))
            qa = torch.randint(-qmax, qmax + 1, (m, 256), generator=g)
            qa[0] = -qmax
            qa[1, :32] = qmax  # a whole group at each end: every limb at its extremes
            ms = torch.randint(1 - ms_max, ms_max, (37, 8), generator=g, dtype=torch.int32)
            if q_max == 8:
                ms[0] = 255  # |q * ms| at its largest: one-group spans
            # at most the spread whose T fits int64 (below 12 only for 32-bit activations)
            sh_max = min(sh_max, dataflow.max_safe_spread(256, w_bits, act_bits))
            sh = torch.randint(0, sh_max + 1, (37, 8), generator=g, dtype=torch.int32)
            sh[1] = sh_max
            weights = NativeWeights(q, ms << sh)
            p = (qa.view(m, 1, 8, 32) * q.view(1, 37, 8, 32)).sum(-1)
            want = ((p * ms.long()) << sh.long()).sum(-1)
            e_r, emin = torch.randint(-160, 10, (m,), generator=g), torch.randint(-9, 9, (37,),
                                                                                 generator=g)
            kernels = [(biased_limbs(qa, act_bits), False)]
            if act_bits == 16 and w_bits == 4 and has_spans:
                kernels.append((span_order(qa), True))
            for a, spans in kernels:
                got = accumulate(a, act_bits, weights, lib, spans=spans)
                where = (f"{'exact_linear_spans' if spans else 'exact_linear_limbs'}, "
                         f"{w_bits}-bit weights, {m} rows, act_bits {act_bits}")
                if not torch.equal(got[:, :37], want):
                    return no(f"its self-check failed on the accumulation ({where})")
                for fmt in FORMATS.values():  # the rounding in the kernel's registers
                    y = accumulate(a, act_bits, weights, lib, (e_r, emin, fmt), spans)
                    if not torch.equal(float_bits(y), round_scaled_array(want, e_r[:, None]
                                                                         + emin[None, :], fmt)):
                        return no(f"its self-check failed on the fused rounding to {fmt.name} "
                                  f"({where})")
    # the one-call path (exact_grouped), through either kernel, against exact_linear_limbs's passes
    # (checked above); one group too (fewer than a tile's rows: the span kernel's rounding of the
    # tile before then waits past the tile's end)
    for k, act_bits, m in ((256, 16, SPAN_MIN_ROWS), (32, 16, SPAN_MIN_ROWS + 2), (256, 16, 3),
                           (256, 8, 5), (256, 32, 6)):
        q = torch.randint(-8, 8, (37, k), generator=g)
        ms = torch.randint(-255, 256, (37, k // 32), generator=g, dtype=torch.int32)
        weights = NativeWeights(q, ms << torch.randint(0, 2, ms.shape, generator=g,
                                                       dtype=torch.int32))
        emin = torch.randint(-9, 9, (37,), generator=g)
        for fmt in FORMATS.values():
            x = torch.randn(m, k, generator=g).to(torch_dtype(fmt))
            limbs, e_r = quantize(x, act_bits, lib)
            want = accumulate(limbs, act_bits, weights, lib, (e_r, emin, fmt))
            spans = act_bits == 16 and m >= SPAN_MIN_ROWS and has_spans
            if not torch.equal(linear(x, act_bits, weights, emin, fmt, lib, spans), want):
                return no(f"its self-check failed on the one-call path (exact_grouped, K = {k}, "
                          f"{m} rows, act_bits {act_bits}, {fmt.name})")
    # a grouped call of three experts of two parts (the span kernel for one of them), rows
    # gathered from x in another order, against the one-call path on each expert's own rows
    for act_bits in (16, 8, 32):
        layers = [[(NativeWeights(torch.randint(-8, 8, (20, 64), generator=g),
                                  torch.randint(-255, 256, (20, 2), generator=g,
                                                dtype=torch.int32)),
                    torch.randint(-9, 9, (20,), generator=g)) for _ in range(2)]
                  for _ in range(3)]
        spans = [False, act_bits == 16 and has_spans, False]
        counts = [5, SPAN_MIN_ROWS, 1]
        source = torch.randint(0, 7, (sum(counts),), generator=g)
        offsets = torch.tensor([0, *counts]).cumsum(0).tolist()
        x = torch.randn(7, 64, generator=g).bfloat16()
        got = grouped(x, act_bits, layers, spans, offsets, source, BFLOAT16, lib)
        for e, parts in enumerate(layers):
            rows = source[offsets[e]:offsets[e + 1]]
            for p, (weights, emin) in enumerate(parts):
                want = linear(x[rows], act_bits, weights, emin, BFLOAT16, lib, spans[e])
                if not torch.equal(got[offsets[e]:offsets[e + 1], 20 * p:20 * p + 20], want):
                    return no(f"its self-check failed on a grouped call (exact_grouped, expert "
                              f"{e}, part {p}, act_bits {act_bits})")
    # the layers read in place (prepare_block): the checkpoint's own words and scales against
    # the derived layout of the same weights (NativeWeights of the unpacked words and the
    # certificate's factors), and the emin and flags found against the certificate's: 4- and
    # 8-bit words, a partial last block, one group a row (K = 32), zero, subnormal, non-finite
    # and far-apart scales (slow rows)
    for bits, k, n in ((4, 256, 37), (8, 64, 21), (4, 32, 5), (8, 32, 16)):
        q, packed, scale = checkpoint_layer(bits, k, n, g)
        for act_bits in (8, 16, 32):
            weights = Weights(packed, scale, n, k, bits, act_bits)
            cert = certify(scale, k, bits, act_bits)
            derived, in_place = NativeWeights(q, cert.factor), InPlace(weights)
            spans = bits == 4 and act_bits == 16 and has_spans  # the span kernel too
            for fmt in FORMATS.values():
                x = torch.randn(6, k, generator=g).to(torch_dtype(fmt))
                want = linear(x, act_bits, derived, cert.emin, fmt, lib)
                for kernel in (False, True) if spans else (False,):
                    if not torch.equal(linear(x, act_bits, in_place, None, fmt, lib, kernel),
                                       want):
                        return no(f"its self-check failed on the weights read in place "
                                  f"({bits}-bit words, K = {k}, act_bits {act_bits}, "
                                  f"{fmt.name}{', span kernel' if kernel else ''})")
            twin = span_scales(derived.c, derived.w, k) if spans else ()
            for layer in (derived, in_place) if spans else ():
                if not all(map(torch.equal, span_scales_of(layer, lib), twin)):
                    return no(f"its self-check failed on the span scales of a layer "
                              f"{type(layer).__name__} (K = {k}): not vnni_layout.span_scales'")
            if not in_place.agrees_with(cert):
                return no(f"its self-check failed on the scales read in place: emin or flags "
                          f"({bits}-bit words, K = {k}, act_bits {act_bits})")
    # the span scales at their bounds, against their twin: every weight -8 and groups of 255
    # that one more group would take past the span bound (a 1020 makes the block take spans);
    # then each chain loaded alone at factor 516, one step past an unshifted block
    edge = [NativeWeights(torch.full((16, 256), -8), torch.tensor(
        [[255] * 7 + [1020]] + [[255] * 8] * 15, dtype=torch.int32))]
    for chain in (0, 1):
        q = torch.where(torch.arange(64) % 2 == chain, -8, 0).expand(16, 64)  # k0, k2 or k1, k3
        edge.append(NativeWeights(q, torch.tensor([[255, 516]] * 16, dtype=torch.int32)))
    for weights in edge if has_spans else ():
        if not all(map(torch.equal, span_scales_of(weights, lib),
                       span_scales(weights.c, weights.w, weights.k))):
            return no("its self-check failed on the span scales at their bounds: not "
                      "vnni_layout.span_scales'")
    return yes("derived and in place")


def rounding(lib, build: vnni_library.Build, g: torch.Generator) -> Fit:
    """round_rows against formats.round_scaled_array: ties, subnormals, overflow, every format."""
    t = torch.randint(-(2**62), 2**62, (4, 67), generator=g) >> torch.randint(0, 62, (4, 67),
                                                                            generator=g)
    t[0, :8] = torch.tensor([0, 1, -1, 3, -3, 2**62, -(2**62), 5])
    e_r, emin = torch.randint(-300, 200, (4,), generator=g), torch.randint(-40, 40, (67,),
                                                                            generator=g)
    # rows 1..3, columns 8..23: exact ties at each format's precision p and one unit either side
    # (both signs, even and odd kept parts), at e = 0: normal results, round8_normal's own path
    for row, p, s_max in ((1, 8, 40), (2, 11, 4), (3, 24, 39)):
        s = torch.randint(1, s_max + 1, (16,), generator=g)
        kept = (1 << (p - 1)) + torch.randint(0, 1 << (p - 1), (16,), generator=g)
        half = 1 << (s - 1)
        tail = torch.minimum(half + torch.randint(-1, 2, (16,), generator=g), 2 * half - 1)
        sign = torch.where(torch.rand(16, generator=g) < 0.5, -1, 1)
        t[row, 8:24] = sign * ((kept << s) + tail)
        e_r[row] = 0
    emin[8:24] = 0
    for fmt in FORMATS.values():
        want = round_scaled_array(t, e_r[:, None] + emin[None, :], fmt)
        if not torch.equal(float_bits(round_rows(t, 67, e_r, emin, fmt, lib)), want):
            return no(f"its self-check failed on round_rows to {fmt.name} (ties, subnormals, "
                      f"overflow)")
    return yes("rounded")
