"""The counterexample reader under fuzzing: whatever a file holds, `read` returns a case or raises
CounterexampleFileError, and a document it accepts round-trips (every pattern within its width).

Only `read` is fuzzed: a replay runs every kernel, the Triton interpreter's too, which is slow.
"""

import contextlib
import io
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from exactness.suite import counterexamples
from exactness.suite.gate import repro
from exactness.suite.paths import run
from exactness.suite.strategies import linear_cases, routed_cases

pytestmark = pytest.mark.stage("reliability")  # make verify's stage

PATTERN_KEYS = ("x_bits", "weight_packed", "weight_scale_bits", "expected_bits", "actual_bits")

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                 max_size=4),
    max_leaves=12)
# text that is almost a pattern: hex digits with a few of the characters int(_, 16) forgives
hexish = st.text("0123456789abcdefABCDEF0x-+_ g", max_size=10)


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """One file, rewritten by every example (Hypothesis rejects function-scoped fixtures such
    as tmp_path, which would not be reset between examples)."""
    return tmp_path_factory.mktemp("fuzz") / "counterexample.json"


@st.composite
def documents(draw) -> dict:
    """A valid counterexample document of a small case, as `to_document` writes it: a layer's,
    or a grouped projection's (with its routing)."""
    case = draw(linear_cases(max_k=64, max_n=3, max_rows=2)
                | routed_cases(max_k=64, max_n=2, max_experts=3, max_rows=2))
    want = run(case, "reference")
    path = draw(st.sampled_from(["cpu", "reference", "wide", "simulated-dot32-acc32"]))
    return counterexamples.to_document(case, path=path, expected=want, actual=want)


@st.composite
def mutated_documents(draw) -> dict:
    """A valid document with up to three edits, each at a top-level key or inside its rows (half
    of them in the patterns)."""
    doc = draw(documents())
    for _ in range(draw(st.integers(0, 3))):
        parent, key = doc, draw(st.sampled_from([*doc, "junk"]) | st.sampled_from(PATTERN_KEYS))
        for _ in range(draw(st.integers(0, 2))):  # into a row, then into a pattern
            node = parent.get(key) if isinstance(parent, dict) else parent[key]
            if not isinstance(node, list) or not node:
                break
            parent, key = node, draw(st.integers(0, len(node) - 1))
        old = parent.get(key) if isinstance(parent, dict) else parent[key]
        edit = draw(st.sampled_from(["value", "hex", "widen", "delete", "append"]))
        if edit == "delete":
            if isinstance(parent, list) or key in parent:
                del parent[key]
        elif edit == "append" and isinstance(old, list):
            old.append(draw(st.sampled_from(old) if old else json_values))
        elif edit == "widen" and isinstance(old, str):
            parent[key] = draw(st.sampled_from("0123456789abcdef")) + old
        else:
            parent[key] = draw(hexish if edit == "hex" else json_values)
    return doc


@st.composite
def mutated_texts(draw) -> bytes:
    """A valid document as `write` writes it, with up to three characters inserted, deleted or
    replaced, most of them inside a string (elsewhere most edits only break the JSON)."""
    text = bytearray(json.dumps(draw(documents()), indent=1).encode())
    strings = [i + 1 for i, char in enumerate(text) if char == ord('"')]
    for _ in range(draw(st.integers(1, 3))):
        at = min(draw(st.sampled_from(strings) | st.integers(0, len(text) - 1)), len(text) - 1)
        char = draw(st.sampled_from(b'0f9Fg-x ",[]:'))
        edit = draw(st.sampled_from(["insert", "delete", "replace"]))
        if edit == "insert":
            text.insert(at, char)
        elif edit == "delete":
            del text[at]
        else:
            text[at] = char
    return bytes(text)


def values(rows):
    return None if rows is None else [[int(v, 16) for v in row] for row in rows]


def read_or_refuse(file):
    """`read` returns a case or raises CounterexampleFileError; an accepted document, written
    again from its case, holds the same patterns (none was masked to fit)."""
    try:
        case, doc = counterexamples.read(file)
    except counterexamples.CounterexampleFileError:
        return None
    actual = None if doc.get("actual_bits") is None else np.array(values(doc["actual_bits"]))
    again = counterexamples.to_document(case, path=doc["path"], expected=case.expected,
                                        actual=actual)
    for key in PATTERN_KEYS:
        assert values(doc.get(key)) == values(again[key]), key
    assert [doc["shape"][d] for d in "MKN"] == [again["shape"][d] for d in "MKN"]
    assert (doc["act_bits"], doc["w_bits"]) == (again["act_bits"], again["w_bits"])
    for key in ("experts", "parts", "routing"):  # a grouped projection's, read as written
        assert doc.get(key) == again.get(key) or (key != "routing" and doc.get(key) in (None, 1)
                                                  and "routing" not in again), key
    return case


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_read_of_arbitrary_bytes(scratch, data):
    scratch.write_bytes(data)
    read_or_refuse(scratch)


@settings(max_examples=300, deadline=None)
@given(json_values | st.dictionaries(st.sampled_from([*PATTERN_KEYS, "shape", "act_bits", "path",
                                                     "routing", "experts", "parts"]),
                                     json_values).map(lambda d: {"format": counterexamples.FORMAT,
                                                                 "version": 2, **d}))
def test_read_of_arbitrary_json(scratch, value):
    scratch.write_text(json.dumps(value))
    read_or_refuse(scratch)


@settings(max_examples=200, deadline=None)
@given(mutated_documents())
def test_read_of_a_mutated_document(scratch, doc):
    scratch.write_text(json.dumps(doc))
    read_or_refuse(scratch)


@settings(max_examples=200, deadline=None)
@given(mutated_texts())
def test_read_of_a_mutated_file(scratch, text):
    scratch.write_bytes(text)
    read_or_refuse(scratch)


@settings(max_examples=30, deadline=None)
@given(mutated_documents())
def test_repro_exits_2_exactly_when_read_refuses(scratch, doc):
    """The command line on the same documents, replaying only the reference (cheap)."""
    scratch.write_text(json.dumps(doc))
    try:
        counterexamples.read(scratch)
        readable = True
    except counterexamples.CounterexampleFileError:
        readable = False
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = repro.main(["--path", "reference", str(scratch)])
    assert code == (0 if readable else 2), err.getvalue()
    assert ("fixed" in out.getvalue()) == readable
    assert readable or len(err.getvalue().strip().splitlines()) == 1
