"""The Python-int oracle and the numpy reference agree bit for bit on generated cases."""

import numpy as np
import pytest
from hypothesis import given, note
from hypothesis import strategies as st

from exactness import dataflow
from exactness.contract import BFLOAT16, FLOAT32, act_qmax
from exactness.suite.counterexamples import check_bits
from exactness.suite.reference import (
    oracle_linear,
    oracle_quantize_row,
    quantize_activations,
    reference_linear,
    split_scales,
)
from exactness.suite.strategies import activation_bits, formats, linear_cases, scale_bits

pytestmark = pytest.mark.stage("reference")  # make verify's stage


def run_both(case):
    args = (case.x_bits, case.x_format, case.weight_packed, case.scale_bits)
    return np.array(oracle_linear(*args, **case.kwargs())), reference_linear(*args,
                                                                              **case.kwargs())


@given(linear_cases(max_k=160, max_n=4, max_rows=3))
def test_reference_matches_oracle(case):
    want, got = run_both(case)
    note(f"oracle={want.tolist()} reference={got.tolist()}")
    check_bits(case, "reference", got, want)


@given(formats, st.sampled_from((4, 8, 16)), st.data())
def test_quantize_matches_oracle(fmt, act_bits, data):
    x = data.draw(activation_bits(3, 64, fmt, act_bits))
    qa, e = quantize_activations(x, fmt, act_bits)
    for r in range(3):
        want_qa, want_e = oracle_quantize_row(x[r], fmt, act_bits)
        assert qa[r].tolist() == want_qa and e[r] == want_e
    assert np.abs(qa).max() <= act_qmax(act_bits)


@given(st.data())
def test_wide_spread_rows_take_the_python_path(data):
    """Rows whose scale exponents span more than int64 holds are computed exactly all the same."""
    case = data.draw(linear_cases(max_k=96, max_n=3, max_rows=2, w_bits=4, min_k=64))
    case.scale_bits = data.draw(scale_bits(case.q.shape[0], case.x_bits.shape[1] // 32,
                                           kind="spread"))
    case.scale_bits[:, 0] = 0x0001  # 2**-133 beside ...
    case.scale_bits[:, -1] = 0x7F00  # ... 2**127: a spread of 260 in every row
    _, _, _, spread = split_scales(case.scale_bits)
    assert (spread > dataflow.max_safe_spread(case.x_bits.shape[1], 4, case.act_bits)).all()
    want, got = run_both(case)
    assert (got == want).all()


def test_full_kimi_size_row_is_fast_and_matches_itself_per_row():
    """7168 -> 2048 at full size: rows do not depend on each other (batch invariance)."""
    rng = np.random.default_rng(7)
    from exactness.formats import pack_weights

    q = rng.integers(-8, 8, (2048, 7168))
    packed = pack_weights(q, 4)
    scales = 0x3C00 + rng.integers(0, 128, (2048, 224))
    x = rng.integers(0, 0x7F00, (3, 7168)) | (rng.integers(0, 2, (3, 7168)) << 15)
    both = reference_linear(x, BFLOAT16, packed, scales, act_bits=16)
    one = reference_linear(x[1:2], BFLOAT16, packed, scales, act_bits=16)
    assert (both[1] == one[0]).all() and np.count_nonzero(both) > 6000


def test_extreme_case_reaches_the_group_bound():
    """All weights -8, every activation at -Qa: |P| = 32 * 8 * Qa exactly, no overflow."""
    from exactness.formats import pack_weights, round_scaled

    qmax = act_qmax(16)
    x = np.full((1, 32), round_scaled(-qmax, 0, FLOAT32))
    packed = pack_weights(np.full((1, 32), -8), 4)
    y = reference_linear(x, FLOAT32, packed, np.array([[0x3F80]]), act_bits=16)  # scale 1.0
    assert y[0, 0] == round_scaled(32 * 8 * qmax, 0, FLOAT32)
