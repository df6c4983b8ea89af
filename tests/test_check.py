"""`python -m exactness check`: the suite on kernels this project did not write. Each property is
shown to refute a planted bug of its kind (tests/planted_kernels.py), with a counterexample file
that replays; the peers' verdicts are pinned, so a change in them is seen."""

from __future__ import annotations

import json
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings

from exactness.contract import BFLOAT16, FLOAT32
from exactness.formats import decode, round_scaled
from exactness.suite.gate.repro import main as repro
from exactness.suite.peers import command as check_command
from exactness.suite.peers import properties as checker
from exactness.suite.peers.properties import CheckError, Claim, check
from exactness.suite.strategies import linear_cases
from exactness.suite.truth import correctly_rounded_bits, true_product, ulp_errors

pytestmark = pytest.mark.stage("reliability")

PLANTED = "tests.planted_kernels"


def verdicts(report) -> dict[str, str]:
    return {v.prop: v.verdict for v in report.verdicts}


def _value(bits: int, fmt) -> Fraction:
    m, e = decode(int(bits), fmt)
    return Fraction(m) * Fraction(2) ** e


@settings(max_examples=25)
@given(linear_cases(max_k=128, max_n=4, max_rows=3, w_bits=4))
def test_the_true_product_is_the_fractions_sum(case):
    """truth.true_product against Fractions, at every scale spread the strategies draw."""
    t, e = true_product(case.x_bits, case.x_format, case.q, case.scale_bits)
    assert np.abs(case.x_bits).any() or not t.any()
    m, k, n = case.shape
    for r in range(m):
        for c in range(n):
            want = sum(_value(case.x_bits[r, i], case.x_format) * int(case.q[c, i])
                       * _value(case.scale_bits[c, i // 32], BFLOAT16) for i in range(k))
            assert Fraction(int(t[r, c])) * Fraction(2) ** int(e[r, c]) == want


def test_ulp_errors_measure_from_the_true_value():
    """Correctly rounded: at most half an ulp; one pattern away: between a half and 1.5; an
    infinity where the truth is finite: inf. A planted error of a whole ulp is seen."""
    t = np.array([[3 * 2**30 + 1, -(2**40) - 2**15, 5]], dtype=object)
    e = np.array([[-20, -30, -149]])
    want = correctly_rounded_bits(t, e, FLOAT32)
    assert list(want[0]) == [round_scaled(int(v), int(x), FLOAT32)
                             for v, x in zip(t[0], e[0], strict=True)]
    exact = ulp_errors(want, t, e, FLOAT32)
    assert (exact <= 0.5).all() and exact[0, 0] > 0
    off = ulp_errors(want + 1, t, e, FLOAT32)
    assert ((off > 0.5) & (off <= 1.5)).all()
    inf = ulp_errors(np.array([[0x7F800000, 0, 0]]), t, e, FLOAT32)
    assert inf[0, 0] == np.inf


def test_an_exact_outside_kernel_passes_every_property(tmp_path):
    report = check("exactness.suite.peers.kernels:exact16", examples=4, directory=tmp_path)
    assert verdicts(report) == dict.fromkeys(checker.PROPERTIES, "passed"), \
        check_command.render(report)
    assert all(v.inputs > 0 for v in report.verdicts)
    assert not list(tmp_path.iterdir())


def test_a_registered_kernel_is_checked_as_an_outside_one(tmp_path):
    report = check("int8-gemm", Claim("exact", 8), examples=3, directory=tmp_path,
                   properties=("claim", "tails"))
    assert report.ok, check_command.render(report)


@pytest.mark.parametrize("factory, claim, refuted", [
    ("one_ulp_off", Claim("exact"), "claim"),
    ("one_ulp_off", Claim("w4a16", max_ulp=0.5), "claim"),
    ("batch_dependent", Claim("w4a16"), "batch-invariant"),
    ("nondeterministic", Claim("w4a16"), "deterministic"),
    ("nan_swallowed", Claim("w4a16"), "non-finite"),
    ("nan_with_its_sign_set", Claim("exact"), "non-finite"),
    ("k_tail_dropped", Claim("w4a16", max_ulp=1), "tails"),
])
def test_each_property_refutes_its_planted_bug_and_the_file_replays(
        tmp_path, capsys, factory, claim, refuted):
    kernel = f"{PLANTED}:{factory}"
    report = check(kernel, claim, examples=12, directory=tmp_path, properties=(refuted,))
    (verdict,) = report.verdicts
    assert verdict.verdict == "refuted", check_command.render(report)
    doc = json.loads(verdict.file.read_text())
    assert (doc["kernel"], doc["property"], doc["claim"]) == (kernel, refuted, claim.name)
    assert verdict.file.name.startswith("tests.planted_kernels-" + factory)
    assert repro([str(verdict.file), "--kernel", kernel]) == 1
    assert repro([str(verdict.file)]) == 1  # the file names its kernel
    assert "still fails" in capsys.readouterr().out
    # the same input on a sound kernel of the same claim: the property holds
    sound = "exactness.suite.peers.kernels:exact16" if claim.name == "exact" else \
        f"{PLANTED}:correctly_rounded"
    assert repro([str(verdict.file), "--kernel", sound]) == 0, capsys.readouterr().out


def test_a_kernel_that_does_not_refuse_inf_is_refuted_under_refuse(tmp_path):
    report = check("exactness.suite.peers.kernels:compressed_tensors_bf16", Claim("w4a16",
                   non_finite="refuse"), examples=3, directory=tmp_path,
                   properties=("non-finite",))
    assert verdicts(report) == {"non-finite": "refuted"}
    assert "was not refused" in report.verdicts[0].detail


@pytest.mark.parametrize("spec, message", [
    ("no_such_module_here:f", "cannot import 'no_such_module_here'"),
    ("exactness.suite.peers.kernels:missing", "has no callable 'missing'"),
    ("no-such-kernel", "is no MODULE:FACTORY and no kernel named 'no-such-kernel'"),
])
def test_a_kernel_that_cannot_be_loaded_is_a_typed_error(spec, message):
    with pytest.raises(CheckError, match=message):
        check(spec, examples=1)


@pytest.mark.parametrize("claim, message", [
    (dict(name="fast"), "--claim must be one of exact, w4a16, got 'fast'"),
    (dict(act_bits=12), "--act-bits must be one of"),
    (dict(non_finite="ignore"), "--non-finite must be one of nan, refuse, propagate"),
    (dict(max_ulp=-1.0), "--max-ulp must be a number >= 0"),
])
def test_bad_options_are_typed_errors(claim, message):
    with pytest.raises(CheckError, match=message):
        Claim(**claim)


def test_the_command_line_exits_by_the_verdict(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("EXACTNESS_COUNTEREXAMPLES", str(tmp_path))
    assert check_command.main([f"{PLANTED}:one_ulp_off", "--examples", "3", "--property",
                         "claim"]) == 1
    out = capsys.readouterr().out
    assert "claim            refuted" in out and "--kernel tests.planted_kernels:one_ulp_off" in out
    assert check_command.main(["nowhere:f"]) == 2
    assert "cannot import" in capsys.readouterr().err


@pytest.mark.parametrize("kernel, multiple, exact, batch, tails", [
    ("compressed_tensors_bf16", 1, "refuted", "passed", "passed"),
    ("torch_int4_cpu", 16, "refuted", "passed", "refuted"),
    ("exact16", 1, "passed", "passed", "passed"),
])
def test_the_peers_verdicts(tmp_path, kernel, multiple, exact, batch, tails):
    """What docs/PEERS.md reports, pinned: the contract's bits only from this project's layer;
    torch's int4 kernel refuses N that is no multiple of 16."""
    spec = f"exactness.suite.peers.kernels:{kernel}"
    got = check(spec, Claim("exact"), examples=3, n_multiple=multiple, scales="qat",
                directory=tmp_path, properties=("claim",))
    assert verdicts(got)["claim"] == exact
    w4 = check(spec, Claim("w4a16"), examples=3, n_multiple=multiple, scales="qat",
               directory=tmp_path, properties=("claim", "batch-invariant", "tails"))
    assert verdicts(w4) == {"claim": "passed", "batch-invariant": batch, "tails": tails}
    assert w4.worst_ulp is not None and w4.worst_ulp >= 0


def test_a_file_of_the_projects_paths_replays_on_a_kernel(capsys):
    """repro FILE --kernel on a corpus file (no property of its own): its claim, exact."""
    file = str(Path(__file__).parent / "counterexamples" / "final-tie-and-subnormal-tie-bf16.json")
    assert repro([file, "--kernel", "exactness.suite.peers.kernels:exact16"]) == 0
    assert repro([file, "--kernel", f"{PLANTED}:one_ulp_off"]) == 1
    assert "property 'claim'" in capsys.readouterr().out


def test_a_registered_kernel_that_cannot_run_here_is_unknown_not_refuted(monkeypatch, tmp_path):
    """Nothing of a kernel that cannot run on this machine is checked (a CPU feature or Triton
    missing): each property is unknown, saying why, and no counterexample is written."""
    from exactness.kernels import REGISTRY
    from exactness.kernels.registry import by_name, no

    monkeypatch.setattr(by_name(REGISTRY, "int8-gemm"), "available",
                        lambda device: no("planted: a CPU without it"))
    report = check("int8-gemm", examples=3, directory=tmp_path)
    assert verdicts(report) == dict.fromkeys(checker.PROPERTIES, "unknown") and not report.ok
    assert all(v.detail == "it cannot run here: planted: a CPU without it" and v.inputs == 0
               for v in report.verdicts)
    assert not list(tmp_path.iterdir())
