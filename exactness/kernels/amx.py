"""The AMX kernel (cpu_amx.c): the VNNI limb kernel's dataflow with its dots on AMX tiles, for the
Intel Xeons with AMX-INT8 (Sapphire Rapids on), where torch's bf16 matmul runs on tiles too.

It is built as cpu_vnni.c with cpu_amx.c appended, so it shares that kernel's quantization, its
weight layout (native.NativeWeights: one prepared object per layer for both), its combine and its
one rounding; only the dots differ (tdpbusd on 16 x 16 tiles, one group of 32 per tile).

EXACTNESS_AMX: "1" (the default) uses the real tiles where the CPU reports amx_tile and amx_int8
and Linux grants the tile state; "emulate" builds the tiles from amx_emulated.h (portable C) on
any CPU, for verification (the suite does so where AMX is missing); "0" turns it off. Either build
passes its self-check before use, or is refused with the reason. Emulated tiles are never picked
unasked: kernel="amx" or EXACTNESS_KERNEL=amx runs them.
"""

from __future__ import annotations

import ctypes
import functools
import warnings
from pathlib import Path

import torch

from .. import dataflow
from ..contract import FloatFormat
from . import native
from .registry import Fit, Weights, int8_limbs_hold, no, yes

SOURCE = Path(__file__).with_name("cpu_amx.c")
EMULATION = Path(__file__).with_name("amx_emulated.h")
FLAGS = ("-mamx-tile", "-mamx-int8")
MODES = {"1": "the AMX instructions", "0": "off", "emulate": "emulated AMX tiles"}
NEEDS = ("amx_tile", "amx_int8")
# a tile's activation rows; below that the VNNI kernel wastes nothing on empty tile rows
# (a roofline estimate: no AMX machine has measured it yet, docs/PERFORMANCE.md)
MIN_ROWS = dataflow.AMX_TILE_ROWS


def mode() -> str:
    """EXACTNESS_AMX: "1" (the default), "0" or "emulate"; ContractValueError for anything else."""
    return native.switch("EXACTNESS_AMX", MODES)


def missing_features() -> list[str]:
    """The AMX features /proc/cpuinfo does not list ([] on an AMX machine)."""
    return native.cpu_lacks(NEEDS)


def source(emulated: bool, amx_source: str | None = None) -> str:
    """What is compiled: cpu_vnni.c, then (emulated) amx_emulated.h, then cpu_amx.c (or
    `amx_source` in its place: a planted bug, exactness.suite.mutants)."""
    tiles = EMULATION.read_text() if emulated else ""
    return "\n".join((native.SOURCE.read_text(), tiles, amx_source or SOURCE.read_text()))


def build(amx_source: str | None = None) -> tuple[ctypes.CDLL | None, Fit]:
    """The library compiled (emulated tiles where EXACTNESS_AMX=emulate), its entry points'
    signatures set and the tile state granted, not yet self-checked; or None and why not."""
    emulated = mode() == "emulate"
    lib, why = native.build(source(emulated, amx_source), () if emulated else FLAGS)
    if lib is None:
        return None, why
    ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.exact_linear_amx.argtypes = [ptr] * 5 + [i64] * 3 + [i32] * 2 + [ptr] * 3 + [i64] + \
        [i32] * 2
    lib.exact_linear_amx.restype = i64
    lib.amx_request.restype, lib.amx_faults.restype = i32, i64
    if lib.amx_request() != 0:
        return None, no("Linux did not grant the AMX tile state (arch_prctl "
                        "ARCH_REQ_XCOMP_PERM: a kernel before 5.16, or a seccomp filter)")
    return lib, why


@functools.cache
def status() -> tuple[ctypes.CDLL | None, Fit]:
    """(the loaded kernel or None, and why): which switch, feature, build or check refused it."""
    if mode() == "0":
        return None, no("EXACTNESS_AMX=0 turns the AMX kernel off")
    if native.mode() == "0":
        return None, no("EXACTNESS_NATIVE=0 turns the C kernels off, the AMX kernel with them")
    emulated = mode() == "emulate"
    missing = missing_features()
    if not emulated and missing:
        return None, no(f"the CPU lacks {', '.join(missing)}")
    if not emulated and native.emulated():
        return None, no("real AMX tiles need the real AVX-512 beside them, and "
                        "EXACTNESS_NATIVE=emulate is set")
    if native._missing_features() and not native.emulated():
        return None, no(f"its AVX-512 half needs {', '.join(native._missing_features())} "
                        f"or EXACTNESS_NATIVE=emulate")
    lib, why = build()
    if lib is None:
        return None, why
    verdict = self_check(lib)
    if verdict and emulated:
        verdict = yes("emulated AMX tiles (EXACTNESS_AMX=emulate): for verification, not speed")
    return (lib if verdict else None), verdict


