"""The AMX kernel (cpu_amx.c): an exact int8 GEMM on AMX tiles, for the Intel Xeons with AMX-INT8
(Sapphire Rapids on), where torch's bf16 matmul runs on tiles too.

Per block of 16 weight rows, the scales are folded into the weights over spans of groups
(amx_spans): f = c >> base, |q * f| an s16 split into a u8 and an s8 digit. The tiles sum each
span's dots of the activations' biased u8 limbs (cpu_vnni.c's quantization) by those digits in
int32, and the int64 combine runs once a span, not once a group. It shares cpu_vnni.c's
quantization, its weight blocks (native.NativeWeights: one prepared object per layer for both)
and its one rounding. 16-bit activations at most (two limbs); 32 bits take `vnni-limbs`.

EXACTNESS_AMX: "1" (the default) uses the real tiles where the CPU reports amx_tile and amx_int8
and Linux grants the tile state; "emulate" builds the tiles from amx_emulated.h (portable C) on
any CPU, for verification (the suite does so where AMX is missing); "0" turns it off. Either build
passes its self-check, run first in a child process (first_run.py), or is refused with the
reason. Emulated tiles are never picked unasked: kernel="amx" or EXACTNESS_KERNEL=amx runs them.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from .. import dataflow
from ..contract import FloatFormat, act_qmax, float_format
from ..formats import check_finite, float_bits, torch_dtype
from . import native, toolchain
from .registry import Fit, Weights, int8_limbs_hold, no, warn_fallback, yes

SOURCE = native.CSRC / "cpu_amx.c"
EMULATION = native.CSRC / "amx_emulated.h"
FLAGS = ("-mamx-tile", "-mamx-int8")
MODES = {"1": "the AMX instructions", "0": "off", "emulate": "emulated AMX tiles"}
NEEDS = ("amx_tile", "amx_int8")
# the plan prefers the real tiles from this many rows on; None: never, where no table measured on
# AMX shows them faster than the VNNI kernels (docs/PERFORMANCE.md)
MIN_ROWS: int | None = None


def mode() -> str:
    """EXACTNESS_AMX: "1" (the default), "0" or "emulate"; ContractValueError for anything else."""
    return toolchain.switch("EXACTNESS_AMX", MODES)


def missing_features() -> list[str]:
    """The AMX features /proc/cpuinfo does not list ([] on an AMX machine)."""
    return toolchain.cpu_lacks(NEEDS)


def source(emulated: bool, amx_source: str | None = None) -> str:
    """What is compiled: cpu_vnni.c, then (emulated) amx_emulated.h, then cpu_amx.c (or
    `amx_source` in its place: a planted bug, exactness.suite.mutants)."""
    tiles = EMULATION.read_text() if emulated else ""
    return "\n".join((native.SOURCE.read_text(), tiles, amx_source or SOURCE.read_text()))


def build(amx_source: str | None = None) -> tuple[ctypes.CDLL | None, Fit]:
    """The library compiled (emulated tiles where EXACTNESS_AMX=emulate) and its entry points'
    signatures set, never yet run; or None and why not."""
    emulated = mode() == "emulate"
    lib, why = native.build(source(emulated, amx_source), () if emulated else FLAGS)
    return (bind(lib), why) if lib is not None else (None, why)


def bind(lib):
    """`lib` with the AMX entry points' signatures set (cpu_vnni.c's are native.SIGNATURES)."""
    ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.amx_tiles.argtypes = [ptr, ptr, i64, i32, ptr, ptr, ptr, i32, i32]
    lib.exact_linear_amx.argtypes = [ptr, ptr, i32, i32, i32, i64, i32, i64, ptr, i32, i32]
    lib.amx_plane_bytes.argtypes = [i64, i64, i32]
    lib.amx_tiles.restype = lib.exact_linear_amx.restype = lib.amx_plane_bytes.restype = i64
    lib.amx_request.restype, lib.amx_faults.restype = i32, i64
    return lib


def request(lib) -> Fit:
    """The tile state asked of Linux for this process: the tiles run only once it is granted."""
    if lib.amx_request() != 0:
        return no("Linux did not grant the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM: a "
                  "kernel before 5.16, or a seccomp filter)")
    return yes("the tile state granted")


def load(amx_source: str | None = None, check: bool = True) -> tuple[ctypes.CDLL | None, Fit]:
    """The library built, its first run (the self-check) done in a child process, then the tile
    state granted here; None and why not. A child that dies refuses it; with `check`, so does a
    failed self-check (check=False is for planted bugs: exactness.suite.mutants)."""
    lib, why = build(amx_source)
    if lib is None:
        return None, why
    first = native.judged(lib, "exactness.kernels.amx:check_file",
                          f"the AMX kernel ({MODES[mode()]})")
    if first.died or (check and not first.verdict):
        return None, first.verdict
    granted = request(lib)
    return (lib, first.verdict) if granted else (None, granted)


def check_file(file: Path, digest: str) -> Fit:
    """In first_run's child: the library at `file` (its bytes must match `digest`) loaded, its
    tile state granted, then self-checked."""
    lib, why = native.load_file(file, digest)
    if lib is None:
        return why
    granted = request(bind(lib))
    return self_check(lib) if granted else granted


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
    if native.missing_features() and not native.emulated():
        return None, no(f"its AVX-512 half needs {', '.join(native.missing_features())} "
                        f"or EXACTNESS_NATIVE=emulate")
    lib, verdict = load()
    if lib is not None and emulated:
        verdict = yes("emulated AMX tiles (EXACTNESS_AMX=emulate): for verification, not speed")
    return lib, verdict


def library():
    """The loaded, self-checked AMX kernel, or None (status() says why)."""
    return status()[0]


def amx_spans(weights: native.NativeWeights) -> AmxSpans:
    """The AMX kernel's spans of one layer's weights (NativeWeights: c [G, Np] in row order, wsum
    [G, Np] in lane order). Per block of 16 rows, groups are taken into a span greedily while, for
    every row, the largest |c| of the span over the largest power of two dividing them all (base)
    is at most dataflow.span_fold_limit (then every q * (c >> base) is an s16, proofs:
    amx-span-digits), and the span has at most AMX_SPAN_GROUPS groups. A group alone always
    fits: c >> its low bit is |ms| <= 255."""
    c, groups = weights.c.t().to(torch.int64), weights.k // 32
    nb = weights.np // 16
    c = c.reshape(nb, 16, groups)  # row order
    limit = dataflow.span_fold_limit(4 if weights.nibbles else 8)
    never = 1 << 40  # "no nonzero factor yet": divides nothing
    low_bit = torch.where(c != 0, c & -c, never)
    top = c.abs()
    ends = torch.zeros(nb, groups, dtype=torch.bool)
    lows = torch.ones(nb, 16, groups, dtype=torch.int64)  # 2**base at each span's end
    span_low, span_top = low_bit[..., 0], top[..., 0]
    length = torch.ones(nb, dtype=torch.int64)
    for g in range(1, groups):  # greedy: extend the span while every row's fold holds
        low, high = torch.minimum(span_low, low_bit[..., g]), torch.maximum(span_top, top[..., g])
        fits = (high // low <= limit).all(1) & (length < dataflow.AMX_SPAN_GROUPS)
        ends[~fits, g - 1] = True
        lows[~fits, :, g - 1] = span_low[~fits]
        keep = fits[:, None]
        span_low = torch.where(keep, low, low_bit[..., g])
        span_top = torch.where(keep, high, top[..., g])
        length = torch.where(fits, length + 1, 1)
    ends[:, -1] = True
    lows[..., -1] = span_low
    low = native.at_span_ends(lows, ends)
    base = torch.where(low == never, 0, low.double().log2().round().to(torch.int64))  # exact
    f = c >> base
    rows = torch.tensor(native.LANE_ROWS).argsort()  # each row's lane
    wsum = weights.wsum.to(torch.int64).view(groups, nb, 16)[:, :, rows].reshape(groups, -1)
    rsum = (wsum * weights.c.to(torch.int64)).sum(0)  # R = sum_k q * c, row order
    return AmxSpans(f[:, native.LANE_ROWS].transpose(1, 2).to(torch.int16).contiguous(),
                    base.transpose(1, 2).to(torch.int8).contiguous(),
                    ends.to(torch.uint8).contiguous(), rsum.contiguous())


class AmxLayer(ctypes.Structure):
    """cpu_amx.c's AmxLayer: what the AMX kernel reads of a layer."""

    _fields_ = [(name, ctypes.c_void_p) for name in
                ("w", "f", "base", "ends", "rsum", "emin")] + [
        ("k", ctypes.c_int64), ("np", ctypes.c_int64), ("n", ctypes.c_int64),
        ("nibbles", ctypes.c_int32)]


