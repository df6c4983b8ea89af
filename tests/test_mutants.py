"""The mutation catalogue, fast form: every planted bug is caught by its first killer; the planted
bugs of the agreement tests are caught by each of them. (`make mutants` gives the full table.)"""

import os
from unittest import mock

import pytest

from exactness.kernels import native
from exactness.mutants import (
    C_KERNEL,
    CATALOGUE,
    Mutant,
    _killer,
    applied,
    fails,
    mutated_c_kernel,
    runs_here,
)


def survivors(mutant: Mutant, killers) -> list[str]:
    tests = {node: _killer(node) for node in killers}  # imported before the mutant goes in
    with applied(mutant):
        return [node for node, test in tests.items() if not fails(test)]


@pytest.mark.parametrize("mutant", CATALOGUE, ids=lambda m: m.name)
def test_mutant_is_killed(mutant: Mutant):
    if not runs_here(mutant):
        pytest.skip("no C kernel here (AVX-512 VNNI and a C compiler)")
    # make verify asks only for the first killer (EXACTNESS_FIRST_KILLER=1); make test for all
    every = mutant.every_killer and os.environ.get("EXACTNESS_FIRST_KILLER") != "1"
    killers = mutant.killers if every else mutant.killers[:1]
    alive = survivors(mutant, killers)
    assert not alive, f"{mutant.name} ({mutant.bug}) survived {alive}"


@pytest.mark.parametrize("mutant", [m for m in CATALOGUE if m.target == C_KERNEL],
                         ids=lambda m: m.name)
def test_the_start_up_self_check_refuses_the_c_mutant(mutant: Mutant):
    """Had the C kernel carried the bug, the layer would not have used it."""
    if not runs_here(mutant):
        pytest.skip("no C kernel here (AVX-512 VNNI and a C compiler)")
    assert not native._self_check(mutated_c_kernel(mutant))


def test_every_killer_runs_without_arguments():
    """A killer that needed arguments would raise a TypeError under any mutant: a kill that
    proves nothing. _killer refuses one."""
    for node in {node for m in CATALOGUE for node in m.killers}:
        _killer(node)

    def parametrized(path, dtype):
        pass

    with mock.patch("tests.test_errors.test_good_input_passes", parametrized):
        with pytest.raises(ValueError, match=r"needs arguments \['path', 'dtype'\]"):
            _killer("tests/test_errors.py::test_good_input_passes")


def test_a_failing_pytest_raises_counts_as_a_kill():
    def lets_it_through():
        with pytest.raises(ValueError):
            pass

    assert fails(lets_it_through) and not fails(lambda: None)


def test_catalogue_covers_the_bug_classes():
    assert len(CATALOGUE) >= 15
    assert len({m.name for m in CATALOGUE}) == len(CATALOGUE)


def test_applied_restores_the_original():
    import exactness.formats as formats
    import exactness.modules as modules

    before = formats.unpack_weights, modules._PackedExactLinear.forward
    for mutant in (CATALOGUE[0], next(m for m in CATALOGUE if "forward" in m.target)):
        with applied(mutant):
            assert (formats.unpack_weights, modules._PackedExactLinear.forward) != before
    assert (formats.unpack_weights, modules._PackedExactLinear.forward) == before
