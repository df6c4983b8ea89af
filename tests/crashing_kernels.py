"""C kernels planted with a fault that kills whatever process runs them (tests/test_first_run.py):
each must be refused by name after its first run, in a child process, while the test survives."""

from __future__ import annotations

import re
from pathlib import Path

from exactness.kernels.cpu.vnni_library import AVX512
from exactness.kernels.registry import Fit

# the statement planted, and the signal it raises on x86-64 Linux
CRASHES = {
    "SIGILL": '__asm__ volatile("ud2");',  # an illegal instruction, as real AMX tiles on Zen 4
    "SIGSEGV": "*(volatile int *)16 = 1;",  # a wild pointer
    "SIGFPE": "{ volatile int n = 1, zero = 0; volatile int q = n / zero; (void)q; }",  # idiv
}
HANG = "for (volatile int forever = 1; forever;) {}"

# the C kernel's entry points (its AVX-512 build binds each; the AVX2 build, a part of them): the
# quantization's first pass, the first the self-check calls, holds the planted statement
ENTRY_POINTS = tuple(name for name in AVX512.signatures if name != "row_exponents")


def stub(statement: str) -> str:
    """A library with the C kernel's entry points that runs `statement` when first called."""
    stubs = "".join(f"void {name}(void) {{}}\n" for name in ENTRY_POINTS)
    return f"#include <stdint.h>\n{stubs}int64_t row_exponents(void) {{ {statement} return 0; }}\n"


def planted(source: str, function: str, statement: str) -> str:
    """`source` with `statement` run first thing in the C function `function`."""
    pattern = re.compile(rf"(\b{function}\([^)]*\)\s*\{{)")
    result, count = pattern.subn(lambda m: f"{m[1]} {statement}", source, count=1)
    if count != 1:
        raise ValueError(f"no function {function} in the source")
    return result


def tiles_without_the_tile_state(file: Path, digest: str) -> Fit:
    """In first_run's child: the real AMX library's self-check without asking Linux for the tile
    state first. The first tile instruction faults (SIGILL): on a CPU without AMX, as on one whose
    process was never granted the state."""
    from exactness.kernels.cpu import amx_check, amx_library, vnni_library

    lib, why = vnni_library.AVX512.load_file(file, digest)
    return amx_check.self_check(amx_library.bind(lib)) if lib is not None else why


def environment_seen(file: Path, digest: str) -> Fit:
    """In first_run's child: a passing verdict that says what EXACTNESS_PROBE held there and in
    which folder the child ran (the child must see its caller's, at the call)."""
    import os

    return Fit(True, f"{os.environ.get('EXACTNESS_PROBE')} in {os.getcwd()}")
