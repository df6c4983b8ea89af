"""The AMX kernel (kernels/cpu/amx*.py): its emulated tiles checked on any CPU, the real ones
built everywhere and run where AMX-INT8 is; refused with the reason where it cannot run; picked
unasked only as real tiles, from a tile's 16 rows on. (Its bits against the reference: the
equivalence, vector and reliability tests, parametrized over every kernel.)"""

import re
import shutil
import subprocess
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from exactness import ExactLinear, ops
from exactness.contract import BFLOAT16, FLOAT32, ContractValueError, act_qmax
from exactness.formats import pack_weights, round_scaled
from exactness.kernels import KernelUnavailableError, registry
from exactness.kernels.cpu import (
    amx,
    amx_calls,
    amx_layout,
    amx_library,
    vnni_layout,
    vnni_library,
)
from exactness.kernels.registry import no, yes
from exactness.suite.cases import LinearCase
from exactness.suite.counterexamples import check_bits
from exactness.suite.paths import require, run
from exactness.suite.strategies import seeds

pytestmark = pytest.mark.stage("equivalence")  # make verify's stage


@pytest.fixture
def fresh_status():
    """amx_library.status() judged again under the test's settings, and again after it (the
    forwards' plans too)."""
    caches = (amx_library.status, registry.warn_fallback)  # the originals: a test may patch them
    for cache in caches:
        cache.cache_clear()
    ops.PLANS.clear()
    yield
    for cache in caches:
        cache.cache_clear()
    ops.PLANS.clear()


def emulated(monkeypatch) -> None:
    monkeypatch.setenv("EXACTNESS_AMX", "emulate")
    if vnni_library.AVX512.missing_features():
        monkeypatch.setenv("EXACTNESS_NATIVE", "emulate")


def test_the_emulated_tiles_pass_their_self_check_on_any_cpu(monkeypatch, fresh_status):
    """Whatever this CPU has, the emulated build runs: the kernel's tiling, layouts and combine
    are checked here even where the real tiles also run."""
    emulated(monkeypatch)
    lib, why = amx_library.status()
    assert lib is not None, why.why
    assert "emulated AMX tiles" in why.why and lib.amx_faults() == 0


def test_a_tile_shape_the_hardware_refuses_faults_and_is_refused(monkeypatch, fresh_status):
    """An activation tile 64 bytes wide against weight tiles of 8 rows: tdpbusd faults on the
    hardware; the emulation counts the fault and the self-check names it."""
    emulated(monkeypatch)
    planted = amx_library.SOURCE.read_text().replace("cfg.rows[6] = cfg.rows[7] = AMX_STEP_K / 4;",
                                             "cfg.rows[6] = cfg.rows[7] = AMX_STEP_K / 8;")
    lib, verdict = amx_library.load(planted)
    assert lib is None and "faulted" in verdict.why and "the accumulation" in verdict.why


# configure_tiles as it was before issue 39: GCC 12's _tile_loadconfig, whose asm names 8 of the
# config's 64 bytes as read
BEFORE_ISSUE_39 = """
static void configure_tiles(int rows) {
    TileConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 4; t++) {
        cfg.rows[t] = (uint8_t)rows;
        cfg.colsb[t] = 64;
    }
    cfg.rows[4] = cfg.rows[7] = (uint8_t)rows;
    cfg.colsb[4] = cfg.colsb[7] = 32;
    cfg.rows[5] = cfg.rows[6] = 8;
    cfg.colsb[5] = cfg.colsb[6] = 64;
    _tile_loadconfig(&cfg);
}
"""
# configure_tiles in a function that calls nothing after it, as GCC may inline it into a kernel:
# the case where a store no asm operand names is dead
PRINT_CONFIG = """
#include <stdio.h>
__attribute__((noinline)) void configure(int rows) { configure_tiles(rows); }
int main(int argc, char **argv) {
    configure(argc + 6);
    for (int i = 0; i < 64; i++) printf("%02x", emulated_config[i]);
    return 0;
}
"""
COMPILERS = [cc for cc in ("cc", "clang") if shutil.which(cc)]  # clang where it is installed


