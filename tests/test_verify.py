"""make verify's pytest sessions: one session, a verdict per stage, never a silent pass."""

import os
import subprocess
import sys
import zlib

import pytest

from exactness.suite.gate import verify


def session_outcome(monkeypatch, tmp_path, returncode: int, cases: list[tuple[str, bool | str]],
                    select: str | None = None):
    """Runs a two-stage PytestSession (with `select`: only the checks -k picks) on a pytest
    stand-in that exits `returncode` and leaves a JUnit XML of `cases` (classname, failed;
    "skip" for a skipped one); each stage's result."""
    monkeypatch.setattr(verify, "REPORTS", tmp_path)
    session = verify.PytestSession("s")
    session.stage("first", "")
    session.stage("second", "")
    stage_of = {"tests.test_a": "first", "tests.test_b": "second",
                "tests.test_c.TestClass": "second"}  # what each module's pytestmark says

    def fake_pytest(cmd, **kwargs):
        assert "--stage=first" in cmd and "--stage=second" in cmd
        assert ("-k" in cmd) == bool(select) and (not select or cmd[cmd.index("-k") + 1] == select)
        body = "".join(f'<testcase classname="{name}" name="t{i}" time="1.5">'
                       + (f'<properties><property name="stage" value="{stage_of[name]}"/>'
                          f'</properties>' if name in stage_of else "")
                       + ('<skipped message="no C kernel here"/>' if failed == "skip"
                          else '<failure message="boom&#10;more"/>' if failed else "")
                       + "</testcase>"
                       for i, (name, failed) in enumerate(cases))
        (tmp_path / "junit-s.xml").write_text(f"<testsuites><testsuite>{body}"
                                              f"</testsuite></testsuites>")
        return subprocess.CompletedProcess(cmd, returncode, "", "")

    monkeypatch.setattr(verify.subprocess, "run", fake_pytest)
    return session.run("ci", ["first", "second"], select=select)


@pytest.mark.parametrize("select", [None, "not triton"])
def test_each_stage_reads_its_own_tests(monkeypatch, tmp_path, select):
    got = session_outcome(monkeypatch, tmp_path, 1, [
        ("tests.test_a", True), ("tests.test_b", False), ("tests.test_c.TestClass", False)],
        select)
    # a failure names its test and the first line of what it said
    assert got["first"].verdict == "failed" and got["first"].failures == ["tests.test_a::t0: boom"]
    assert got["second"].verdict == "passed" and got["second"].checks == 2
    assert got["second"].seconds == 3.0
    # each check's seconds, for verify.json: where a slow stage's time goes (issue 53)
    assert got["second"].check_seconds == {"tests.test_b::t1": 1.5,
                                           "tests.test_c.TestClass::t2": 1.5}


def test_stage_modules_are_read_without_importing_them(tmp_path):
    """--stage skips a module whose text names none of the chosen stages (never imported); a
    module naming one, by pytestmark or a test's own mark, is collected; without --stage,
    everything is."""
    import conftest

    class Config:
        def __init__(self, stages):
            self.stages = stages

        def getoption(self, name):
            return self.stages

    whole = tmp_path / "test_whole.py"
    whole.write_text('pytestmark = pytest.mark.stage("equivalence")\n')
    one = tmp_path / "test_one.py"
    one.write_text('pytestmark = pytest.mark.stage("reliability")\n'
                   '@pytest.mark.stage( \'vectors\')\ndef test_a(): pass\n')
    helper = tmp_path / "data.py"  # not a test module: pytest's own rules decide
    helper.write_text("")
    assert conftest.stages_named_in(one) == {"reliability", "vectors"}
    ignored = {path.name for path in (whole, one, helper)
               if conftest.pytest_ignore_collect(path, Config(["vectors"]))}
    assert ignored == {"test_whole.py"}
    assert not any(conftest.pytest_ignore_collect(path, Config([])) for path in (whole, one))


