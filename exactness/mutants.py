"""Planted bugs: the suite shows it can fail.

A mutant is one small textual change to one function of the package, compiled in memory and
patched in for as long as `applied(mutant)` is open: nothing on disk changes. Each mutant names
the tests that must fail while it is applied (its killers); tests/test_mutants.py checks that
every one of them does.
"""

from __future__ import annotations

import importlib
import inspect
import sys
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(frozen=True)
class Mutant:
    name: str
    target: str  # "package.module:function"
    old: str  # a snippet that occurs exactly once in the function's source ...
    new: str  # ... and what replaces it
    bug: str  # the class of real bug it stands for
    killers: tuple[str, ...]  # "tests/test_x.py::test_y", each must fail under the mutant


def mutated_function(mutant: Mutant):
    """(original, mutated): the target function and its mutated twin, compiled in memory."""
    module_name, func_name = mutant.target.split(":")
    module = importlib.import_module(module_name)
    original = getattr(module, func_name)
    # a @triton.jit kernel keeps its Python function in .fn; its source carries the decorator
    source = textwrap.dedent(inspect.getsource(getattr(original, "fn", original)))
    if source.count(mutant.old) != 1:
        raise ValueError(f"mutant {mutant.name}: {mutant.old!r} occurs "
                         f"{source.count(mutant.old)} times in {mutant.target}, not once")
    namespace = dict(vars(module))
    code = compile(source.replace(mutant.old, mutant.new), f"<mutant {mutant.name}>", "exec")
    exec(code, namespace)  # noqa: S102 - the point: our own source, one planted change
    return original, namespace[func_name]


def _rebind(old, new) -> None:
    """Bind `new` wherever a loaded module binds `old` (module globals, `from x import f` too)."""
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if namespace is None:
            continue
        for name, value in list(namespace.items()):
            if value is old:
                namespace[name] = new


@contextmanager
def applied(mutant: Mutant) -> Iterator[None]:
    """The mutated function in place of the original everywhere, until the block ends.

    Restoring sweeps for the mutant again, so a module first imported inside the block (and so
    bound to the mutant) is put right too.
    """
    original, mutated = mutated_function(mutant)
    _rebind(original, mutated)
    try:
        yield
    finally:
        _rebind(mutated, original)


def from_env() -> Mutant | None:
    """The mutant named by EXACTNESS_MUTANT (how `make mutants` plants one into a whole run)."""
    import os

    name = os.environ.get("EXACTNESS_MUTANT")
    if not name:
        return None
    by_name = {m.name: m for m in CATALOGUE}
    if name not in by_name:
        raise ValueError(f"EXACTNESS_MUTANT={name!r} is not in the catalogue: {sorted(by_name)}")
    return by_name[name]


CATALOGUE = (
    Mutant("nibble-order-reversed", "exactness.formats:unpack_weights",
           "shifts = np.arange(per, dtype=np.int64) * bits",
           "shifts = (per - 1 - np.arange(per, dtype=np.int64)) * bits",
           "nibble order reversed when repacking (llama.cpp, Kimi int4 -> Q4_0)",
           ("tests/test_formats.py::test_unpack_matches_compressed_tensors",
            "tests/test_reference.py::test_reference_matches_oracle",
            "tests/test_vectors.py::test_every_vector")),
    Mutant("rne-as-half-up", "exactness.formats:round_scaled",
           "if rem > half or (rem == half and n & 1):", "if rem >= half:",
           "round half up instead of ties to even",
           ("tests/test_formats.py::test_round_fp32_matches_torch",
            "tests/test_formats.py::test_round_array_matches_scalar_near_ties",
            "tests/test_vectors.py::test_every_vector_through_the_oracle")),
    Mutant("sticky-bit-ignored", "exactness.formats:rne_shift_right",
           "((rem > half) | ((rem == half) & ((n & 1) == 1)))",
           "((rem >= half) & ((n & 1) == 1))",
           "round on the guard bit alone: every value past half an ulp is treated as a tie",
           ("tests/test_formats.py::test_round_array_matches_scalar_near_ties",
            "tests/test_reference.py::test_reference_matches_oracle",
            "tests/test_vectors.py::test_every_vector")),
    Mutant("subnormal-exponent-off-by-one", "exactness.formats:decode",
           "e = fmt.quantum_min + max(field - 1, 0)", "e = fmt.quantum_min + field - 1",
           "subnormal exponent taken as emin - 1",
           ("tests/test_formats.py::test_decode_matches_torch",
            "tests/test_vectors.py::test_every_vector_through_the_oracle")),
    Mutant("subnormal-exponent-off-by-one-vectorized", "exactness.formats:decode_array",
           "e = fmt.quantum_min + (field - 1).clip(min=0)", "e = fmt.quantum_min + field - 1",
           "subnormal exponent taken as emin - 1",
           ("tests/test_formats.py::test_decode_every_16bit_pattern_matches_torch",
            "tests/test_reference.py::test_reference_matches_oracle",
            "tests/test_vectors.py::test_every_vector")),
    Mutant("cpu-limb-shift-dropped", "exactness.kernels.cpu:accumulate",
           "<< (dataflow.LIMB_BITS * (i + j))", "<< (dataflow.LIMB_BITS * i)",
           "a limb's place value lost when combining int8 GEMMs",
           ("tests/test_modules.py::test_cpu_path_matches_reference",
            "tests/test_modules.py::test_vectors_through_the_cpu_path")),
)
