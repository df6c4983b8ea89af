"""Where the catalogue plants its bugs and the tests that must catch them: the Mutant record,
targets named from the objects themselves (at, triton_at; source for a C kernel), and the
killers' pytest node ids the entries share (exactness.suite.mutants.catalogue)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ...kernels.cpu import amx_library, vnni_calls, vnni_layout, vnni_library
from ...kernels.triton import group as triton_group
from ...kernels.triton import grouped as triton_grouped

ROOT = Path(__file__).resolve().parents[3]  # the repository: killers are its tests' node ids


@dataclass(frozen=True)
class Mutant:
    name: str
    target: str  # "package.module:function", or a C file (C_FILES, AMX_KERNEL)
    old: str  # a snippet that occurs exactly once in the function's (or file's) source ...
    new: str  # ... and what replaces it
    bug: str  # the class of real bug it stands for
    killers: tuple[str, ...]  # "tests/test_x.py::test_y": the first must fail under the mutant
    every_killer: bool = False  # the agreement tests (oracle, reference, peers): each must fail



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
    return relative(module.SOURCE)


def relative(path: Path) -> str:
    return path.resolve().relative_to(ROOT).as_posix()



ORACLE_VECTORS = "tests/test_vectors.py::test_every_vector_through_the_oracle"
VECTORS = "tests/test_vectors.py::test_every_vector"
AGREEMENT = "tests/test_reference.py::test_reference_matches_oracle"


def equivalence(path: str) -> str:
    """The property: `path` (a backend or a kernel) against the reference."""
    return f"tests/test_modules.py::test_path_matches_reference[{path}]"


def vectors(path: str) -> str:
    return f"tests/test_modules.py::test_vectors_through_the_layer[{path}]"


CPU, CPU_VECTORS = equivalence("vnni-limbs"), vectors("vnni-limbs")  # the C kernel
AVX2, AVX2_VECTORS = equivalence("avx2-limbs"), vectors("avx2-limbs")  # its AVX2 build
GEMM, GEMM_VECTORS = equivalence("int8-gemm"), vectors("int8-gemm")
TRITON, TRITON_VECTORS = equivalence("triton-group"), vectors("triton-group")
# the CPU and the Triton device compared (make verify's devices stage)
DEVICES_LAYER = ("tests/test_devices.py::"
                 "test_a_layer_gives_the_same_bits_on_the_cpu_and_the_triton_device")
DEVICES_MOE = "tests/test_devices.py::test_the_moe_experts_give_the_same_bits_on_both"
FOLDED = "tests/test_modules.py::test_triton_folded_path_matches_reference"
FOLDED_VECTORS = vectors("triton-folded")
SPANS, SPANS_VECTORS = equivalence("vnni-spans"), vectors("vnni-spans")
# the C kernel's self-check run in this process, where a mutant of its Python side applies
SELF_CHECK = "tests/test_modules.py::test_the_vnni_self_check_passes_in_this_process[vnni-limbs]"
AVX2_SELF_CHECK = ("tests/test_modules.py::test_the_vnni_self_check_passes_in_this_process"
                   "[avx2-limbs]")
KERNEL = triton_at(triton_group, "exact_group_kernel")
C_KERNEL = source(vnni_library)  # cpu_kernel.c: what every build of the C kernel shares
AVX512_KERNEL = relative(vnni_library.AVX512.isa)  # kernel_avx512.h: the AVX-512 build's own
AVX2_KERNEL = relative(vnni_library.AVX2.isa)  # kernel_avx2.h: the AVX2 build's own
# each C file of the C kernel, and the builds a bug planted in it is built into
C_FILES = {C_KERNEL: vnni_library.BUILDS, AVX512_KERNEL: (vnni_library.AVX512,),
           AVX2_KERNEL: (vnni_library.AVX2,)}
AMX_KERNEL = source(amx_library)
# the modules whose code only the C kernel runs: their mutants need it built
C_ONLY = (vnni_layout.__name__, vnni_calls.__name__)
AMX, AMX_VECTORS = equivalence("amx"), vectors("amx")
AMX_SPANS_TWIN = "tests/test_amx.py::test_the_c_spans_are_their_python_twin"
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


EXACT_BLOCK = "tests/test_exact_block.py::"


def moe_block(backend: str) -> str:
    """The property: the grouped MoE block against its per-expert loop (transformers' own in
    the transformers block) and, in the exact block, its reference."""
    return f"tests/test_moe.py::test_grouped_experts_match_transformers_loop[{backend}]"
