"""The AMX kernel (kernels/amx.py, cpu_amx.c): its emulated tiles checked on any CPU, the real ones
built everywhere and run where AMX-INT8 is; refused with the reason where it cannot run; picked
unasked only as real tiles, from a tile's 16 rows on. (Its bits against the reference: the
equivalence, vector and reliability tests, parametrized over every kernel.)"""

import warnings

import numpy as np
import pytest
import torch

from exactness import ExactLinear
from exactness.contract import BFLOAT16, FLOAT32, ContractValueError, act_qmax
from exactness.formats import pack_weights, round_scaled
from exactness.kernels import KernelUnavailableError, amx, native
from exactness.kernels.registry import no, yes
from exactness.suite.cases import LinearCase
from exactness.suite.counterexamples import check_bits
from exactness.suite.paths import require, run

pytestmark = pytest.mark.stage("equivalence")  # make verify's stage


@pytest.fixture
def fresh_status():
    """amx.status() judged again under the test's settings, and again after it."""
    caches = (amx.status, amx.warn_refused)  # the originals: a test may patch them
    for cache in caches:
        cache.cache_clear()
    yield
    for cache in caches:
        cache.cache_clear()


def emulated(monkeypatch) -> None:
    monkeypatch.setenv("EXACTNESS_AMX", "emulate")
    if native._missing_features():
        monkeypatch.setenv("EXACTNESS_NATIVE", "emulate")


def test_the_emulated_tiles_pass_their_self_check_on_any_cpu(monkeypatch, fresh_status):
    """Whatever this CPU has, the emulated build runs: the kernel's tiling, layouts and combine
    are checked here even where the real tiles also run."""
    emulated(monkeypatch)
    lib, why = amx.status()
    assert lib is not None, why.why
    assert "emulated AMX tiles" in why.why and lib.amx_faults() == 0


def test_a_tile_shape_the_hardware_refuses_faults_and_is_refused(monkeypatch, fresh_status):
    """An activation tile configured 64 bytes wide against 8 weight rows: tdpbusd faults on the
    hardware; the emulation counts the fault and the self-check names it."""
    emulated(monkeypatch)
    planted = amx.SOURCE.read_text().replace("cfg.colsb[4] = cfg.colsb[7] = 32;",
                                             "cfg.colsb[4] = cfg.colsb[7] = 64;")
    lib, why = amx.build(planted)
    assert lib is not None, why.why
    verdict = amx.self_check(lib)
    assert not verdict and "faulted" in verdict.why and "the accumulation" in verdict.why


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
    monkeypatch.setattr(amx, "missing_features", lambda: missing)
    lib, fit = amx.status()
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
        amx.mode()


def as_an_amx_machine(monkeypatch) -> None:
    """The real tiles' settings (EXACTNESS_AMX=1, AMX-INT8 listed), running the emulated
    library: what the plan and the layer do on a Xeon with AMX."""
    emulated(monkeypatch)
    lib, why = amx.status()
    assert lib is not None, why.why
    monkeypatch.setattr(amx, "status", lambda: (lib, yes("AMX-INT8 tiles, self-checked")))
    monkeypatch.setattr(amx, "mode", lambda: "1")
    monkeypatch.setattr(amx, "missing_features", lambda: [])


def test_the_plan_takes_real_tiles_from_16_rows_and_emulated_ones_never(monkeypatch,
                                                                        fresh_status):
    emulated(monkeypatch)
    w = torch.randn(40, 96)
    for rows in (15, 16, 40):
        assert ExactLinear.from_weight(w).plan(torch.randn(rows, 96)).kernel.name != "amx"
    as_an_amx_machine(monkeypatch)
    for rows, kernel in ((1, "vnni-limbs"), (15, "vnni-limbs"), (16, "amx"), (40, "amx")):
        layer = ExactLinear.from_weight(w)
        x = torch.randn(rows, 96).bfloat16()
        plan = layer.plan(x)
        assert plan.kernel.name == kernel, str(plan)
        if kernel != "amx":
            assert "not amx: preferred from 16 rows on" in str(plan)
        want = ExactLinear.from_weight(w, kernel="wide")(x)
        assert torch.equal(layer(x).view(torch.int16), want.view(torch.int16))


def test_an_amx_machine_that_refuses_the_kernel_says_why_once(monkeypatch, fresh_status):
    monkeypatch.setattr(amx, "status", lambda: (None, no("its self-check failed on X")))
    monkeypatch.setattr(amx, "mode", lambda: "1")
    monkeypatch.setattr(amx, "missing_features", lambda: [])
    with pytest.warns(native.FallbackWarning, match="AMX kernel is not used: its self-check"):
        assert not amx.AMX.available(torch.device("cpu"))
    monkeypatch.setattr(amx, "missing_features", lambda: ["amx_int8"])  # not an AMX machine:
    with warnings.catch_warnings():  # no warning there, the VNNI kernel is simply its kernel
        warnings.simplefilter("error")
        assert not amx.AMX.available(torch.device("cpu"))


def test_the_c_tiles_are_the_shapes_dataflow_proves():
    """cpu_amx.c's tile of activation rows and its K per tdpbusd are dataflow's, whose
    amx-tile-dot obligation bounds them."""
    import re

    from exactness import dataflow

    source = amx.SOURCE.read_text()
    assert int(re.search(r"#define AMX_ROWS (\d+)", source)[1]) == dataflow.AMX_TILE_ROWS
    assert int(re.search(r"cfg\.colsb\[4\] = cfg\.colsb\[7\] = (\d+);", source)[1]) == \
        dataflow.AMX_TILE_K
    assert amx.MIN_ROWS == dataflow.AMX_TILE_ROWS


def test_the_real_tiles_compile_here():
    """The real build differs from the emulated one in the six tile instructions only; where it
    cannot run, it still compiles (the instructions' spelling is checked, not their bits)."""
    lib, why = native.build(amx.source(False), amx.FLAGS)
    assert lib is not None, why.why
    assert hasattr(lib, "exact_linear_amx") and hasattr(lib, "amx_request")


@pytest.mark.parametrize("act_bits", [8, 16, 32])
@pytest.mark.parametrize("w_bits", [4, 8])
def test_every_tile_at_its_extremes(act_bits, w_bits):
    """17 rows (a tile and a tail) of +-Qa against weights all -2**(w_bits - 1) and scale
    mantissas 255, K = 96 (a pair of groups and one over): every limb's dot, its correction
    and its group's term at their largest, through the AMX kernel and the reference."""
    require("amx")
    m, k, n = 17, 96, 20
    qmax = act_qmax(act_bits)
    even = (np.arange(m) % 2 == 0)[:, None]
    x = np.where(even, round_scaled(qmax, 0, FLOAT32), round_scaled(-qmax, 0, FLOAT32))
    x = np.broadcast_to(x, (m, k)).copy()
    q = np.full((n, k), -(2 ** (w_bits - 1)))
    scales = np.full((n, k // 32), round_scaled(255, -100, BFLOAT16))  # 255 * 2**-100
    case = LinearCase(x, FLOAT32, q, pack_weights(q, w_bits), scales, act_bits, FLOAT32, w_bits)
    expected = np.asarray(run(case, "reference"))
    assert (expected & 0x7FFFFFFF).min() > 0  # nothing cancelled to zero
    check_bits(case, "amx", run(case, "amx"), expected)
