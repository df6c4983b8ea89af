"""Proof obligations, generated from `exactness.dataflow` (the widths the kernel and the
reference use), in Z3 bit-vector arithmetic at those widths.

Each obligation is a claim `pre -> post` over symbolic inputs; the prover asks Z3 for a model of
`pre and not post`: none (unsat) is a proof, a model is a refutation with concrete values, a
timeout is unknown. Sums over K are proved by induction: one step lemma with the step index
symbolic (the base case, an empty sum, is 0), so K = 18432 costs what K = 32 does.

Widths: an n-bit two's-complement operation (wrap-around, as int32 / int64 registers and numpy
arrays compute) returns the exact result if and only if the exact result lies in
[-2**(n-1), 2**(n-1) - 1]. So each step's exact value is computed in a bit-vector wide enough
never to wrap (products at their operands' natural widths, which keeps the multipliers small), and
the claim at the code's width `n` is `fits(value, n)`.

Each obligation lives beside the stage of the dataflow it bounds: activations.py (the limbs),
dots.py (group dots on int8 limbs), dots_avx2.py, dots_amx.py and dots_spans.py (each kernel's
own dots), combine.py (scales times group sums, over K), gemms.py (the CPU's folded GEMMs) and
rounding.py (the one rounding); terms.py holds the Obligation record and the terms they share.
Here, `for_config` gathers every obligation of one configuration.
"""

from __future__ import annotations

from exactness import dataflow

from .activations import limb_split
from .combine import combine, combine_offset, scale_factor, wide_combine, wide_group_sum
from .dots import (
    four_limb_terms,
    group_bound,
    group_dot,
    group_recombine,
    vnni_dot,
    vnni_four_limbs,
    vnni_recombine,
)
from .dots_amx import amx_span_combine, amx_span_digits, amx_span_dot, amx_span_terms
from .dots_avx2 import avx2_byte_words, avx2_group_sum, avx2_halves, avx2_nibble_pairs, avx2_offset
from .dots_spans import span_fold, span_group, span_unshifted
from .gemms import (
    cpu_combine,
    cpu_float64_gemm,
    cpu_float64_recombine,
    cpu_int64_matmul,
    cpu_int_mm,
)
from .terms import MAX_SPREAD, Obligation


def for_config(w_bits: int, a_bits: int, k: int, acc_bits: int | None = None,
               spread: int | None = None) -> list[Obligation]:
    """Every obligation of one (weight bits, act bits, K) configuration, at the code's widths
    (acc_bits overrides the combine accumulator; spread overrides the certified limit)."""
    acc_bits = acc_bits or dataflow.COMBINE_ACC_BITS
    if spread is not None and not 0 <= spread <= MAX_SPREAD:
        raise ValueError(f"spread must be in [0, {MAX_SPREAD}], got {spread}")
    if spread is None:
        spread = max(0, dataflow.certified_spread(k, w_bits, a_bits, acc_bits))
    dot = dataflow.DOT_ACC_BITS
    obligations = [limb_split(a_bits), group_bound(w_bits, a_bits),
                   wide_group_sum(w_bits, a_bits), wide_combine(w_bits, a_bits, k),
                   combine(w_bits, a_bits, k, acc_bits, spread),
                   scale_factor(w_bits, a_bits, k, spread),
                   cpu_int64_matmul(w_bits, a_bits, k, spread)]
    if dataflow.float64_gemm_holds(k, w_bits, spread):  # else the kernel refuses the layer
        obligations += [cpu_float64_gemm(w_bits, a_bits, k, spread),
                        cpu_float64_recombine(w_bits, a_bits, k, spread)]
    limbs = dataflow.act_limbs(a_bits)
    obligations += [group_dot(w_bits, a_bits, dot), vnni_dot(w_bits, dot)]
    # the AVX2 build: vpmaddubsw pairs of 4-bit fields, vpmaddwd ones of 8-bit fields
    obligations.append(avx2_nibble_pairs(a_bits) if w_bits == 4 else avx2_byte_words(a_bits))
    for half in avx2_halves(a_bits):
        obligations += [avx2_group_sum(w_bits, a_bits, half), avx2_offset(w_bits, a_bits, half)]
    if dataflow.amx_holds(k, w_bits, a_bits, spread):  # else the AMX kernel refuses the layer
        obligations += [amx_span_digits(w_bits), amx_span_dot(dot), amx_span_terms(a_bits),
                        amx_span_combine(w_bits, a_bits, k, spread)]
    if limbs > 1:  # four limbs: each half recombines as two limbs do
        obligations.append(group_recombine(w_bits, a_bits, dot))
    if limbs == 4:
        obligations += [four_limb_terms(w_bits, a_bits, k, spread, "group"),
                        vnni_four_limbs(w_bits, a_bits, dot),
                        four_limb_terms(w_bits, a_bits, k, spread, "vnni"),
                        four_limb_terms(w_bits, a_bits, k, spread, "avx2")]
    else:
        obligations.append(vnni_recombine(w_bits, a_bits, dot))
    if (w_bits, a_bits) == (4, 16):  # the span kernel's configuration
        obligations += [span_fold(w_bits), span_group(w_bits, a_bits, dot),
                        span_unshifted(a_bits, dot)]
    if limbs > 1:
        obligations.append(combine_offset(w_bits, a_bits, k, acc_bits, spread))
    if limbs <= dataflow.GEMM_ACT_LIMBS:  # the int8 GEMMs on folded weights
        obligations += [cpu_int_mm(dataflow.int_mm_chunk(k), dot),
                        cpu_combine(w_bits, a_bits, k, spread)]
    return _configured(obligations, w_bits, a_bits, k, dot)


def _configured(obligations: list[Obligation], w_bits: int, a_bits: int, k: int,
                dot: int) -> list[Obligation]:
    for o in obligations:
        o.w_bits, o.a_bits, o.k = w_bits, a_bits, k
        o.acc_bits = o.acc_bits or dot
    return obligations
