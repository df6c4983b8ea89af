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
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import z3

from exactness import dataflow
from exactness.contract import BFLOAT16, FLOAT16, FLOAT32, GROUP_SIZE, act_qmax

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


# --------------------------------------------------------------------------- helpers


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


# --------------------------------------------------------------------------- the catalogue


def limb_split(a_bits: int) -> Obligation:
    """qa in [-Qa, Qa] -> its int8 limbs (dataflow.activation_limbs: the digits of
    qa - limb_offset, taken in int64) are int8 and recombine."""
    qmax = act_qmax(a_bits)
    limbs, offset = dataflow.act_limbs(a_bits), dataflow.limb_offset(a_bits)

    def build():
        qa = z3.BitVec("qa", 64)
        if limbs == 1:
            return in_range(qa, -qmax, qmax), in_range(qa, -128, 127), {"qa": qa}
        rest, digits = qa - offset, []
        for _ in range(limbs):
            low = ((rest + 128) & 255) - 128
            digits.append(low)
            rest = (rest - low) >> dataflow.LIMB_BITS
        post = z3.And(*[in_range(d, -128, 127) for d in digits], rest == 0,
                      sum(d << (dataflow.LIMB_BITS * i) for i, d in enumerate(digits)) + offset
                      == qa)
        return in_range(qa, -qmax, qmax), post, {"qa": qa}

    return Obligation(f"limb-split-a{a_bits}", "activation limbs are int8 and sum back to qa",
                      build, a_bits=a_bits)


def group_dot(w_bits: int, a_bits: int, dot_bits: int) -> Obligation:
    limb_max = act_qmax(a_bits) if dataflow.act_limbs(a_bits) == 1 else 128
    return accumulate_step(
        f"group-dot-w{w_bits}-a{a_bits}", f"int8 x int{w_bits} limb dots of 32 in int{dot_bits}",
        dot_bits, GROUP_SIZE, limb_max * 2 ** (w_bits - 1),
        product_term(-limb_max, min(limb_max, 127), w_bits),
        w_bits=w_bits, a_bits=a_bits)


def vnni_dot(w_bits: int, dot_bits: int) -> Obligation:
    """cpu_vnni.c: vpdpbusd sums (limb + 128) * q, limb + 128 in [0, 255], in int32 lanes."""
    return accumulate_step(
        f"vnni-dot-w{w_bits}", f"biased u8 x int{w_bits} dots of 32 (vpdpbusd) in int{dot_bits}",
        dot_bits, GROUP_SIZE, 255 * 2 ** (w_bits - 1), product_term(0, 255, w_bits),
        w_bits=w_bits)


# kernel_avx2.h: the stored fields w = q + 2**(bits - 1) (unsigned) against qa's bytes b_l in two's
# complement, the low ones unsigned and the top one signed; per word of 32 bits, D_l = sum w * b_l
# over its k (8 of 4-bit fields, 4 of 8-bit ones); P' = sum_l 256**l D_l over a group's words; and
# P = P' - 2**(bits - 1) * S with S = sum_k qa (four limbs: each 16-bit half so).


def avx2_limb(a_bits: int, limb: int) -> tuple[int, int]:
    """The range of qa's byte `limb` in the AVX2 build's activations (quantize_into)."""
    limbs = dataflow.act_limbs(a_bits)
    if limbs == 1:
        return -act_qmax(a_bits), act_qmax(a_bits)
    return (-128, 127) if limb == limbs - 1 else (0, 255)


def avx2_halves(a_bits: int) -> list[tuple[int, ...]]:
    """The limbs of each int32 half of P: all of them, or with four limbs (0, 1) and (2, 3)."""
    limbs = dataflow.act_limbs(a_bits)
    return [(0, 1), (2, 3)] if limbs == 4 else [tuple(range(limbs))]


def avx2_pairs(a_bits: int, field_max: int, pairs: tuple[tuple[int, int], ...],
               bits: int) -> Callable:
    """build() for a lane's products of 4 fields (w in [0, field_max]) by 4 bytes of each limb:
    every pair of `pairs` (indices of the products it adds) fits int`bits`, and so does the sum
    of the two."""

    def build():
        names, pre, post = {}, [], []
        for limb in range(dataflow.act_limbs(a_bits)):
            lo, hi = avx2_limb(a_bits, limb)
            terms = []
            for i in range(4):
                w, w_ok = signed_var(f"w{limb}_{i}", 0, field_max)
                b, b_ok = signed_var(f"b{limb}_{i}", lo, hi)
                names |= {f"w{limb}_{i}": w, f"b{limb}_{i}": b}
                terms.append(product(w, b))
                pre += [w_ok, b_ok]
            sums = [terms[i] + terms[j] for i, j in pairs]
            post += [*(fits(p, bits) for p in sums), fits(sums[0] + sums[1], bits)]
        return z3.And(*pre), z3.And(*post), names

    return build


