"""Contract inputs as one value (`LinearCase`), and the shared test vectors loaded into it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..contract import FloatFormat, float_format
from ..formats import unpack_weights

VECTORS = Path(__file__).resolve().parent / "data" / "contract-v1.json"  # package data


@dataclass
class LinearCase:
    """One input of the contract: everything `reference_linear` and the layers take."""

    x_bits: np.ndarray
    x_format: FloatFormat
    q: np.ndarray
    weight_packed: np.ndarray
    scale_bits: np.ndarray
    act_bits: int
    out_format: FloatFormat
    w_bits: int = 4
    expected: np.ndarray | None = None  # y bit patterns, where an independent source gave them
    name: str = ""

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.x_bits.shape[0], self.x_bits.shape[1], self.q.shape[0]

    def kwargs(self) -> dict:
        """Keyword arguments of `reference_linear` / `oracle_linear`."""
        return dict(act_bits=self.act_bits, out_format=self.out_format, w_bits=self.w_bits)

    def __repr__(self) -> str:  # the arrays are big; a failure report names the structure
        m, k, n = self.shape
        return (f"LinearCase({self.name + ', ' if self.name else ''}M={m}, K={k}, N={n}, "
                f"x={self.x_format.name}, out={self.out_format.name}, act_bits={self.act_bits}, "
                f"w_bits={self.w_bits})")


def _hex(rows) -> np.ndarray:
    return np.array([[int(v, 16) for v in row] for row in rows], dtype=np.int64)


def load_vectors(path: Path | str = VECTORS) -> list[LinearCase]:
    """The contract's test vectors (computed independently of this project)."""
    cases = []
    for i, c in enumerate(json.loads(Path(path).read_text())["cases"]):
        packed = _hex(c["weight_packed"]).astype(np.uint32).view(np.int32)
        cases.append(LinearCase(
            x_bits=_hex(c["x_bits"]), x_format=float_format(c["x_dtype"]),
            q=unpack_weights(packed, 4).astype(np.int64), weight_packed=packed,
            scale_bits=_hex(c["weight_scale_bits"]), act_bits=c["act_bits"],
            out_format=float_format(c["out_dtype"]), expected=_hex(c["y_bits"]),
            name=f"v{i:02d}-{c['kind']}-a{c['act_bits']}-{c['x_dtype']}"))
    return cases
