"""The CPU path's fast kernel (cpu_vnni.c): compiled on first use with the system C compiler,
cached by source hash, loaded with ctypes, and used only where the CPU has AVX-512 VNNI and the
compiled kernel passes its exactness self-check; otherwise the int8-GEMM path runs instead.
EXACTNESS_NATIVE=emulate builds it against avx512_emulated.h (portable C) on any x86 CPU: slow,
for verification; the suite does so where the CPU lacks AVX-512 VNNI.

One forward is one call into C (exact_linear) that runs two passes: the activations quantized (the
row exponents e_r by the contract's integer rule on the row maxima, as
quantize.quantize_activations computes them) into biased int8 limbs, or into int16 words for the
span kernel (16-bit activations, 4-bit weights, from SPAN_MIN_ROWS rows on); then the exact
accumulation T, rounded once in registers and written straight into the output tensor. The
passes are also exposed one by one (quantize, accumulate, round_rows) for the self-check and the
tests.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from .. import dataflow
from ..contract import (
    BFLOAT16,
    GROUP_SIZE,
    ContractValueError,
    FloatFormat,
    act_qmax,
    float_format,
)
from ..formats import check_finite, float_bits, torch_dtype
from ..quantize import quantize_activations
from . import first_run, toolchain
from .registry import (
    Fit,
    Weights,
    int8_limbs_hold,
    no,
    refuse_unheld,
    warn_fallback,
    yes,
)

CSRC = Path(__file__).with_name("csrc")  # the C sources and headers of the CPU kernels
SOURCE = CSRC / "cpu_vnni.c"
FLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC", "-mavx512f", "-mavx512bw", "-mavx512dq",
         "-mavx512vl", "-mavx512cd", "-mavx512vnni"]
# EXACTNESS_NATIVE=emulate: the intrinsics in portable C (SIMDe from simde-py, and the header)
EMULATION = CSRC / "avx512_emulated.h"
EMULATED_FLAGS = ["-O2", "-fopenmp", "-shared", "-fPIC", "-DSIMDE_NO_NATIVE", "-Wno-psabi"]
MODES = {"1": "the AVX-512 VNNI instructions", "0": "off", "emulate": "emulated AVX-512"}
NEEDS = ("avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd", "avx512_vnni")
FORMAT_CODES = {"bfloat16": 0, "float16": 1, "float32": 2}  # cpu_vnni.c's load16
SPAN_MIN_ROWS = 24  # from here on the span kernel is faster (measured: docs/PERFORMANCE.md)
# lane 2i of a 16-lane block holds weight row i, lane 2i + 1 row 8 + i (cpu_vnni.c's layout)
LANE_ROWS = [row for i in range(8) for row in (i, 8 + i)]
_P, _I64, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
SIGNATURES = {  # cpu_vnni.c's entry points: (argument types, result type)
    "exact_linear_vnni": ([_P] * 5 + [_I64] * 3 + [_I32] * 2 + [_P] * 3 + [_I64] + [_I32] * 2,
                          None),
    "exact_linear_spans": ([_P] * 7 + [_I64] * 3 + [_P] * 3 + [_I64] + [_I32] * 2, None),
    "row_exponents": ([_P, _I32, _I32, _I64, _I64, _I64, _P], _I64),
    "quantize_limbs": ([_P, _I32, _I64, _I64, _P, _P, _I32], None),
    "round_rows": ([_P, _I64, _P, _P, _I64, _I64, _I32, _I32, _P], None),
    "exact_grouped": ([_P, _P, _I32, _I32, _I32, _I64, _I32, _I64, _P, _I32, _I32, _P, _I64],
                      _I64),
}


def missing_features() -> list[str]:
    return toolchain.cpu_lacks(NEEDS)


def _cpu_has_vnni() -> bool:
    return not missing_features()


def mode() -> str:
    """EXACTNESS_NATIVE: "1" (the default: the real instructions where the CPU has them), "0"
    (off) or "emulate" (avx512_emulated.h); ContractValueError for anything else."""
    return toolchain.switch("EXACTNESS_NATIVE", MODES)


def emulated() -> bool:
    return mode() == "emulate"


@functools.cache
def status() -> tuple[ctypes.CDLL | None, Fit]:
    """(the loaded kernel or None, and why): no VNNI, no compiler, or which self-check failed."""
    if mode() == "0":
        return None, no("EXACTNESS_NATIVE=0 turns the C kernel off")
    missing = missing_features()
    if missing and not emulated():
        return None, no(f"the CPU lacks {', '.join(missing)}")
    lib, why = build(SOURCE.read_text())
    if lib is None:
        return None, why
    verdict = judged(lib).verdict
    if verdict and emulated():
        verdict = yes("emulated AVX-512 (EXACTNESS_NATIVE=emulate): for verification, not speed")
    return (lib if verdict else None), verdict


def judged(lib, check: str = "exactness.kernels.native:check_file",
           build: str | None = None) -> first_run.FirstRun:
    """The library's first run, its self-check (`check`, run on its file), in a child process:
    the verdict, or why the child gave none (first_run.py). The library runs here only after."""
    build = build or f"the C kernel ({MODES[mode()]})"
    return first_run.run(lib.exactness_file, lib.exactness_digest, check, build,
                         toolchain.machine())


def check_file(file: Path, digest: str) -> Fit:
    """In first_run's child: the library at `file` loaded (its bytes must match `digest`) and
    self-checked (_self_check)."""
    lib, why = load_file(file, digest)
    return _self_check(lib) if lib is not None else why


def load_file(file: Path, digest: str) -> tuple[ctypes.CDLL | None, Fit]:
    """The compiled library at `file`, loaded if its bytes match `digest` (a child's view of a
    build; build() binds it the same way)."""
    return toolchain.load_file(file, digest, SIGNATURES)


def library():
    """The loaded, self-checked kernel, or None (status() says why)."""
    return status()[0]


def load(source: str, check: bool = True):
    """`source` compiled (cached by its hash) and loaded; None if it does not compile, if its
    first run dies in a child process or, with `check`, if it fails the self-check there.
    (check=False is for planted bugs: exactness.suite.mutants.)"""
    lib, _ = build(source)
    if lib is None:
        return None
    first = judged(lib)
    return None if first.died or (check and not first.verdict) else lib


def build(source: str, extra_flags: tuple[str, ...] = ()) -> tuple[ctypes.CDLL | None, Fit]:
    """`source` (cpu_vnni.c, or amx.py's build of it) compiled as this kernel compiles it
    (as_compiled), with `extra_flags` too, through the toolchain's cache, and loaded with the
    entry points' signatures set; or None and why not. Never raises."""
    source, flags, why = as_compiled(source)
    if source is None:
        return None, why
    return toolchain.build(source, [*flags, *extra_flags], SOURCE.name, SIGNATURES)


def as_compiled(source: str) -> tuple[str | None, list[str], Fit]:
    """(the source the compiler sees, its flags, why): emulated, with avx512_emulated.h in place
    of <immintrin.h> (None where simde-py, which holds SIMDe's headers, is missing)."""
    if not emulated():
        return source, FLAGS, yes("the AVX-512 VNNI instructions")
    try:
        import simde_py
    except ImportError:
        return None, [], no("EXACTNESS_NATIVE=emulate needs SIMDe's headers: pip install simde-py")
    return (source.replace("#include <immintrin.h>", EMULATION.read_text(), 1),
            [*EMULATED_FLAGS, f"-I{simde_py.get_include()}"], yes("emulated AVX-512"))


class Layer(ctypes.Structure):
    """cpu_vnni.c's Layer: what exact_grouped reads of a layer that does not change between
    forwards."""

    _fields_ = [(name, ctypes.c_void_p) for name in
                ("w", "wsum", "c", "f", "rsh", "ends", "unshifted", "emin")] + [
        ("k", ctypes.c_int64), ("np", ctypes.c_int64), ("n", ctypes.c_int64),
        ("nibbles", ctypes.c_int32), ("packed", ctypes.c_void_p), ("scale", ctypes.c_void_p),
        ("flags", ctypes.c_void_p), ("bits", ctypes.c_int32), ("limit", ctypes.c_int32)]


FLAG_SLOW, FLAG_NONFINITE = 1, 2  # cpu_vnni.c's per-row flags of a layer read in place


class InPlace:
    """A layer's live buffers as one forward's grouped call reads them in place (cpu_vnni.c's
    prepare_block): nothing derived ahead, nothing kept. The call writes each row's emin and
    flags (slow, non-finite scale) here; `found()` reads the flags back."""

    def __init__(self, weights: Weights):
        self.packed, self.scale = weights.packed, weights.scale  # the call reads these in place
        self.n, self.k = weights.n, weights.k
        self.np = -(-self.n // 16) * 16
        self.emin = torch.zeros(self.np, dtype=torch.int64)
        self.flags = torch.zeros(self.np, dtype=torch.uint8)
        self._layer = Layer(None, None, None, None, None, None, None, self.emin.data_ptr(),
                            self.k, self.np, self.n, 0, self.packed.data_ptr(),
                            self.scale.data_ptr(), self.flags.data_ptr(), weights.bits,
                            dataflow.certified_spread(self.k, weights.bits, weights.act_bits))

    def layer(self, emin: None, spans: bool) -> Layer:
        """exact_grouped's Layer (the emin and spans of a derived layer do not apply)."""
        return self._layer

    def found(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(slow rows, rows with a non-finite scale) [int64], as the call found them."""
        flags = self.flags[:self.n]
        if not bool(flags.any()):
            none = torch.empty(0, dtype=torch.int64)
            return none, none
        return (torch.nonzero(flags & FLAG_SLOW).flatten(),
                torch.nonzero(flags & FLAG_NONFINITE).flatten())

    @property
    def nbytes(self) -> int:
        """What one forward derives and frees: the rows' emin and flags, and each thread's block
        of 16 rows (its words, weight sums, factors and decoded scales: exact_grouped's)."""
        groups = self.k // GROUP_SIZE
        block = self.k * 16 + 4 * groups * 16 * 4
        return self.emin.numel() * 8 + self.flags.numel() + block * torch.get_num_threads()


class Grouped(ctypes.Structure):
    """cpu_vnni.c's Grouped: the experts, their layers and their routed rows of one call."""

    _fields_ = [(name, ctypes.c_void_p) for name in ("layers", "offsets", "source", "spans")] + [
        ("experts", ctypes.c_int64), ("parts", ctypes.c_int64)]


class NativeWeights:
    """Derived at load for cpu_vnni.c: the weights in blocks of 16 rows per vector, as 4-bit pairs
    when every weight fits 4 bits (else a byte each), and per group: the weight sums and the scale
    factors ms << shift (0 on slow rows), int32 each; the span kernel's scales (`spans`) are
    derived from these when it first runs."""

    def __init__(self, q: torch.Tensor, factor: torch.Tensor):
        n, k = q.shape
        self.n, self.k = n, k
        self.np = -(-n // 16) * 16
        pad = self.np - n
        q8 = torch.nn.functional.pad(q.to(torch.int8), (0, 0, 0, pad))
        lanes = q8.view(self.np // 16, 16, k)[:, LANE_ROWS]
        w = lanes.view(self.np // 16, 16, k // 4, 4).permute(0, 2, 1, 3).contiguous()
        self.nibbles = bool(q8.numel() == 0 or (q8.min() >= -8 and q8.max() <= 7))
        if self.nibbles:  # 4-k steps j, j + 1 share a byte: j low, j + 1 high, offset by 8
            pairs = (w.to(torch.int16) + 8).view(self.np // 16, k // 8, 2, 64)
            w = (pairs[:, :, 0] | pairs[:, :, 1] << 4).to(torch.uint8)
        self.w = w.contiguous()
        groups = lanes.reshape(self.np, k // GROUP_SIZE, GROUP_SIZE).sum(-1, dtype=torch.int32)
        self.wsum = groups.t().contiguous()
        self.c = torch.nn.functional.pad(factor.to(torch.int32), (0, 0, 0, pad)).t().contiguous()

    @property
    def nbytes(self) -> int:
        built = (*self.__dict__.get("spans", ()), *self._emin[1:],  # counted once built
                 *(t for d in self._derived.values() for t in d.tensors))
        return sum(t.numel() * t.element_size() for t in (self.w, self.wsum, self.c, *built))

    def derived(self, name: str, build):
        """What another kernel of this layout derives from these weights (the AMX kernel's
        spans): build(self) on first use, kept here, counted in nbytes (its `tensors`)."""
        if name not in self._derived:
            self._derived = {**self._derived, name: build(self)}
        return self._derived[name]

    _derived: dict = {}  # by name: what derived() built (replaced, never mutated in place)

    _emin: tuple = ()  # (the certificate's emin, padded to np): what self._layer points to
    _layer: Layer | None = None

    def padded(self, emin: torch.Tensor) -> torch.Tensor:
        """A per-row int64 vector (the certificate's emin) padded with zeros to np rows."""
        return torch.nn.functional.pad(emin.to(torch.int64), (0, self.np - self.n)).contiguous()

    def layer(self, emin: torch.Tensor, spans: bool) -> Layer:
        """exact_linear's Layer for the certificate's `emin` (with the span kernel's scales when
        `spans`), built once and kept: it points into tensors this object holds."""
        if self._layer is None or self._emin[0] is not emin:
            self._emin = (emin, self.padded(emin))
            self._layer = Layer(self.w.data_ptr(), self.wsum.data_ptr(), self.c.data_ptr(),
                                None, None, None, None, self._emin[1].data_ptr(), self.k,
                                self.np, self.n, int(self.nibbles))
        if spans and not self._layer.f:
            scales = [t.data_ptr() for t in self.spans]
            self._layer.f, self._layer.rsh, self._layer.ends, self._layer.unshifted = scales
        return self._layer

    @functools.cached_property
    def spans(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """exact_linear_spans' scales (span_scales), built on first use."""
        return span_scales(self.c, self.w, self.k)


def span_scales(c: torch.Tensor, w: torch.Tensor, k: int):
    """exact_linear_spans' scales for 4-bit weights (NativeWeights' c and nibbles w, K = k):
    (f [Np/16, G, 16] int16 in lane order, rsh [Np/16, G, 16] int8 in row order, ends
    [Np/16, G] uint8, unshifted [Np/16] uint8). Per block of 16 rows, one of two kinds (whatever
    the activations, every sum below times 32767 is an int32, and |q * f| fits s16: |f| <=
    dataflow.span_fold_limit):
    - unshifted, where it holds: f = c = ms << shift itself, every group its own span, and
      |f| * sum_k |q| <= dataflow.span_size_limit over each of a group's two chains (the k of
      each 4-k step in the pairs (k0, k2) and (k1, k3): vpdpwssd's two sums per row);
    - else spans: with base the span's largest power of two dividing every c (so f = c >> base
      is exact), groups are taken into a span while, for every row, sum_g |f_g| * sum_k |q| <=
      span_size_limit, both chains together. One group always fits (proofs: span-fold,
      span-group)."""
    nb, groups = c.shape[1] // 16, k // GROUP_SIZE
    c = c.t().to(torch.int64).view(nb, 16, groups)  # row order
    pairs = w.view(nb, groups, 4, 16, 4).to(torch.int16)
    q_abs = ((pairs & 15) - 8).abs() + ((pairs >> 4) - 8).abs()  # both nibbles of a byte

    def by_row(lanes):  # [Nb, G, 16 lanes] -> [Nb, 16 rows, G]
        rows = torch.empty_like(lanes.transpose(1, 2))
        rows[:, LANE_ROWS] = lanes.transpose(1, 2)
        return rows

    chains = [by_row(q_abs[..., k0::2].sum((2, 4))) for k0 in (0, 1)]  # (k0, k2), (k1, k3)
    q_sum, chain_sum = chains[0] + chains[1], torch.maximum(*chains)  # sum_k |q| per group
    limit, fold_limit = dataflow.span_size_limit(16), dataflow.span_fold_limit(4)
    unshifted = ((c.abs() <= fold_limit) & (c.abs() * chain_sum <= limit)).flatten(1).all(1)
    never = 1 << 40  # "no nonzero scale yet": divides nothing
    low_bit = torch.where(c != 0, c & -c, never)  # the largest power of two dividing c
    size = c.abs() * q_sum
    ends = torch.zeros(nb, groups, dtype=torch.bool)
    divisor = torch.zeros(nb, 16, groups, dtype=torch.int64)  # 2**base at each span end
    span_div, span_size, span_max = low_bit[..., 0], size[..., 0], c[..., 0].abs()
    for g in range(1, groups):  # greedy: extend the span while every row's bound holds
        div = torch.minimum(span_div, low_bit[..., g])
        tot, top = span_size + size[..., g], torch.maximum(span_max, c[..., g].abs())
        fits = ((tot // div <= limit) & (top // div <= fold_limit)).all(1) & ~unshifted
        ends[~fits, g - 1] = True
        divisor[~fits, :, g - 1] = span_div[~fits]
        keep = fits[:, None]
        span_div = torch.where(keep, div, low_bit[..., g])
        span_size = torch.where(keep, tot, size[..., g])
        span_max = torch.where(keep, top, c[..., g].abs())
    ends[:, -1] = True
    divisor[..., -1] = span_div
    divisor = torch.where((divisor == never) | unshifted[:, None, None], 1, divisor)
    base = divisor.log2().round().to(torch.int64)  # exact: powers of two below 2**40
    f = c >> at_span_ends(base, ends)
    return (f[:, LANE_ROWS].transpose(1, 2).to(torch.int16).contiguous(),
            (32 - base).transpose(1, 2).to(torch.int8).contiguous(),
            ends.to(torch.uint8).contiguous(), unshifted.to(torch.uint8).contiguous())


def at_span_ends(values: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """values [Nb, 16, G] as each group's span holds them at its end: per block, each group's
    span is the first end (ends [Nb, G] true) at or after it. (span_scales', amx.amx_spans'.)"""
    nb, rows, groups = values.shape
    last = torch.where(ends, torch.arange(groups), groups)
    end_of = last.flip(1).cummin(1).values.flip(1)
    return torch.gather(values, 2, end_of[:, None, :].expand(nb, rows, groups))


def quantize_mode(act_bits: int, words: bool) -> int:
    """cpu_vnni.c's quantize_limbs mode: 0, int16 words for the span kernel; else how many limbs
    exact_linear_vnni takes (1, 2 or 4)."""
    return 0 if words else dataflow.act_limbs(act_bits)


def quantize(x: torch.Tensor, act_bits: int, lib=None, words: bool = False):
    """(a, e_r): x [M, K] as cpu_vnni.c's biased limbs a [L, M, K] uint8 (biased_limbs),
    or with `words` qa itself as int16 [M, K] in exact_linear_spans' order (16 bits at most),
    and the row exponents e_r [M] int64 (contract section 3). Raises NonFiniteError
    (formats.check_finite) if x holds a non-finite value."""
    lib = lib or library()
    fmt = float_format(x.dtype)
    x = x.contiguous()
    m, k = x.shape
    e_r = torch.empty(m, dtype=torch.int64)
    if lib.row_exponents(x.data_ptr(), fmt.mant_bits, fmt.exp_bits, act_qmax(act_bits), m, k,
                         e_r.data_ptr()):
        check_finite(float_bits(x), fmt, "x")
    if words and act_qmax(act_bits) > 2**15 - 1:
        raise ContractValueError(f"int16 words hold 16-bit activations at most, not act_bits "
                                 f"{act_bits}")
    mode = quantize_mode(act_bits, words)
    a = torch.empty((m, k) if words else (mode, m, k), dtype=torch.int16 if words else torch.uint8)
    lib.quantize_limbs(x.data_ptr(), FORMAT_CODES[fmt.name], m, k, e_r.data_ptr(), a.data_ptr(),
                       mode)
    return a, e_r


def accumulate(a: torch.Tensor, act_bits: int, weights: NativeWeights, lib=None,
               rounding: tuple | None = None, spans: bool = False) -> torch.Tensor:
    """T [M, Np] int64 (padded columns are 0) from the biased limbs a [L, M, K] (or, with
    `spans`, from quantize's words [M, K] through exact_linear_spans); or, with `rounding` =
    (e_r, emin, out_format), y [M, N] in out_format: T rounded in the kernel's registers, the
    same rounding as round_rows."""
    lib = lib or library()
    if not spans and a.shape[0] != dataflow.act_limbs(act_bits):
        raise ValueError(f"act_bits {act_bits} takes {dataflow.act_limbs(act_bits)} limbs, "
                         f"got {a.shape[0]}")
    a = a.contiguous()
    m = a.shape[-2]
    t = y = e_r = emin = None
    fmt = rounding[2] if rounding else float_format("float32")
    if rounding:
        e_r = rounding[0].to(torch.int64).contiguous()
        emin = weights.padded(rounding[1])
        y = torch.empty((m, weights.n), dtype=torch_dtype(fmt))
    else:
        t = torch.empty((m, weights.np), dtype=torch.int64)
    out = (*(v.data_ptr() if v is not None else None for v in (y, e_r, emin)), weights.n,
           fmt.mant_bits, fmt.exp_bits)
    t_ptr = t.data_ptr() if t is not None else None
    if spans:
        f, rsh, ends, unshifted = weights.spans
        lib.exact_linear_spans(a.data_ptr(), weights.w.data_ptr(), f.data_ptr(), rsh.data_ptr(),
                               ends.data_ptr(), unshifted.data_ptr(), t_ptr, m, weights.k,
                               weights.np, *out)
    else:
        lib.exact_linear_vnni(a.data_ptr(), weights.w.data_ptr(), weights.wsum.data_ptr(),
                              weights.c.data_ptr(), t_ptr, m, weights.k, weights.np,
                              dataflow.act_limbs(act_bits), int(weights.nibbles), *out)
    return y if rounding else t


def round_rows(t: torch.Tensor, n: int, e_r: torch.Tensor, emin: torch.Tensor,
               out_format: FloatFormat, lib=None) -> torch.Tensor:
    """formats.round_scaled of t[:, :n] * 2**(e_r[r] + emin[n]), in C, as an [M, n] tensor of
    `out_format`."""
    lib = lib or library()
    e_r, emin = e_r.to(torch.int64).contiguous(), emin.to(torch.int64).contiguous()
    out = torch.empty((t.shape[0], n), dtype=torch_dtype(out_format))
    lib.round_rows(t.data_ptr(), t.shape[1], e_r.data_ptr(), emin.data_ptr(), t.shape[0], n,
                   out_format.mant_bits, out_format.exp_bits, out.data_ptr())
    return out


def linear(x: torch.Tensor, act_bits: int, weights: NativeWeights, emin: torch.Tensor,
           out_format: FloatFormat, lib=None, spans: bool = False) -> torch.Tensor:
    """The whole fast path for x [M, K], in one call of the C kernel: `grouped` with one expert
    of one part, every row routed to it (quantize, then accumulate with the rounding fused,
    through the span kernel with `spans`): y [M, N] in `out_format` (raises on non-finite x)."""
    return grouped(x, act_bits, [[(weights, emin)]], [spans], (0, x.shape[0]), None, out_format,
                   lib)


def scratch_bytes(rows: int, k: int) -> int:
    """The most bytes exact_grouped's quantized x [rows, K] takes: words and two limbs (16-bit
    activations), or four limbs (32-bit ones)."""
    return 2 * (rows * k * 2 + 63) // 64 * 64


def grouped(x: torch.Tensor, act_bits: int, experts, spans, offsets, source: torch.Tensor | None,
            out_format: FloatFormat, lib=None, out: torch.Tensor | None = None,
            scratch: torch.Tensor | None = None) -> torch.Tensor:
    """One grouped call of the C kernel (exact_grouped) for x [M, K]: `experts` lists, for each
    expert that has routed rows, its parts' (NativeWeights, emin) (gate and up: two parts of the
    same K and N; down: one); spans[e] sends expert e through the span kernel (16-bit
    activations, 4-bit weights). Expert e's routed rows are offsets[e] .. offsets[e + 1] (a
    sequence of ints), and routed row r reads row source[r] of x (int64; None: row r). Returns
    y [rows, parts * N] in `out_format`, part p of routed row r at columns p * N .. p * N + N
    (into `out` where given); raises NonFiniteError (formats.check_finite) if x holds a
    non-finite value. `scratch` (uint8, scratch_bytes long) holds the quantized x where given:
    a caller that keeps it across calls saves the page faults of a fresh allocation."""
    lib = lib or library()
    fmt = float_format(x.dtype)
    x = x.contiguous()
    layers = [w.layer(emin, use_spans) for parts, use_spans in zip(experts, spans, strict=True)
              for w, emin in parts]
    table = (ctypes.c_void_p * len(layers))(*map(ctypes.addressof, layers))
    offsets = (ctypes.c_int64 * len(offsets))(*offsets)
    kinds = (ctypes.c_uint8 * len(spans))(*map(bool, spans))
    if source is not None:
        source = source.to(torch.int64).contiguous()
    parts = len(experts[0])
    shape = (offsets[-1], parts * layers[0].n)
    y = torch.empty(shape, dtype=torch_dtype(out_format)) if out is None else out
    if y.shape != shape or y.dtype != torch_dtype(out_format) or not y.is_contiguous():
        raise ValueError(f"out must be a contiguous {shape} tensor of {out_format.name}")
    call = Grouped(ctypes.addressof(table), ctypes.addressof(offsets),
                   None if source is None else source.data_ptr(), ctypes.addressof(kinds),
                   len(experts), parts)
    bad = lib.exact_grouped(ctypes.byref(call), x.data_ptr(), FORMAT_CODES[fmt.name],
                            fmt.mant_bits, fmt.exp_bits, act_qmax(act_bits),
                            dataflow.act_limbs(act_bits), x.shape[0], y.data_ptr(),
                            out_format.mant_bits, out_format.exp_bits,
                            None if scratch is None else scratch.data_ptr(),
                            0 if scratch is None else scratch.numel())
    if bad == -2:
        raise ValueError("a grouped call takes layers of one kind: all in place (InPlace) of one "
                         "width, or all derived (NativeWeights)")
    if bad < 0:
        raise MemoryError(f"no memory for the activations of x {tuple(x.shape)}")
    if bad:
        check_finite(float_bits(x), fmt, "x")  # raises, with the count and the first index
    return y


def biased_limbs(qa: torch.Tensor, act_bits: int) -> torch.Tensor:
    """quantize_limbs' twin: qa [M, K] as exact_linear_vnni's limbs [L, M, K] uint8,
    dataflow.activation_limbs plus 128 (the bytes of qa + 2**(8 L - 1), lowest first)."""
    return (dataflow.activation_limbs(qa, act_bits).to(torch.int16) + 128).to(torch.uint8)


def span_order(qa: torch.Tensor) -> torch.Tensor:
    """qa [M, K] as int16 in exact_linear_spans' order: in each 4 k, 0, 2, 1, 3."""
    m, k = qa.shape
    return qa.view(m, k // 4, 4)[:, :, [0, 2, 1, 3]].reshape(m, k).to(torch.int16).contiguous()


def _self_check(lib) -> Fit:
    """The compiled passes against their Python twins: quantization, limbs and span-order words
    against quantize.quantize_activations and dataflow.activation_limbs, both accumulation
    kernels against int64 arithmetic (the worst case, random data, long and one-group spans,
    unshifted blocks), the rounding, fused and as a pass, against formats.round_scaled_array
    (ties, subnormals, overflow), in every format; then the one-call path against those
    passes, and the layers read in place (prepare_block) against the derived layout and the
    certificate (certificate.certify). The verdict names the check that failed and its input."""
    from ..contract import FORMATS
    from ..formats import bits_to_tensor, pack_weights, round_scaled_array
    from .certificate import certify

    g = torch.Generator().manual_seed(0)
    for act_bits in (4, 8, 16, 32):
        for fmt in FORMATS.values():
            bits = torch.randint(0, 1 << fmt.width, (5, 64), generator=g)
            bits[1] >>= torch.randint(0, fmt.width, (64,), generator=g)  # wide row ranges
            bits = torch.where(((bits >> fmt.mant_bits) & fmt.exp_max_field) == fmt.exp_max_field,
                               bits & fmt.sign_bit, bits)  # finite only
            bits[2], bits[3, 5] = 0, fmt.inf_bits - 1  # a zero row, the largest finite value
            limbs, e_r = quantize(bits_to_tensor(bits, fmt), act_bits, lib)
            qa, want_e = quantize_activations(bits, fmt, act_bits)
            checks = [("row exponents", e_r, want_e), ("limbs", limbs, biased_limbs(qa, act_bits))]
            if act_bits <= 16:
                words, _ = quantize(bits_to_tensor(bits, fmt), act_bits, lib, words=True)
                checks.append(("span-order words", words, span_order(qa)))
            for what, got, want in checks:
                if not torch.equal(got, want):
                    return no(f"its self-check failed on the quantization's {what} "
                              f"(act_bits {act_bits}, {fmt.name} x)")
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
            if act_bits == 16 and w_bits == 4:
                kernels.append((span_order(qa), True))
            for a, spans in kernels:
                got = accumulate(a, act_bits, weights, lib, spans=spans)
                where = (f"{'exact_linear_spans' if spans else 'exact_linear_vnni'}, "
                         f"{w_bits}-bit weights, {m} rows, act_bits {act_bits}")
                if not torch.equal(got[:, :37], want):
                    return no(f"its self-check failed on the accumulation ({where})")
                for fmt in FORMATS.values():  # the rounding in the kernel's registers
                    y = accumulate(a, act_bits, weights, lib, (e_r, emin, fmt), spans)
                    if not torch.equal(float_bits(y), round_scaled_array(want, e_r[:, None]
                                                                         + emin[None, :], fmt)):
                        return no(f"its self-check failed on the fused rounding to {fmt.name} "
                                  f"({where})")
    # the one-call path (exact_grouped), through either kernel, against exact_linear_vnni's passes
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
            spans = act_bits == 16 and m >= SPAN_MIN_ROWS
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
        spans = [False, act_bits == 16, False]
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
        least = -(1 << (bits - 1))
        q = torch.randint(least, -least, (n, k), generator=g)
        q[0] = least
        scale_bits = torch.randint(0, 1 << 16, (n, k // 32), generator=g)  # row 0: anywhere
        scale_bits[1:] = (scale_bits[1:] & 0x807F) | (torch.randint(
            118, 131, scale_bits[1:].shape, generator=g) << 7)  # spreads up to 12: fast rows
        scale_bits[2] = 0
        scale_bits[3, 0] = 0x7F80  # +inf
        scale_bits[4] &= 0x807F  # subnormal
        scale_bits[n - 1, -1] = 0xFFC1  # a NaN, in the buffer's last element
        packed, scale = torch.from_numpy(pack_weights(q.numpy(), bits)), bits_to_tensor(
            scale_bits, BFLOAT16)
        for act_bits in (8, 16, 32):
            weights = Weights(packed, scale, n, k, bits, act_bits)
            cert = certify(scale, k, bits, act_bits)
            derived, in_place = NativeWeights(q, cert.factor), InPlace(weights)
            for fmt in FORMATS.values():
                x = torch.randn(6, k, generator=g).to(torch_dtype(fmt))
                want = linear(x, act_bits, derived, cert.emin, fmt, lib)
                if not torch.equal(linear(x, act_bits, in_place, None, fmt, lib), want):
                    return no(f"its self-check failed on the weights read in place ({bits}-bit "
                              f"words, K = {k}, act_bits {act_bits}, {fmt.name})")
            flags = in_place.flags[:n]
            if not (torch.equal(in_place.emin[:n], cert.emin)
                    and torch.equal((flags & FLAG_SLOW) != 0, ~cert.fast)
                    and torch.equal((flags & FLAG_NONFINITE) != 0, cert.nonfinite)):
                return no(f"its self-check failed on the scales read in place: emin or flags "
                          f"({bits}-bit words, K = {k}, act_bits {act_bits})")
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
    return yes("AVX-512 VNNI, self-checked")


class _VnniKernel:
    """cpu_vnni.c's one-call path (exact_grouped, one expert), through the limb or the span
    kernel."""

    family, layout, grouped = "cpu", "vnni", False
    act_limbs = dataflow.GROUP_ACT_LIMBS

    def __init__(self, name: str, spans: bool, min_rows: int, auto: bool = True):
        self.name, self.spans, self.min_rows, self.auto = name, spans, min_rows, auto

    def available(self, device: torch.device) -> Fit:
        if device.type != "cpu":
            return no(f"it runs on the CPU, x is on {device}")
        lib, why = status()
        if lib is None:
            warn_fallback("the C kernel (AVX-512 VNNI)", why.why)
        return why

    def eligible(self, rows: int, weights: Weights) -> Fit:
        held = int8_limbs_hold(weights.act_bits, self.act_limbs)
        if not held:
            return held
        if self.spans and not (weights.act_bits == 16 and weights.bits == 4):
            return no(f"it takes 16-bit activations and 4-bit weights, not act_bits "
                      f"{weights.act_bits} and {weights.bits}-bit weights")
        return yes("16-bit activations as int16 words" if self.spans else "any widths")

    def prepare(self, weights: Weights) -> InPlace | NativeWeights:
        """The live buffers, read in place; the span kernel's layout and scales, derived for this
        forward in Python (slow: it is taken only when asked for)."""
        if self.spans:
            return NativeWeights(weights.q(), weights.certificate.factor.cpu())
        return InPlace(weights)

    def run(self, x, weights: Weights, prepared: InPlace | NativeWeights,
            out_format: FloatFormat):
        if self.spans:
            return linear(x, weights.act_bits, prepared, weights.certificate.emin, out_format,
                          spans=True)
        y = linear(x, weights.act_bits, prepared, None, out_format)
        weights.found = prepared.found()
        return y


class _VnniGroupedKernel(_VnniKernel):
    """cpu_vnni.c's grouped call (exact_grouped): every routed expert's rows in one call, each
    layer read in place by the limb kernel. As a layer's kernel (kernel="vnni-grouped"): one
    expert, every row routed to it (the limb kernel's prepare and run)."""

    grouped, reads = True, "layers"

    def __init__(self):
        super().__init__("vnni-grouped", spans=False, min_rows=0, auto=False)

    def run_grouped(self, x, routing, experts, bits: int, act_bits: int, out_format: FloatFormat,
                    gather: bool, workspace=None):
        """(y [routed rows, parts * N], None): `experts` [E] holds, for each expert with routed
        rows, its parts' (Weights, InPlace) of these widths, None for the others; routed row r
        reads row routing.token[r] of x where `gather`, else row r (x then in routing order
        already). Each part's InPlace then holds the rows the call found slow or NaN (found()).
        With a `workspace` (moe.Workspace), y and the quantized x are its buffers, which its
        next use overwrites. Raises NonFiniteError for a non-finite x, and
        KernelUnavailableError for activations wider than its limbs."""
        refuse_unheld(self.name, act_bits, self.act_limbs)
        offsets = routing.offsets.tolist()
        active = [e for e, parts in enumerate(experts) if parts is not None]
        ends = [0, *(offsets[e + 1] - offsets[e] for e in active)]
        routed = offsets[routing.experts]
        source = routing.token[:routed] if gather else None
        lists = [[(prepared, None) for _, prepared in experts[e]] for e in active]
        offsets = torch.tensor(ends).cumsum(0).tolist()
        out = scratch = None
        if workspace is not None:
            n = len(lists[0]) * lists[0][0][0].n
            out = workspace.get("y", (offsets[-1], n), torch_dtype(out_format), x.device)
            scratch = workspace.get("x", (scratch_bytes(*x.shape),), torch.uint8, x.device)
        return grouped(x, act_bits, lists, [False] * len(active), offsets, source, out_format,
                       out=out, scratch=scratch), None


# the span kernel's scales are derived in Python per forward (its weights cannot be read in
# place yet): never the plan's own pick, and its min_rows says where it would pay once they are
SPANS = _VnniKernel("vnni-spans", spans=True, min_rows=SPAN_MIN_ROWS, auto=False)
LIMBS = _VnniKernel("vnni-limbs", spans=False, min_rows=0)
GROUPED = _VnniGroupedKernel()