def avx2_nibble_pairs(a_bits: int, field_max: int = 15) -> Obligation:
    """4-bit fields (w in [0, field_max = 15]): each vpmaddubsw pair w0 * b0 + w1 * b1 of every
    limb fits int16 (none saturates), and so do the two pairs of a chunk's low and high nibbles
    added by vpaddw (which wraps). (8-bit fields, field_max 255, would saturate.)"""
    return Obligation(f"avx2-nibble-pairs-a{a_bits}",
                      "vpmaddubsw pairs of 4-bit fields and qa's bytes, two added, fit int16",
                      avx2_pairs(a_bits, field_max, ((0, 1), (2, 3)), 16), w_bits=4,
                      a_bits=a_bits, acc_bits=16)


def avx2_byte_words(a_bits: int) -> Obligation:
    """8-bit fields (w in [0, 255]): vpmaddwd's pairs of 16-bit w * b_l (even k, odd k) fit
    int32, and so does the sum of a lane's two (byte_dots). (vpmaddubsw's would saturate:
    avx2-nibble-pairs at 8-bit fields is refuted.)"""
    return Obligation(f"avx2-byte-words-a{a_bits}",
                      "vpmaddwd pairs of 8-bit fields and qa's bytes, two added, fit int32",
                      avx2_pairs(a_bits, 255, ((0, 2), (1, 3)), 32), w_bits=8, a_bits=a_bits,
                      acc_bits=32)


def avx2_group_sum(w_bits: int, a_bits: int, half: tuple[int, ...]) -> Obligation:
    """A group's P' (one half with four limbs) summed word by word in int32: each word's value
    sum_l 256**l D_l ((D_1 << 8) + D_0) fits, and every partial sum of the group's words (vphaddd
    adds them in a tree: each partial sum is a sum of some of the words) stays within int32."""
    per_word = 32 // w_bits  # k a 32-bit word holds
    w_max = 2**w_bits - 1
    d_max = [per_word * w_max * max(map(abs, avx2_limb(a_bits, limb))) for limb in half]
    word_bound = sum(d << (8 * i) for i, d in enumerate(d_max))

    def make():
        names, pre, value = {}, [], const(0)
        for i, d in enumerate(d_max):
            v, ok = signed_var(f"D{half[i]}", -d, d)
            names[f"D{half[i]}"] = v
            pre.append(ok)
            value = value + (wide(v) << (8 * i))
        return value, z3.And(*pre), fits(value, 32), names

    return accumulate_step(
        f"avx2-group-sum-w{w_bits}-a{a_bits}-l{half[0]}",
        f"a group's words' sum_l 256**l D_l (limbs {half}) in int32", 32,
        GROUP_SIZE // per_word, word_bound, make, w_bits=w_bits, a_bits=a_bits)


def avx2_offset(w_bits: int, a_bits: int, half: tuple[int, ...]) -> Obligation:
    """P = P' - (S << (bits - 1)) in int32: the fields' offset 2**(bits - 1) taken off on the
    activations' side (S: the group's sum of qa, or of its 16-bit half), both terms and the
    difference fitting int32, for every P' within the group bound (avx2-group-sum)."""
    per_word = 32 // w_bits
    w_max = 2**w_bits - 1
    p_max = GROUP_SIZE // per_word * sum(
        per_word * w_max * max(map(abs, avx2_limb(a_bits, limb))) << (8 * i)
        for i, limb in enumerate(half))
    s_lo = min(avx2_limb(a_bits, half[-1])[0] << (8 * (len(half) - 1)), 0)
    s_hi = sum(avx2_limb(a_bits, limb)[1] << (8 * i) for i, limb in enumerate(half))
    if len(half) == 1 or dataflow.act_limbs(a_bits) == 2:  # S sums qa itself
        s_lo, s_hi = -act_qmax(a_bits), act_qmax(a_bits)

    def build():
        p, p_ok = signed_var("P'", -p_max, p_max)
        s, s_ok = signed_var("S", GROUP_SIZE * s_lo, GROUP_SIZE * s_hi)
        offset = wide(s) << (w_bits - 1)
        return (z3.And(p_ok, s_ok), z3.And(fits(offset, 32), fits(wide(p) - offset, 32)),
                {"P'": p, "S": s})

    return Obligation(f"avx2-offset-w{w_bits}-a{a_bits}-l{half[0]}",
                      f"P' - (S << {w_bits - 1}) in int32 (limbs {half})", build,
                      w_bits=w_bits, a_bits=a_bits, acc_bits=32)


