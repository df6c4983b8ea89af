"""The mutation catalogue, fast form: every planted bug is caught by its first killer; the planted
bugs of the agreement tests are caught by each of them. (`make mutants` gives the full table.)"""

import os

import pytest

from exactness.kernels.cpu import amx_library
from exactness.suite.mutants.run import (
    AMX_KERNEL,
    C_FILES,
    CATALOGUE,
    ROOT,
    Mutant,
    applied,
    c_builds,
    judge,
    mutated_amx_kernel,
    mutated_c_kernel,
    run_tests,
    runs_here,
)
from exactness.suite.mutants.targets import AVX2_KERNEL
from exactness.suite.paths import require

pytestmark = pytest.mark.stage("mutants")  # make verify's stage


def by_build(mutants: list[Mutant]) -> list:
    """The mutants as parameters, each C or AMX mutant's tests in one xdist group (with --dist
    loadgroup, as make verify's mutants stage runs): one worker builds it and runs both, where
    two workers started both at once and one waited on the other's build (a cold emulated AMX
    build is about 14 s)."""
    return [pytest.param(m, id=m.name, marks=[pytest.mark.xdist_group(m.name)]
                         if m.target in (*C_FILES, AMX_KERNEL) else []) for m in mutants]


def kernel_of(mutant: Mutant) -> str:
    """The kernel a C or AMX mutant needs: the one whose absence a skip names."""
    return {AMX_KERNEL: "amx", AVX2_KERNEL: "avx2-limbs"}.get(mutant.target, "vnni-limbs")


@pytest.mark.parametrize("mutant", by_build(CATALOGUE))
def test_mutant_is_killed(mutant: Mutant):
    if not runs_here(mutant):  # a skip where there is no C kernel to plant it in, else a failure
        require(kernel_of(mutant))
    # make verify asks only for the first killer (EXACTNESS_FIRST_KILLER=1); make test for all
    every = mutant.every_killer and os.environ.get("EXACTNESS_FIRST_KILLER") != "1"
    verdict = judge(mutant, mutant.killers if every else mutant.killers[:1], every)
    assert verdict.error is None, f"{mutant.name}: the harness failed: {verdict.error}"
    assert verdict.killed_by, f"{mutant.name} ({mutant.bug}) survived {verdict.survivors}"


@pytest.mark.parametrize("mutant", by_build([m for m in CATALOGUE if m.target in C_FILES]))
def test_the_start_up_self_check_refuses_the_c_mutant(mutant: Mutant):
    """Had the C kernel carried the bug, the layer would not have used it: the verdict of its
    first run (the self-check, in a child process) is the one a build's status reads, in every
    build the bug is planted in."""
    if not runs_here(mutant):
        require(kernel_of(mutant))
    for build in c_builds(mutant):
        assert not build.judged(mutated_c_kernel(mutant, build)).verdict, build


@pytest.mark.parametrize("mutant", by_build([m for m in CATALOGUE if m.target == AMX_KERNEL]))
def test_the_start_up_self_check_refuses_the_amx_mutant(mutant: Mutant):
    """Had the AMX kernel carried the bug, the layer would not have used it: the real tiles
    too, where they differ from the emulated ones only in the six tile instructions."""
    if not runs_here(mutant):
        require("amx")
    assert not amx_library.judged(mutated_amx_kernel(mutant)).verdict


def test_every_killer_is_a_test_pytest_collects():
    """A killer is a pytest node id; one that names no test (a renamed test, a parameter that
    is gone) would be a harness error under every mutant, never a kill."""
    killers = sorted({node for m in CATALOGUE for node in m.killers})
    code, outcomes = run_tests(killers, collect_only=True)
    missing = [k for k in killers if not any(c == k or c.endswith("/" + k)
                                             for c in outcomes.collected)]
    assert code == 0 and not missing, (code, missing)


def test_a_harness_error_is_not_a_kill():
    """A killer that is not collected, or that skips, leaves the mutant unjudged: an error."""
    mutant = CATALOGUE[0]
    verdict = judge(mutant, ["tests/test_formats.py::test_no_such_test"])
    assert verdict.killed_by is None and verdict.error
    skipping = "tests/test_modules.py::test_path_matches_reference[no-such-kernel]"
    verdict = judge(mutant, [skipping])
    assert verdict.killed_by is None and verdict.error


def test_a_killer_fails_only_under_its_mutant():
    """The same killer passes unmutated: the kill is the mutant's."""
    code, outcomes = run_tests([CATALOGUE[0].killers[0]])
    assert code == 0 and set(outcomes.calls.values()) == {"passed"}


def test_catalogue_covers_the_bug_classes():
    assert len(CATALOGUE) >= 15
    assert len({m.name for m in CATALOGUE}) == len(CATALOGUE)


def test_applied_restores_the_original():
    import exactness.formats as formats
    from exactness.kernels.cpu import gemm

    before = formats.unpack_weights, gemm.forward
    for mutant in (CATALOGUE[0], next(m for m in CATALOGUE if m.target.endswith("gemm:forward"))):
        with applied(mutant):
            assert (formats.unpack_weights, gemm.forward) != before
    assert (formats.unpack_weights, gemm.forward) == before


def test_every_target_is_found_from_its_object():
    """The catalogue names each target from the object (at(), source()): each resolves, and
    names the object it came from, so a moved function cannot leave a mutant pointing at
    nothing."""
    from exactness import formats
    from exactness.suite.mutants.run import _resolve, at

    assert at(formats.unpack_weights) == "exactness.formats:unpack_weights"
    for mutant in CATALOGUE:
        if mutant.target in (*C_FILES, AMX_KERNEL):
            assert (ROOT / mutant.target).is_file(), mutant.name
            continue
        owner, name, found = _resolve(mutant.target)
        assert at(found) == mutant.target, mutant.name


def test_every_triaged_survivor_is_answered_by_an_argument():
    """docs/mutmut_triage.csv's rows each name one of MUTMUT.md's arguments, once a mutant; a
    row with a verdict no argument gives is reported (make mutmut then fails)."""
    from exactness.suite.mutants.mutmut_score import arguments, triage, unanswered

    rows = triage()
    assert len(rows) >= 200 and len({row["mutant"] for row in rows}) == len(rows)
    assert unanswered(rows, arguments()) == []
    planted = [{"mutant": "m", "change": "c", "verdict": "no such argument"}]
    assert unanswered(planted, arguments()) == ["m: 'no such argument'"]
