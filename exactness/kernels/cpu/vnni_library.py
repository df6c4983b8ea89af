"""cpu_vnni.c built, judged and loaded: compiled on first use with the system C compiler (cached
by source hash, kernels/toolchain.py), self-checked in a child process (kernels/first_run.py,
vnni_check.py), and loaded with ctypes only where the CPU has AVX-512 VNNI and the check passed.
Otherwise status() says why, and the plan takes another kernel.

EXACTNESS_NATIVE=emulate builds it against avx512_emulated.h (portable C) on any x86 CPU: slow,
for verification; the suite does so where the CPU lacks AVX-512 VNNI.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

from .. import first_run, toolchain
from ..registry import Fit, no, yes
from . import CSRC

SOURCE = CSRC / "cpu_vnni.c"
FLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC", "-mavx512f", "-mavx512bw", "-mavx512dq",
         "-mavx512vl", "-mavx512cd", "-mavx512vnni"]
# EXACTNESS_NATIVE=emulate: the intrinsics in portable C (SIMDe from simde-py, and the header)
EMULATION = CSRC / "avx512_emulated.h"
EMULATED_FLAGS = ["-O2", "-fopenmp", "-shared", "-fPIC", "-DSIMDE_NO_NATIVE", "-Wno-psabi"]
MODES = {"1": "the AVX-512 VNNI instructions", "0": "off", "emulate": "emulated AVX-512"}
NEEDS = ("avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd", "avx512_vnni")
CHECK = f"{__package__}.vnni_check:check_file"  # the self-check first_run's child calls
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
    "span_layer_scales": ([_P] * 5, _I64),
}


def missing_features() -> list[str]:
    return toolchain.cpu_lacks(NEEDS)


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


def judged(lib, check: str = CHECK, build: str | None = None) -> first_run.FirstRun:
    """The library's first run, its self-check (`check`, run on its file), in a child process:
    the verdict, or why the child gave none (first_run.py). The library runs here only after."""
    build = build or f"the C kernel ({MODES[mode()]})"
    return first_run.run(lib.exactness_file, lib.exactness_digest, check, build,
                         toolchain.machine())


def load_file(file: Path, digest: str) -> tuple[ctypes.CDLL | None, Fit]:
    """The compiled library at `file`, loaded if its bytes match `digest` (a child's view of a
    build; build() binds it the same way)."""
    return toolchain.load_file(file, digest, SIGNATURES)


def library():
    """The loaded, self-checked kernel, or None (status() says why)."""
    return status()[0]


def load(source: str, check: bool = True, extra_flags: tuple[str, ...] = ()):
    """`source` compiled (cached by its hash and flags) with `extra_flags` too, and loaded;
    None if it does not compile, if its first run dies in a child process or, with `check`, if
    it fails the self-check there. (check=False is for planted bugs: exactness.suite.mutants.)"""
    lib, _ = build(source, extra_flags)
    if lib is None:
        return None
    first = judged(lib)
    return None if first.died or (check and not first.verdict) else lib


def build(source: str, extra_flags: tuple[str, ...] = ()) -> tuple[ctypes.CDLL | None, Fit]:
    """`source` (cpu_vnni.c, or amx_library.py's build of it) compiled as this kernel compiles it
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
