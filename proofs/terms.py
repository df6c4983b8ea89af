"""The Obligation record, and the bit-vector terms every stage's obligations are built from."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import z3

WIDE = 100  # the spec's arithmetic: wide enough that nothing it computes can wrap


MAX_SPREAD = 40  # (steps + 1) * 255 * 2**27 * 2**40 < 2**99: WIDE holds every bound below


@dataclass
class Obligation:
    name: str
    claim: str
    build: Callable[[], tuple[z3.BoolRef, z3.BoolRef, dict]]  # (pre, post, named variables)
    w_bits: int | None = None
    a_bits: int | None = None
    k: int | None = None
    acc_bits: int | None = None
    spread: int | None = None
    tactic: bool = False  # bit-blast through an explicit tactic (FP-heavy queries)
    extra: dict = field(default_factory=dict)


def wide(x: z3.BitVecRef) -> z3.BitVecRef:
    return z3.SignExt(WIDE - x.size(), x)


def const(v: int, bits: int = WIDE) -> z3.BitVecRef:
    return z3.BitVecVal(v, bits)


def within(x: z3.BitVecRef, bound) -> z3.BoolRef:
    """|x| <= bound, judged in wide arithmetic (bound: int or a wide term)."""
    b = const(bound) if isinstance(bound, int) else bound
    return z3.And(wide(x) <= b, wide(x) >= -b)


def in_range(x: z3.BitVecRef, lo: int, hi: int) -> z3.BoolRef:
    return z3.And(wide(x) >= const(lo), wide(x) <= const(hi))


def fits(value: z3.BitVecRef, bits: int) -> z3.BoolRef:
    """An n-bit register holds `value` exactly (n-bit arithmetic did not wrap)."""
    return in_range(value, -(2 ** (bits - 1)), 2 ** (bits - 1) - 1)


def signed_var(name: str, lo: int, hi: int) -> tuple[z3.BitVecRef, z3.BoolRef]:
    """A variable just wide enough for [lo, hi], with its range as precondition."""
    bits = max(abs(lo), abs(hi)).bit_length() + 1
    v = z3.BitVec(name, bits)
    return v, in_range(v, lo, hi)


def product(a: z3.BitVecRef, b: z3.BitVecRef) -> z3.BitVecRef:
    """The exact a * b, multiplied at the natural width of the result, then widened."""
    bits = a.size() + b.size()
    return wide(z3.SignExt(bits - a.size(), a) * z3.SignExt(bits - b.size(), b))


def accumulate_step(name: str, claim: str, acc_bits: int, steps: int, term_bound: int,
                    make_term: Callable, **meta) -> Obligation:
    """Induction step for acc_{j+1} = acc_j + term_j in `acc_bits`, for every j < steps:
    |acc_j| <= j * B and the term's preconditions  ->  every step computing the term, the term
    and the sum fit `acc_bits`, and |acc_{j+1}| <= (j + 1) * B. With acc_0 = 0 this bounds every
    partial sum by steps * B.

    make_term() -> (the term's exact value (wide), its preconditions, its inner steps' claims,
    its named variables)."""

    if steps * term_bound >= 2 ** (WIDE - 2):
        raise ValueError(f"{name}: {steps} steps of {term_bound} do not fit the proofs' "
                         f"{WIDE}-bit arithmetic")

    def build():
        j = z3.BitVec("j", 32)
        acc = z3.BitVec("acc", acc_bits)
        term, term_pre, term_ok, names = make_term()
        bound = z3.ZeroExt(WIDE - 32, j) * term_bound
        new = wide(acc) + term
        pre = z3.And(z3.ULT(j, steps), within(acc, bound), term_pre)
        post = z3.And(term_ok, fits(term, acc_bits), fits(new, acc_bits),
                      z3.And(new <= bound + term_bound, new >= -(bound + term_bound)))
        return pre, post, {"j": j, "acc": acc, **names}

    return Obligation(name, claim, build, acc_bits=acc_bits, **meta)


def bounded_product(a: tuple[str, int, int], b: tuple[str, int, int]):
    """A term for accumulate_step: the product of two named variables, each in [lo, hi]."""

    def make():
        (a_name, a_lo, a_hi), (b_name, b_lo, b_hi) = a, b
        x, x_ok = signed_var(a_name, a_lo, a_hi)
        y, y_ok = signed_var(b_name, b_lo, b_hi)
        return product(x, y), z3.And(x_ok, y_ok), z3.BoolVal(True), {a_name: x, b_name: y}

    return make


def product_term(a_lo: int, a_hi: int, w_bits: int):
    """a * w with a in [a_lo, a_hi] (an int8 limb or an activation) and w a `w_bits` weight."""
    return bounded_product(("a", a_lo, a_hi), ("w", -(2 ** (w_bits - 1)), 2 ** (w_bits - 1) - 1))
