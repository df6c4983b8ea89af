"""cpu_amx.c's self-check, its first run: in first_run's child process (check_file), with the
tile state granted there, before the library runs in the caller.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ...contract import FORMATS, act_qmax, float_format
from ...formats import bits_to_tensor, float_bits, round_scaled_array, torch_dtype
from ..certificate import certify
from ..registry import Fit, Weights, no, yes
from . import amx_library, vnni_library
from .amx_calls import accumulate, linear, spans
from .amx_layout import AmxInPlace, amx_spans
from .vnni_calls import quantize
from .vnni_layout import NativeWeights, biased_limbs, checkpoint_layer


def check_file(file: Path, digest: str) -> Fit:
    """In first_run's child: the library at `file` (its bytes must match `digest`) loaded, its
    tile state granted, then self-checked."""
    lib, why = vnni_library.AVX512.load_file(file, digest)
    if lib is None:
        return why
    granted = amx_library.request(amx_library.bind(lib))
    return self_check(lib) if granted else granted


def self_check(lib) -> Fit:
    """amx_tiles against int64 arithmetic: T and its fused rounding, at one and two limbs, both
    weight layouts, every tail of a tile's 16 rows, odd group counts, spans of every kind (one
    group each and ending mid-step, long ones, bases above 0, the AMX_SPAN_GROUPS cap, negative
    and zero factors), the limbs and the digits at their extremes, the spans against their Python
    twin (amx_layout.amx_spans); then the one-call path (exact_linear_amx) against quantize and
    amx_tiles; the layers read in place (read_in_place); and no tile fault (the emulation counts
    them). The verdict names the check that failed, and the faults where there were any."""
    def refused(what: str) -> Fit:
        faults = lib.amx_faults()
        return no(f"its self-check failed on {what}" + (
            f"; the emulated tiles faulted {faults} times (a tile shape the hardware refuses)"
            if faults else ""))

    g = torch.Generator().manual_seed(39)
    cases = [  # (w_bits, rows, K, ms and shift ranges, N)
        (4, 17, 96, 255, 12, 37), (8, 16, 64, 255, 8, 37), (4, 1, 32, 255, 12, 20),
        (4, 33, 256, 255, 1, 37), (8, 5, 160, 255, 0, 20), (4, 3, 32 * 1030, 3, 0, 16),
        (4, 16, 512, 255, 3, 21)]
    for act_bits in (8, 16):
        qmax = act_qmax(act_bits)
        for w_bits, m, k, ms_max, sh_max, n in cases:
            q = torch.randint(-(1 << (w_bits - 1)), 1 << (w_bits - 1), (n, k), generator=g)
            q[0] = -(1 << (w_bits - 1))
            q[1] = (1 << (w_bits - 1)) - 1
            qa = torch.randint(-qmax, qmax + 1, (m, k), generator=g)
            qa[0] = -qmax
            qa[-1, -32:] = qmax  # the last row's last group: every limb at its top
            ms = torch.randint(-ms_max, ms_max + 1, (n, k // 32), generator=g, dtype=torch.int32)
            ms[0], ms[2] = -ms_max, 0  # the largest folded weight; a zero row
            ms[3] |= 1  # odd: base 0
            sh = torch.randint(0, sh_max + 1, ms.shape, generator=g, dtype=torch.int32)
            sh[4] = sh_max  # bases above 0: every factor of the row a multiple of 2**sh_max
            weights = NativeWeights(q, ms << sh)
            p = (qa.view(m, 1, k // 32, 32) * q.view(1, n, k // 32, 32)).sum(-1)
            want = ((p * ms.long()) << sh.long()).sum(-1)
            a = biased_limbs(qa, act_bits)
            where = f"{w_bits}-bit weights, {m} rows, K = {k}, act_bits {act_bits}"
            if not torch.equal(accumulate(a, act_bits, weights, lib)[:, :n], want):
                return refused(f"the accumulation ({where})")
            if act_bits == 8 and not all(map(torch.equal, spans(weights, lib),
                                             amx_spans(weights))):
                return refused(f"the spans: not amx_layout.amx_spans' ({where})")
            e_r = torch.randint(-160, 10, (m,), generator=g)
            emin = torch.randint(-9, 9, (n,), generator=g)
            for fmt in FORMATS.values():
                y = accumulate(a, act_bits, weights, lib, (e_r, emin, fmt))
                if not torch.equal(float_bits(y), round_scaled_array(want, e_r[:, None]
                                                                     + emin[None, :], fmt)):
                    return refused(f"the fused rounding to {fmt.name} ({where})")
            x = bits_to_tensor(torch.randint(0x3800, 0x4800, (m, k), generator=g)
                               | torch.randint(0, 2, (m, k), generator=g) << 15,
                               float_format("bfloat16"))
            limbs, e_x = quantize(x, act_bits, lib)
            fmt = float_format("bfloat16")
            if not torch.equal(linear(x, act_bits, weights, emin, fmt, lib),
                               accumulate(limbs, act_bits, weights, lib, (e_x, emin, fmt))):
                return refused(f"the one-call path (exact_linear_amx, {where})")
    in_place = read_in_place(lib, g)
    if not in_place:
        return refused(in_place.why)
    if lib.amx_faults():
        return refused("the tiles' shapes")
    return yes("AMX-INT8 tiles, self-checked")


def read_in_place(lib, g: torch.Generator) -> Fit:
    """The layers read in place (prepare_block, then the spans and digits built per block in C)
    against the derived layout of the same weights (NativeWeights of the unpacked words and the
    certificate's factors), and both layers' spans against amx_layout.amx_spans, their Python
    twin: 4- and 8-bit words, a partial last block, one group a row, and the scales of
    vnni_check.checkpoint_layer."""
    for bits, k, n in ((4, 256, 37), (8, 96, 21), (4, 32, 5)):
        q, packed, scale = checkpoint_layer(bits, k, n, g)
        for act_bits in (8, 16):
            weights = Weights(packed, scale, n, k, bits, act_bits)
            cert = certify(scale, k, bits, act_bits)
            derived, in_place = NativeWeights(q, cert.factor), AmxInPlace(weights)
            where = f"{bits}-bit words, K = {k}, act_bits {act_bits}"
            for fmt in FORMATS.values():
                x = torch.randn(18, k, generator=g).to(torch_dtype(fmt))
                want = linear(x, act_bits, derived, cert.emin, fmt, lib)
                if not torch.equal(linear(x, act_bits, in_place, None, fmt, lib), want):
                    return no(f"the weights read in place ({where}, {fmt.name})")
            twin = amx_spans(derived)
            for layer in (derived, in_place):
                if not all(map(torch.equal, spans(layer, lib), twin)):
                    return no(f"the spans of a layer {type(layer).__name__} ({where}): not "
                              f"amx_layout.amx_spans'")
    return yes("read in place")
