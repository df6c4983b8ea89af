"""cpu_amx.c built, judged and loaded: compiled after the C kernel's AVX-512 build (cpu_kernel.c
with kernel_avx512.h) as one library (it shares its quantization and rounding), self-checked in a
child process (amx_check.py), then the tile state asked of Linux. Used only where the CPU reports
amx_tile and amx_int8.

EXACTNESS_AMX: "1" (the default) uses the real tiles where the CPU reports them and Linux grants
the tile state; "emulate" builds the tiles from amx_emulated.h (portable C) on any CPU, for
verification (the suite does so where AMX is missing); "0" turns it off. Either build passes its
self-check, run first in a child process (first_run.py), or is refused with the reason.
"""

from __future__ import annotations

import ctypes
import functools

from .. import toolchain
from ..registry import Fit, no, yes
from . import CSRC, vnni_library

SOURCE = CSRC / "cpu_amx.c"
EMULATION = CSRC / "amx_emulated.h"
FLAGS = ("-mamx-tile", "-mamx-int8")
# the emulated tiles' build: at -O2, GCC spends about 90 s on amx_tile with the rounding inlined
# over SIMDe's emulated vectors, at -O1 about 10 s (measured, issue 53); it is for verification
EMULATED_FLAGS = ("-O1",)
MODES = {"1": "the AMX instructions", "0": "off", "emulate": "emulated AMX tiles"}
NEEDS = ("amx_tile", "amx_int8")
CHECK = f"{__package__}.amx_check:check_file"  # the self-check first_run's child calls


def mode() -> str:
    """EXACTNESS_AMX: "1" (the default), "0" or "emulate"; ContractValueError for anything else."""
    return toolchain.switch("EXACTNESS_AMX", MODES)


def missing_features() -> list[str]:
    """The AMX features /proc/cpuinfo does not list ([] on an AMX machine)."""
    return toolchain.cpu_lacks(NEEDS)


def source(emulated: bool, amx_source: str | None = None) -> str:
    """What is compiled: the AVX-512 build's source, then (emulated) amx_emulated.h, then
    cpu_amx.c (or `amx_source` in its place: a planted bug, exactness.suite.mutants)."""
    tiles = EMULATION.read_text() if emulated else ""
    return "\n".join((vnni_library.AVX512.source(), tiles, amx_source or SOURCE.read_text()))


def build(amx_source: str | None = None,
          extra_flags: tuple[str, ...] = ()) -> tuple[ctypes.CDLL | None, Fit]:
    """The library compiled (emulated tiles where EXACTNESS_AMX=emulate; `extra_flags` last)
    and its entry points' signatures set, never yet run; or None and why not."""
    emulated = mode() == "emulate"
    lib, why = vnni_library.AVX512.build(source(emulated, amx_source),
                                  (*(EMULATED_FLAGS if emulated else FLAGS), *extra_flags))
    return (bind(lib), why) if lib is not None else (None, why)


def bind(lib):
    """`lib` with the AMX entry points' signatures set (cpu_kernel.c's: the AVX512 build's)."""
    ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.amx_tiles.argtypes = [ptr, ptr, i64, i32, ptr, ptr, ptr, i32, i32, i64]
    lib.exact_linear_amx.argtypes = [ptr, ptr, i32, i32, i32, i64, i32, i64, ptr, i32, i32, i64]
    lib.amx_plane_bytes.argtypes = [i64, i64, i32]
    lib.amx_layer_spans.argtypes = [ptr, i64, ptr, ptr, ptr, ptr]
    for entry in (lib.amx_tiles, lib.exact_linear_amx, lib.amx_plane_bytes, lib.amx_layer_spans):
        entry.restype = i64
    lib.amx_request.restype, lib.amx_faults.restype = i32, i64
    return lib


def request(lib) -> Fit:
    """The tile state asked of Linux for this process: the tiles run only once it is granted."""
    if lib.amx_request() != 0:
        return no("Linux did not grant the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM: a "
                  "kernel before 5.16, or a seccomp filter)")
    return yes("the tile state granted")


def judged(lib):
    """The library's first run, the AMX self-check in a child process (Build.judged): cached by
    the library's bytes."""
    return vnni_library.AVX512.judged(lib, CHECK, f"the AMX kernel ({MODES[mode()]})")


def load(amx_source: str | None = None, check: bool = True,
         extra_flags: tuple[str, ...] = ()) -> tuple[ctypes.CDLL | None, Fit]:
    """The library built, its first run (the self-check) done in a child process, then the tile
    state granted here; None and why not. A child that dies refuses it; with `check`, so does a
    failed self-check (check=False is for planted bugs: exactness.suite.mutants)."""
    lib, why = build(amx_source, extra_flags)
    if lib is None:
        return None, why
    first = judged(lib)
    if first.died or (check and not first.verdict):
        return None, first.verdict
    granted = request(lib)
    return (lib, first.verdict) if granted else (None, granted)


@functools.cache
def status() -> tuple[ctypes.CDLL | None, Fit]:
    """(the loaded kernel or None, and why): which switch, feature, build or check refused it."""
    if mode() == "0":
        return None, no("EXACTNESS_AMX=0 turns the AMX kernel off")
    if vnni_library.mode() == "0":
        return None, no("EXACTNESS_NATIVE=0 turns the C kernels off, the AMX kernel with them")
    emulated = mode() == "emulate"
    missing = missing_features()
    if not emulated and missing:
        return None, no(f"the CPU lacks {', '.join(missing)}")
    if not emulated and vnni_library.AVX512.emulated():
        return None, no("real AMX tiles need the real AVX-512 beside them, and "
                        "EXACTNESS_NATIVE=emulate is set")
    avx512 = vnni_library.AVX512
    if avx512.missing_features() and not avx512.emulated():
        return None, no(f"its AVX-512 half needs {', '.join(avx512.missing_features())} "
                        f"or EXACTNESS_NATIVE=emulate")
    lib, verdict = load()
    if lib is not None and emulated:
        verdict = yes("emulated AMX tiles (EXACTNESS_AMX=emulate): for verification, not speed")
    return lib, verdict


def library():
    """The loaded, self-checked AMX kernel, or None (status() says why)."""
    return status()[0]