def amx_span_digits(w_bits: int) -> Obligation:
    """cpu_amx.c's fold: q * f with |f| <= dataflow.span_fold_limit, as vpmullw computes it (16
    bits, wrapping), is exact; its low byte read as u8 (lo, vpmovwb) and its arithmetic shift by 8
    read as s8 (hi) give it back: 256 * hi + lo == q * f."""

    def build():
        limit = dataflow.span_fold_limit(w_bits)
        q, q_ok = signed_var("q", -(2 ** (w_bits - 1)), 2 ** (w_bits - 1) - 1)
        f, f_ok = signed_var("f", -limit, limit)
        exact = product(q, f)
        folded = z3.Extract(15, 0, exact)  # vpmullw keeps the low 16 bits
        lo = z3.ZeroExt(WIDE - 8, z3.Extract(7, 0, folded))
        hi = z3.SignExt(WIDE - 8, z3.Extract(15, 8, folded))  # vpsraw 8, then the low byte
        post = z3.And(fits(exact, dataflow.SPAN_WEIGHT_BITS), hi * 256 + lo == exact)
        return z3.And(q_ok, f_ok), post, {"q": q, "f": f}

    return Obligation(f"amx-span-digits-w{w_bits}", "folded weights q * f in s16, split into a "
                      "u8 and an s8 digit exactly", build, w_bits=w_bits,
                      acc_bits=dataflow.SPAN_WEIGHT_BITS)


def amx_span_dot(dot_bits: int) -> Obligation:
    """cpu_amx.c: a span's tdpbuud and tdpbusd add, per int32 element of a tile zeroed per span,
    products u * d, u a biased u8 limb and d a u8 or s8 digit, over at most AMX_SPAN_GROUPS
    groups. One product a step: Intel adds a dword's 4 products, then the sum, so each of its
    partial sums is one of these."""
    steps = dataflow.AMX_SPAN_GROUPS * GROUP_SIZE
    return accumulate_step(
        "amx-span-dot", f"tdpbuud / tdpbusd: {steps} u8 x (u8 or s8) products in int{dot_bits}",
        dot_bits, steps, 255 * 255, bounded_product(("u", 0, 255), ("d", -128, 255)))


def amx_span_terms(a_bits: int) -> Obligation:
    """cpu_amx.c's add_span: E = sum_ij D_ij << 8 (i + j) over its limbs i and digits j, each D
    within dataflow.amx_span_dot_bound, summed in int64 term by term."""
    bound = dataflow.amx_span_dot_bound()
    limbs = dataflow.act_limbs(a_bits)

    def build():
        names, pre, post, acc = {}, [], [], const(0)
        for i in range(limbs):
            for j in range(2):
                d, d_ok = signed_var(f"D{i}{j}", -bound, bound)
                names[f"D{i}{j}"] = d
                pre.append(d_ok)
                acc = acc + (wide(d) << (8 * (i + j)))
                post.append(fits(acc, dataflow.COMBINE_ACC_BITS))
        return z3.And(pre), z3.And(post), names

    return Obligation(f"amx-span-terms-a{a_bits}", f"{limbs}x2 span dots combined in "
                      f"int{dataflow.COMBINE_ACC_BITS}", build, a_bits=a_bits,
                      acc_bits=dataflow.COMBINE_ACC_BITS)


