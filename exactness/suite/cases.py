"""Contract inputs as one value (`LinearCase`), and the shared test vectors loaded into it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..contract import FLOAT32, FloatFormat, float_format
from ..formats import unpack_weights

# package data, copied unchanged from the contract: v1 (36 cases), v1.1's act_bits = 32 (18),
# v1.2's rows of non-finite x (12)
VECTOR_FILES = tuple(Path(__file__).resolve().parent / "data" / name
                     for name in ("contract-v1.json", "contract-v1.1-a32.json",
                                  "contract-v1.2-nonfinite.json"))


@dataclass
class LinearCase:
    """One input of the contract: everything `reference_linear` and the layers take. With
    `routing`, a grouped projection's input: the weights are `experts` experts' [N / experts, K]
    stacked, each of `parts` layers (gate and up: 2) stacked, and row t of x goes to the experts
    routing[t] names (E: none), as an MoE layer's top_k_index routes it
    (exactness.kernels.routing); its output is [M, top_k * N / experts], slot s of row t at
    columns s * N / experts onwards (zeros for no expert)."""

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
    routing: np.ndarray | None = None  # [M, top_k] int64 expert ids in [0, experts]
    experts: int = 1
    parts: int = 1

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.x_bits.shape[0], self.x_bits.shape[1], self.q.shape[0]

    def kwargs(self) -> dict:
        """Keyword arguments of `reference_linear` / `oracle_linear`."""
        return dict(act_bits=self.act_bits, out_format=self.out_format, w_bits=self.w_bits)

    def __repr__(self) -> str:  # the arrays are big; a failure report names the structure
        m, k, n = self.shape
        routed = "" if self.routing is None else \
            f", {self.experts} experts of N={n // self.experts} in {self.parts} part(s), " \
            f"top_k={self.routing.shape[1]}"
        return (f"LinearCase({self.name + ', ' if self.name else ''}M={m}, K={k}, N={n}, "
                f"x={self.x_format.name}, out={self.out_format.name}, act_bits={self.act_bits}, "
                f"w_bits={self.w_bits}{routed})")

    def weight_row(self, r: int, column: int) -> int:
        """The weight row behind output (r, column): itself, or with routing its slot's
        expert's row."""
        if self.routing is None:
            return column
        per = self.shape[2] // self.experts
        return int(self.routing[r, column // per]) * per + column % per


def _hex(rows) -> np.ndarray:
    return np.array([[int(v, 16) for v in row] for row in rows], dtype=np.int64)


def load_vectors(paths=VECTOR_FILES) -> list[LinearCase]:
    """The contract's test vectors (computed independently of this project), every file's."""
    cases = []
    cases_of = (c for path in paths for c in json.loads(Path(path).read_text())["cases"])
    for i, c in enumerate(cases_of):
        packed = _hex(c["weight_packed"]).astype(np.uint32).view(np.int32)
        cases.append(LinearCase(
            x_bits=_hex(c["x_bits"]), x_format=float_format(c["x_dtype"]),
            q=unpack_weights(packed, 4).astype(np.int64), weight_packed=packed,
            scale_bits=_hex(c["weight_scale_bits"]), act_bits=c["act_bits"],
            out_format=float_format(c["out_dtype"]), expected=_hex(c["y_bits"]),
            name=f"v{i:02d}-{c['kind']}-a{c['act_bits']}-{c['x_dtype']}"))
    return cases


@dataclass
class MoECase:
    """An MoE layer's routed experts and an input: `experts` experts of hidden size H and
    intermediate size I, 4-bit. gate_up holds expert e's gate then up rows at [2 I e, 2 I e + 2 I)
    of [2 I E, H]; down expert e's rows at [H e, H e + H) of [H E, I]."""

    x_bits: np.ndarray  # [T, H]
    x_format: FloatFormat
    act_bits: int
    routing: np.ndarray  # [T, top_k] expert ids in [0, E]
    top_k_weights: np.ndarray  # [T, top_k] float32
    experts: int
    gate_up: tuple[np.ndarray, np.ndarray]  # (weight_packed, scale bits) [2 I E, ...]
    down: tuple[np.ndarray, np.ndarray]  # [H E, ...]
    block: str = "transformers"  # the glue between the projections (exactness.glue.BLOCKS)

    @property
    def hidden(self) -> int:
        return self.x_bits.shape[1]

    @property
    def inter(self) -> int:
        return self.down[1].shape[1] * 32

    @property
    def inner_format(self) -> FloatFormat:
        """The projections' outputs and h: fp32 in the exact block, x's format otherwise."""
        return FLOAT32 if self.block == "exact" else self.x_format

    def gate_up_case(self) -> LinearCase:
        """The gate and up projection as one grouped call's case (two parts an expert)."""
        packed, scales = self.gate_up
        return LinearCase(self.x_bits, self.x_format, unpack_weights(packed, 4), packed, scales,
                          self.act_bits, self.inner_format, 4, routing=self.routing,
                          experts=self.experts, parts=2, name="gate_up")

    def down_case(self, h_bits: np.ndarray, experts_of_rows: np.ndarray) -> LinearCase:
        """The down projection of the routed rows h [R, I] (each row its own token), each row
        to its expert."""
        packed, scales = self.down
        return LinearCase(h_bits, self.inner_format, unpack_weights(packed, 4), packed, scales,
                          self.act_bits, self.inner_format, 4, routing=experts_of_rows[:, None],
                          experts=self.experts, name="down")

    def __repr__(self) -> str:
        t, top_k = self.routing.shape
        return (f"MoECase(T={t}, H={self.hidden}, I={self.inter}, experts={self.experts}, "
                f"top_k={top_k}, x={self.x_format.name}, act_bits={self.act_bits}, "
                f"block={self.block})")