def test_a_stage_mark_the_text_does_not_name_is_refused(tmp_path):
    """A stage given by a variable would be invisible to that reading: --stage would drop its
    tests unseen. A full collection refuses it, naming the module."""
    import conftest

    hidden = tmp_path / "test_hidden.py"
    hidden.write_text('STAGE = "vectors"\npytestmark = pytest.mark.stage(STAGE)\n')

    class Item:
        path, nodeid = hidden, "test_hidden.py::test_a"

        def get_closest_marker(self, name):
            return pytest.mark.stage("vectors").mark

    class Config:
        def getoption(self, name):
            return [] if name == "stage" else None

    with pytest.raises(pytest.UsageError, match="test_hidden.py: vectors"):
        conftest.pytest_collection_modifyitems(Config(), [Item()])


@pytest.mark.parametrize("returncode, cases", [
    (2, [("tests.test_a", False), ("tests.test_b", False)]),  # a collection error
    (1, [("tests.test_a", False), ("tests.test_b", False), ("tests.test_x", True)]),  # elsewhere
    (0, [("tests.test_a", False)]),  # the second stage ran no test
])
def test_an_unexplained_outcome_is_unknown(monkeypatch, tmp_path, returncode, cases):
    got = session_outcome(monkeypatch, tmp_path, returncode, cases)
    assert "unknown" in {r.verdict for r in got.values()}
    assert "failed" not in {r.verdict for r in got.values()}


def test_a_stage_that_skipped_a_check_is_unknown_never_passed(monkeypatch, tmp_path):
    """A check that did not run vouches for nothing: its stage is unknown, and says which check
    and why, however many others passed."""
    got = session_outcome(monkeypatch, tmp_path, 0, [
        ("tests.test_a", False), ("tests.test_b", False), ("tests.test_c.TestClass", "skip")])
    assert got["first"].verdict == "passed"
    assert got["second"].verdict == "unknown" and got["second"].checks == 2
    assert "1 of 2 checks skipped" in got["second"].detail
    assert "no C kernel here" in got["second"].detail


def test_a_c_kernel_refused_where_it_should_run_fails_its_checks(monkeypatch):
    """On a CPU with AVX-512 VNNI and a compiler, or where the suite emulates the kernel, a C
    kernel refused (its build or its self-check) is a failure of every check of it, naming why,
    not a skip."""
    from exactness.kernels.cpu import vnni, vnni_library
    from exactness.kernels.registry import no
    from exactness.suite import paths

    refused = no("its self-check failed on the accumulation (exact_linear_limbs, 4-bit weights)")
    avx512 = vnni_library.AVX512
    monkeypatch.setattr(avx512, "status", lambda: (None, refused))
    monkeypatch.setattr(vnni, "warn_fallback", lambda *why: None)
    monkeypatch.setattr(avx512, "missing_features", lambda: [])
    monkeypatch.setenv("CC", "sh")  # a compiler on PATH
    monkeypatch.setenv("EXACTNESS_NATIVE", "1")
    with pytest.raises(pytest.fail.Exception, match="self-check failed on the accumulation"):
        paths.require("vnni-limbs")
    monkeypatch.setattr(avx512, "missing_features", lambda: ["avx512_vnni"])
    with pytest.raises(pytest.skip.Exception, match="self-check failed"):
        paths.require("vnni-limbs")  # no VNNI, and the real kernel asked for: an honest skip
    monkeypatch.setenv("EXACTNESS_NATIVE", "emulate")  # the suite's choice on such a CPU
    with pytest.raises(pytest.fail.Exception, match="self-check failed on the accumulation"):
        paths.require("vnni-limbs")