def amx_span_combine(w_bits: int, a_bits: int, k: int, spread: int) -> Obligation:
    """cpu_amx.c's T, one k at a time (a span's E << base is the sum of its k's terms, so each
    span's end is one of these partial sums): T starts at -B * R (B = 2**(8 L - 1), R =
    sum_k q * c) and adds (qa + B) * q * c per k, c = ms << shift. Invariant: T = X - B * R',
    X = sum of qa * q * c so far, R' the rest of R. Claim: every T, and each span's term, fits
    int64, within dataflow.amx_combine_bound."""
    bias = 2 ** (8 * dataflow.act_limbs(a_bits) - 1)
    qmax, mant = act_qmax(a_bits), 2**dataflow.SCALE_MANT_BITS - 1
    qc_max = 2 ** (w_bits - 1) * mant << spread
    bound = dataflow.amx_combine_bound(k, w_bits, a_bits, spread)
    bits = dataflow.COMBINE_ACC_BITS

    def build():
        j, acc = z3.BitVec("j", 32), z3.BitVec("T", bits)
        x, x_ok = signed_var("X", -k * qmax * qc_max, k * qmax * qc_max)
        rest, rest_ok = signed_var("R'", -k * qc_max, k * qc_max)
        qa, qa_ok = signed_var("qa", -qmax, qmax)
        qc, qc_ok = signed_var("q * c", -qc_max, qc_max)  # |q| * |ms| << spread at most
        done = z3.ZeroExt(WIDE - 32, j)
        exact = product(qa, qc)  # the contract's term; the kernel adds (qa + B) * q * c
        new_x = wide(x) + exact
        qc = wide(qc)
        pre = z3.And(z3.ULT(j, k), x_ok, rest_ok, qa_ok, qc_ok,
                     wide(x) <= done * (qmax * qc_max), wide(x) >= -done * (qmax * qc_max),
                     wide(rest) <= (k - 1 - done) * qc_max,
                     wide(rest) >= -(k - 1 - done) * qc_max,
                     wide(acc) == wide(x) - bias * (wide(rest) + qc))
        new = wide(acc) + exact + bias * qc
        post = z3.And(fits(new, bits), within(new, bound), new == new_x - bias * wide(rest),
                      new_x <= (done + 1) * (qmax * qc_max), new_x >= -(done + 1) * (qmax * qc_max),
                      fits(const(bound), bits),
                      fits(const(bias * k * qc_max), bits))  # the start, -B * R
        return pre, post, {"j": j, "T": acc, "X": x, "R'": rest, "qa": qa, "q * c": qc}

    return Obligation(f"amx-span-combine-w{w_bits}-a{a_bits}-k{k}",
                      f"the AMX kernel's T over {k} k, starting at -B * R, in int{bits}, spread "
                      f"<= {spread}", build, w_bits=w_bits, a_bits=a_bits, k=k, acc_bits=bits,
                      spread=spread)


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


def group_recombine(w_bits: int, a_bits: int, dot_bits: int) -> Obligation:
    """P' = 256 * D_hi + D_lo in the dot width, from the limb dots' bounds. The GPU kernel's MMA
    may add the low limb's products onto C = 256 * D_hi in its (saturating) accumulator: D_lo
    ranges over every partial sum of the low dot too (group-dot bounds them all)."""

    def build():
        bound = GROUP_SIZE * 128 * 2 ** (w_bits - 1)
        d_hi, hi_ok = signed_var("d_hi", -bound, bound)
        d_lo, lo_ok = signed_var("d_lo", -bound, bound)
        t1 = wide(d_hi) * 256
        t2 = t1 + wide(d_lo)
        return (z3.And(hi_ok, lo_ok), z3.And(fits(t1, dot_bits), fits(t2, dot_bits)),
                {"d_hi": d_hi, "d_lo": d_lo})

    return Obligation(f"group-recombine-w{w_bits}-a{a_bits}",
                      f"two-limb recombination of P' in int{dot_bits}", build, w_bits=w_bits,
                      a_bits=a_bits, acc_bits=dot_bits)


