"""The CPU's folded-digit GEMMs (int8-gemm, float64-gemm, int64-matmul) and their combine."""

from __future__ import annotations

import z3

from exactness import dataflow
from exactness.contract import act_qmax

from .terms import (
    Obligation,
    accumulate_step,
    bounded_product,
    const,
    fits,
    product_term,
    signed_var,
    wide,
)


def cpu_int64_matmul(w_bits: int, a_bits: int, k: int, spread: int) -> Obligation:
    """gemm.accumulate_int64: T = qa @ Wf^T in int64, K products of an activation and a folded
    weight q * ms << shift (shift <= spread), every partial sum."""
    qmax = act_qmax(a_bits)
    fold_max = dataflow.folded_weight_max(w_bits, spread)
    bits = dataflow.COMBINE_ACC_BITS
    return accumulate_step(
        f"cpu-int64-matmul-w{w_bits}-a{a_bits}-k{k}",
        f"qa @ folded weights over K={k} in int{bits}, spread <= {spread}", bits, k,
        qmax * fold_max, bounded_product(("qa", -qmax, qmax), ("wf", -fold_max, fold_max)),
        w_bits=w_bits, a_bits=a_bits, k=k, spread=spread)


def cpu_float64_gemm(w_bits: int, a_bits: int, k: int, spread: int) -> Obligation:
    """gemm.accumulate_float64: each half of qa (hi in [-2**15, 2**15), lo in [0, 2**16)) times
    the folded weights over K: every partial sum an integer within FLOAT64_EXACT_BITS, where
    float64 holds every integer, so each add (or FMA) of the GEMM is exact."""
    fold_max = dataflow.folded_weight_max(w_bits, spread)
    half = 2**dataflow.HALF_BITS
    bits = dataflow.FLOAT64_EXACT_BITS
    return accumulate_step(
        f"cpu-float64-gemm-w{w_bits}-a{a_bits}-k{k}",
        f"halves @ folded weights over K={k} within 2**53 (float64-exact), spread <= {spread}",
        bits, k, half * fold_max,
        bounded_product(("half", -half // 2, half - 1), ("wf", -fold_max, fold_max)),
        w_bits=w_bits, a_bits=a_bits, k=k, spread=spread)


def cpu_float64_recombine(w_bits: int, a_bits: int, k: int, spread: int) -> Obligation:
    """T = (hi part << 16) + lo part in int64, from the halves' GEMM bounds: hi = qa >> 16 is in
    [-1, 0] up to 16-bit activations and [-2**15, 2**15) at 32 bits."""
    fold_max = dataflow.folded_weight_max(w_bits, spread)
    half = 2**dataflow.HALF_BITS
    qmax = act_qmax(a_bits)
    hi_max = max(-(-qmax >> dataflow.HALF_BITS), qmax >> dataflow.HALF_BITS)
    bits = dataflow.COMBINE_ACC_BITS

    def build():
        hi, hi_ok = signed_var("hi_part", -k * hi_max * fold_max, k * hi_max * fold_max)
        lo, lo_ok = signed_var("lo_part", -k * (half - 1) * fold_max, k * (half - 1) * fold_max)
        shifted = wide(hi) << dataflow.HALF_BITS
        return (z3.And(hi_ok, lo_ok), z3.And(fits(shifted, bits), fits(shifted + wide(lo), bits)),
                {"hi_part": hi, "lo_part": lo})

    return Obligation(f"cpu-float64-recombine-w{w_bits}-a{a_bits}-k{k}",
                      f"the halves' parts recombined in int{bits}, spread <= {spread}", build,
                      w_bits=w_bits, a_bits=a_bits, k=k, acc_bits=bits, spread=spread)


def cpu_int_mm(k: int, dot_bits: int) -> Obligation:
    return accumulate_step(f"cpu-int-mm-k{k}", f"int8 x int8 GEMM over K={k} in int{dot_bits}",
                           dot_bits, k, 128 * 128, product_term(-128, 127, 8), k=k)


def cpu_combine(w_bits: int, a_bits: int, k: int, spread: int) -> Obligation:
    """T = sum_{i,j} Z_ij << 8 (i + j) (+ 128 * rowsum) in int64, term by term: gemm.accumulate
    and the GPU's triton.folded.combine_kernel (linear_folded), the same dataflow."""
    fold_max = dataflow.folded_weight_max(w_bits, spread)
    limbs_w = dataflow.folded_weight_limbs(w_bits, spread)
    limbs_a = dataflow.act_limbs(a_bits)
    bits = dataflow.COMBINE_ACC_BITS

    def build():
        names, pre, post = {}, [], []
        acc = const(0)
        for i in range(limbs_a):
            for j in range(limbs_w):
                z, z_ok = signed_var(f"Z{i}{j}", -k * 128 * 128, k * 128 * 128)
                names[f"Z{i}{j}"] = z
                pre.append(z_ok)
                acc = acc + (wide(z) << (8 * (i + j)))
                post.append(fits(acc, bits))
        if limbs_a == 2:
            rowsum, ok = signed_var("rowsum", -k * fold_max, k * fold_max)
            names["rowsum"] = rowsum
            pre.append(ok)
            acc = acc + dataflow.LIMB_OFFSET * wide(rowsum)
            post.append(fits(acc, bits))
        return z3.And(pre), z3.And(post), names

    return Obligation(f"cpu-combine-w{w_bits}-a{a_bits}-k{k}",
                      f"{limbs_a}x{limbs_w} limb GEMMs combined in int{bits}, spread <= {spread}",
                      build, w_bits=w_bits, a_bits=a_bits, k=k, acc_bits=bits, spread=spread)
