"""The C kernel (csrc/cpu_kernel.c) built for an ISA, judged and loaded: compiled on first use
with the system C compiler (cached by source hash, kernels/toolchain.py), self-checked in a child
process (kernels/first_run.py, vnni_check.py), and loaded with ctypes only where the CPU has the
ISA and the check passed. Otherwise a build's status() says why, and the plan takes another
kernel.

Two builds, one source: AVX512 (kernel_avx512.h, AVX-512 VNNI) and AVX2 (kernel_avx2.h, every
x86-64 CPU this project runs on), each cpu_kernel.c with its ISA file in place of the #include
"kernel_isa.h". EXACTNESS_NATIVE=emulate builds AVX512 against avx512_emulated.h (portable C) on
any x86 CPU: slow, for verification; the suite does so where the CPU lacks AVX-512 VNNI. It
leaves AVX2 as it is: every x86-64 CPU this project is built on runs it natively.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.metadata
from pathlib import Path

from .. import first_run, toolchain
from ..registry import Fit, no, yes
from . import CSRC

SOURCE = CSRC / "cpu_kernel.c"
ISA_INCLUDE = '#include "kernel_isa.h"'  # the line of SOURCE a build's ISA file takes
# EXACTNESS_NATIVE=emulate: the AVX-512 intrinsics in portable C (SIMDe from simde-py, and the
# header), in place of <immintrin.h>
EMULATION = CSRC / "avx512_emulated.h"
EMULATED_FLAGS = ["-O2", "-fopenmp", "-shared", "-fPIC", "-DSIMDE_NO_NATIVE", "-Wno-psabi"]
MODES = {"1": "the CPU's own instructions", "0": "off", "emulate": "emulated AVX-512"}
_P, _I64, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
SIGNATURES = {  # cpu_kernel.c's entry points: (argument types, result type)
    "row_exponents": ([_P, _I32, _I32, _I64, _I64, _I64, _P], _I64),
    "quantize_limbs": ([_P, _I32, _I64, _I64, _P, _P, _I32], None),
    "act_row_bytes": ([_I64], _I64),
    "round_rows": ([_P, _I64, _P, _P, _I64, _I64, _I32, _I32, _P], None),
    "exact_grouped": ([_P, _P, _I32, _I32, _I32, _I64, _I32, _I64, _P, _P, _I32, _I32, _P,
                       _I64], _I64),
}
DERIVED_SIGNATURES = {  # a build that reads layers derived ahead too (KERNEL_DERIVED)
    "exact_linear_limbs": ([_P] * 5 + [_I64] * 3 + [_I32] * 2 + [_P] * 3 + [_I64] + [_I32] * 2,
                           None),
}
SPAN_SIGNATURES = {  # the span kernel's, in a build whose ISA file holds it (KERNEL_SPANS)
    "exact_linear_spans": ([_P] * 7 + [_I64] * 3 + [_P] * 3 + [_I64] + [_I32] * 2, None),
    "span_layer_scales": ([_P] * 5, _I64),
}


def mode() -> str:
    """EXACTNESS_NATIVE: "1" (the default: the real instructions where the CPU has them), "0"
    (off: every build) or "emulate" (the AVX-512 build against avx512_emulated.h);
    ContractValueError for anything else."""
    return toolchain.switch("EXACTNESS_NATIVE", MODES)


class Build:
    """cpu_kernel.c built for one ISA: its file (`isa`), compiler flags, the CPU features it
    needs, whether it reads layers derived ahead (NativeWeights) besides layers read in place and
    whether it holds the span kernel, and its self-check (first_run's "module:function").
    `status()` is cached per process: (the loaded, self-checked library or None, and why)."""

    def __init__(self, name: str, what: str, isa: Path, flags: list[str], needs: tuple[str, ...],
                 derived: bool, spans: bool, check: str):
        self.name, self.what, self.isa, self.flags = name, what, isa, flags
        self.needs, self.derived, self.spans, self.check = needs, derived, spans, check
        self.signatures = {**SIGNATURES, **(DERIVED_SIGNATURES if derived else {}),
                           **(SPAN_SIGNATURES if spans else {})}
        self.status = functools.cache(self._status)

    def __repr__(self) -> str:
        return f"Build({self.name!r})"

    def missing_features(self) -> list[str]:
        return toolchain.cpu_lacks(self.needs)

    def emulated(self) -> bool:
        """Whether this build runs emulated (EXACTNESS_NATIVE=emulate; the AVX-512 build only)."""
        return self is AVX512 and mode() == "emulate"

    def _status(self) -> tuple[ctypes.CDLL | None, Fit]:
        """(the loaded kernel or None, and why): switched off, the ISA missing, no compiler, or
        which self-check failed."""
        if mode() == "0":
            return None, no("EXACTNESS_NATIVE=0 turns the C kernel off")
        missing = self.missing_features()
        if missing and not self.emulated():
            return None, no(f"the CPU lacks {', '.join(missing)}")
        lib, why = self.build()
        if lib is None:
            return None, why
        verdict = self.judged(lib).verdict
        if verdict and self.emulated():
            verdict = yes("emulated AVX-512 (EXACTNESS_NATIVE=emulate): for verification, not "
                          "speed")
        return (lib if verdict else None), verdict

    def library(self):
        """The loaded, self-checked kernel, or None (status() says why)."""
        return self.status()[0]

    def source(self, texts: dict[Path, str] | None = None) -> str:
        """What this build compiles: cpu_kernel.c with the ISA file in place of its #include
        "kernel_isa.h". `texts` replaces a file's text (a planted bug: exactness.suite.mutants)."""
        texts = texts or {}

        def text(path: Path) -> str:
            return texts[path] if path in texts else path.read_text()

        kernel = text(SOURCE)
        if kernel.count(ISA_INCLUDE) != 1:
            raise ValueError(f"{SOURCE.name} must include {ISA_INCLUDE} once")
        return kernel.replace(ISA_INCLUDE, text(self.isa), 1)

    def as_compiled(self, source: str) -> tuple[str | None, list[str], Fit]:
        """(the source the compiler sees, its flags, why): emulated, with avx512_emulated.h in
        place of <immintrin.h> (None where simde-py, which holds SIMDe's headers, is missing)."""
        if not self.emulated():
            return source, self.flags, yes(self.what)
        try:
            import simde_py
        except ImportError:
            return None, [], no("EXACTNESS_NATIVE=emulate needs SIMDe's headers: pip install "
                                "simde-py")
        # SIMDe's headers are found by path, not inlined: their version keys the build
        version = importlib.metadata.version("simde-py")
        return (source.replace("#include <immintrin.h>", EMULATION.read_text(), 1),
                [*EMULATED_FLAGS, f"-I{simde_py.get_include()}", f"-DEXACTNESS_SIMDE={version}"],
                yes("emulated AVX-512"))

    def build(self, source: str | None = None,
              extra_flags: tuple[str, ...] = ()) -> tuple[ctypes.CDLL | None, Fit]:
        """`source` (default: source(); the AMX build's, a planted bug's, a test's stub)
        compiled as this build compiles it (as_compiled), with `extra_flags` too, through the
        toolchain's cache, and loaded with the entry points' signatures set; or None and why
        not. Never raises."""
        source, flags, why = self.as_compiled(self.source() if source is None else source)
        if source is None:
            return None, why
        return toolchain.build(source, [*flags, *extra_flags], f"cpu_kernel_{self.name}.c",
                               self.signatures)

    def judged(self, lib, check: str | None = None,
               build: str | None = None) -> first_run.FirstRun:
        """The library's first run, its self-check (`check`, run on its file), in a child
        process: the verdict, or why the child gave none (first_run.py). The library runs here
        only after."""
        build = build or f"the C kernel ({self.what}, {MODES[mode()]})"
        return first_run.run(lib.exactness_file, lib.exactness_digest, check or self.check,
                             build, toolchain.machine())

    def load_file(self, file: Path, digest: str) -> tuple[ctypes.CDLL | None, Fit]:
        """The compiled library at `file`, loaded if its bytes match `digest` (a child's view of
        a build; build() binds it the same way)."""
        return toolchain.load_file(file, digest, self.signatures)

    def load(self, source: str | None = None, check: bool = True,
             extra_flags: tuple[str, ...] = ()):
        """`source` (default: source()) compiled (cached by its hash and flags) with
        `extra_flags` too, and loaded; None if it does not compile, if its first run dies in a
        child process or, with `check`, if it fails the self-check there. (check=False is for
        planted bugs: exactness.suite.mutants.)"""
        lib, _ = self.build(source, extra_flags)
        if lib is None:
            return None
        first = self.judged(lib)
        return None if first.died or (check and not first.verdict) else lib


_CHECK = f"{__package__}.vnni_check"  # the self-checks first_run's child calls
AVX512 = Build("avx512", "AVX-512 VNNI", CSRC / "kernel_avx512.h",
               ["-O3", "-fopenmp", "-shared", "-fPIC", "-mavx512f", "-mavx512bw", "-mavx512dq",
                "-mavx512vl", "-mavx512cd", "-mavx512vnni"],
               ("avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd", "avx512_vnni"),
               derived=True, spans=True, check=f"{_CHECK}:check_avx512_file")
AVX2 = Build("avx2", "AVX2", CSRC / "kernel_avx2.h",
             ["-O3", "-fopenmp", "-shared", "-fPIC", "-mavx2", "-mfma", "-mf16c"],
             ("avx2", "fma", "f16c"), derived=False, spans=False,
             check=f"{_CHECK}:check_avx2_file")
BUILDS = (AVX512, AVX2)


def instead_of(build: Build) -> Build | None:
    """The build that runs where `build` does not: the first after it in BUILDS that runs here
    natively, or None."""
    later = BUILDS[BUILDS.index(build) + 1:]
    return next((b for b in later if not b.emulated() and b.library() is not None), None)

