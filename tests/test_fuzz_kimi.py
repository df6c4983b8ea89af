"""Fuzzing the Kimi checkpoint readers: config.json, model.safetensors.index.json and the
safetensors headers. Whatever the bytes or the JSON, the reader loads them or raises
KimiCheckpointError, never another exception; and a refused conversion leaves the model as it was.
Each test is bounded (max_examples, a small tiny-model checkpoint) to a few seconds."""

from __future__ import annotations

import copy
import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from exactness.kimi import (
    KimiCheckpoint,
    KimiCheckpointError,
    KimiConfig,
    KimiModel,
    convert_kimi_to_exact,
)
from tests.kimi_checkpoints import join_safetensors, split_safetensors, write_checkpoint

pytestmark = pytest.mark.stage("reliability")  # make verify's stage

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TINY = dict(hidden_size=64, moe_intermediate_size=32, intermediate_size=128, n_routed_experts=1,
            num_experts_per_tok=1, num_hidden_layers=2)
# keys the readers look at, so that arbitrary objects often reach the deeper checks
KEYS = ["quantization_config", "text_config", "config_groups", "weights", "format",
        "quant_method", "input_activations", "num_bits", "hidden_size", "moe_intermediate_size",
        "weight_map", "dtype", "shape", "data_offsets", "__metadata__"]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=8), inner, max_size=4),
    max_leaves=12)


@st.composite
def mutated(draw, valid):
    """`valid` (a JSON value) with one to three values somewhere inside it replaced by
    arbitrary JSON, or removed."""
    value = copy.deepcopy(valid)
    for _ in range(draw(st.integers(1, 3))):
        parent, key, node = None, None, value
        while isinstance(node, dict | list) and node and (parent is None or draw(st.booleans())):
            key = draw(st.sampled_from(sorted(node) if isinstance(node, dict)
                                       else range(len(node))))
            parent, node = node, node[key]
        if parent is None:  # nothing to descend into
            return draw(json_values)
        if draw(st.booleans()):
            parent[key] = draw(json_values)
        else:
            del parent[key]
    return value


@st.composite
def damaged(draw, data: bytes, hot: int | None = None):
    """`data` truncated, or with one to four bytes flipped (with `hot`, often in its first `hot`
    bytes: a safetensors file's length prefix and header)."""
    if draw(st.booleans()):
        return data[:draw(st.integers(0, len(data) - 1))]
    out = bytearray(data)
    for _ in range(draw(st.integers(1, 4))):
        end = hot if hot is not None and draw(st.booleans()) else len(out)
        out[draw(st.integers(0, end - 1))] ^= draw(st.integers(1, 255))
    return bytes(out)


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> dict[str, Path]:
    """A valid tiny checkpoint (one routed expert), sharded with an index, and as one file."""
    base = tmp_path_factory.mktemp("fuzz")
    return {"sharded": write_checkpoint(base / "sharded", layers={1: [0]}),
            "single": write_checkpoint(base / "single", layers={1: [0]}, single_file=True)}


def with_file(checkpoint: Path, name: str, data: bytes, check: Callable[[Path], None]) -> None:
    """Run check on a copy of `checkpoint` whose file `name` holds `data`."""
    with tempfile.TemporaryDirectory() as tmp:
        copy_dir = Path(tmp) / "ckpt"
        shutil.copytree(checkpoint, copy_dir)
        (copy_dir / name).write_bytes(data)
        check(copy_dir)


def open_or_refuse(directory: Path) -> None:
    try:
        KimiCheckpoint(directory)
    except KimiCheckpointError:
        pass


def convert_or_refuse(directory: Path) -> None:
    model = KimiModel(KimiConfig(**TINY))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        convert_kimi_to_exact(model, directory)
    except KimiCheckpointError:
        after = model.state_dict()
        assert all(torch.equal(after[k], v) for k, v in before.items())  # left untouched


def json_bytes(value) -> bytes:
    return json.dumps(value).encode()


def first_header_bytes(data: bytes) -> int:
    return 8 + int.from_bytes(data[:8], "little")


# --------------------------------------------------------------------------- config.json, the index

# config.json is read when the checkpoint opens; the index, when a model is converted from it
JSON_FILES = pytest.mark.parametrize(("name", "reader"), [
    ("config.json", open_or_refuse),
    ("model.safetensors.index.json", convert_or_refuse)], ids=["config", "index"])


@JSON_FILES
@FUZZ
@given(st.data())
def test_json_values(good, name, reader, data):
    valid = json.loads((good["sharded"] / name).read_text())
    value = data.draw(json_values | mutated(valid))
    with_file(good["sharded"], name, json_bytes(value), reader)


@JSON_FILES
@FUZZ
@given(st.data())
def test_json_bytes(good, name, reader, data):
    valid = (good["sharded"] / name).read_bytes()
    raw = data.draw(st.binary(max_size=64) | damaged(valid))
    with_file(good["sharded"], name, raw, reader)


# --------------------------------------------------------------------------- safetensors headers


prefixed = st.binary(max_size=64).map(lambda body: len(body).to_bytes(8, "little") + body)


@FUZZ
@given(st.binary(max_size=80) | prefixed)
def test_safetensors_arbitrary_bytes(good, raw):
    with_file(good["single"], "model.safetensors", raw, open_or_refuse)


@FUZZ
@given(st.sampled_from(["single", "sharded"]), st.data())
def test_safetensors_damaged_files(good, layout, data):
    name = "model.safetensors" if layout == "single" else "model-00001-of-00002.safetensors"
    valid = (good[layout] / name).read_bytes()
    raw = data.draw(damaged(valid, hot=first_header_bytes(valid)))
    with_file(good[layout], name, raw, convert_or_refuse)


@FUZZ
@given(st.data())
def test_safetensors_header_values(good, data):
    valid = (good["single"] / "model.safetensors").read_bytes()
    header, payload = split_safetensors(valid)
    raw = join_safetensors(data.draw(mutated(header)), payload)
    with_file(good["single"], "model.safetensors", raw, convert_or_refuse)
