"""The exact-linear contract v1.2 (docs/SPEC.md restates it) as constants, formats, typed errors.

Everything else in the package reads its numbers from here: group size, the admissible weight and
activation widths, the activation range Qa, and the three float formats the contract speaks of.
"""

from __future__ import annotations

from dataclasses import dataclass

GROUP_SIZE = 32
WEIGHT_BITS = (4, 8)
ACT_BITS = (4, 8, 16, 32)  # 32: contract v1.1
DEFAULT_ACT_BITS = 16


class ExactnessError(Exception):
    """Base of every error the package raises on bad input."""


class ContractValueError(ExactnessError, ValueError):
    """A value the contract does not admit (non-finite, out of range, wrong size)."""


class NonFiniteError(ContractValueError):
    """Non-finite activations or scales: at load, or in a forward of a layer built strict (by
    default a non-finite x gives NaN rows, contract v1.2)."""


class ShapeError(ContractValueError):
    """A tensor whose shape contradicts the contract or its companions."""


class ContractTypeError(ExactnessError, TypeError):
    """A tensor of a dtype the contract does not admit."""


def act_qmax(act_bits: int) -> int:
    """Qa = 2**(ba-1) - 1: activations are quantized into [-Qa, Qa]."""
    check_act_bits(act_bits)
    return 2 ** (act_bits - 1) - 1


def weight_range(bits: int) -> tuple[int, int]:
    """The full two's-complement range of a `bits`-wide weight, -2**(bits-1) included."""
    check_weight_bits(bits)
    return -(2 ** (bits - 1)), 2 ** (bits - 1) - 1


def group_dot_bound(w_bits: int, act_bits: int) -> int:
    """Worst |P| of one group: 32 * 2**(bw-1) * Qa (contract section 6)."""
    return GROUP_SIZE * 2 ** (w_bits - 1) * act_qmax(act_bits)


def check_act_bits(act_bits: object) -> int:
    if act_bits not in ACT_BITS or isinstance(act_bits, bool):
        raise ContractValueError(f"act_bits must be one of {ACT_BITS}, got {act_bits!r}")
    return act_bits  # type: ignore[return-value]


def check_weight_bits(bits: object) -> int:
    if bits not in WEIGHT_BITS or isinstance(bits, bool):
        raise ContractValueError(f"bits must be one of {WEIGHT_BITS}, got {bits!r}")
    return bits  # type: ignore[return-value]


def check_in_features(k: object, name: str = "in_features") -> int:
    if not isinstance(k, int) or isinstance(k, bool) or k <= 0 or k % GROUP_SIZE:
        raise ShapeError(f"{name} must be a positive multiple of {GROUP_SIZE}, got {k!r}")
    return k


@dataclass(frozen=True)
class FloatFormat:
    """An IEEE 754 binary format: 1 sign bit, `exp_bits` exponent bits, `mant_bits` stored bits."""

    name: str
    exp_bits: int
    mant_bits: int

    @property
    def width(self) -> int:
        return 1 + self.exp_bits + self.mant_bits

    @property
    def bias(self) -> int:
        return 2 ** (self.exp_bits - 1) - 1

    @property
    def precision(self) -> int:
        """Significand bits including the hidden one."""
        return self.mant_bits + 1

    @property
    def exp_max_field(self) -> int:
        """The all-ones exponent field: inf and NaN."""
        return 2**self.exp_bits - 1

    @property
    def quantum_min(self) -> int:
        """Exponent of the smallest subnormal: every finite value is an integer times 2**this."""
        return 1 - self.bias - self.mant_bits

    @property
    def sign_bit(self) -> int:
        return 1 << (self.width - 1)

    @property
    def abs_mask(self) -> int:
        return self.sign_bit - 1

    @property
    def inf_bits(self) -> int:
        return self.exp_max_field << self.mant_bits

    @property
    def nan_bits(self) -> int:
        """The canonical quiet NaN (contract v1.2, section 3): positive, top fraction bit set."""
        return self.inf_bits | 1 << (self.mant_bits - 1)


BFLOAT16 = FloatFormat("bfloat16", 8, 7)
FLOAT16 = FloatFormat("float16", 5, 10)
FLOAT32 = FloatFormat("float32", 8, 23)
FORMATS = {f.name: f for f in (BFLOAT16, FLOAT16, FLOAT32)}


def float_format(name: object) -> FloatFormat:
    """The format called `name` ('bfloat16', 'float16', 'float32'; torch dtypes are accepted)."""
    if isinstance(name, FloatFormat):
        return name
    key = str(name).removeprefix("torch.")
    key = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32",
           "float": "float32"}.get(key, key)
    if key not in FORMATS:
        raise ContractTypeError(
            f"dtype must be one of {sorted(FORMATS)}, got {name!r}")
    return FORMATS[key]