def vnni_recombine(w_bits: int, a_bits: int, dot_bits: int) -> Obligation:
    """cpu_vnni.c's correction of its biased dots D' = D + 128 * sum_k q: the low limb's sum
    starts at -(sum_k q << 15) (two limbs) or -(sum_k q << 7) (one limb); every partial sum from
    there, and P = (D'_hi << 8) + that sum, stay in int32 and give dataflow's
    P = 256 * D_hi + D_lo + 128 * sum_k q (or P = D_lo)."""
    two = dataflow.act_limbs(a_bits) == 2
    limb_max = 128 if two else act_qmax(a_bits)

    def build():
        bound = GROUP_SIZE * limb_max * 2 ** (w_bits - 1)
        biased_bound = GROUP_SIZE * 255 * 2 ** (w_bits - 1)  # vnni-dot: every partial sum
        d_hi, hi_ok = signed_var("D_hi", -bound, bound)
        d_lo, lo_ok = signed_var("D_lo", -bound, bound)
        wsum, sum_ok = signed_var("wsum", -GROUP_SIZE * 2 ** (w_bits - 1),
                                  GROUP_SIZE * (2 ** (w_bits - 1) - 1))
        partial, partial_ok = signed_var("partial", -biased_bound, biased_bound)
        offset = dataflow.LIMB_OFFSET * wide(wsum)
        biased_hi, biased_lo = wide(d_hi) + offset, wide(d_lo) + offset  # vpdpbusd's D'
        correction = wide(wsum) * 2 ** (15 if two else 7)
        low_sum = biased_lo - correction
        steps = [correction, -correction, wide(partial) - correction, low_sum]
        if two:
            steps += [biased_hi * 256, biased_hi * 256 + low_sum]
            want = wide(d_hi) * 256 + wide(d_lo) + offset
        else:
            want = wide(d_lo)
        post = z3.And(*[fits(v, dot_bits) for v in steps], steps[-1] == want)
        return (z3.And(hi_ok, lo_ok, sum_ok, partial_ok), post,
                {"D_hi": d_hi, "D_lo": d_lo, "wsum": wsum, "partial": partial})

    return Obligation(f"vnni-recombine-w{w_bits}-a{a_bits}",
                      f"the VNNI kernel's bias correction gives P in int{dot_bits}", build,
                      w_bits=w_bits, a_bits=a_bits, acc_bits=dot_bits)


def span_fold(w_bits: int) -> Obligation:
    """cpu_vnni.c's span kernel: the folded weights q * f, |f| <= dataflow.span_fold_limit, are
    s16 values (what vpmullw and vpdpwssd hold)."""

    def build():
        limit = dataflow.span_fold_limit(w_bits)
        q, q_ok = signed_var("q", -(2 ** (w_bits - 1)), 2 ** (w_bits - 1) - 1)
        f, f_ok = signed_var("f", -limit, limit)
        return z3.And(q_ok, f_ok), fits(product(q, f), dataflow.SPAN_WEIGHT_BITS), {"q": q, "f": f}

    return Obligation(f"span-fold-w{w_bits}", f"folded weights q * f in "
                      f"int{dataflow.SPAN_WEIGHT_BITS}", build, w_bits=w_bits,
                      acc_bits=dataflow.SPAN_WEIGHT_BITS)


def span_group(w_bits: int, a_bits: int, dot_bits: int) -> Obligation:
    """cpu_vnni.c's span kernel with a span of one group, which the certificate always allows:
    there f = c >> base is the odd part of ms << shift, |f| <= 255, and the 32 products
    qa * (q * f) sum in int32 (vpdpwssd) whatever the activations and weights."""
    qmax, f_max = act_qmax(a_bits), 2**dataflow.SCALE_MANT_BITS - 1

    def make():
        a, a_ok = signed_var("qa", -qmax, qmax)
        q, q_ok = signed_var("q", -(2 ** (w_bits - 1)), 2 ** (w_bits - 1) - 1)
        f, f_ok = signed_var("f", -f_max, f_max)
        bits = q.size() + f.size()  # q * f at its natural width: exact
        qf = z3.SignExt(bits - q.size(), q) * z3.SignExt(bits - f.size(), f)
        return product(a, qf), z3.And(a_ok, q_ok, f_ok), z3.BoolVal(True), {"qa": a, "q": q,
                                                                            "f": f}

    return accumulate_step(
        f"span-group-w{w_bits}-a{a_bits}", f"one group of folded s16 dots (vpdpwssd) in "
        f"int{dot_bits}", dot_bits, GROUP_SIZE, qmax * 2 ** (w_bits - 1) * f_max, make,
        w_bits=w_bits, a_bits=a_bits)