def is_gcc(compiler: str) -> bool:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    return "Free Software Foundation" in version and "clang" not in version


def config_seen(tmp_path, compiler: str, level: str, configure: str) -> bytes:
    """The 64 bytes the emulated ldtilecfg is given by `configure` (a configure_tiles), compiled
    by `compiler` at `level`: a program of its own, run in a child process."""
    kernel = amx_library.SOURCE.read_text()
    config_type = re.search(r"typedef struct \{\n    uint8_t palette.*?\} TileConfig;", kernel,
                            re.DOTALL)[0]
    source = tmp_path / f"config{level}.c"
    sizes = "\n".join(re.findall(r"#define AMX_\w+ \d+", kernel))
    source.write_text("\n".join((amx_library.EMULATION.read_text(), sizes, config_type, configure,
                                 PRINT_CONFIG)))
    program = tmp_path / f"config{level}"
    subprocess.run([compiler, level, str(source), "-o", str(program)], check=True,
                   capture_output=True, timeout=120)
    return bytes.fromhex(subprocess.run([str(program)], check=True, capture_output=True,
                                        text=True, timeout=60).stdout)


@pytest.mark.parametrize("compiler", COMPILERS)
def test_every_byte_of_the_tile_config_reaches_ldtilecfg(tmp_path, compiler):
    """Issue 39. The emulated ldtilecfg sees only the bytes its asm operand shows the compiler,
    as the real one does (amx_emulated.h). configure_tiles as it was loses its widths and rows to
    GCC's -O2 and -O3, leaving tiles of 0 rows (the real build's disassembly showed the same,
    and the first tileloadd raised #UD on a Xeon with AMX). cpu_amx.c's own, through LDTILECFG
    (the whole config its operand), gives every byte at every level, as at -O0."""
    kernel = amx_library.SOURCE.read_text()
    now = re.search(r"static void configure_tiles\(int rows\) \{.*?\n\}\n", kernel, re.DOTALL)[0]
    assert "LDTILECFG(cfg);" in now and "_tile_loadconfig" not in now
    want = config_seen(tmp_path, compiler, "-O0", now)
    assert want[0] == 1 and all(want[48:56]), want.hex()  # palette 1, tiles 0..7 have rows
    for level in ("-O2", "-O3"):
        assert config_seen(tmp_path, compiler, level, now) == want, (compiler, level)
    if is_gcc(compiler):
        before = config_seen(tmp_path, compiler, "-O0", BEFORE_ISSUE_39)
        assert before[0] == 1 and all(before[48:56]), before.hex()
        for level in ("-O2", "-O3"):
            lost = config_seen(tmp_path, compiler, level, BEFORE_ISSUE_39)
            assert lost[0] == 1 and not any(lost[16:]), (level, lost.hex())  # 0 rows, 0 bytes


@pytest.mark.parametrize("settings, missing, why", [
    ({"EXACTNESS_AMX": "0"}, [], "EXACTNESS_AMX=0 turns the AMX kernel off"),
    ({"EXACTNESS_AMX": "1", "EXACTNESS_NATIVE": "0"}, [], "EXACTNESS_NATIVE=0 turns the C kernels"),
    ({"EXACTNESS_AMX": "1"}, ["amx_int8"], "the CPU lacks amx_int8"),
    ({"EXACTNESS_AMX": "1", "EXACTNESS_NATIVE": "emulate"}, [], "need the real AVX-512"),
])
def test_the_amx_kernel_says_why_it_does_not_run(monkeypatch, fresh_status, settings, missing,
                                                 why):
    for name, value in settings.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(amx_library, "missing_features", lambda: missing)
    lib, fit = amx_library.status()
    assert lib is None and why in fit.why
    layer = ExactLinear.from_weight(torch.randn(16, 64), kernel="amx")
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        with pytest.raises(KernelUnavailableError, match=why):
            layer(torch.randn(2, 64))
    # a warning only where an AMX machine refuses it unasked, not where a switch or the CPU did
    refused = [w for w in said if "the AMX kernel is not used" in str(w.message)]
    assert len(refused) == (settings.get("EXACTNESS_NATIVE") == "emulate")