class AmxSpans:
    """The AMX kernel's spans of one layer (amx_spans), derived once and kept beside its
    NativeWeights: f [Np/16, G, 16] int16 in lane order, base [Np/16, G, 16] int8 and the
    rows' R = sum_k q * c [Np] int64 in row order, ends [Np/16, G] uint8."""

    def __init__(self, f, base, ends, rsum):
        self.f, self.base, self.ends, self.rsum = f, base, ends, rsum
        self.tensors = (f, base, ends, rsum)
        self._layer: tuple = ()  # (emin, its padded copy, the AmxLayer pointing into them)

    def layer(self, weights: native.NativeWeights, emin: torch.Tensor) -> AmxLayer:
        """The AmxLayer for the certificate's `emin`, built once per emin and kept."""
        if not self._layer or self._layer[0] is not emin:
            padded = weights.padded(emin)
            self._layer = (emin, padded, AmxLayer(
                weights.w.data_ptr(), self.f.data_ptr(), self.base.data_ptr(),
                self.ends.data_ptr(), self.rsum.data_ptr(), padded.data_ptr(), weights.k,
                weights.np, weights.n, int(weights.nibbles)))
        return self._layer[2]


def spans_of(weights: native.NativeWeights) -> AmxSpans:
    return weights.derived("amx", amx_spans)


