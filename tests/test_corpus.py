"""The regression corpus: every counterexample ever kept replays exact on every path, forever."""

import io
from pathlib import Path

import pytest

from exactness.suite.gate.repro import replay

CORPUS = sorted((Path(__file__).parent / "counterexamples").glob("*.json"))


def test_the_corpus_is_not_empty():
    assert len(CORPUS) >= 2


@pytest.mark.parametrize("file", CORPUS, ids=lambda f: f.stem)
def test_counterexample_replays_exact(file):
    out = io.StringIO()
    assert replay(str(file), out=out) == 0, out.getvalue()
