"""make verify's pytest sessions: one session, a verdict per stage, never a silent pass."""

import subprocess

import pytest

from exactness.suite import verify


def session_outcome(monkeypatch, tmp_path, returncode: int, cases: list[tuple[str, bool]]):
    """Runs a two-stage PytestSession on a pytest stand-in that exits `returncode` and leaves a
    JUnit XML of `cases` (classname, failed); each stage's result."""
    monkeypatch.setattr(verify, "REPORTS", tmp_path)
    session = verify.PytestSession("s")
    session.stage("first", "")
    session.stage("second", "")
    stage_of = {"tests.test_a": "first", "tests.test_b": "second",
                "tests.test_c.TestClass": "second"}  # what each module's pytestmark says

    def fake_pytest(cmd, **kwargs):
        assert "--stage=first" in cmd and "--stage=second" in cmd
        body = "".join(f'<testcase classname="{name}" name="t{i}" time="1.5">'
                       + (f'<properties><property name="stage" value="{stage_of[name]}"/>'
                          f'</properties>' if name in stage_of else "")
                       + f'{"<failure/>" if failed else ""}</testcase>'
                       for i, (name, failed) in enumerate(cases))
        (tmp_path / "junit-s.xml").write_text(f"<testsuites><testsuite>{body}"
                                              f"</testsuite></testsuites>")
        return subprocess.CompletedProcess(cmd, returncode, "", "")

    monkeypatch.setattr(verify.subprocess, "run", fake_pytest)
    return session.run("ci", ["first", "second"])


def test_each_stage_reads_its_own_tests(monkeypatch, tmp_path):
    got = session_outcome(monkeypatch, tmp_path, 1, [
        ("tests.test_a", True), ("tests.test_b", False), ("tests.test_c.TestClass", False)])
    assert got["first"].verdict == "failed" and got["first"].failures == ["tests.test_a::t0"]
    assert got["second"].verdict == "passed" and got["second"].checks == 2
    assert got["second"].seconds == 3.0


@pytest.mark.parametrize("returncode, cases", [
    (2, [("tests.test_a", False), ("tests.test_b", False)]),  # a collection error
    (1, [("tests.test_a", False), ("tests.test_b", False), ("tests.test_x", True)]),  # elsewhere
    (0, [("tests.test_a", False)]),  # the second stage ran no test
])
def test_an_unexplained_outcome_is_unknown(monkeypatch, tmp_path, returncode, cases):
    got = session_outcome(monkeypatch, tmp_path, returncode, cases)
    assert "unknown" in {r.verdict for r in got.values()}
    assert "failed" not in {r.verdict for r in got.values()}


@pytest.mark.parametrize("thorough, stages, verdict, recorded", [
    (True, None, "passed", True),
    (False, None, "passed", False),  # the ci profile vouches for nothing thorough
    (True, ["fake"], "passed", False),  # a subset of the stages
    (True, None, "failed", False),
    (True, None, "unknown", False),
])
def test_only_an_exact_thorough_run_of_every_stage_is_recorded_for_the_gate(
        monkeypatch, tmp_path, thorough, stages, verdict, recorded):
    from exactness.suite import gate

    monkeypatch.setattr(verify, "REPORTS", tmp_path)
    monkeypatch.setattr(verify, "STAGES", [verify.Stage(
        "fake", "", lambda profile: verify.StageResult("fake", verdict, checks=1))])
    calls = []
    monkeypatch.setattr(gate, "record_thorough_verdict", lambda *args: calls.append(args))
    assert verify.run(thorough, stages) == (0 if verdict == "passed" else 1)
    assert len(calls) == recorded