def test_the_suite_emulates_the_c_kernel_where_the_cpu_lacks_it(monkeypatch):
    """Without AVX-512 VNNI the suite checks the emulated build (a skip would vouch for
    nothing); an EXACTNESS_NATIVE the user set is kept, and a value of none of its modes is a
    typed error naming it."""
    from exactness.contract import ContractValueError
    from exactness.kernels.cpu import vnni_library
    from exactness.suite import paths

    monkeypatch.setattr(vnni_library.AVX512, "missing_features", lambda: ["avx512_vnni"])
    monkeypatch.delenv("EXACTNESS_NATIVE", raising=False)
    said = paths.emulate_the_c_kernel_where_missing()
    assert "(AVX-512 VNNI) emulated" in said and "the C kernel (AVX2): the CPU's own" in said
    assert os.environ["EXACTNESS_NATIVE"] == "emulate"
    monkeypatch.setenv("EXACTNESS_NATIVE", "0")
    assert paths.emulate_the_c_kernel_where_missing() == (
        "the C kernel (AVX-512 VNNI): off (every C build, the AMX kernel with them)")
    monkeypatch.setattr(vnni_library.AVX512, "missing_features", lambda: [])
    monkeypatch.delenv("EXACTNESS_NATIVE")
    assert "instructions" in paths.emulate_the_c_kernel_where_missing()
    assert "EXACTNESS_NATIVE" not in os.environ  # the real kernel, unasked
    monkeypatch.setenv("EXACTNESS_NATIVE", "yes")
    with pytest.raises(ContractValueError, match="EXACTNESS_NATIVE must be one of .*'yes'"):
        vnni_library.mode()


@pytest.mark.parametrize("profile, stages, verdict, recorded, select", [
    ("thorough", None, "passed", True, None),
    ("ci", None, "passed", False, None),  # the ci profile vouches for nothing thorough
    ("smoke", None, "passed", False, None),
    ("thorough", ["fake"], "passed", False, None),  # a subset of the stages
    ("thorough", None, "passed", False, "vnni"),  # a subset of the checks
    ("thorough", None, "failed", False, None),
    ("thorough", None, "unknown", False, None),
])
def test_only_an_exact_thorough_run_of_every_stage_is_recorded_for_the_gate(
        monkeypatch, tmp_path, profile, stages, verdict, recorded, select):
    from exactness.suite.gate import ci as gate

    monkeypatch.setattr(verify, "REPORTS", tmp_path)
    monkeypatch.setattr(verify, "STAGES", [verify.Stage(
        "fake", "", lambda profile: verify.StageResult("fake", verdict, checks=1))])
    calls = []
    monkeypatch.setattr(gate, "record_thorough_verdict", lambda *args: calls.append(args))
    assert verify.run(profile, stages, select=select) == {
        "passed": 0, "failed": 1, "unknown": 3}[verdict]
    assert len(calls) == recorded


