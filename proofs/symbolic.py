"""Run the package's own vectorized integer code on Z3 bit-vectors.

`formats` picks its array module from its input (`formats.array_module`); handed a `Sym`, the
same functions that round real tensors build a Z3 term instead. The proof of the final rounding
is therefore a proof about `formats.round_scaled_array` itself, not about a transcription of it.

Semantics follow numpy/torch int64: wrap-around arithmetic, arithmetic right shift, booleans as
0/1. Every shift records a side condition that its amount lies in [0, 63] (beyond that numpy and
torch shifts are undefined), which the prover checks along with the main claim.
"""

from __future__ import annotations

import z3

WIDTH = 64


class Sym:
    """A symbolic int64 (or 0/1 boolean) value."""

    shift_conditions: list = []  # (amount term) of every shift built, for the side conditions

    def __init__(self, term):
        self.term = term

    @staticmethod
    def lift(v) -> z3.BitVecRef:
        if isinstance(v, Sym):
            return v.term
        if isinstance(v, bool | int):
            return z3.BitVecVal(int(v), WIDTH)
        raise TypeError(f"cannot lift {type(v).__name__} into a bit-vector")

    # arithmetic (wrapping, like int64 arrays)
    def __add__(self, o): return Sym(self.term + Sym.lift(o))  # noqa: E704
    def __radd__(self, o): return Sym(Sym.lift(o) + self.term)  # noqa: E704
    def __sub__(self, o): return Sym(self.term - Sym.lift(o))  # noqa: E704
    def __rsub__(self, o): return Sym(Sym.lift(o) - self.term)  # noqa: E704
    def __mul__(self, o): return Sym(self.term * Sym.lift(o))  # noqa: E704
    def __rmul__(self, o): return Sym(Sym.lift(o) * self.term)  # noqa: E704
    def __neg__(self): return Sym(-self.term)  # noqa: E704
    def __and__(self, o): return Sym(self.term & Sym.lift(o))  # noqa: E704
    def __rand__(self, o): return Sym(Sym.lift(o) & self.term)  # noqa: E704
    def __or__(self, o): return Sym(self.term | Sym.lift(o))  # noqa: E704
    def __ror__(self, o): return Sym(Sym.lift(o) | self.term)  # noqa: E704

    def __lshift__(self, o):
        Sym.shift_conditions.append(Sym.lift(o))
        return Sym(self.term << Sym.lift(o))

    def __rlshift__(self, o):
        Sym.shift_conditions.append(self.term)
        return Sym(Sym.lift(o) << self.term)

    def __rshift__(self, o):  # arithmetic, as int64 arrays shift
        Sym.shift_conditions.append(Sym.lift(o))
        return Sym(self.term >> Sym.lift(o))

    # comparisons give 0/1 values, as boolean arrays do in integer arithmetic
    def _bool(self, cond) -> Sym:
        return Sym(z3.If(cond, z3.BitVecVal(1, WIDTH), z3.BitVecVal(0, WIDTH)))

    def __lt__(self, o): return self._bool(self.term < Sym.lift(o))  # noqa: E704
    def __le__(self, o): return self._bool(self.term <= Sym.lift(o))  # noqa: E704
    def __gt__(self, o): return self._bool(self.term > Sym.lift(o))  # noqa: E704
    def __ge__(self, o): return self._bool(self.term >= Sym.lift(o))  # noqa: E704
    def __eq__(self, o): return self._bool(self.term == Sym.lift(o))  # noqa: E704
    def __ne__(self, o): return self._bool(self.term != Sym.lift(o))  # noqa: E704
    __hash__ = None

    def clip(self, min=None, max=None):  # noqa: A002 - numpy's names
        t = self.term
        if min is not None:
            t = z3.If(t < Sym.lift(min), Sym.lift(min), t)
        if max is not None:
            t = z3.If(t > Sym.lift(max), Sym.lift(max), t)
        return Sym(t)


class SymbolicModule:
    """The few array-module functions `formats` calls: where, abs."""

    @staticmethod
    def where(cond, a, b) -> Sym:
        return Sym(z3.If(Sym.lift(cond) != 0, Sym.lift(a), Sym.lift(b)))

    @staticmethod
    def abs(a) -> Sym:
        t = Sym.lift(a)
        return Sym(z3.If(t < 0, -t, t))


Sym.array_module = SymbolicModule


def shift_amounts_in_range() -> z3.BoolRef:
    """Every shift recorded so far has its amount in [0, 63]."""
    return z3.And([z3.And(a >= 0, a <= 63) for a in Sym.shift_conditions] or [z3.BoolVal(True)])
