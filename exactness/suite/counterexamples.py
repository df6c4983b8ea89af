"""Counterexample files: one stable, self-contained format for every failure the project finds.

A failure found by Hypothesis, refuted by a proof, or met in a user's own input is written as the
same JSON document (format "exactness-counterexample", version 2): the contract input as bit
patterns (hex, like the contract vectors in exactness/suite/data), the path that failed, the
expected and actual output bits, the library versions, and the device it was found on
(device.describe: the device, the GPU's name, Triton's version). Version 2 adds a grouped
projection's routing ("experts", "parts" and "routing", as cases.LinearCase holds them); version
1 files still read. Files are written atomically and replay with `python -m exactness repro`,
on whichever device is asked for (--device); `read` refuses
(CounterexampleFileError) any file it cannot take exactly as written.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import re
import tempfile
from importlib import metadata
from pathlib import Path

import numpy as np

from ..contract import (
    BFLOAT16,
    GROUP_SIZE,
    ExactnessError,
    check_act_bits,
    check_in_features,
    check_weight_bits,
    float_format,
)
from ..formats import finite_mask, unpack_weights
from .cases import LinearCase
from .device import describe
from .paths import PATHS

FORMAT = "exactness-counterexample"
VERSION = 2
def default_dir() -> Path:
    return Path(os.environ.get("EXACTNESS_COUNTEREXAMPLES", "reports/counterexamples"))


def _rows(a: np.ndarray, width: int) -> list[list[str]]:
    a = np.asarray(a).astype(np.int64) & ((1 << width) - 1)
    return [[f"{int(v):0{width // 4}x}" for v in row] for row in a.reshape(a.shape[0], -1)]


@functools.cache
def _versions() -> dict:
    """Read once a process (each read scans site-packages' metadata: 1.9 s of a warm make
    verify's CPU, for the documents the fuzz tests write); callers copy it."""
    out = {"python": platform.python_version()}
    for name in ("exactness", "torch", "numpy", "triton", "hypothesis", "z3-solver"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return out


def to_document(case: LinearCase, *, path: str, expected=None, actual=None, source: str = "user",
                note: str = "", extra: dict | None = None) -> dict:
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
        "versions": dict(_versions()),
        "device": describe(),  # where it was found: the device, the GPU's name, Triton's version
    }
    if case.routing is not None:
        doc["experts"], doc["parts"] = case.experts, case.parts
        doc["routing"] = [[int(e) for e in row] for row in case.routing]
    return {**doc, **(extra or {})}


def write(case: LinearCase, *, path: str, expected=None, actual=None, source: str = "user",
          note: str = "", directory: Path | str | None = None, extra: dict | None = None) -> Path:
    """Write the counterexample atomically; the file name is a hash of its input. `extra`:
    further fields (a checked outside kernel's: exactness.suite.peers.properties)."""
    doc = to_document(case, path=path, expected=expected, actual=actual, source=source, note=note,
                      extra=extra)
    text = json.dumps(doc, indent=1)
    key = hashlib.sha256(json.dumps([doc["x_bits"], doc["weight_packed"],
                                     doc["weight_scale_bits"], doc["act_bits"], path,
                                     doc.get("routing"), doc.get("kernel"),
                                     doc.get("property")]).encode())
    directory = Path(directory or default_dir())
    directory.mkdir(parents=True, exist_ok=True)
    name = path if "kernel" not in doc else re.sub(r"[^A-Za-z0-9_.-]+", "-", doc["kernel"])
    target = directory / f"{name}-{key.hexdigest()[:12]}.json"
    fd, tmp = tempfile.mkstemp(dir=directory, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, target)
    return target


class CounterexampleFileError(ExactnessError, ValueError):
    """A file `read` refuses; the message names the file and the key or row at fault."""


_HEX = re.compile(r"[0-9a-fA-F]+")  # int(_, 16) alone also takes "0x1f", "-1" and " 1_0"
_SIMULATED = re.compile(r"simulated(-dot\d{1,3})?(-acc\d{1,3})?")  # paths.run's simulated paths
_KINDS = {int: "an integer", str: "a string", list: "a list", dict: "an object"}


def read(file: Path | str) -> tuple[LinearCase, dict]:
    """(the case, the whole document). A file that is not a complete version-1 document, every
    pattern within its width, raises CounterexampleFileError naming the key or row at fault:
    nothing is masked or guessed, so a replay is of exactly what the file holds."""
    doc = _load(file)  # version 1 or 2
    _field(file, doc, "source", str)  # replay prints source and note
    _field(file, doc, "note", str, optional=True)
    path = _field(file, doc, "path", str)
    if path == "kernel":  # an outside kernel's (exactness.suite.peers): it names the kernel
        _field(file, doc, "kernel", str)
        _field(file, doc, "property", str)
    elif path not in PATHS and not _SIMULATED.fullmatch(path):
        raise _error(file, "path", f"{_show(path)} is none of {', '.join(PATHS)}, kernel, "
                     f"simulated-...")
    act_bits = _checked(file, "act_bits", check_act_bits, _field(file, doc, "act_bits", int))
    w_bits = _checked(file, "w_bits", check_weight_bits, _field(file, doc, "w_bits", int))
    x_format = _checked(file, "x_dtype", float_format, _field(file, doc, "x_dtype", str))
    out_format = _checked(file, "out_dtype", float_format, _field(file, doc, "out_dtype", str))
    shape = _field(file, doc, "shape", dict)
    m, k, n = (_field(file, shape, d, int, where=f"shape.{d}") for d in "MKN")
    _checked(file, "shape.K", lambda v: check_in_features(v, "K"), k)
    for d, size in (("M", m), ("N", n)):
        if size < 1:
            raise _error(file, f"shape.{d}", f"must be at least 1, got {size}")
    x_bits = _patterns(file, doc, "x_bits", x_format.width, (m, k))
    packed = _patterns(file, doc, "weight_packed", 32, (n, k * w_bits // 32))
    scale_bits = _patterns(file, doc, "weight_scale_bits", BFLOAT16.width, (n, k // GROUP_SIZE))
    experts, parts, routing = _routing(file, doc, m, n)
    outputs = n if routing is None else routing.shape[1] * n // experts
    expected = _patterns(file, doc, "expected_bits", out_format.width, (m, outputs),
                         optional=True)
    # any shape: check_bits writes a wrong-shaped output as it was
    _patterns(file, doc, "actual_bits", out_format.width, None, optional=True)
    # a non-finite scale cannot load into a layer: such a file has no output to replay
    _finite(file, "weight_scale_bits", scale_bits, BFLOAT16)  # x may hold them: v1.2's NaN rows
    packed = packed.astype(np.uint32).view(np.int32)
    case = LinearCase(
        x_bits=x_bits, x_format=x_format, q=unpack_weights(packed, w_bits).astype(np.int64),
        weight_packed=packed, scale_bits=scale_bits, act_bits=act_bits, out_format=out_format,
        w_bits=w_bits, expected=expected, name=Path(file).stem, routing=routing, experts=experts,
        parts=parts)
    return case, doc


def _routing(file, doc: dict, m: int, n: int) -> tuple[int, int, np.ndarray | None]:
    """(experts, parts, routing [M, top_k] int64 or None) of a grouped projection's file:
    experts a divisor of N, parts of N / experts, each row the same number of ids in
    [0, experts], no expert twice in a row (the product refuses that: kernels.routing)."""
    if not {"routing", "experts", "parts"} & set(doc):
        return 1, 1, None
    if doc["version"] < 2:
        raise _error(file, "routing", "a grouped projection's routing needs format version 2")
    experts = _field(file, doc, "experts", int)
    if experts < 1 or n % experts:
        raise _error(file, "experts", f"must divide N = {n}, got {experts}")
    parts = _field(file, doc, "parts", int)
    if parts < 1 or n // experts % parts:
        raise _error(file, "parts", f"must divide N / experts = {n // experts}, got {parts}")
    rows = _field(file, doc, "routing", list)
    if len(rows) != m:
        raise _error(file, "routing", f"has {len(rows)} rows, expected M = {m}")
    top_k = len(rows[0]) if isinstance(rows[0], list) else 0
    for r, row in enumerate(rows):
        if not isinstance(row, list) or len(row) != top_k or not top_k:
            raise _error(file, f"routing row {r}", f"must be a list of {top_k or 'some'} ids, "
                         f"got {_show(row)}")
        for c, e in enumerate(row):
            if isinstance(e, bool) or not isinstance(e, int) or not 0 <= e <= experts:
                raise _error(file, f"routing row {r}, column {c}",
                             f"{_show(e)} is no expert id in [0, {experts}]")
        named = [e for e in row if e != experts]
        if len(set(named)) != len(named):
            raise _error(file, f"routing row {r}", f"names an expert twice: {row}")
    return experts, parts, np.array(rows, dtype=np.int64)


def _error(file, where: str, problem: str) -> CounterexampleFileError:
    return CounterexampleFileError(f"{file}: {where}: {problem}")


def _show(value) -> str:
    """A value for a one-line message: its repr, cut short."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _load(file) -> dict:
    try:
        doc = json.loads(Path(file).read_bytes())
    except OSError as e:
        raise CounterexampleFileError(f"{file}: cannot be read ({e.strerror or e})") from e
    except (ValueError, RecursionError) as e:  # not JSON, not UTF-8, or nested past the parser
        raise CounterexampleFileError(f"{file}: not JSON ({e})") from e
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise CounterexampleFileError(f"{file}: not an {FORMAT} file")
    version = doc.get("version")
    if type(version) is int and version > VERSION:  # type(): true is no version
        raise _error(file, "version", f"format version {version} is newer than {VERSION}")
    if type(version) is not int or version not in (1, VERSION):
        raise _error(file, "version", f"must be 1 or {VERSION}, got {_show(version)}")
    return doc


def _field(file, doc: dict, key: str, kind: type, *, where: str | None = None,
           optional: bool = False):
    """doc[key], of type `kind` (bool is no int here); optional: None where absent or null."""
    value = doc.get(key)
    if value is None and optional:
        return None
    if key not in doc:
        raise _error(file, where or key, "missing")
    if isinstance(value, bool) or not isinstance(value, kind):
        raise _error(file, where or key, f"must be {_KINDS[kind]}, got {_show(value)}")
    return value


def _checked(file, key: str, check, value):
    """check(value), its contract error re-raised as one naming the file and the key."""
    try:
        return check(value)
    except ExactnessError as e:
        raise _error(file, key, str(e)) from e


def _patterns(file, doc: dict, key: str, width: int, shape: tuple[int, int] | None, *,
              optional: bool = False) -> np.ndarray | None:
    """doc[key]: rows of hex patterns, each below 2**width, as int64 [rows, columns]; `shape`
    None accepts any non-empty rectangle."""
    rows = _field(file, doc, key, list, optional=optional)
    if rows is None:
        return None
    if shape is None:
        shape = (len(rows), len(rows[0]) if rows and isinstance(rows[0], list) else 0)
        if 0 in shape:
            raise _error(file, key, "must be a non-empty list of rows of patterns")
    if len(rows) != shape[0]:
        raise _error(file, key, f"has {len(rows)} rows, expected {shape[0]}")
    out = np.empty(shape, dtype=np.int64)
    for r, row in enumerate(rows):
        if not isinstance(row, list):
            raise _error(file, f"{key} row {r}", f"must be a list of patterns, got {_show(row)}")
        if len(row) != shape[1]:
            raise _error(file, f"{key} row {r}", f"has {len(row)} patterns, expected {shape[1]}")
        for c, text in enumerate(row):
            if not isinstance(text, str) or not _HEX.fullmatch(text):
                raise _error(file, f"{key} row {r}, column {c}",
                             f"{_show(text)} is not a hex pattern")
            value = int(text, 16)
            if value >> width:  # masking it would replay another input and could say "fixed"
                raise _error(file, f"{key} row {r}, column {c}",
                             f"{_show(text)} is wider than {width} bits")
            out[r, c] = value
    return out


def _finite(file, key: str, bits: np.ndarray, fmt) -> None:
    bad = np.argwhere(~finite_mask(bits, fmt))
    if len(bad):
        r, c = (int(i) for i in bad[0])
        raise _error(file, f"{key} row {r}, column {c}",
                     f"{int(bits[r, c]):x} is not finite, and a layer refuses such scales "
                     f"when they load")


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