def test_a_kernel_refused_by_its_self_check_fails_make_verify(tmp_path):
    """A miscompiled C kernel (a compiler that truncates where the source rounds) fails its
    start-up self-check; where the CPU could run it, make verify then exits non-zero, naming the
    check that failed, instead of verifying the other paths and passing."""
    from exactness.suite.paths import expected_here

    if not expected_here("vnni-limbs"):
        pytest.skip("the C kernel does not run here: no AVX-512 VNNI or no compiler")
    planting = tmp_path / "cc"
    planting.write_text("#!/bin/sh\nfor a; do case \"$a\" in *.c) sed -i "
                        "'s/_MM_FROUND_TO_NEAREST_INT/_MM_FROUND_TO_ZERO/' \"$a\";; esac; done\n"
                        "exec cc \"$@\"\n")
    planting.chmod(0o755)
    env = {**os.environ, "CC": str(planting), "XDG_CACHE_HOME": str(tmp_path / "cache"),
           "EXACTNESS_REPORTS": str(tmp_path / "reports"),  # not the running make verify's
           "EXACTNESS_WORKERS": "1"}
    # the C paths' checks only: the interpreted Triton ones cannot meet this kernel
    done = subprocess.run([sys.executable, "-m", "exactness", "verify", "--stage", "vectors",
                           "--select", "not triton"],
                          cwd=verify.ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 1, done.stdout
    assert "NOT exact" in done.stdout and "self-check failed" in done.stdout, done.stdout


def test_two_shards_cover_what_one_run_covers():
    """verify --shard 1/2 and 2/2 together run every check of one run, each once: every stage
    that is no pytest session on exactly one shard, and each pytest stage's tests split
    between the two (collected as make verify's session collects them)."""
    from exactness.suite.mutants.run import run_tests

    for n in (2, 3):
        alone = [s for s in verify.STAGES if s.session is None]
        assert sorted(verify.stage_shard(s, n) for s in alone) == sorted(
            k % n + 1 for k in range(len(alone)))
    stages = [f"--stage={s.name}" for s in verify.STAGES if s.session is not None]

    def collected(*args):
        code, outcomes = run_tests(["tests"], collect_only=True, extra=[*stages, *args])
        assert code == 0, outcomes.report[-2000:]
        return set(outcomes.collected)

    whole, first, second = collected(), collected("--shard=1/2"), collected("--shard=2/2")
    assert whole and first and second and not first & second
    assert first | second == whole
    assert abs(len(first) - len(second)) <= 1


def test_the_example_database_is_the_directory_ci_keeps_and_its_artifacts(monkeypatch, tmp_path):
    """The dev and thorough profiles' database: EXACTNESS_HYPOTHESIS_DB's directory (CI keeps
    it between runs and uploads it), and CI's artifacts read-only where named, so a failure
    found in CI replays first here."""
    from hypothesis.database import (
        DirectoryBasedExampleDatabase,
        GitHubArtifactDatabase,
        MultiplexedDatabase,
    )

    from exactness.suite.gate.profiles import example_database

    monkeypatch.setenv("EXACTNESS_HYPOTHESIS_DB", str(tmp_path))
    monkeypatch.delenv("EXACTNESS_HYPOTHESIS_GITHUB", raising=False)
    local = example_database()
    assert isinstance(local, DirectoryBasedExampleDatabase) and local.path == tmp_path
    local.save(b"key", b"a failing example")
    monkeypatch.setenv("EXACTNESS_HYPOTHESIS_GITHUB", "owner/repo:db-1,db-2")
    both = example_database()
    assert isinstance(both, MultiplexedDatabase)
    shared = [db._wrapped for db in both._wrapped[1:]]
    assert [db.artifact_name for db in shared] == ["db-1", "db-2"]
    assert all(isinstance(db, GitHubArtifactDatabase) for db in shared)
    assert list(both._wrapped[0].fetch(b"key")) == [b"a failing example"]
    monkeypatch.setenv("EXACTNESS_HYPOTHESIS_GITHUB", "no-slash")
    with pytest.raises(ValueError, match="OWNER/REPO"):
        example_database()


def test_a_repeating_profile_seeds_each_test_from_its_node_id(request, monkeypatch):
    """In the ci profiles every test starts with Python's, numpy's and torch's generators seeded
    from its node id (conftest, profiles.seed_of_test): its own data repeats whatever ran before
    it in its worker. In dev they are left as they are. The hook runs here under each profile,
    so this test checks the same whatever profile runs it."""
    import random

    import numpy as np
    import torch

    from exactness.suite.gate.profiles import SEEDED, seed_of_test

    setup = sys.modules["conftest"].pytest_runtest_setup
    monkeypatch.setenv("EXACTNESS_STAGE", os.environ.get("EXACTNESS_STAGE", "-"))

    def draws(profile):
        monkeypatch.setenv("HYPOTHESIS_PROFILE", profile)
        for _ in range(2):  # whatever the generators held before the hook
            random.random(), np.random.random(), torch.rand(1)
        setup(request.node)
        return random.random(), float(np.random.random()), float(torch.rand(1))

    seed = zlib.crc32(request.node.nodeid.encode())
    random.seed(seed), np.random.seed(seed), torch.manual_seed(seed)
    want = random.random(), float(np.random.random()), float(torch.rand(1))
    assert {"ci", "ci-kill"} <= SEEDED and "dev" not in SEEDED and "thorough" not in SEEDED
    for profile in ("ci", "ci-kill"):
        assert draws(profile) == want
        assert seed_of_test(request.node.nodeid) == seed != seed_of_test("tests/other::test")
    unseeded = draws("dev")
    assert seed_of_test(request.node.nodeid) is None
    assert all(got != w for got, w in zip(unseeded, want, strict=True))
