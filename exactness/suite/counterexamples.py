"""Counterexample files: one stable, self-contained format for every failure the project finds.

A failure found by Hypothesis, refuted by a proof, or met in a user's own input is written as the
same JSON document (format "exactness-counterexample", version 1): the contract input as bit
patterns (hex, like the contract vectors in exactness/suite/data), the path that failed, the
expected and actual output bits, and the library versions. Files are written atomically and
replay with `python -m exactness repro`.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import tempfile
from importlib import metadata
from pathlib import Path

import numpy as np

from ..contract import float_format
from ..formats import unpack_weights
from .cases import LinearCase, _hex

FORMAT = "exactness-counterexample"
VERSION = 1
def default_dir() -> Path:
    return Path(os.environ.get("EXACTNESS_COUNTEREXAMPLES", "reports/counterexamples"))


def _rows(a: np.ndarray, width: int) -> list[list[str]]:
    a = np.asarray(a).astype(np.int64) & ((1 << width) - 1)
    return [[f"{int(v):0{width // 4}x}" for v in row] for row in a.reshape(a.shape[0], -1)]


def _versions() -> dict:
    out = {"python": platform.python_version()}
    for name in ("exactness", "torch", "numpy", "triton", "hypothesis", "z3-solver"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return out


def to_document(case: LinearCase, *, path: str, expected=None, actual=None, source: str = "user",
                note: str = "") -> dict:
    m, k, n = case.shape
    doc = {
        "format": FORMAT, "version": VERSION, "source": source, "path": path, "note": note,
        "shape": {"M": m, "K": k, "N": n}, "act_bits": case.act_bits, "w_bits": case.w_bits,
        "x_dtype": case.x_format.name, "out_dtype": case.out_format.name,
        "x_bits": _rows(case.x_bits, case.x_format.width),
        "weight_packed": _rows(case.weight_packed, 32),
        "weight_scale_bits": _rows(case.scale_bits, 16),
        "expected_bits": None if expected is None else _rows(expected, case.out_format.width),
        "actual_bits": None if actual is None else _rows(actual, case.out_format.width),
        "versions": _versions(),
    }
    return doc


def write(case: LinearCase, *, path: str, expected=None, actual=None, source: str = "user",
          note: str = "", directory: Path | str | None = None) -> Path:
    """Write the counterexample atomically; the file name is a hash of its input."""
    doc = to_document(case, path=path, expected=expected, actual=actual, source=source, note=note)
    text = json.dumps(doc, indent=1)
    key = hashlib.sha256(json.dumps([doc["x_bits"], doc["weight_packed"],
                                     doc["weight_scale_bits"], doc["act_bits"], path]).encode())
    directory = Path(directory or default_dir())
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / f"{path}-{key.hexdigest()[:12]}.json"
    fd, tmp = tempfile.mkstemp(dir=directory, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, target)
    return target


def read(file: Path | str) -> tuple[LinearCase, dict]:
    """(the case, the whole document); refuses files of another format or a newer version."""
    doc = json.loads(Path(file).read_text())
    if doc.get("format") != FORMAT or not isinstance(doc.get("version"), int):
        raise ValueError(f"{file}: not an {FORMAT} file")
    if doc["version"] > VERSION:
        raise ValueError(f"{file}: format version {doc['version']} is newer than {VERSION}")
    w_bits = doc["w_bits"]
    packed = _hex(doc["weight_packed"]).astype(np.uint32).view(np.int32)
    case = LinearCase(
        x_bits=_hex(doc["x_bits"]), x_format=float_format(doc["x_dtype"]),
        q=unpack_weights(packed, w_bits).astype(np.int64), weight_packed=packed,
        scale_bits=_hex(doc["weight_scale_bits"]), act_bits=doc["act_bits"],
        out_format=float_format(doc["out_dtype"]), w_bits=w_bits,
        expected=None if doc.get("expected_bits") is None else _hex(doc["expected_bits"]),
        name=Path(file).stem)
    return case, doc


def _count(outputs: int) -> None:
    """Tally compared outputs where `make verify` asks for it (EXACTNESS_COUNT_FILE), with the
    stage of the test that compared them (EXACTNESS_STAGE, set by conftest; "-" outside one): one
    pytest session runs several stages."""
    target = os.environ.get("EXACTNESS_COUNT_FILE")
    if target:
        with open(target, "a") as f:
            f.write(f"{outputs} {os.environ.get('EXACTNESS_STAGE', '-')}\n")


def from_layer(layer, x, *, path: str = "user", directory: Path | str | None = None) -> Path:
    """A user's own input to a layer as a counterexample file (expected: the reference's bits)."""
    from ..formats import float_bits, tensor_to_bits
    from .reference import reference_linear

    x2 = x.reshape(-1, layer.in_features)
    case = LinearCase(tensor_to_bits(x2), float_format(x.dtype), None,
                      layer.weight_packed.cpu().numpy(),
                      float_bits(layer.weight_scale).cpu().numpy(), layer.act_bits,
                      float_format(layer.out_dtype or x.dtype), layer.bits)
    case.q = unpack_weights(case.weight_packed, case.w_bits).astype(np.int64)
    want = reference_linear(case.x_bits, case.x_format, case.weight_packed, case.scale_bits,
                            **case.kwargs())
    got = tensor_to_bits(layer(x2))
    return write(case, path=path, expected=want, actual=got, source="user", directory=directory)


def check_bits(case: LinearCase, path: str, actual, expected, source: str = "hypothesis") -> None:
    """Assert equal bits; on a difference write the counterexample first and name it."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    _count(expected.size)
    if actual.shape == expected.shape and (actual == expected).all():
        return
    file = write(case, path=path, expected=expected, actual=actual, source=source)
    diff = np.argwhere(actual != expected) if actual.shape == expected.shape else []
    where = f"first difference at (row, out) {tuple(int(i) for i in diff[0])}" if len(diff) else \
        f"shapes {actual.shape} vs {expected.shape}"
    raise AssertionError(f"{path} differs from the reference on {case!r}: {where}; "
                         f"{len(diff)} outputs differ. Counterexample: {file} "
                         f"(replay: python -m exactness repro {file})")