def accumulate(limbs: torch.Tensor, act_bits: int, weights: native.NativeWeights, lib,
               rounding: tuple | None = None) -> torch.Tensor:
    """amx_tiles on the biased limbs [L, M, K] uint8 (native.biased_limbs): T [M, Np] int64, or,
    with `rounding` = (e_r, emin, out_format), y [M, N] rounded once in the kernel."""
    count, m, k = limbs.shape
    planes = torch.zeros(lib.amx_plane_bytes(m, k, count), dtype=torch.uint8)  # and the slack
    planes[:limbs.numel()] = limbs.contiguous().view(-1)
    emin = rounding[1] if rounding else torch.zeros(weights.n, dtype=torch.int64)
    layer = spans_of(weights).layer(weights, emin)
    t = y = e_r = None
    fmt = float_format("float32")
    if rounding:
        e_r, fmt = rounding[0].to(torch.int64).contiguous(), rounding[2]
        y = torch.empty((m, weights.n), dtype=torch_dtype(fmt))
    else:
        t = torch.empty((m, weights.np), dtype=torch.int64)
    if lib.amx_tiles(ctypes.byref(layer), planes.data_ptr(), m, count,
                     None if t is None else t.data_ptr(), None if y is None else y.data_ptr(),
                     None if e_r is None else e_r.data_ptr(), fmt.mant_bits, fmt.exp_bits):
        raise MemoryError(f"no memory for the AMX kernel's digit planes (K = {weights.k})")
    return y if rounding else t


def linear(x: torch.Tensor, act_bits: int, weights: native.NativeWeights, emin: torch.Tensor,
           out_format: FloatFormat, lib=None) -> torch.Tensor:
    """The AMX forward of x [M, K] in one C call (exact_linear_amx): quantized, the tiles, one
    rounding; y [M, N] in `out_format`. Raises NonFiniteError for a non-finite x."""
    lib = lib or library()
    fmt = float_format(x.dtype)
    x = x.contiguous()
    y = torch.empty((x.shape[0], weights.n), dtype=torch_dtype(out_format))
    bad = lib.exact_linear_amx(ctypes.byref(spans_of(weights).layer(weights, emin)),
                               x.data_ptr(), native.FORMAT_CODES[fmt.name], fmt.mant_bits,
                               fmt.exp_bits, act_qmax(act_bits), dataflow.act_limbs(act_bits),
                               x.shape[0], y.data_ptr(), out_format.mant_bits,
                               out_format.exp_bits)
    if bad < 0:
        raise MemoryError(f"no memory for the AMX kernel's activations of x {tuple(x.shape)}")
    if bad:
        check_finite(float_bits(x), fmt, "x")  # raises, with the count and the first index
    return y