def test_a_mode_of_none_of_its_names_is_a_typed_error(monkeypatch):
    monkeypatch.setenv("EXACTNESS_AMX", "yes")
    with pytest.raises(ContractValueError, match="EXACTNESS_AMX must be one of .*'yes'"):
        amx_library.mode()


def as_an_amx_machine(monkeypatch) -> None:
    """The real tiles' settings (EXACTNESS_AMX=1, AMX-INT8 listed), running the emulated
    library: what the plan and the layer do on a Xeon with AMX."""
    emulated(monkeypatch)
    lib, why = amx_library.status()
    assert lib is not None, why.why
    monkeypatch.setattr(amx_library, "status", lambda: (lib, yes("AMX-INT8 tiles, self-checked")))
    monkeypatch.setattr(amx_library, "mode", lambda: "1")
    monkeypatch.setattr(amx_library, "missing_features", lambda: [])
    monkeypatch.setattr(ops, "PLANS", {})  # the forwards' plans, made on such a machine


@pytest.mark.parametrize("min_rows", [amx.MIN_ROWS, None, 16])
def test_the_plan_takes_real_tiles_from_min_rows_and_emulated_ones_never(monkeypatch,
                                                                         fresh_status, min_rows):
    """amx.MIN_ROWS as set (from a table measured on AMX), None (never: no measurement shows the
    tiles faster), and 16."""
    monkeypatch.setattr(amx, "MIN_ROWS", min_rows)
    emulated(monkeypatch)
    w = torch.randn(40, 96)
    for rows in (15, 16, 40):
        assert ExactLinear.from_weight(w).plan(torch.randn(rows, 96)).kernel.name != "amx"
    as_an_amx_machine(monkeypatch)
    for rows in (1, 15, 16, 40):
        layer = ExactLinear.from_weight(w)
        x = torch.randn(rows, 96).bfloat16()
        plan = layer.plan(x)
        takes = min_rows is not None and rows >= min_rows
        assert (plan.kernel.name == "amx") == takes, str(plan)
        if min_rows is not None and rows < min_rows:
            assert f"not amx: preferred from {min_rows} rows on" in str(plan)
        want = ExactLinear.from_weight(w, kernel="wide")(x)
        assert torch.equal(layer(x).view(torch.int16), want.view(torch.int16))


def test_an_amx_machine_that_refuses_the_kernel_says_why_once(monkeypatch, fresh_status):
    monkeypatch.setattr(amx_library, "status", lambda: (None, no("its self-check failed on X")))
    monkeypatch.setattr(amx_library, "mode", lambda: "1")
    monkeypatch.setattr(amx_library, "missing_features", lambda: [])
    with pytest.warns(registry.FallbackWarning, match="AMX kernel is not used: its self-check"):
        assert not amx.AMX.available(torch.device("cpu"))
    # not an AMX machine:
    monkeypatch.setattr(amx_library, "missing_features", lambda: ["amx_int8"])
    with warnings.catch_warnings():  # no warning there, the VNNI kernel is simply its kernel
        warnings.simplefilter("error")
        assert not amx.AMX.available(torch.device("cpu"))


def test_the_c_tiles_are_the_shapes_dataflow_proves():
    """cpu_amx.c's tile of activation rows, its K per step and its longest span are dataflow's,
    whose amx-span obligations bound them."""
    from exactness import dataflow

    source = amx_library.SOURCE.read_text()
    for name, value in (("AMX_ROWS", dataflow.AMX_TILE_ROWS), ("AMX_STEP_K", dataflow.AMX_STEP_K),
                        ("AMX_SPAN_GROUPS", dataflow.AMX_SPAN_GROUPS)):
        assert int(re.search(rf"#define {name} (\d+)", source)[1]) == value, name