def library():
    """The loaded, self-checked AMX kernel, or None (status() says why)."""
    return status()[0]


@functools.cache
def warn_refused(why: str) -> None:
    """Says once per process why an AMX machine does not run the AMX kernel."""
    warnings.warn(f"the AMX kernel is not used: {why}; a slower exact CPU kernel runs instead",
                  native.FallbackWarning, stacklevel=3)


def self_check(lib) -> Fit:
    """exact_linear_amx against int64 arithmetic: T and its fused rounding, at every limb count,
    both weight layouts, every tail of a tile's 16 rows and of the groups taken two at a time,
    the limbs and weights at their extremes; and no tile fault (the emulation counts them). The
    verdict names the check that failed, and the faults where there were any."""
    from ..contract import FORMATS
    from ..formats import float_bits, round_scaled_array

    def refused(what: str) -> Fit:
        faults = lib.amx_faults()
        return no(f"its self-check failed on {what}" + (
            f"; the emulated tiles faulted {faults} times (a tile shape the hardware refuses)"
            if faults else ""))

    g = torch.Generator().manual_seed(26)
    for act_bits in (8, 16, 32):
        qmax = (1 << (act_bits - 1)) - 1
        for w_bits, m, k in ((4, 17, 96), (8, 16, 64), (4, 1, 32), (4, 33, 256), (8, 5, 160)):
            q = torch.randint(-(1 << (w_bits - 1)), 1 << (w_bits - 1), (37, k), generator=g)
            q[0] = -(1 << (w_bits - 1))
            qa = torch.randint(-qmax, qmax + 1, (m, k), generator=g)
            qa[0] = -qmax
            qa[-1, -32:] = qmax  # the last row's last group: every limb at its top
            ms = torch.randint(-255, 256, (37, k // 32), generator=g, dtype=torch.int32)
            spread = min(12, dataflow.max_safe_spread(k, w_bits, act_bits))
            sh = torch.randint(0, spread + 1, ms.shape, generator=g, dtype=torch.int32)
            weights = native.NativeWeights(q, ms << sh)
            p = (qa.view(m, 1, k // 32, 32) * q.view(1, 37, k // 32, 32)).sum(-1)
            want = ((p * ms.long()) << sh.long()).sum(-1)
            a = native.biased_limbs(qa, act_bits)
            where = f"{w_bits}-bit weights, {m} rows, K = {k}, act_bits {act_bits}"
            if not torch.equal(native.accumulate(a, act_bits, weights, lib, amx=True)[:, :37],
                               want):
                return refused(f"the accumulation ({where})")
            e_r = torch.randint(-160, 10, (m,), generator=g)
            emin = torch.randint(-9, 9, (37,), generator=g)
            for fmt in FORMATS.values():
                y = native.accumulate(a, act_bits, weights, lib, (e_r, emin, fmt), amx=True)
                if not torch.equal(float_bits(y), round_scaled_array(want, e_r[:, None]
                                                                     + emin[None, :], fmt)):
                    return refused(f"the fused rounding to {fmt.name} ({where})")
    if lib.amx_faults():
        return refused("the tiles' shapes")
    return yes("AMX-INT8 tiles, self-checked")


class _AmxKernel:
    """cpu_amx.c for one layer: x quantized by cpu_vnni.c's pass, then exact_linear_amx with the
    rounding fused."""

    name, family, layout, grouped = "amx", "cpu", "vnni", False
    act_limbs = dataflow.GROUP_ACT_LIMBS
    min_rows = MIN_ROWS

    @property
    def auto(self) -> bool:
        """The plan picks the real tiles unasked; emulated ones only when asked for."""
        return mode() == "1"

    def available(self, device: torch.device) -> Fit:
        if device.type != "cpu":
            return no(f"it runs on the CPU, x is on {device}")
        lib, why = status()
        if lib is None and mode() == "1" and native.mode() != "0" and not missing_features():
            warn_refused(why.why)  # an AMX machine that does not run it, unasked
        return why

    def eligible(self, rows: int, weights: Weights) -> Fit:
        held = int8_limbs_hold(weights.act_bits, self.act_limbs)
        return held if not held else yes("any widths")

    def prepare(self, weights: Weights) -> native.NativeWeights:
        return native.NativeWeights(weights.q(), weights.certificate.factor.cpu())

    def run(self, x, weights: Weights, prepared: native.NativeWeights,
            out_format: FloatFormat) -> torch.Tensor:
        lib = library()
        limbs, e_r = native.quantize(x, weights.act_bits, lib)
        return native.accumulate(limbs, weights.act_bits, prepared, lib,
                                 (e_r, weights.certificate.emin, out_format), amx=True)


AMX = _AmxKernel()
