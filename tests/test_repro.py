"""A planted kernel bug: verify exits 1 and leaves a counterexample whose replay shows the bits;
without the bug the same replay exits 0. A file repro cannot read exits 2, never 0."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from exactness.contract import ExactnessError
from exactness.suite import counterexamples
from exactness.suite.gate import repro
from tests.cli import main_here

pytestmark = pytest.mark.stage("reliability")  # make verify's stage

ROOT = Path(__file__).resolve().parent.parent


def cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "exactness", *args], cwd=ROOT, text=True,
                          capture_output=True, env={**os.environ, **(env or {})})


@pytest.fixture
def cli_here(capsys, monkeypatch):
    """`python -m exactness ARGS` in this process (tests.cli), with `env` set for the call
    (EXACTNESS_MUTANT plants its mutant for the call alone);
    test_cli_refuses_a_bad_file_in_one_line_and_still_replays_the_others runs the command."""

    def run(*args, env=None):
        with monkeypatch.context() as scope:
            for name, value in (env or {}).items():
                scope.setenv(name, value)
            return main_here(capsys, *args)

    return run


def test_planted_kernel_bug_is_caught_saved_and_replayed(tmp_path, cli_here):
    from exactness.kernels.cpu import vnni_library

    # the CPU path's activation exponent off by one: in the C kernel, or where that does not run
    # here, in the int8-GEMM fallback's Python
    bug = ("vnni-row-exponent-too-small" if any(b.library() for b in vnni_library.BUILDS)
           else "activation-exponent-too-large")
    env = {"EXACTNESS_MUTANT": bug, "EXACTNESS_COUNTEREXAMPLES": str(tmp_path),
           "TRITON_INTERPRET": "1"}
    # its reports apart: the repository's are the running make verify's (its tallies too); one
    # worker: this test already runs beside others; the CPU paths' checks only (the
    # interpreted Triton ones, two thirds of the stage's time, cannot meet this bug)
    verify = cli("verify", "--stage", "vectors", "--select", "not triton", env={
        **env, "EXACTNESS_REPORTS": str(tmp_path / "reports"), "EXACTNESS_WORKERS": "1"})
    assert verify.returncode == 1, verify.stdout
    assert "NOT exact" in verify.stdout and "-k 'not triton'" in verify.stdout
    files = sorted(tmp_path.glob("cpu-*.json"))
    assert files, verify.stdout
    doc = json.loads(files[0].read_text())
    assert doc["format"] == "exactness-counterexample" and doc["path"] == "cpu"
    assert doc["expected_bits"] != doc["actual_bits"]
    still = cli_here("repro", str(files[0]), env=env)
    assert still.returncode == 1 and "DIFFERS" in still.stdout
    assert "first differing bit" in still.stdout and re.search(r"row \d+, out \d+", still.stdout)
    fixed = cli_here("repro", str(files[0]))
    assert fixed.returncode == 0 and "fixed" in fixed.stdout, fixed.stdout


def test_planted_grouped_kernel_bug_is_caught_saved_and_replayed(tmp_path, cli_here):
    """A grouped kernel's bug (the neighbouring expert's weights) fails the grouped projection
    property, which leaves a counterexample with its routing; it replays as still failing under
    the bug, naming the expert, and as fixed without it."""
    from exactness.suite.paths import require

    require("vnni-grouped")  # the planted bug is in the C kernel
    env = {"EXACTNESS_MUTANT": "grouped-neighbouring-experts-weights",
           "EXACTNESS_COUNTEREXAMPLES": str(tmp_path), "HYPOTHESIS_PROFILE": "ci-kill"}
    test = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "tests/test_moe.py::test_grouped_projection_matches_reference"
                           "[vnni-grouped]"], cwd=ROOT, text=True, capture_output=True,
                          env={**os.environ, **env})
    assert test.returncode == 1, test.stdout[-2000:]
    files = sorted(tmp_path.glob("vnni-grouped-*.json"))
    assert files, test.stdout[-2000:]
    assert json.loads(files[0].read_text())["routing"]
    still = cli_here("repro", "--path", "vnni-grouped", str(files[0]), env=env)
    assert still.returncode == 1 and "DIFFERS" in still.stdout and "expert" in still.stdout
    fixed = cli_here("repro", str(files[0]))
    assert fixed.returncode == 0 and "fixed" in fixed.stdout, fixed.stdout


# --------------------------------------------------------------------------- files repro refuses
# repro never says "fixed" about a file it could not read: it names the file and where, on one
# line of stderr, and exits 2 (1 is "still differs", 0 "fixed").

VALID = ROOT / "tests" / "counterexamples" / "final-tie-and-subnormal-tie-bf16.json"  # bf16, w4


def document() -> dict:
    return json.loads(VALID.read_text())


def widened(key):  # one more leading hex digit: a pattern one bit (or more) past its key's width
    def change(doc):
        doc[key][0][0] = "1" + doc[key][0][0]
    return change


def assigned(key, value):
    def change(doc):
        doc[key] = value
    return change


def deleted(key):
    def change(doc):
        del doc[key]
    return change


def pattern(key, value, row=0, column=0):
    def change(doc):
        doc[key][row][column] = value
    return change


def shorter_row(doc):
    doc["x_bits"][1].pop()


def missing_scale_row(doc):
    doc["weight_scale_bits"].pop()


def other_shape(doc):
    doc["shape"]["M"] = 4


# bf16 x, int32 packed words, bf16 scales, bf16 outputs: 17, 33, 17 and 17 bits
OUT_OF_WIDTH = ("x_bits", "weight_packed", "weight_scale_bits", "expected_bits")

MALFORMED_DOCUMENTS = {
    "other-format": assigned("format", "something-else"),
    "newer-version": assigned("version", 3),
    "version-0": assigned("version", 0),
    "version-as-text": assigned("version", "1"),
    "missing-x_bits": deleted("x_bits"),
    "missing-source": deleted("source"),
    "act_bits-as-text": assigned("act_bits", "16"),
    "act_bits-5": assigned("act_bits", 5),
    "x_dtype-int4": assigned("x_dtype", "int4"),
    "unknown-path": assigned("path", "no-such-path"),
    "ragged-rows": shorter_row,
    "missing-scale-row": missing_scale_row,
    "shape-disagrees": other_shape,
    "junk-hex": pattern("x_bits", "zz"),
    "negative-hex": pattern("x_bits", "-001"),
    "prefixed-hex": pattern("x_bits", "0x3f"),
    "number-not-text": pattern("x_bits", 16256),
    "non-finite-scale": pattern("weight_scale_bits", "7f80"),
}

MALFORMED_TEXTS = {
    "empty": b"",
    "not-json": b"{not json",
    "not-utf8": b"\x80\x81{",
    "a-list": b"[1, 2]",
    "deeply-nested": b"[" * 100_000 + b"]" * 100_000,
}


def refused(capsys, file) -> str:
    """Run repro on `file`; assert exit 2, nothing on stdout, one stderr line naming the file."""
    assert repro.main([str(file)]) == 2
    out, err = capsys.readouterr()
    assert "fixed" not in out and "exact" not in out, out
    assert len(err.strip().splitlines()) == 1 and str(file) in err, err
    return err


@pytest.mark.parametrize("key", OUT_OF_WIDTH)
def test_out_of_width_pattern_is_refused(key, tmp_path, capsys):
    doc = document()
    widened(key)(doc)
    file = tmp_path / "wide.json"
    file.write_text(json.dumps(doc))
    err = refused(capsys, file)
    assert f"{key} row 0" in err and "bits" in err, err


def routed_document() -> dict:
    """A grouped projection's valid document: 3 rows of K = 64 to two experts of two parts of
    2 outputs (2 is "no expert")."""
    from exactness.contract import BFLOAT16
    from exactness.formats import pack_weights
    from exactness.suite.cases import LinearCase
    from exactness.suite.paths import run

    rng = np.random.default_rng(0)
    q = rng.integers(-8, 8, (8, 64))
    case = LinearCase(rng.integers(0x3C00, 0x4000, (3, 64)), BFLOAT16, q, pack_weights(q, 4),
                      rng.integers(0x3C00, 0x3D00, (8, 2)), 16, BFLOAT16, 4,
                      routing=np.array([[0, 1], [1, 2], [2, 2]]), experts=2, parts=2)
    want = run(case, "reference")
    return counterexamples.to_document(case, path="vnni-grouped", expected=want, actual=want)


def routing_cell(value, row=0, column=0):
    def change(doc):
        doc["routing"][row][column] = value
    return change


MALFORMED_ROUTED = {
    "routing-in-version-1": assigned("version", 1),
    "experts-not-dividing-n": assigned("experts", 7),
    "experts-zero": assigned("experts", 0),
    "parts-not-dividing": assigned("parts", 5),
    "parts-missing": deleted("parts"),
    "routing-rows-missing": lambda doc: doc["routing"].pop(),
    "routing-ragged": lambda doc: doc["routing"][0].append(0),
    "id-past-padding": lambda doc: routing_cell(doc["experts"] + 1)(doc),
    "id-negative": routing_cell(-1),
    "id-as-text": routing_cell("0"),
    "id-as-bool": routing_cell(True),
    "expert-twice": lambda doc: doc["routing"][0].__setitem__(slice(None),
                                                              [0] * len(doc["routing"][0])),
}


MALFORMED = {**{name: (document, change) for name, change in MALFORMED_DOCUMENTS.items()},
             **{f"routed-{name}": (routed_document, change)
                for name, change in MALFORMED_ROUTED.items()}}


@pytest.mark.parametrize("make, change", MALFORMED.values(), ids=MALFORMED)
def test_malformed_document_is_refused(make, change, tmp_path, capsys):
    """A layer's document, or a grouped projection's (its routing), with one thing wrong."""
    doc = make()
    change(doc)
    file = tmp_path / "bad.json"
    file.write_text(json.dumps(doc))
    refused(capsys, file)


def test_a_routed_document_reads_back_and_replays_clean(tmp_path, capsys):
    doc = routed_document()
    file = tmp_path / "routed.json"
    file.write_text(json.dumps(doc))
    case, _ = counterexamples.read(file)
    assert case.routing is not None and case.experts == doc["experts"]
    assert repro.main([str(file)]) == 0  # every path, the grouped kernels' too
    out = capsys.readouterr().out
    assert "2 experts" in out and "vnni-grouped" in out and "fixed" in out, out


@pytest.mark.parametrize("text", MALFORMED_TEXTS.values(), ids=MALFORMED_TEXTS)
def test_unreadable_text_is_refused(text, tmp_path, capsys):
    file = tmp_path / "bad.json"
    file.write_bytes(text)
    refused(capsys, file)


def test_a_directory_and_a_missing_file_are_refused(tmp_path, capsys):
    refused(capsys, tmp_path)
    refused(capsys, tmp_path / "no-such-file.json")


def test_the_error_names_the_file_the_key_and_the_row(tmp_path):
    doc = document()
    shorter_row(doc)
    file = tmp_path / "ragged.json"
    file.write_text(json.dumps(doc))
    with pytest.raises(counterexamples.CounterexampleFileError, match="x_bits row 1") as error:
        counterexamples.read(file)
    assert str(file) in str(error.value)
    assert isinstance(error.value, ExactnessError) and isinstance(error.value, ValueError)


def test_non_finite_bits_are_shown_not_raised(tmp_path, capsys):
    """Output bits may be inf or NaN (a wrong path, an expected overflow): the diff shows them."""
    doc = document()
    doc["expected_bits"][0][:2] = ["ff80", "7fc1"]
    file = tmp_path / "inf.json"
    file.write_text(json.dumps(doc))
    assert repro.main(["--path", "reference", str(file)]) == 0
    out = capsys.readouterr().out
    assert "expected bits differ" in out and "0xff80 (-inf)" in out and "0x7fc1 (nan)" in out, out


def test_cli_refuses_a_bad_file_in_one_line_and_still_replays_the_others(tmp_path):
    doc = document()
    widened("x_bits")(doc)
    wide = tmp_path / "wide.json"
    wide.write_text(json.dumps(doc))
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    done = cli("repro", "--path", "reference", str(wide), str(VALID), str(broken))
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 2 and str(wide) in lines[0] and str(broken) in lines[1], done.stderr
    assert str(wide) not in done.stdout and str(broken) not in done.stdout
    assert f"{VALID}: user counterexample" in done.stdout and "fixed" in done.stdout
