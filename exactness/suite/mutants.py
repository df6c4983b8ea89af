"""Planted bugs: the suite shows it can fail.

A mutant is one small textual change to one function of the package, compiled in memory and
patched in for as long as `applied(mutant)` is open: nothing on disk changes. Each mutant names
the tests that must fail while it is applied (its killers), as pytest node ids (parametrized ids
too); `judge` runs them through pytest itself, in this process, with the mutant applied. A kill
is a test failing in its call; a killer not collected, erring in setup or skipping is the
harness's error, never a kill. tests/test_mutants.py checks every mutant.
"""

from __future__ import annotations

import importlib
import inspect
import sys
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from .. import dataflow, formats, kimi, modules, moe, ops, quantize
from ..kernels import wide
from ..kernels.cpu import activations, amx_library, gemm, vnni_calls, vnni_layout, vnni_library
from ..kernels.triton import folded as triton_folded
from ..kernels.triton import group as triton_group
from ..kernels.triton import grouped as triton_grouped
from ..kernels.triton import integers as triton_integers
from ..kernels.triton import layer as triton_layer
from ..kernels.triton import quantize as triton_quantize
from ..kernels.triton import scales as triton_scales
from ..kernels.triton import wide as triton_wide


@dataclass(frozen=True)
class Mutant:
    name: str
    target: str  # "package.module:function", or C_KERNEL (the C source)
    old: str  # a snippet that occurs exactly once in the function's (or file's) source ...
    new: str  # ... and what replaces it
    bug: str  # the class of real bug it stands for
    killers: tuple[str, ...]  # "tests/test_x.py::test_y": the first must fail under the mutant
    every_killer: bool = False  # the agreement tests (oracle, reference, peers): each must fail


def _resolve(target: str):
    """(owner, name, original) of "package.module:function" or "package.module:Class.method"."""
    module_name, path = target.split(":")
    owner = importlib.import_module(module_name)
    *outer, name = path.split(".")
    for part in outer:
        owner = getattr(owner, part)
    return owner, name, getattr(owner, name)


def _planted(source: str, mutant: Mutant) -> str:
    """`source` with the mutant's one change; refuses a snippet that does not occur exactly once."""
    if source.count(mutant.old) != 1:
        raise ValueError(f"mutant {mutant.name}: {mutant.old!r} occurs "
                         f"{source.count(mutant.old)} times in {mutant.target}, not once")
    return source.replace(mutant.old, mutant.new)


def mutated_function(mutant: Mutant):
    """(original, mutated): the target function and its mutated twin, compiled in memory."""
    owner, name, original = _resolve(mutant.target)
    module = sys.modules[mutant.target.split(":")[0]]
    # a @triton.jit kernel keeps its Python function in .fn; its source carries the decorator
    source = textwrap.dedent(inspect.getsource(getattr(original, "fn", original)))
    namespace = dict(vars(module))
    code = compile(_planted(source, mutant), f"<mutant {mutant.name}>", "exec")
    exec(code, namespace)  # noqa: S102 - the point: our own source, one planted change
    return original, namespace[name]


def _rebind(old, new) -> None:
    """Bind `new` wherever a loaded module binds `old` (module globals, `from x import f` too)."""
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if namespace is None:
            continue
        for name, value in list(namespace.items()):
            if value is old:
                namespace[name] = new


def mutated_c_kernel(mutant: Mutant):
    """The C kernel compiled from the mutated source, its start-up self-check skipped (the
    self-check would refuse it: tests/test_mutants.py shows it does)."""
    lib = vnni_library.load(_planted(vnni_library.SOURCE.read_text(), mutant), check=False)
    if lib is None:
        raise RuntimeError(f"mutant {mutant.name}: the mutated C kernel does not compile")
    return lib


def mutated_amx_kernel(mutant: Mutant):
    """The AMX kernel built with the mutated cpu_amx.c, its self-check skipped (as above)."""
    lib, why = amx_library.load(_planted(amx_library.SOURCE.read_text(), mutant), check=False)
    if lib is None:
        raise RuntimeError(f"mutant {mutant.name}: the mutated AMX kernel does not build or "
                           f"run: {why.why}")
    return lib


def at(function) -> str:
    """A mutant's target, "module:qualname", from the function or method itself (a Triton
    kernel's own function): a function moved is found where it went, and one gone fails the
    import of this catalogue, never a mutant silently."""
    function = getattr(function, "fn", function)  # triton.jit wraps the function
    return f"{function.__module__}:{function.__qualname__}"


def triton_at(module, name: str) -> str:
    """at() of a function of a Triton module; where Triton is missing (its kernels are not
    defined then), the name in that module, whose mutants do not run there."""
    if module.triton is None:
        return f"{module.__name__}:{name}"
    return at(getattr(module, name))


def source(module) -> str:
    """The C source a kernel module builds (its SOURCE), relative to the repository."""
    return module.SOURCE.resolve().relative_to(ROOT).as_posix()


def runs_here(mutant: Mutant) -> bool:
    """C mutants, and those of the code only the C kernel runs, need the C kernel (AVX-512 VNNI
    and a compiler); the AMX kernel's, the AMX kernel (real or emulated tiles)."""
    if mutant.target == AMX_KERNEL:
        return amx_library.library() is not None
    needs_c = mutant.target == C_KERNEL or mutant.target.split(":")[0] in C_ONLY
    return not needs_c or vnni_library.library() is not None


@contextmanager
def applied(mutant: Mutant) -> Iterator[None]:
    """The mutated function (or C kernel) in place of the original everywhere, until the block
    ends.

    Restoring sweeps for the mutant again, so a module first imported inside the block (and so
    bound to the mutant) is put right too.
    """
    vnni_library.library()  # load and self-check the C kernel with the real code, as at start-up
    if mutant.target in (C_KERNEL, AMX_KERNEL):
        module, build = ((amx_library, mutated_amx_kernel) if mutant.target == AMX_KERNEL
                         else (vnni_library, mutated_c_kernel))
        module.library()  # the real one first, as above
        lib, original_library = build(mutant), module.library
        module.library = lambda: lib
        try:
            yield
        finally:
            module.library = original_library
        return
    original, mutated = mutated_function(mutant)
    owner, name, _ = _resolve(mutant.target)
    if isinstance(owner, type):  # a method: it lives in its class
        setattr(owner, name, mutated)
    else:
        _rebind(original, mutated)
    try:
        yield
    finally:
        if isinstance(owner, type):
            setattr(owner, name, original)
        else:
            _rebind(mutated, original)


ROOT = Path(__file__).resolve().parents[2]  # the repository: killers are its tests' node ids


class _Outcomes:
    """A pytest plugin: each test's outcome in the call phase (setup and teardown failures are
    the harness's errors, never kills)."""

    def __init__(self):
        self.calls: dict[str, str] = {}  # node id -> "passed" | "failed" | "skipped"
        self.errors: list[str] = []  # node ids whose setup or teardown failed
        self.collected: list[str] = []
        self.report = ""  # what pytest printed

    def pytest_collection_finish(self, session):
        self.collected = [item.nodeid for item in session.items]

    def pytest_runtest_logreport(self, report):
        if report.when == "call":
            self.calls[report.nodeid] = report.outcome
        elif report.failed:
            self.errors.append(report.nodeid)
        elif report.skipped and report.when == "setup":
            self.calls[report.nodeid] = "skipped"