def test_the_real_tiles_compile_here(monkeypatch):
    """The real build differs from the emulated one in the seven tile instructions only; where it
    cannot run, it still compiles (the instructions' spelling is checked, not their bits). It is
    the real AVX-512 build too: SIMDe's emulation and the real tiles' <immintrin.h> clash, on a
    CPU without VNNI, where the suite emulates the rest."""
    monkeypatch.setenv("EXACTNESS_NATIVE", "1")
    lib, why = vnni_library.AVX512.build(amx_library.source(False), amx_library.FLAGS)
    assert lib is not None, why.why
    assert hasattr(lib, "exact_linear_amx") and hasattr(lib, "amx_request")


@pytest.mark.parametrize("act_bits", [8, 16])
@pytest.mark.parametrize("w_bits", [4, 8])
def test_every_tile_at_its_extremes(act_bits, w_bits):
    """17 rows (a tile and a tail) of +-Qa against weights all -2**(w_bits - 1), K = 96 (a step
    and a lone group): every limb at its extremes, and the folded weights at the two digits'
    edge: scales 255 * 2**-100 and 255 * 2**-96 in one span (f = 255 and 4080, q * f = -32640)
    for 4-bit weights, 255 * 2**-100 (q * f = -32640) for 8-bit ones."""
    require("amx")
    m, k, n = 17, 96, 20
    qmax = act_qmax(act_bits)
    even = (np.arange(m) % 2 == 0)[:, None]
    x = np.where(even, round_scaled(qmax, 0, FLOAT32), round_scaled(-qmax, 0, FLOAT32))
    x = np.broadcast_to(x, (m, k)).copy()
    q = np.full((n, k), -(2 ** (w_bits - 1)))
    exponents = np.array([-100, -96, -100]) if w_bits == 4 else np.full(3, -100)
    scales = np.array([round_scaled(255, e, BFLOAT16) for e in exponents])[None, :].repeat(n, 0)
    case = LinearCase(x, FLOAT32, q, pack_weights(q, w_bits), scales, act_bits, FLOAT32, w_bits)
    expected = np.asarray(run(case, "reference"))
    assert (expected & 0x7FFFFFFF).min() > 0  # nothing cancelled to zero
    check_bits(case, "amx", run(case, "amx"), expected)


def test_32_bit_activations_are_refused_with_the_reason():
    """Four limbs would need 8 dot tiles of the 8: the VNNI kernel takes them."""
    layer = ExactLinear.from_weight(torch.randn(16, 64), act_bits=32, kernel="amx")
    with pytest.raises(KernelUnavailableError, match="needs 4 int8 limbs, it carries at most 2"):
        layer(torch.randn(2, 64))


@given(seed=seeds, groups=st.sampled_from([1, 2, 3, 7, 64, 1030]), small=st.booleans(),
       most_shift=st.integers(0, 12))
def test_the_c_spans_are_their_python_twin(seed, groups, small, most_shift):
    """cpu_amx.c's spans (amx_block_spans, per block in C) against amx_layout.amx_spans: every
    span end, base, folded factor and R. Small factors make spans reach the AMX_SPAN_GROUPS cap
    (1030 groups); large ones with shifts end spans at every kind of step; rows of zeros, of one
    shared power of two and of odd factors beside them; 4- and 8-bit weights."""
    require("amx")
    g = torch.Generator().manual_seed(seed)
    n, k = 37, 32 * groups
    ms_max = 3 if small else 255
    least = -8 if seed % 2 else -128
    q = torch.randint(least, -least, (n, k), generator=g)
    ms = torch.randint(-ms_max, ms_max + 1, (n, groups), generator=g, dtype=torch.int32)
    shift = torch.randint(0, most_shift + 1, ms.shape, generator=g, dtype=torch.int32)
    ms[2] = 0  # a zero row: base 0
    ms[3] |= 1  # odd factors: base 0
    shift[4] = most_shift  # every factor of the row a multiple of 2**most_shift
    weights = vnni_layout.NativeWeights(q, ms << shift)
    got, want = amx_calls.spans(weights, amx_library.library()), amx_layout.amx_spans(weights)
    for name, a, b in zip(("f", "base", "ends", "rsum"), got, want, strict=True):
        assert torch.equal(a, b), name
