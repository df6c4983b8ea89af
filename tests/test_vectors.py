"""The contract's independent test vectors: every path reproduces their bits exactly."""

import numpy as np
import pytest

from exactness.suite.cases import load_vectors
from exactness.suite.counterexamples import check_bits
from exactness.suite.reference import oracle_linear, reference_linear

pytestmark = pytest.mark.stage("reference")  # make verify's stage

VECTORS = load_vectors()


def test_the_vectors_are_all_there():
    assert len(VECTORS) == 36 + 18  # contract v1, and v1.1 at act_bits = 32
    assert sum(c.act_bits == 32 for c in VECTORS) == 18
    assert all(np.any(c.expected != 0) for c in VECTORS if "zeros" not in c.name)


@pytest.mark.parametrize("case", VECTORS, ids=lambda c: c.name)
def test_oracle_reproduces_vector(case):
    got = oracle_linear(case.x_bits, case.x_format, case.weight_packed, case.scale_bits,
                        **case.kwargs())
    np.testing.assert_array_equal(np.array(got), case.expected)


@pytest.mark.parametrize("case", VECTORS, ids=lambda c: c.name)
def test_reference_reproduces_vector(case):
    got = reference_linear(case.x_bits, case.x_format, case.weight_packed, case.scale_bits,
                           **case.kwargs())
    np.testing.assert_array_equal(got, case.expected)


def test_every_vector():
    """All 54 at once, without fixtures: the planted-bug catalogue calls this one."""
    for case in VECTORS:
        got = reference_linear(case.x_bits, case.x_format, case.weight_packed, case.scale_bits,
                               **case.kwargs())
        check_bits(case, "reference", got, case.expected, source="vectors")


def test_every_vector_through_the_oracle():
    for case in VECTORS:
        got = oracle_linear(case.x_bits, case.x_format, case.weight_packed, case.scale_bits,
                            **case.kwargs())
        check_bits(case, "oracle", np.array(got), case.expected, source="vectors")
