"""The CI gate's choice of profile (exactness/suite/gate/ci.py), in a repository of its own."""

import subprocess

import pytest

from exactness.suite.gate import ci as gate


def git(root, *args):
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=root,
                   check=True, capture_output=True)


def commit(root, path, text):
    (root / path).parent.mkdir(parents=True, exist_ok=True)
    (root / path).write_text(text)
    git(root, "add", "-A")
    git(root, "commit", "-qm", f"{path}: {text}")


@pytest.fixture
def repo(tmp_path):
    git(tmp_path, "init", "-q")
    commit(tmp_path, "exactness/kernels/kernel.py", "v1")
    commit(tmp_path, "README.md", "v1")
    return tmp_path


def test_no_thorough_verdict_yet_means_thorough(repo):
    chosen, why = gate.profile("HEAD~1", repo)
    assert chosen == "thorough" and "last thorough verdict" in why


def test_a_recorded_verdict_on_these_files_means_ci(repo):
    gate.record_thorough_verdict(gate.watched_digest(repo), 1.0, repo)
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "stamp")
    assert gate.profile("HEAD~1", repo)[0] == "ci"


def test_a_kernel_change_in_the_last_commit_means_thorough(repo):
    gate.record_thorough_verdict(gate.watched_digest(repo), 1.0, repo)
    commit(repo, "exactness/kernels/kernel.py", "v2")
    chosen, why = gate.profile("HEAD~1", repo)
    assert chosen == "thorough" and "changed since HEAD~1" in why


def test_a_kernel_change_behind_a_later_commit_still_means_thorough(repo):
    """What comparing with the previous commit alone missed: a push of several commits whose
    last leaves the kernel alone."""
    gate.record_thorough_verdict(gate.watched_digest(repo), 1.0, repo)
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "stamp")
    commit(repo, "exactness/kernels/kernel.py", "v2")
    commit(repo, "README.md", "v2")
    chosen, why = gate.profile("HEAD~1", repo)
    assert chosen == "thorough" and why.startswith("the watched files differ")
    # verified thoroughly on v2: the ci profile from then on
    gate.record_thorough_verdict(gate.watched_digest(repo), 1.0, repo)
    assert gate.profile("HEAD~1", repo)[0] == "ci"


def test_outside_a_git_checkout_means_thorough(tmp_path):
    assert gate.profile("HEAD~1", tmp_path)[0] == "thorough"


def test_files_edited_while_verify_ran_are_not_recorded(repo):
    began = gate.watched_digest(repo)
    (repo / "exactness/kernels/kernel.py").write_text("edited meanwhile")
    assert not gate.record_thorough_verdict(began, 1.0, repo)
    assert gate.stamped_digest(repo) is None


def test_ci_runs_as_much_of_the_thorough_profile_as_its_time_holds(monkeypatch):
    """gate.thorough_examples: the ci verify's time scaled to the time left, with a margin, at
    most the full profile, and none where not even twice the ci profile fits."""
    from exactness.suite.gate import profiles
    from exactness.suite.gate.ci import thorough_examples

    assert thorough_examples(3600, 60) == 2000  # a fast machine: the full profile
    assert thorough_examples(3600, 600) == 240  # 60 * 3600 / (600 * 1.5)
    assert thorough_examples(1000, 600) == 0  # 66 examples: no more than the ci verdict
    assert thorough_examples(1800, 600) == 120  # exactly twice the ci profile
    monkeypatch.setenv("EXACTNESS_THOROUGH_EXAMPLES", "240")
    assert profiles.thorough_examples() == 240
    for bad in ("0", "2001", "many", "-5"):
        monkeypatch.setenv("EXACTNESS_THOROUGH_EXAMPLES", bad)
        with pytest.raises(ValueError, match="EXACTNESS_THOROUGH_EXAMPLES must be an integer"):
            profiles.thorough_examples()


def test_the_gate_command_prints_the_examples_or_fails_saying_why(capsys):
    from exactness.suite.gate.ci import main

    assert main(["--examples-for", "3600", "--ci-seconds", "600"]) == 0
    assert capsys.readouterr().out.strip() == "240"
    assert main(["--examples-for", "600", "--ci-seconds", "600"]) == 1
    assert "hold no thorough run" in capsys.readouterr().err