def span_unshifted(a_bits: int, dot_bits: int) -> Obligation:
    """cpu_vnni.c's span kernel on an unshifted block, one step of its induction over the chains
    of every group: a chain's sums lo (even lane, started at 2**31) and hi (odd lane, from 0),
    each certified to |.| <= Qa * dataflow.span_size_limit, wrap into int32 registers whose 64-bit
    lane V (hi above lo) is added to A, and V >> 32 (arithmetic) to H, both mod 2**64. Claim: the
    registers hold hi exactly and V = hi * 2**32 + lo + 2**31, and the invariant
    A - (H << 32) - n * 2**31 == L (mod 2**64, L the sum of the lo's, n the chains so far) holds
    for n + 1. So the kernel's A - ((H + G) << 32) after 2 G chains is the even rows' T mod 2**64,
    and T itself, as |T| < 2**63 (combine); the odd rows' T is H."""
    bound = act_qmax(a_bits) * dataflow.span_size_limit(a_bits)

    def build():
        lo, lo_ok = signed_var("lo", -bound, bound)
        hi, hi_ok = signed_var("hi", -bound, bound)
        acc, h_acc, low_sum, n = (z3.BitVec(name, 64) for name in ("A", "H", "L", "n"))
        bias = z3.BitVecVal(2**31, 64)
        invariant = acc - (h_acc << 32) - n * bias == low_sum
        lo_reg = z3.Extract(dot_bits - 1, 0, z3.SignExt(64 - lo.size(), lo)) + 2**31  # wraps
        hi_reg = z3.Extract(dot_bits - 1, 0, z3.SignExt(64 - hi.size(), hi))
        v = z3.Concat(hi_reg, lo_reg)
        new_acc, new_h = acc + v, h_acc + (v >> 32)  # vpaddq; vpsraq then vpaddq
        new_low = low_sum + z3.SignExt(64 - lo.size(), lo)
        post = z3.And(fits(lo, dot_bits), fits(hi, dot_bits),
                      wide(v) == wide(hi) * 2**32 + wide(lo) + 2**31,
                      new_acc - (new_h << 32) - (n + 1) * bias == new_low)
        return z3.And(lo_ok, hi_ok, invariant), post, {"lo": lo, "hi": hi, "A": acc, "H": h_acc,
                                                       "L": low_sum, "n": n}

    return Obligation(f"span-unshifted-a{a_bits}", f"an unshifted block's biased chains "
                      f"(int{dot_bits}) recombine exactly mod 2**64", build, a_bits=a_bits,
                      acc_bits=dot_bits)


def four_limb_bounds(w_bits: int, kind: str) -> tuple[int, int]:
    """The largest |P_lo| and |P_hi| of a four-limb group: P_lo = 256 * D_1 + D_0 and
    P_hi = 256 * D_3 + D_2, each D_j a limb dot of 32 (group-dot). "vnni": the AVX-512 build's
    (vnni_four_limbs), whose biased dots vnni-dot bounds by 32 * 255 * 2**(w_bits - 1) and whose
    P_hi also holds the correction -2**15 * sum_k q. "avx2": the AVX2 build's, P_lo = sum_k q *
    (qa & 0xFFFF) and P_hi = sum_k q * (qa >> 16)."""
    if kind == "avx2":
        q_max = GROUP_SIZE * 2 ** (w_bits - 1)
        return q_max * 0xFFFF, q_max * 2**15
    if kind == "group":
        dot = GROUP_SIZE * 128 * 2 ** (w_bits - 1)
        return 257 * dot, 257 * dot
    dot, wsum = GROUP_SIZE * 255 * 2 ** (w_bits - 1), GROUP_SIZE * 2 ** (w_bits - 1)
    return 257 * dot, 257 * dot + 2**15 * wsum  # "vnni"


def vnni_four_limbs(w_bits: int, a_bits: int, dot_bits: int) -> Obligation:
    """cpu_vnni.c at 32-bit activations: four biased limbs (the bytes of qa + 2**31), their dots
    D'_j = D_j + 128 * sum_k q. The high pair's low sum starts at -(sum_k q << 15); every
    partial sum from there, P_hi = (D'_3 << 8) + that sum and P_lo = (D'_1 << 8) + D'_0 stay in
    int32, and 2**16 * P_hi + P_lo is dataflow's P = sum_j 256**j D_j + limb_offset * sum_k q."""
    bound = GROUP_SIZE * 128 * 2 ** (w_bits - 1)
    biased_bound = GROUP_SIZE * 255 * 2 ** (w_bits - 1)  # vnni-dot: every partial sum

    def build():
        dots = [signed_var(f"D_{j}", -bound, bound) for j in range(4)]
        wsum, sum_ok = signed_var("wsum", -GROUP_SIZE * 2 ** (w_bits - 1),
                                  GROUP_SIZE * (2 ** (w_bits - 1) - 1))
        partial, partial_ok = signed_var("partial", -biased_bound, biased_bound)
        offset = dataflow.LIMB_OFFSET * wide(wsum)
        biased = [wide(d) + offset for d, _ in dots]  # vpdpbusd's D'_j
        correction = wide(wsum) * 2**15
        high_low = biased[2] - correction
        p_hi, p_lo = biased[3] * 256 + high_low, biased[1] * 256 + biased[0]
        steps = [correction, -correction, wide(partial) - correction, high_low, biased[3] * 256,
                 p_hi, biased[1] * 256, p_lo]
        want = sum(wide(d) * 256**j for j, (d, _) in enumerate(dots)) \
            + dataflow.limb_offset(a_bits) * wide(wsum)
        post = z3.And(*[fits(v, dot_bits) for v in steps], p_hi * 2**16 + p_lo == want)
        names = {f"D_{j}": d for j, (d, _) in enumerate(dots)}
        return (z3.And(*[ok for _, ok in dots], sum_ok, partial_ok), post,
                {**names, "wsum": wsum, "partial": partial})

    return Obligation(f"vnni-four-limbs-w{w_bits}-a{a_bits}",
                      f"the VNNI kernel's four limbs give P as two int{dot_bits} halves", build,
                      w_bits=w_bits, a_bits=a_bits, acc_bits=dot_bits)


