"""The combine stage: each group's exact sum times its scale, summed over K in int64."""

from __future__ import annotations

import z3

from exactness import dataflow
from exactness.contract import GROUP_SIZE, act_qmax

from .terms import (
    WIDE,
    Obligation,
    accumulate_step,
    bounded_product,
    const,
    fits,
    product,
    product_term,
    signed_var,
    wide,
    within,
)


def scale_factor(w_bits: int, a_bits: int, k: int, spread: int) -> Obligation:
    """f = ms << shift is held in dataflow.FACTOR_BITS: the certificate's factors, the GPU group
    kernel's int32 x int32 -> int64 products, fold_kernel's q * f, cpu_vnni.c's vpmuldq."""

    def build():
        ms, ms_ok = signed_var("ms", -(2**dataflow.SCALE_MANT_BITS - 1),
                               2**dataflow.SCALE_MANT_BITS - 1)
        sh = z3.BitVec("shift", 8)
        c = wide(ms) << z3.ZeroExt(WIDE - 8, sh)
        return (z3.And(ms_ok, z3.ULE(sh, spread)), fits(c, dataflow.FACTOR_BITS),
                {"ms": ms, "shift": sh})

    return Obligation(f"scale-factor-w{w_bits}-a{a_bits}-k{k}",
                      f"ms << shift is an int{dataflow.FACTOR_BITS} for spread <= {spread}", build,
                      w_bits=w_bits, a_bits=a_bits, k=k, spread=spread,
                      acc_bits=dataflow.FACTOR_BITS)


def combine(w_bits: int, a_bits: int, k: int, acc_bits: int, spread: int) -> Obligation:
    """The group kernel's T: per group P' * f (an int32 by an int32, f = ms << shift: the value
    (P' * ms) << shift), summed in `acc_bits`; in any order of groups (split K's atomics add
    slices in any order: every partial sum is some groups' terms)."""
    pmax = dataflow.group_term_bound(w_bits, a_bits)
    mant = 2**dataflow.SCALE_MANT_BITS - 1

    def make():
        p, p_ok = signed_var("P'", -pmax, pmax)
        ms, ms_ok = signed_var("ms", -mant, mant)
        sh = z3.BitVec("shift", 8)
        term = product(p, ms) << z3.ZeroExt(WIDE - 8, sh)
        return (term, z3.And(p_ok, ms_ok, z3.ULE(sh, spread)), z3.BoolVal(True),
                {"P'": p, "ms": ms, "shift": sh})

    return accumulate_step(
        f"combine-w{w_bits}-a{a_bits}-k{k}",
        f"sum over {k // GROUP_SIZE} groups of P' * (ms << shift) in int{acc_bits}, "
        f"spread <= {spread}", acc_bits, k // GROUP_SIZE, mant * pmax << spread, make,
        w_bits=w_bits, a_bits=a_bits, k=k, spread=spread)


def combine_offset(w_bits: int, a_bits: int, k: int, acc_bits: int, spread: int) -> Obligation:
    """Two or four limbs: the group kernel adds limb_offset * R, R = sum_k q * f (offset_sums,
    int64; limb_offset 128 at 16 bits, 0x808080 at 32), to any partial sum of the combine (its
    first slice of K does, before or after the others'): R and the result fit `acc_bits`, within
    dataflow.combine_bound. The grouped kernel adds each group's share of R with the group: a
    partial R, within the same bound."""
    groups = k // GROUP_SIZE
    mant = 2**dataflow.SCALE_MANT_BITS - 1
    acc_max = groups * (mant * dataflow.group_term_bound(w_bits, a_bits) << spread)
    r_max = groups * (GROUP_SIZE * 2 ** (w_bits - 1) * mant << spread)

    def build():
        acc, r = z3.BitVec("acc", acc_bits), z3.BitVec("R", acc_bits)
        t = wide(acc) + dataflow.limb_offset(a_bits) * wide(r)
        post = z3.And(fits(const(r_max), acc_bits), fits(t, acc_bits),
                      within(t, dataflow.combine_bound(k, w_bits, a_bits, spread)))
        return z3.And(within(acc, acc_max), within(r, r_max)), post, {"acc": acc, "R": r}

    return Obligation(f"combine-offset-w{w_bits}-a{a_bits}-k{k}",
                      f"the limb offset's {dataflow.limb_offset(a_bits)} * R added in "
                      f"int{acc_bits}, spread <= {spread}", build, w_bits=w_bits,
                      a_bits=a_bits, k=k, acc_bits=acc_bits, spread=spread)


def wide_group_sum(w_bits: int, a_bits: int) -> Obligation:
    """The wide kernel's group sums P = sum_k qa * q (an einsum) in dataflow.group_sum_bits."""
    bits = dataflow.group_sum_bits(w_bits, a_bits)
    qmax = act_qmax(a_bits)
    return accumulate_step(
        f"wide-group-sum-w{w_bits}-a{a_bits}", f"P = sum of 32 qa * q in int{bits}", bits,
        GROUP_SIZE, qmax * 2 ** (w_bits - 1), product_term(-qmax, qmax, w_bits),
        w_bits=w_bits, a_bits=a_bits)


def wide_combine(w_bits: int, a_bits: int, k: int) -> Obligation:
    """The wide kernel's int64 sums of P * ms, dataflow.wide_groups_per_sum groups at a time
    (or all of a K = k row's), before its Python integers take the shifts."""
    pmax = dataflow.group_dot_bound(w_bits, a_bits)
    mant = 2**dataflow.SCALE_MANT_BITS - 1
    steps = min(dataflow.wide_groups_per_sum(w_bits, a_bits), k // GROUP_SIZE)
    bits = dataflow.COMBINE_ACC_BITS
    return accumulate_step(
        f"wide-combine-w{w_bits}-a{a_bits}-k{k}", f"{steps} groups' P * ms in int{bits}",
        bits, steps, mant * pmax, bounded_product(("P", -pmax, pmax), ("ms", -mant, mant)),
        w_bits=w_bits, a_bits=a_bits, k=k)