def self_check(lib) -> Fit:
    """amx_tiles against int64 arithmetic: T and its fused rounding, at one and two limbs, both
    weight layouts, every tail of a tile's 16 rows, odd group counts, spans of every kind (one
    group each and ending mid-step, long ones, bases above 0, the AMX_SPAN_GROUPS cap, negative
    and zero factors), the limbs and the digits at their extremes; then the one-call path
    (exact_linear_amx) against quantize and amx_tiles; and no tile fault (the emulation counts
    them). The verdict names the check that failed, and the faults where there were any."""
    from ..contract import FORMATS
    from ..formats import bits_to_tensor, round_scaled_array

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
            weights = native.NativeWeights(q, ms << sh)
            p = (qa.view(m, 1, k // 32, 32) * q.view(1, n, k // 32, 32)).sum(-1)
            want = ((p * ms.long()) << sh.long()).sum(-1)
            a = native.biased_limbs(qa, act_bits)
            where = f"{w_bits}-bit weights, {m} rows, K = {k}, act_bits {act_bits}"
            if not torch.equal(accumulate(a, act_bits, weights, lib)[:, :n], want):
                return refused(f"the accumulation ({where})")
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
            limbs, e_x = native.quantize(x, act_bits, lib)
            fmt = float_format("bfloat16")
            if not torch.equal(linear(x, act_bits, weights, emin, fmt, lib),
                               accumulate(limbs, act_bits, weights, lib, (e_x, emin, fmt))):
                return refused(f"the one-call path (exact_linear_amx, {where})")
    if lib.amx_faults():
        return refused("the tiles' shapes")
    return yes("AMX-INT8 tiles, self-checked")


class _AmxKernel:
    """cpu_amx.c for one layer, in one C call (exact_linear_amx): quantized by cpu_vnni.c's
    passes, the tiles, the rounding fused."""

    name, family, layout, grouped = "amx", "cpu", "vnni", False
    act_limbs = dataflow.AMX_ACT_LIMBS

    @property
    def auto(self) -> bool:
        """The plan picks the real tiles unasked where MIN_ROWS says at what size; emulated ones
        only when asked for."""
        return mode() == "1" and MIN_ROWS is not None

    @property
    def min_rows(self) -> int:
        return MIN_ROWS or 0

    def available(self, device: torch.device) -> Fit:
        if device.type != "cpu":
            return no(f"it runs on the CPU, x is on {device}")
        lib, why = status()
        if lib is None and mode() == "1" and native.mode() != "0" and not missing_features():
            warn_fallback("the AMX kernel", why.why)  # an AMX machine that does not run it
        return why

    def eligible(self, rows: int, weights: Weights) -> Fit:
        held = int8_limbs_hold(weights.act_bits, self.act_limbs)
        if not held:
            return held
        # at the certified spread, the most a fast row has (the plan reads no scales)
        spread = dataflow.certified_spread(weights.k, weights.bits, weights.act_bits)
        if not dataflow.amx_holds(weights.k, weights.bits, weights.act_bits, spread):
            return no(f"K = {weights.k} by factors of spread {spread} could pass int64 in its "
                      f"combine")
        return yes(f"act_bits {weights.act_bits} in {dataflow.act_limbs(weights.act_bits)} "
                   f"u8 limb(s), scales folded into two digits")

    def prepare(self, weights: Weights) -> native.NativeWeights:
        return native.NativeWeights(weights.q(), weights.certificate.factor.cpu())

    def run(self, x, weights: Weights, prepared: native.NativeWeights,
            out_format: FloatFormat) -> torch.Tensor:
        return linear(x, weights.act_bits, prepared, weights.certificate.emin, out_format)


AMX = _AmxKernel()
