"""The contract's independent test vectors: every path reproduces their bits exactly."""

import numpy as np
import pytest

from exactness.formats import finite_mask
from exactness.suite.cases import load_vectors
from exactness.suite.counterexamples import check_bits
from exactness.suite.reference import oracle_linear, reference_linear

pytestmark = pytest.mark.stage("vectors")  # make verify's stage

VECTORS = load_vectors()


def test_the_vectors_are_all_there():
    """Contract v1, v1.1 at act_bits = 32, and v1.2's non-finite rows: in each of those two rows
    of x hold an inf or a NaN, and every output of theirs is the canonical NaN."""
    assert len(VECTORS) == 36 + 18 + 12
    assert sum(c.act_bits == 32 and "nonfinite" not in c.name for c in VECTORS) == 18
    assert all(np.any(c.expected != 0) for c in VECTORS if "zeros" not in c.name)
    nonfinite = [c for c in VECTORS if "nonfinite" in c.name]
    assert len(nonfinite) == 12
    for c in nonfinite:
        bad = ~finite_mask(c.x_bits, c.x_format).all(axis=1)
        assert bad.sum() == 2 and (c.expected[bad] == c.out_format.nan_bits).all(), c
        assert finite_mask(c.expected[~bad], c.out_format).any(), c


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
    """All 66 at once, without fixtures: the planted-bug catalogue calls this one."""
    for case in VECTORS:
        got = reference_linear(case.x_bits, case.x_format, case.weight_packed, case.scale_bits,
                               **case.kwargs())
        check_bits(case, "reference", got, case.expected, source="vectors")


def test_every_vector_through_the_oracle():
    for case in VECTORS:
        got = oracle_linear(case.x_bits, case.x_format, case.weight_packed, case.scale_bits,
                            **case.kwargs())
        check_bits(case, "oracle", np.array(got), case.expected, source="vectors")