def run_tests(node_ids, stop_at_first_failure: bool = False, collect_only: bool = False,
              extra: tuple[str, ...] = ()):
    """The tests `node_ids` ("tests/test_x.py::test_y[param]") run by pytest itself, in this
    process (so a mutant applied here is in them), with `extra` options: (pytest's exit code,
    _Outcomes)."""
    import contextlib
    import io

    import pytest

    outcomes = _Outcomes()
    args = [str(ROOT / node) for node in node_ids]
    options = ["-q", "-p", "no:cacheprovider", f"--rootdir={ROOT}", "-o", "addopts=",
               "--tb=line", "-W", "ignore::pytest.PytestAssertRewriteWarning",
               *(["-x"] if stop_at_first_failure else []),
               *(["--collect-only"] if collect_only else []), *extra]
    with contextlib.redirect_stdout(io.StringIO()) as report:  # the caller's table stays clean
        code = pytest.main([*options, *args], plugins=[outcomes])
    outcomes.report = report.getvalue()
    return int(code), outcomes


@dataclass
class Verdict:
    """A mutant's result: killed (by which test), survived, or an error of the harness (a killer
    that is not collected, fails in setup, or skips): never a kill."""

    mutant: str
    killed_by: str | None
    survivors: list[str]
    error: str | None
    failed: list[str] = field(default_factory=list)  # every killer that failed (all run)


def judge(mutant: Mutant, killers, every: bool = False, all_killers: bool = False) -> Verdict:
    """Run `killers` under the mutant: the first must fail (with `every`, each must); with
    `all_killers` each runs, to count how many fail (the kill's strength)."""
    with applied(mutant):
        code, outcomes = run_tests(killers, stop_at_first_failure=not (every or all_killers))
    ids = {node: _collected_as(node, outcomes.collected) for node in killers}
    missing = [node for node, found in ids.items() if found is None]
    failed = [node for node, found in ids.items() if outcomes.calls.get(found) == "failed"]
    ran = [node for node, found in ids.items() if found in outcomes.calls]
    error = None
    if missing or outcomes.errors or code not in (0, 1):
        error = (f"pytest exit {code}; not collected: {missing}; "
                 f"setup/teardown errors: {outcomes.errors}; {outcomes.report[-600:]}")
    skipped = [node for node in ran if outcomes.calls[ids[node]] == "skipped"]
    if skipped and not failed:
        error = f"skipped (not a kill): {skipped}"
    survivors = [node for node in ran if node not in failed]
    killed = (failed and not survivors) if every else bool(failed)
    return Verdict(mutant.name, failed[0] if killed and not error else None, survivors, error,
                   failed)


def _collected_as(node: str, collected: list[str]) -> str | None:
    """The collected node id that `node` (relative to the repository) names."""
    return next((c for c in collected if c == node or c.endswith("/" + node)), None)


@dataclass
class Outcome:
    mutant: str
    killed_by: str | None
    error: str | None
    seconds_to_first: float | None
    seconds: float
    counterexample: str | None
    size: str | None  # M x K x N of the shrunk counterexample
    replays_clean: bool | None  # repro of that file against the unmutated code passes
    strength: int = 0  # how many of its killers failed
    killers: int = 0  # how many it names


def hunt(mutant: Mutant, directory: Path) -> Outcome:
    """Run every killer of the mutant, counting those that fail (the kill's strength); keep the
    shrunk counterexample of the last."""
    import importlib as _importlib
    import os
    import shutil
    import time

    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    os.environ["EXACTNESS_COUNTEREXAMPLES"] = str(directory)
    start, began = time.perf_counter(), time.time()
    verdict = judge(mutant, mutant.killers, all_killers=True)
    seconds = time.perf_counter() - start
    files = sorted(directory.glob("*.json"), key=lambda f: f.stat().st_mtime_ns)
    first = files[0].stat().st_mtime - began if files and verdict.killed_by else None
    kept, size, clean = None, None, None
    if files:  # Hypothesis replays the shrunk example last: the newest file is the minimal one
        from .counterexamples import read
        from .repro import replay

        kept = directory.parent / f"{mutant.name}.json"
        shutil.copy(files[-1], kept)
        m, k, n = read(kept)[0].shape
        size = f"{m}x{k}x{n}"
        clean = replay(str(kept), out=open(os.devnull, "w")) == 0  # noqa: SIM115
        for f in files:
            f.unlink()
    shutil.rmtree(directory, ignore_errors=True)
    _importlib.invalidate_caches()
    return Outcome(mutant.name, verdict.killed_by, verdict.error,
                   None if first is None else round(first, 2), round(seconds, 2),
                   str(kept) if kept else None, size, clean, len(verdict.failed),
                   len(mutant.killers))