def four_limb_terms(w_bits: int, a_bits: int, k: int, spread: int, kind: str) -> Obligation:
    """A group term at 32-bit activations, (P_hi * c << 16) + P_lo * c with c = ms << shift:
    both products, the shift and the sum fit int64 for every P_hi and P_lo of four_limb_bounds,
    shift <= spread. So the term is P * c exactly (P' * c: the Triton kernels add the limb
    offset apart), the term the combine proof sums. `kind`: "vnni" (the AVX-512 build's two
    vpmuldq), "group" (the Triton kernels' group_term) or "avx2" (the AVX2 build's halves of qa
    itself)."""
    lo_max, hi_max = four_limb_bounds(w_bits, kind)
    mant = 2**dataflow.SCALE_MANT_BITS - 1
    bits = dataflow.COMBINE_ACC_BITS

    def build():
        p_hi, hi_ok = signed_var("P_hi", -hi_max, hi_max)
        p_lo, lo_ok = signed_var("P_lo", -lo_max, lo_max)
        ms, ms_ok = signed_var("ms", -mant, mant)
        sh = z3.BitVec("shift", 8)
        shift = z3.ZeroExt(WIDE - 8, sh)
        high, low = (product(p_hi, ms) << shift) << 16, product(p_lo, ms) << shift
        return (z3.And(hi_ok, lo_ok, ms_ok, z3.ULE(sh, spread)),
                z3.And(fits(high, bits), fits(low, bits), fits(high + low, bits)),
                {"P_hi": p_hi, "P_lo": p_lo, "ms": ms, "shift": sh})

    return Obligation(f"{kind}-four-limb-terms-w{w_bits}-a{a_bits}-k{k}",
                      f"(P_hi * c << 16) + P_lo * c in int{bits}, spread <= {spread}", build,
                      w_bits=w_bits, a_bits=a_bits, k=k, acc_bits=bits, spread=spread)


def group_bound(w_bits: int, a_bits: int) -> Obligation:
    """The closed form (A2Q-style) |P| <= 32 * 2**(bw-1) * Qa: never exceeded, and attained; with
    two limbs also the group kernel's |P'| = |sum_k (qa - LIMB_OFFSET) * q| <=
    dataflow.group_term_bound."""
    qmax, bound = act_qmax(a_bits), 2 ** (w_bits - 1) * act_qmax(a_bits)
    term_bound = dataflow.group_term_bound(w_bits, a_bits) // GROUP_SIZE

    def build():
        a, a_ok = signed_var("a", -qmax, qmax)
        w, w_ok = signed_var("w", -(2 ** (w_bits - 1)), 2 ** (w_bits - 1) - 1)
        post = within(product(a, w), bound)
        if dataflow.act_limbs(a_bits) > 1:  # a - limb_offset one bit wider: it cannot wrap
            shifted = z3.SignExt(1, a) - dataflow.limb_offset(a_bits)
            post = z3.And(post, within(product(shifted, w), term_bound))
        return z3.And(a_ok, w_ok), post, {"a": a, "w": w}

    return Obligation(f"group-bound-w{w_bits}-a{a_bits}",
                      f"|qa * q| <= {bound}, so |P| <= 32 * that = {GROUP_SIZE * bound}", build,
                      w_bits=w_bits, a_bits=a_bits, extra={"attained": bound})


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