def main(argv: list[str] | None = None) -> int:
    """`make mutants`: every mutant against the suite's properties (ci profile), one table;
    "kills" counts the killers that fail, and a mutant only one test kills is flagged (weak)."""
    import argparse
    import json
    import os
    import statistics
    from dataclasses import asdict
    from pathlib import Path

    parser = argparse.ArgumentParser(prog="python -m exactness mutants")
    parser.add_argument("--only", action="append", help="run only these mutants")
    parser.add_argument("--out", default="reports/mutants")
    args = parser.parse_args(argv)
    os.environ.setdefault("HYPOTHESIS_PROFILE", "ci")
    from . import profiles

    profiles.load()

    out = Path(args.out)
    outcomes = []
    print(f"{'mutant':<42} {'verdict':<9} {'kills':>5} {'first cex s':>11} {'total s':>8}  "
          f"{'size':<12} killed by")
    for mutant in CATALOGUE:
        if args.only and mutant.name not in args.only:
            continue
        if not runs_here(mutant):
            print(f"{mutant.name:<42} skipped   (no C kernel here: no AVX-512 VNNI or compiler)")
            continue
        o = hunt(mutant, out / mutant.name)
        outcomes.append(o)
        verdict = "killed" if o.killed_by else ("ERROR" if o.error else "SURVIVED")
        if o.killed_by and o.replays_clean is False:
            verdict = "killed*"  # its counterexample does not replay clean unmutated
        first = "-" if o.seconds_to_first is None else f"{o.seconds_to_first:.2f}"
        kills = f"{o.strength}/{o.killers}" + ("!" if o.killed_by and o.strength == 1 else "")
        print(f"{o.mutant:<42} {verdict:<9} {kills:>5} {first:>11} {o.seconds:>8.2f}  "
              f"{o.size or '-':<12} {o.killed_by or o.error or '-'}", flush=True)
    killed = [o for o in outcomes if o.killed_by]
    firsts = [o.seconds_to_first for o in killed if o.seconds_to_first is not None]
    ok = len(killed) == len(outcomes) and all(o.replays_clean is not False for o in killed)
    print(f"\n{len(killed)}/{len(outcomes)} killed"
          f"{f', median time to the first counterexample {statistics.median(firsts):.2f} s' if firsts else ''}"  # noqa: E501
          f"; counterexamples in {out}/")
    weak = [o.mutant for o in killed if o.strength == 1]
    if weak:
        print(f"weak (one test kills it, marked !): {len(weak)}: {', '.join(weak)}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "mutants.json").write_text(json.dumps([asdict(o) for o in outcomes], indent=1))
    return 0 if ok else 1


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


ORACLE_VECTORS = "tests/test_vectors.py::test_every_vector_through_the_oracle"
VECTORS = "tests/test_vectors.py::test_every_vector"
AGREEMENT = "tests/test_reference.py::test_reference_matches_oracle"


def equivalence(path: str) -> str:
    """The property: `path` (a backend or a kernel) against the reference."""
    return f"tests/test_modules.py::test_path_matches_reference[{path}]"


def vectors(path: str) -> str:
    return f"tests/test_modules.py::test_vectors_through_the_layer[{path}]"


CPU, CPU_VECTORS = equivalence("vnni-limbs"), vectors("vnni-limbs")  # the C kernel
GEMM, GEMM_VECTORS = equivalence("int8-gemm"), vectors("int8-gemm")
TRITON, TRITON_VECTORS = equivalence("triton-group"), vectors("triton-group")
# the CPU and the Triton device compared (make verify's devices stage)
DEVICES_LAYER = ("tests/test_devices.py::"
                 "test_a_layer_gives_the_same_bits_on_the_cpu_and_the_triton_device")
DEVICES_MOE = "tests/test_devices.py::test_the_moe_experts_give_the_same_bits_on_both"
FOLDED = "tests/test_modules.py::test_triton_folded_path_matches_reference"
FOLDED_VECTORS = vectors("triton-folded")
SPANS, SPANS_VECTORS = equivalence("vnni-spans"), vectors("vnni-spans")
KERNEL = triton_at(triton_group, "exact_group_kernel")
C_KERNEL = source(vnni_library)
AMX_KERNEL = source(amx_library)
# the modules whose code only the C kernel runs: their mutants need it built
C_ONLY = (vnni_layout.__name__, vnni_calls.__name__)
AMX, AMX_VECTORS = equivalence("amx"), vectors("amx")
BATCH = "tests/test_modules.py::test_batch_and_permutation_invariance"
QUANTIZE_SLICES = "tests/test_modules.py::test_the_quantize_kernel_at_any_slicing_and_tile"
SPANS_EDGE = "tests/test_modules.py::test_span_kernel_at_the_int32_edge"
LIMBS_32 = "tests/test_proofs.py::test_activation_limbs_recombine_at_every_width[32]"
CAPTURE = "tests/test_capture.py::"
SLOW_ROWS = CAPTURE + "test_the_device_slow_rows_are_exact_at_every_spread"
TIE = CAPTURE + "test_a_tie_broken_by_a_far_group_rounds_away_from_it"
ACT32_KERNELS = "tests/test_act32.py::test_a_kernel_holds_32_bits_or_refuses_them_by_name"
SPANS_CHAIN = "tests/test_modules.py::test_span_bounds_attacked_one_chain_at_a_time"
GROUPED_KERNEL = triton_at(triton_grouped, "grouped_kernel")


def grouped(path: str) -> str:
    """The property: a grouped kernel's projection against the reference."""
    return f"tests/test_moe.py::test_grouped_projection_matches_reference[{path}]"


def moe_block(backend: str) -> str:
    """The property: the grouped MoE block against transformers' per-expert loop."""
    return f"tests/test_moe.py::test_grouped_experts_match_transformers_loop[{backend}]"


CATALOGUE = (
    # --- packing and decoding
    Mutant("nibble-order-reversed", at(formats.unpack_weights),
           "shifts = np.arange(per, dtype=np.int64) * bits",
           "shifts = (per - 1 - np.arange(per, dtype=np.int64)) * bits",
           "nibble order reversed when repacking (llama.cpp, Kimi int4 -> Q4_0)",
           (AGREEMENT, "tests/test_formats.py::test_unpack_matches_compressed_tensors",
            VECTORS), every_killer=True),
    Mutant("int4-read-as-twos-complement", at(formats.unpack_weights),
           "return (fields - 2 ** (bits - 1))",
           "return (fields - ((fields >> (bits - 1)) << bits))",
           "int4 read as another 4-bit type (vLLM batched Marlin's hard-coded type id)",
           (AGREEMENT, "tests/test_formats.py::test_unpack_matches_compressed_tensors")),
    Mutant("kernel-nibble-order-reversed", KERNEL,
           "fields = tl.arange(0, per_word) * W_BITS",
           "fields = (per_word - 1 - tl.arange(0, per_word)) * W_BITS",
           "nibble order reversed in the kernel's unpack", (TRITON, TRITON_VECTORS)),
    Mutant("kernel-high-nibble-sign-extended", triton_at(triton_integers, "unpack_fields"),
           "((words[:, :, None] >> shifts[None, None, :]) & ((1 << W_BITS) - 1))",
           "(words[:, :, None] >> shifts[None, None, :])",
           "sign of the high nibble kept by an arithmetic shift (compressed-tensors review)",
           (TRITON, TRITON_VECTORS, FOLDED)),
    Mutant("subnormal-exponent-off-by-one", at(formats.decode),
           "e = fmt.quantum_min + max(field - 1, 0)", "e = fmt.quantum_min + field - 1",
           "subnormal exponent taken as emin - 1",
           (ORACLE_VECTORS, "tests/test_formats.py::test_decode_matches_torch"),
           every_killer=True),
    Mutant("subnormal-exponent-off-by-one-vectorized", at(formats.decode_array),
           "e = fmt.quantum_min + (field - 1).clip(min=0)", "e = fmt.quantum_min + field - 1",
           "subnormal exponent taken as emin - 1",
           (AGREEMENT, "tests/test_formats.py::test_decode_every_16bit_pattern_matches_torch",
            VECTORS), every_killer=True),
    # --- group scales and tiles
    Mutant("kernel-scale-of-the-previous-group", KERNEL,
           "f = tl.load(f_ptr + offs_n * stride_fn + g, mask=mask_n, other=0)",
           "f = tl.load(f_ptr + offs_n * stride_fn + tl.maximum(g - 1, 0), mask=mask_n, other=0)",
           "group g's scale applied to group g + 1", (TRITON, TRITON_VECTORS, DEVICES_LAYER)),
    Mutant("tile-of-64-with-one-scale", at(gemm.fold),
           "scale[:, :, None]", "scale[:, (torch.arange(k // GROUP_SIZE) // 2) * 2, None]",
           "one group's scale applied to a whole tile wider than the group (vLLM triton w4a16)",
           (GEMM, GEMM_VECTORS)),
    Mutant("vnni-scale-of-the-neighbour-group", at(vnni_layout.NativeWeights.__init__),
           "pad(factor.to(torch.int32)", "pad(factor.roll(1, dims=1).to(torch.int32)",
           "group g's scale applied to group g + 1 in the derived layout (the span kernel's)",
           (SPANS, SPANS_VECTORS)),
    Mutant("vnni-rows-interleaved-wrong", at(vnni_layout.NativeWeights.__init__),
           ".permute(0, 2, 1, 3)", ".permute(0, 2, 1, 3).flip(2)",
           "weight rows swapped inside a 16-row vector block of the derived layout",
           (SPANS, SPANS_VECTORS)),
    Mutant("kernel-tail-group-dropped", KERNEL, "for g in range(g_start, g_end):",
           "for g in range(g_start, g_end - 1):", "the last group of each slice of K never "
           "accumulated", (TRITON, TRITON_VECTORS)),
    Mutant("kernel-k-slice-overwrites", KERNEL,
           "tl.atomic_add(t_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(tl.int64),\n"
           "                      mask=mask_m[:, None] & mask_n[None, :], sem=\"relaxed\")",
           "tl.store(t_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(tl.int64),\n"
           "                 mask=mask_m[:, None] & mask_n[None, :])",
           "split K: a slice's partial T stored over the others' instead of added to them",
           (TRITON, "tests/test_modules.py::test_the_group_kernels_k_split_changes_no_bit")),
    Mutant("kernel-limb-offset-in-every-slice", KERNEL,
           "tl.where(g_start == 0, LIMB_OFFSET, 0)", "LIMB_OFFSET",
           "split K: the limb offset's sum added by every slice of K instead of the first",
           (TRITON, "tests/test_modules.py::test_the_group_kernels_k_split_changes_no_bit")),
    Mutant("kernel-offset-sum-of-biased-fields", triton_at(triton_scales, "scales_kernel"),
           "r += tl.sum(q_sum.to(tl.int64) * f.to(tl.int64), axis=1)",
           "r += tl.sum((q_sum + 256).to(tl.int64) * f.to(tl.int64), axis=1)",
           "the limb offset's sum taken over the stored fields (q + 8), not q",
           (TRITON, FOLDED)),
    # --- the device's slow rows and NaN rows, and host reads planted in a GPU forward
    Mutant("device-multiword-top-part-dropped", triton_at(triton_wide, "add_shifted"),
           "+ tl.where(word == q + 2, high >> 32, 0)", "+ 0",
           "a shifted term's top part (a negative term's sign) not added to its word",
           (SLOW_ROWS + "[triton-group]", TRITON)),
    Mutant("device-multiword-sticky-dropped", triton_at(triton_wide, "wide_round"),
           "| ((below & 3) != 0).to(tl.int64) | sticky", "",
           "the bits below the 62 kept dropped, not folded into a sticky bit: a tie broken "
           "by a far group rounds to even",
           (TIE + "[1-triton-group]", TIE + "[-1-triton-grouped]")),
    Mutant("device-nan-rows-not-written", triton_at(triton_wide, "finish_kernel"),
           "store_nan(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], nan,",
           "store_nan(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], nan & False,",
           "a non-finite row of x computed as if finite, not given the canonical NaN",
           ("tests/test_errors.py::test_layer_non_finite_x_gives_nan_rows_or_raises_when_strict"
            "[triton-group]",)),
    Mutant("host-read-in-the-layer-forward", at(modules.ExactLayer.forward),
           "y = ops.linear(x2.detach(),",
           "x2 = x2[:int(x2.shape[0] + 0 * x2.abs().max())]; y = ops.linear(x2.detach(),",
           "an .item() in the forward: a CUDA graph cannot capture it, a trace breaks",
           (CAPTURE + "test_the_layer_forward_runs_on_fake_cuda_tensors[gate-up-16]",
            CAPTURE + "test_the_layer_graph_holds_its_op_and_shape_ops_alone[16]")),
    Mutant("host-read-in-the-moe-call", at(moe._on_device),
           "args = (x.detach(), top_k_index,",
           "x = x[:int(x.shape[0] + 0 * top_k_index.max())]; args = (x.detach(), top_k_index,",
           "a read of the routing in the MoE call: a CUDA graph cannot capture it",
           (CAPTURE + "test_the_moe_call_runs_on_fake_cuda_tensors[1-16]",
            CAPTURE + "test_the_moe_graph_holds_its_op_and_shape_ops_alone")),
    Mutant("host-read-in-the-triton-launches", at(triton_layer._TritonKernel.launches),
           "args = (weights.packed, factor, row_sums, emin, weights.bits)",
           "args = (weights.packed, factor, row_sums, emin, weights.bits + 0 * int(flags.max()))",
           "a read of the certificate's flags between the launches (as the forward made before)",
           (CAPTURE + "test_the_op_bodies_read_nothing_back[16]",
            "tests/test_reliability.py::test_the_triton_forward_reads_nothing_back")),
    Mutant("host-read-in-the-moe-op", at(moe.device_experts),
           "routing = route(top_k_index, experts, check=False)",
           "routing = route(top_k_index, experts, check=top_k_index.max().item() < 0)",
           "the routing's ids checked on the host inside the op: a read per call",
           (CAPTURE + "test_the_op_bodies_read_nothing_back[16]",)),
    Mutant("kernel-int4-word-stride-hard-coded", KERNEL,
           "(g * W_BITS + offs_w)", "(g * 4 + offs_w)",
           "a group's word offset hard-coded for int4: 8-bit weights read from the wrong words",
           ("tests/test_modules.py::test_the_triton_kernels_at_8_bit_weights[triton-group]",
            TRITON)),
    # the Triton kernels at 32-bit activations: four limbs, P' in two int32 halves
    Mutant("kernel-32-top-limb-from-the-third", triton_at(triton_group, "group_sums"),
           "limb_dot(a_ptrs, 3 * stride_limb", "limb_dot(a_ptrs, 2 * stride_limb",
           "the top activation limb read from the plane of the one below it (a limb dropped)",
           (TRITON_VECTORS, TRITON, ACT32_KERNELS + "[triton-group]")),
    Mutant("kernel-32-high-half-place-off", triton_at(triton_group, "group_term"),
           "f.to(COMBINE_ACC)[None, :]) << 16", "f.to(COMBINE_ACC)[None, :]) << 8",
           "the high pair of limbs at 2**8, not 2**16: a limb's place value off by one",
           (TRITON_VECTORS, TRITON, ACT32_KERNELS + "[triton-group]")),
    Mutant("kernel-32-group-sum-in-int32", triton_at(triton_group, "group_term"),
           "term += (p_hi.to(COMBINE_ACC) * f.to(COMBINE_ACC)[None, :]) << 16",
           "term += (p_hi << 16).to(COMBINE_ACC) * f.to(COMBINE_ACC)[None, :]",
           "a group's high half placed in int32, where 32-bit activations need int64: it wraps",
           (TRITON_VECTORS, TRITON, ACT32_KERNELS + "[triton-group]")),
    # --- accumulators
    Mutant("kernel-int32-combine", triton_at(triton_group, "group_constants"),
           "COMBINE_ACC=TRITON_INT[dataflow.COMBINE_ACC_BITS]",
           "COMBINE_ACC=TRITON_INT[32]",
           "an int32 accumulator where the contract needs int64",
           (TRITON, "tests/test_modules.py::test_full_kimi_sizes[triton-16]")),
    Mutant("cpu-limb-shift-dropped", at(gemm.accumulate),
           "<< (dataflow.LIMB_BITS * (i + j))", "<< (dataflow.LIMB_BITS * i)",
           "a limb's place value lost when combining int8 GEMMs", (GEMM, GEMM_VECTORS)),
    Mutant("wide-int32-group-sum", at(wide.linear_rows),
           "{32: torch.int32, 64: torch.int64}", "{32: torch.int32, 64: torch.int32}",
           "an int32 group sum where 32-bit activations need int64",
           (equivalence("wide"), vectors("wide"))),
    Mutant("float64-half-place-value-lost", at(gemm.accumulate_float64),
           "(parts[0] << dataflow.HALF_BITS)", "parts[0]",
           "the high half's place value lost when recombining the float64 GEMMs",
           (equivalence("float64-gemm"), vectors("float64-gemm"))),
    Mutant("act-limb-dropped", at(dataflow.act_limbs),
           "return -(-act_qmax(act_bits).bit_length() // LIMB_BITS)",
           "return min(3, -(-act_qmax(act_bits).bit_length() // LIMB_BITS))",
           "32-bit activations split into one limb too few",
           (LIMBS_32, "tests/test_proofs.py::test_the_limb_split_is_proved_at_every_width[32]")),
    Mutant("act-limb-place-value-off-by-one", at(dataflow.offset_for_limbs),
           "2 ** (LIMB_BITS * (limbs - 1))", "2 ** (LIMB_BITS * (limbs - 1) - 1)",
           "a limb's place value off by one bit in the offset that centres the limbs",
           (LIMBS_32, GEMM)),
    Mutant("limb-saturates", at(dataflow.int8_digits),
           "low = ((rest + 128) & 255) - 128", "low = rest.clamp(-128, 127)",
           "saturating instead of splitting into limbs", (GEMM, equivalence("int64-matmul"))),
    Mutant("overflow-wraps-instead-of-inf", at(formats.round_scaled_array),
           "xp.where(field >= fmt.exp_max_field, fmt.inf_bits,\n"
           "                 (field << fmt.mant_bits)",
           "xp.where(field >= 10**9, fmt.inf_bits,\n                 (field << fmt.mant_bits)",
           "an exponent past the format wraps instead of rounding to inf",
           (AGREEMENT, VECTORS)),
    # --- rounding
    Mutant("rne-as-half-up", at(formats.round_scaled),
           "if rem > half or (rem == half and n & 1):", "if rem >= half:",
           "round half up instead of ties to even",
           (ORACLE_VECTORS, "tests/test_formats.py::test_round_fp32_matches_torch",
            "tests/test_formats.py::test_round_array_matches_scalar_near_ties"),
           every_killer=True),
    Mutant("rne-as-half-away", at(formats.rne_shift_right),
           "((rem > half) | ((rem == half) & ((n & 1) == 1)))", "(rem >= half)",
           "round half away from zero instead of ties to even",
           (AGREEMENT, "tests/test_formats.py::test_round_array_matches_scalar_near_ties")),
    Mutant("rne-as-truncation", at(formats.rne_shift_right),
           "return n + ((s > 0) &", "return n + (s < 0) * (",
           "truncation instead of rounding", (AGREEMENT, VECTORS)),
    Mutant("sticky-bit-ignored", at(formats.rne_shift_right),
           "((rem > half) | ((rem == half) & ((n & 1) == 1)))",
           "((rem >= half) & ((n & 1) == 1))",
           "round on the guard bit alone: every value past half an ulp is treated as a tie",
           (AGREEMENT, "tests/test_formats.py::test_round_array_matches_scalar_near_ties",
            VECTORS), every_killer=True),
    Mutant("double-rounding-through-fp32", at(gemm.forward),
           "return bits_to_tensor(round_scaled_array(t, e, out_format), out_format)",
           "return torch.ldexp(t.double(), e.double()).float().to(x.dtype)",
           "the exact integer rounded to fp32, then to bf16 (Marlin epilogue, OpenVINO)",
           ("tests/test_modules.py::test_final_rounding_near_ties[int8-gemm]", GEMM)),
    # --- activation quantization
    Mutant("activation-exponent-too-small-clamped", at(activations.quantize_rows),
           "return torch.round(scaled).to(torch.int32), e_r",
           "qmax = 2 ** (act_bits - 1) - 1\n"
           "    return torch.round(scaled * 2).clamp(-qmax, qmax).to(torch.int32), e_r - 1",
           "activation scale exponent one too small, the overflow clamped",
           (GEMM, GEMM_VECTORS)),
    Mutant("activation-exponent-too-large", at(activations.quantize_rows),
           "return torch.round(scaled).to(torch.int32), e_r",
           "return torch.round(scaled / 2).to(torch.int32), e_r + 1",
           "activation scale exponent one too large: a bit of precision lost",
           (GEMM, GEMM_VECTORS)),
    Mutant("negative-zero-for-exact-zero", at(gemm.forward),
           "return bits_to_tensor(round_scaled_array(t, e, out_format), out_format)",
           "return bits_to_tensor(torch.where(t == 0, out_format.sign_bit, "
           "round_scaled_array(t, e, out_format)), out_format)",
           "-0.0 for an exact zero", (GEMM_VECTORS, GEMM)),
    Mutant("row-scale-from-the-batch", at(activations.quantize_rows),
           "amax = x.abs().amax(dim=1, keepdim=True)",
           "amax = x.abs().amax().expand(x.shape[0], 1)",
           "one activation scale for the whole batch: a row's bits depend on the others",
           (GEMM, GEMM_VECTORS)),
    # --- the Triton kernels' quantization and rounding
    Mutant("kernel-rounding-ties-away", triton_at(triton_integers, "rne_shift_right"),
           "((rem == half) & ((n & 1) == 1))", "(rem == half)",
           "the Triton epilogue's ties rounded away from zero instead of to even",
           ("tests/test_modules.py::test_final_rounding_near_ties[triton-group]", TRITON)),
    Mutant("kernel-activation-exponent-too-small", triton_at(triton_quantize, "quantize_kernel"),
           "ae + t0 + tl.where(fits, 0, 1)", "ae + t0",
           "the Triton quantization's row exponent one too small where the maximum needs the next",
           (TRITON, TRITON_VECTORS)),
    Mutant("kernel-row-exponent-of-the-slice", triton_at(triton_quantize, "quantize_kernel"),
           "for k0 in tl.range(0, K, BLOCK_K, loop_unroll_factor=4):",
           "for k0 in tl.range(tl.program_id(1) * slice_k,"
           " tl.minimum(K, (tl.program_id(1) + 1) * slice_k), BLOCK_K, loop_unroll_factor=4):",
           "each slice of K of the Triton quantization takes its rows' exponents from its own "
           "slice, not the whole row", (QUANTIZE_SLICES,)),
    Mutant("kernel-infinity-not-flagged", triton_at(triton_quantize, "quantize_kernel"),
           "(row_max >= ((1 << EXP) - 1) << MANT)", "(row_max > ((1 << EXP) - 1) << MANT)",
           "the Triton quantization flags rows holding NaN but not rows holding an infinity, "
           "which then goes through the grouped MoE call as a number",
           ("tests/test_errors.py::test_layer_non_finite_x_gives_nan_rows_or_raises_when_strict"
            "[triton-group]",
            "tests/test_moe.py::test_a_non_finite_input_gives_the_loops_nan_rows_or_its_error"
            "[triton]")),
    Mutant("launch-blocks-read-the-first-rows",
           at(triton_layer._TritonKernel.launches),
           "quantize(rows, weights.act_bits)",
           "quantize(x[:len(rows)], weights.act_bits)",
           "each block of rows launched to keep offsets in int32 reads the first block's rows "
           "(the block's offset not carried into its launch)",
           ("tests/test_modules.py::test_launches_in_blocks_of_rows_match_reference",)),
    Mutant("kernel-output-sign-dropped", triton_at(triton_integers, "round_scaled"),
           "bits = bits | tl.where(m < 0, (a * 0 + 1) << (MANT + EXP), 0)", "bits = bits",
           "the sign bit not set on negative outputs in the Triton epilogue",
           (TRITON_VECTORS, TRITON)),
    # --- the GPU's folded path (many rows): fold_kernel's digits, combine_kernel's place values
    Mutant("kernel-folded-digit-carry-lost", triton_at(triton_folded, "fold_kernel"),
           "v = (v - low) >> 8", "v = v >> 8",
           "a folded weight's next digit taken without the borrow of a negative low digit",
           (FOLDED, FOLDED_VECTORS)),
    Mutant("kernel-folded-weight-digit-place-dropped",
           triton_at(triton_folded, "combine_kernel"),
           "t += z.to(tl.int64) << (8 * (i + j))", "t += z.to(tl.int64) << (8 * i)",
           "a weight digit's place value lost when combining the limb GEMMs",
           (FOLDED, FOLDED_VECTORS)),
    # --- the layer as serving stacks drive it (issue 20)
    Mutant("int-mm-k-not-sliced", at(dataflow.int_mm_chunk),
           "return min(k, INT_MM_CHUNK)", "return k",
           "all of K summed in one int32 GEMM: past 2**17 products it wraps (a sign flip)",
           ("tests/test_reliability.py::"
            "test_the_int8_gemm_path_is_exact_past_two_to_the_17_products",
            "tests/test_proofs.py::test_the_int8_gemms_are_sliced_where_all_of_k_would_wrap")),
    Mutant("prepared-kept-across-forwards", at(ops.forward),
           "prepared = chosen.kernel.prepare(weights)",
           "prepared = vars(ops).setdefault(\"kept\", {}).setdefault(\n"
           "        (weights.n, weights.k, chosen.kernel.name), chosen.kernel.prepare(weights))",
           "what a kernel derives kept from the first forward on: a write through any door "
           "(param.data.copy_, a numpy view, a reassignment) never reaches it",
           ("tests/test_reliability.py::test_weights_written_through_any_door_are_seen_at_the_"
            "next_forward[through_data_copy-int64-matmul]",
            "tests/test_reliability.py::test_weights_written_through_any_door_are_seen_at_the_"
            "next_forward[through_reassignment-vnni-limbs]")),
    # --- the C kernel reading the checkpoint's buffers in place (issue 40)
    Mutant("in-place-scales-of-the-neighbour-row", C_KERNEL,
           "L->scale + (b * 16 + i) * G + g0",
           "L->scale + (b * 16 + ((i ^ 1) < rows ? i ^ 1 : i)) * G + g0",
           "a block's scales read for the wrong rows: neighbouring rows take each other's "
           "scales", (CPU, CPU_VECTORS)),
    Mutant("in-place-activations-in-natural-order", C_KERNEL,
           "first->packed && first->bits == 4);", "0);",
           "4-bit words read in place against activations in natural order: each nibble's "
           "product taken with its neighbour's activation", (CPU, CPU_VECTORS)),
    Mutant("in-place-weight-sums-unbiased", C_KERNEL,
           "_mm512_set1_epi32(nibbles ? 8 * 32 : 128 * 32)",
           "_mm512_set1_epi32(nibbles ? 0 : 128 * 32)",
           "the weight sums of 4-bit words taken from the stored q + 8: the limb bias "
           "corrected by the wrong amount", (CPU, CPU_VECTORS)),
    Mutant("in-place-slow-rows-unflagged", C_KERNEL,
           "_mm512_maskz_mov_epi32(slow & live, _mm512_set1_epi32(FLAG_SLOW))",
           "_mm512_maskz_mov_epi32(0, _mm512_set1_epi32(FLAG_SLOW))",
           "a row past the certified spread computed as zero and never sent to `wide`",
           ("tests/test_modules.py::test_wide_spread_rows_stay_exact",)),
    Mutant("in-place-non-finite-scale-unflagged", C_KERNEL,
           "nonfinite |= ~finite;", "nonfinite |= 0;",
           "a non-finite scale counted as 0 and its row left finite, not NaN (contract v1.2)",
           ("tests/test_reliability.py::test_a_non_finite_scale_written_in_place_gives_its_row_"
            "nan[vnni-limbs]",)),
    # --- contract v1.2: non-finite rows (issue 40)
    Mutant("nan-rows-of-x-left-zero", at(ops.cpu_forward),
           "y = y.masked_fill_(bad_rows[:, None], float(\"nan\"))", "pass",
           "a row of x holding an inf or a NaN computed as zeros, its outputs +0.0, not NaN",
           ("tests/test_errors.py::test_layer_non_finite_x_gives_nan_rows_or_raises_when_strict"
            "[vnni-limbs]", CPU_VECTORS)),
    Mutant("nan-weight-rows-left-zero", at(ops.cpu_forward),
           "y = y.index_fill_(1, nan_rows.to(y.device), float(\"nan\"))",
           "pass", "a non-finite scale written in place counted as 0: finite outputs for its row",
           ("tests/test_reliability.py::test_a_non_finite_scale_written_in_place_gives_its_row_nan"
            "[vnni-limbs]",)),
    Mutant("nan-weight-rows-left-zero-on-the-device", triton_at(triton_wide, "finish_kernel"),
           "((flags & NONFINITE_BIT) != 0)[None, :]", "((flags & 0) != 0)[None, :]",
           "the Triton forward's rows holding a non-finite scale left finite, not NaN",
           ("tests/test_reliability.py::test_a_non_finite_scale_written_in_place_gives_its_row_nan"
            "[triton-group]",)),
    Mutant("weight-shape-read-at-every-gpu-forward",
           at(modules.ExactLayer._readable_buffers),
           "elif self._shape_seen[0] is not shape or self._shape_seen[1] != shape._version:",
           "elif True:",
           "a GPU forward reads weight_shape's values back each time: a host sync a CUDA graph "
           "cannot hold",
           ("tests/test_reliability.py::test_the_triton_forward_reads_nothing_back",)),
    # --- the C kernel (cpu_vnni.c), the CPU path's production code
    Mutant("vnni-high-limb-correction-unscaled", C_KERNEL, "limbs == 1 ? 7 : 15", "7",
           "the bias correction of the high limb not scaled by 256 (per-limb zero points)",
           (CPU, CPU_VECTORS)),
    Mutant("vnni-high-nibble-leaks-neighbour", C_KERNEL,
           "_mm512_and_si512(_mm512_srli_epi16(pair, 4), low4)", "_mm512_srli_epi16(pair, 4)",
           "a 16-bit shift unpacks the high nibble with the next byte's bits in it",
           (CPU, CPU_VECTORS)),
    Mutant("vnni-tail-row-dropped", C_KERNEL, "case 3: CALL(3, __VA_ARGS__); break;",
           "case 3: CALL(2, __VA_ARGS__); break;",
           "the last row of a batch whose size leaves 3 rows over never computed",
           (CPU, CPU_VECTORS)),
    Mutant("vnni-activations-truncated", C_KERNEL, "_MM_FROUND_TO_NEAREST_INT",
           "_MM_FROUND_TO_ZERO", "activations quantized by truncation instead of RNE",
           (CPU, CPU_VECTORS)),
    Mutant("vnni-row-exponent-too-small", C_KERNEL, "ae + t0 + !fits", "ae + t0",
           "the activation exponent one too small where the row maximum needs the next one",
           (CPU, CPU_VECTORS)),
    Mutant("vnni-row-scale-from-the-batch", C_KERNEL,
           "for (int64_t k = r * K; k < (r + 1) * K; k++) {",
           "for (int64_t k = 0; k < M * K; k++) {",
           "one activation scale for the whole batch, in C", (CPU, BATCH)),
    Mutant("vnni-one-call-high-limb-is-the-low", C_KERNEL,
           "grouped_tiles(gr, words, planes, M * K, limbs,",
           "grouped_tiles(gr, words, planes, 0, limbs,",
           "the one-call path (exact_grouped) reads every limb from the low limb's plane",
           (CPU, CPU_VECTORS)),
    # the C kernel at 32-bit activations: four limbs, P in two int32 halves, an int64 term
    Mutant("vnni-32-lowest-limb-dropped", C_KERNEL,
           "p_lo = _mm512_add_epi32(_mm512_slli_epi32(d[1], 8), d[0]);",
           "p_lo = _mm512_slli_epi32(d[1], 8);",
           "the lowest of four activation limbs never added (a limb dropped)",
           (CPU_VECTORS, CPU, ACT32_KERNELS + "[vnni-limbs]")),
    Mutant("vnni-32-high-half-place-off", C_KERNEL,
           "_mm512_slli_epi64(_mm512_mul_epi32(p_hi, c), 16)",
           "_mm512_slli_epi64(_mm512_mul_epi32(p_hi, c), 8)",
           "the high pair of limbs at 2**8, not 2**16: a limb's place value off by one",
           (CPU_VECTORS, CPU, ACT32_KERNELS + "[vnni-limbs]")),
    Mutant("vnni-32-group-sum-in-int32", C_KERNEL,
           """    return _mm512_add_epi64(_mm512_slli_epi64(_mm512_mul_epi32(p_hi, c), 16),
                            _mm512_mul_epi32(p_lo, c));""",
           "    return _mm512_mul_epi32(_mm512_add_epi32(_mm512_slli_epi32(p_hi, 16), p_lo), c);",
           "a group's P = 2**16 * P_hi + P_lo summed in int32, where 32-bit activations need "
           "int64: it wraps", (CPU_VECTORS, CPU, ACT32_KERNELS + "[vnni-limbs]")),
    Mutant("vnni-rounding-ties-up", C_KERNEL, "_mm512_cmpeq_epi64_mask(rem, half) & odd;",
           "_mm512_cmpeq_epi64_mask(rem, half);",
           "the final rounding's ties away from zero instead of to even",
           ("tests/test_modules.py::test_final_rounding_near_ties[vnni-limbs]", CPU,
            DEVICES_MOE)),
    Mutant("vnni-normal-rounding-ties-down", C_KERNEL,
           "_mm512_add_epi64(_mm512_add_epi64(a, below_half), last_kept)",
           "_mm512_add_epi64(a, below_half)",
           "the final rounding's fast path (normal results) breaks ties toward zero, not to even",
           ("tests/test_modules.py::test_final_rounding_near_ties[vnni-limbs]", CPU)),
    Mutant("vnni-normal-rounding-past-the-largest-binade", C_KERNEL,
           "_mm512_cmplt_epi64_mask(field, _mm512_set1_epi64(emax - 1))",
           "_mm512_cmplt_epi64_mask(field, _mm512_set1_epi64(emax + 1))",
           "the final rounding's fast path taken for results past the largest finite binade "
           "(NaN and garbage patterns where infinity is due)",
           ("tests/test_modules.py::test_final_rounding_at_the_top_of_the_range",)),
    Mutant("vnni-subnormal-output-flushed", C_KERNEL,
           "bits = _mm512_mask_mov_epi64(bits, subnormal, n);",
           "bits = _mm512_maskz_mov_epi64(~subnormal, bits);",
           "subnormal results flushed to zero (FTZ)", (CPU_VECTORS, CPU)),
    # --- the span kernel (16-bit activations, 4-bit weights)
    Mutant("span-bound-doubled", at(vnni_layout.span_scales),
           "fits = ((tot // div <= limit)", "fits = ((tot // div <= 2 * limit)",
           "a span's int32 bound off by a factor of two: two extreme groups share a span and wrap",
           (SPANS_EDGE, SPANS_CHAIN + "[one-step-past-k1-k3]")),
    Mutant("span-base-shift-dropped", C_KERNEL,
           "_mm512_srav_epi64(_mm512_slli_epi64(d, 32), r_even)",
           "_mm512_srai_epi64(_mm512_slli_epi64(d, 32), 32)",
           "a span's sum added without its power of two (the even rows' scale exponent lost)",
           (SPANS, SPANS_VECTORS)),
    Mutant("span-chain-bound-doubled", at(vnni_layout.span_scales),
           "(c.abs() * chain_sum <= limit)", "(c.abs() * chain_sum <= 2 * limit)",
           "an unshifted block's chain bound off by a factor of two: a chain wraps",
           (SPANS_EDGE, SPANS_CHAIN + "[one-step-past-k0-k2]")),
    Mutant("span-unshifted-biases-kept", C_KERNEL,
           "_mm512_slli_epi64(_mm512_add_epi64(odd[i], groups), 32)",
           "_mm512_slli_epi64(odd[i], 32)",
           "an unshifted block's even rows keep the 2 G biases of 2**31 of their chains",
           (SPANS_EDGE, SPANS)),
    Mutant("span-pending-rows-lost", C_KERNEL,
           "for (int i = K / 32; i < before; i++) finish_pending(p, i, Np);",
           "for (int i = K / 32; i < 0; i++) finish_pending(p, i, Np);",
           "with fewer groups than tile rows, the previous tile's last rows never rounded out",
           (SPANS, "tests/test_modules.py::test_rows_agree_across_the_kernel_switch")),
    Mutant("span-second-sum-not-reset", C_KERNEL,
           "                d0[i] = d1[i] = _mm512_setzero_si512();",
           "                d0[i] = _mm512_setzero_si512();",
           "one of a row's two partial sums carried into the next span",
           (SPANS, SPANS_VECTORS)),
    # --- the AMX kernel (cpu_amx.c): its tiles emulated where the CPU has none
    Mutant("amx-tile-stride-wrong", AMX_KERNEL, "_tile_loadd(4, at, K);",
           "_tile_loadd(4, at, AMX_STEP_K);",
           "the activation tile loaded with a stride of one step, not of a row: every row after "
           "the first reads its neighbour's bytes", (AMX, AMX_VECTORS)),
    Mutant("amx-high-digit-unsigned", AMX_KERNEL, "_tile_dpbusd(1, 4, 7);",
           "_tile_dpbuud(1, 4, 7);",
           "the low limb's high-digit dot reads the s8 digit as u8: a negative folded weight "
           "counts 256 too much there", (AMX, AMX_VECTORS)),
    Mutant("amx-span-base-dropped", AMX_KERNEL, "_mm512_sllv_epi64(even, b_even)", "even",
           "a span's dots combined without its base: rows 0..7 of a block whose factors share a "
           "power of two come out that power too small", (AMX, AMX_VECTORS)),
    Mutant("amx-split-step-lost", AMX_KERNEL, "if (!pair && g + 1 < G) {",
           "if (!pair && g + 1 < G && 0) {",
           "where a span ends after the first group of a step, the second group is never taken",
           (AMX, AMX_VECTORS)),
    # --- inputs the suite did not generate (issue 23)
    Mutant("int-mm-exactness-trusted", at(gemm._GemmKernel.available),
           "if self.int8 and not int_mm_exact():", "if False:",
           "torch._int_mm trusted without the check of its exactness: on a CPU whose int8 GEMM "
           "runs through fp32, wrong sums",
           ("tests/test_modules.py::test_every_cpu_path_the_plan_takes_on_another_machine"
            "[no-vnni-int-mm-inexact]",)),
    Mutant("subnormal-scale-not-on-the-subnormal-grid", at(quantize.quantize_weight),
           "es = np.maximum(es, BFLOAT16.quantum_min)", "es = es + 0",
           "from_weight's scale exponent left below bf16's smallest: a tiny group's scale "
           "encoded as a subnormal of another value",
           ("tests/test_modules.py::test_from_weight_matches_the_oracle_quantizer",)),
    Mutant("converter-keeps-a-layer-of-other-act-bits", at(kimi._stage),
           "reuse = isinstance(module, PackedInt4Linear) and module.act_bits == act_bits",
           "reuse = isinstance(module, PackedInt4Linear)",
           "convert_kimi_to_exact keeps the model's exact layers at their act_bits, not the one "
           "asked for", ("tests/test_kimi.py::test_every_conversion_option_computes_at_its_"
                         "setting[None-8]",
                         "tests/test_kimi.py::test_every_conversion_option_computes_at_its_"
                         "setting[4-4]")),
    Mutant("converter-checks-only-the-first-projection", at(kimi.routed_reads),
           "for name, layer in targets.items():  # all header checks before the first byte",
           "for name, layer in list(targets.items())[:1]:  # all header checks before the "
           "first byte",
           "the loader checks the first projection's header entries alone: a tensor of "
           "another shape further on is installed as it is, and read out of bounds",
           ("tests/test_kimi.py::test_bad_tensors_name_the_tensor_and_the_file"
            "[packed-too-short]",
            "tests/test_kimi.py::test_bad_tensors_name_the_tensor_and_the_file[packed-int64]")),
    # --- the streamed loader (issue 42)
    Mutant("loader-values-unchecked", at(kimi.routed_reads),
           "checkpoint.check_values(targets[name], name, buffer, tensor)", "pass",
           "the streamed tensors' values never checked: a non-finite scale loads silently",
           ("tests/test_load.py::test_a_failure_midway_through_the_stream_leaves_the_model_"
            "unchanged",
            "tests/test_kimi.py::test_bad_tensors_name_the_tensor_and_the_file[scale-nan]")),
    Mutant("loader-keeps-every-shard-mapped", at(kimi.KimiCheckpoint.stream),
           "if last and not mapped:", "if last and False:",
           "each shard's mapping kept to the end of the load: the process holds the whole "
           "checkpoint's pages on top of the copies",
           ("tests/test_load.py::test_each_scale_is_checked_once_and_each_shard_released_after_"
            "its_last_tensor",)),
    Mutant("loader-size-not-looked-at-again", at(kimi.KimiCheckpoint.map_tensor),
           "if size != shard.size:", "if False:",
           "a shard cut short after its header was read is read through its mapping: a SIGBUS "
           "where the pages are gone",
           ("tests/test_load.py::test_a_shard_cut_short_under_the_reader_is_an_error_not_a_"
            "crash",)),
    Mutant("mmap-copies-the-tensors", at(kimi.KimiCheckpoint.read),
           "if mapped and view.data_ptr() % view.element_size() == 0:", "if False:",
           "mmap=True copies every tensor: anonymous memory the size of the experts",
           ("tests/test_load.py::test_mmap_leaves_the_int4_tensors_file_backed_and_copy_on_"
            "write",)),
    Mutant("finite-check-first-step-only", at(formats.check_finite_tensor),
           "flat.split(CHECK_STEP) if", "flat.split(CHECK_STEP)[:1] if",
           "a CPU check in steps that stops after the first: a non-finite scale past it loads",
           ("tests/test_formats.py::test_a_finite_check_in_steps_finds_a_bad_value_at_every_"
            "step_edge[inf-131076]",)),
    Mutant("remote-expert-computes-zeros", at(moe.RemoteLinear.forward),
           "raise MissingExpertError(", "return x.new_zeros(x.shape[0], self.out_features)\n"
           "    MissingExpertError(",
           "a token routed to an expert held elsewhere gets zeros, silently",
           ("tests/test_load.py::test_a_rank_loads_its_experts_and_refuses_tokens_for_the_"
            "others[copied-per-expert]",
            "tests/test_load.py::test_a_predicate_takes_any_subset_and_the_fused_layout_too[k2]")),
    Mutant("span-chain-bound-of-the-first-chain", at(vnni_layout.span_scales),
           "chains[0] + chains[1], torch.maximum(*chains)", "chains[0] + chains[1], chains[0]",
           "an unshifted block certified on one of its two chains: the other wraps",
           (SPANS_CHAIN + "[one-step-past-k1-k3]",)),  # weak by design: the other three pass
    Mutant("nibble-layout-past-four-bits", at(vnni_layout.NativeWeights.__init__),
           "q8.max() <= 7", "q8.max() <= 8",
           "the C kernel's nibble layout taken for weights one past 4 bits: an 8 spills into "
           "its neighbour's nibble",
           ("tests/test_modules.py::test_the_c_layout_chosen_from_the_weights_range_at_its_"
            "edges[8]",)),
    # --- the grouped MoE kernels (issue 22)
    Mutant("grouped-neighbouring-experts-weights", C_KERNEL,
           "const Layer *L = gr->layers[e * gr->parts + p];",
           "const Layer *L = gr->layers[(e + 1) % gr->experts * gr->parts + p];",
           "the tokens routed to one expert run through the neighbouring expert's weights",
           (grouped("vnni-grouped"), moe_block("cpu"))),
    Mutant("grouped-expert-stride-off-by-one", C_KERNEL,
           "const Layer *L = gr->layers[e * gr->parts + p];",
           "const Layer *L = gr->layers[e * (gr->parts - 1) + p];",
           "the expert stride of the table of (expert, part) layers off by one",
           (grouped("vnni-grouped"), moe_block("cpu"))),
    Mutant("grouped-blocks-of-the-neighbouring-expert", triton_at(triton_grouped, "blocks"),
           "torch.searchsorted(ends, block, right=True)",
           "torch.searchsorted(ends, block, right=False)",
           "the GPU schedule's block of an expert's rows given the expert before it: its rows "
           "never computed", (grouped("triton-grouped"), moe_block("triton"))),
    Mutant("grouped-last-blocks-padding-stored-as-a-token", GROUPED_KERNEL,
           "out = valid[:, None] & mask_n[None, :]", "out = (rows >= 0)[:, None] & mask_n[None, :]",
           "the padding of an expert's last block of rows read as a token and stored over a "
           "routed row", (grouped("triton-grouped"), moe_block("triton"))),
    Mutant("grouped-table-stride-off-by-one", triton_at(triton_grouped, "block_layer"),
           "entry = table_ptr + (expert * PARTS + part) * 4",
           "entry = table_ptr + (expert * (PARTS - 1) + part) * 4",
           "the expert stride of the GPU's table of layers off by one: another expert's (or "
           "part's) weights", (grouped("triton-grouped"), moe_block("triton"))),
    Mutant("grouped-row-sent-to-the-wrong-token", at(moe.weighted_sum),
           "row_of[routing.pair] = torch.arange(pairs, device=rows.device)",
           "row_of = routing.pair.clone()",
           "the routing's permutation taken for its inverse: a row's result summed into the "
           "wrong token", (moe_block("cpu"), "tests/test_moe.py::"
                           "test_kimi_moe_grouped_matches_its_per_expert_loop[cpu]")),
)