def rounding_inputs(m: z3.BitVecRef, e: z3.BitVecRef) -> z3.BoolRef:
    """What the roundings are proved for: every int64 m but -2**63, and every e the layers
    produce (|e| <= 320, beyond every e_r + emin: activations and scales are at most 2**128 or
    2**-149)."""
    return z3.And(m != z3.BitVecVal(-(2**63), 64), e >= -320, e <= 320)


def rounding(fmt) -> Obligation:
    """formats.round_scaled_array itself (run on bit-vectors) == IEEE RNE of m * 2**e, for every
    int64 m (but -2**63) and every e the layers produce, and all its shifts stay in [0, 63]."""
    from exactness.formats import round_scaled_array

    from .symbolic import Sym, shift_amounts_in_range

    def build():
        m, e = z3.BitVec("m", 64), z3.BitVec("e", 64)
        Sym.shift_conditions = []
        got = round_scaled_array(Sym(m), Sym(e), fmt).term
        pre = rounding_inputs(m, e)
        post = z3.And(got == ieee_rne_bits(m, e, fmt), shift_amounts_in_range())
        return pre, post, {"m": m, "e": e}

    return Obligation(f"rounding-{fmt.name}", f"round_scaled_array is IEEE RNE to {fmt.name}",
                      build, acc_bits=64, tactic=True)


def rounding_normal(fmt) -> Obligation:
    """cpu_vnni.c's round8_normal, one lane, as written there: where its test passes (bits to
    drop, s > 0, and the leading bit's binade normal and finite), RNE as one add,
    (a + 2**(s-1) - 1 + the last kept bit) >> s, joined to the exponent field by an add that
    carries a rounded-up significand into it, is IEEE RNE of m * 2**e; its shifts stay in
    [0, 63]. Every other vector goes to round8, whose arithmetic is round_scaled_array's."""
    mant, bias, emax = fmt.mant_bits, fmt.bias, fmt.exp_max_field

    def build():
        m, e = z3.BitVec("m", 64), z3.BitVec("e", 64)
        a = z3.If(m < 0, -m, m)  # vpabsq
        lz = z3.BitVecVal(64, 64)  # vplzcntq
        for bit in range(64):
            lz = z3.If(z3.Extract(bit, bit, a) == 1, z3.BitVecVal(63 - bit, 64), lz)
        s = (64 - fmt.precision) - lz
        field = e + (62 + bias) - lz
        normal = z3.And(s > 0, field >= 0, field < emax - 1)
        one = z3.BitVecVal(1, 64)
        last_kept = z3.LShR(a, s) & one
        below_half = (one << (s - 1)) - one
        n = z3.LShR(a + below_half + last_kept, s)
        bits = (field << mant) + n
        bits = z3.If(m < 0, bits | (1 << (mant + fmt.exp_bits)), bits)
        shifts = z3.And(*(z3.And(x >= 0, x <= 63) for x in (s, s - 1)))
        pre = z3.And(rounding_inputs(m, e), normal)
        return pre, z3.And(bits == ieee_rne_bits(m, e, fmt), shifts), {"m": m, "e": e}

    return Obligation(f"rounding-normal-{fmt.name}", f"round8_normal's add-based RNE is IEEE RNE "
                      f"to {fmt.name} where its test passes", build, acc_bits=64, tactic=True)


def ieee_rne_bits(m: z3.BitVecRef, e: z3.BitVecRef, fmt) -> z3.BitVecRef:
    """Z3's own IEEE semantics: m exactly into a wide float, times 2**e (exponent field), RNE."""
    sort = z3.FPSort(13, 66)  # 65 fraction bits: every int64 exact; exponents far from limits
    value = z3.fpSignedToFP(z3.RNE(), m, sort)
    bits = z3.fpToIEEEBV(value)
    scaled = z3.Concat(z3.Extract(78, 78, bits), z3.Extract(77, 65, bits) + z3.Extract(12, 0, e),
                       z3.Extract(64, 0, bits))
    exact_value = z3.If(m == 0, value, z3.fpBVToFP(scaled, sort))
    out = z3.fpToFP(z3.RNE(), exact_value, z3.FPSort(fmt.exp_bits, fmt.precision))
    return z3.ZeroExt(64 - fmt.width, z3.fpToIEEEBV(out))


ROUNDING_FORMATS = (BFLOAT16, FLOAT16, FLOAT32)


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
