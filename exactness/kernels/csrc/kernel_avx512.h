// The C kernel's AVX-512 VNNI half (cpu_kernel.c holds the rest): its limb kernel's tile, the span
// kernel, the quantization, the rounding and the blocks read in place, in 512-bit vectors of 16
// weight rows. vnni_library.py puts this file in place of cpu_kernel.c's #include "kernel_isa.h"
// (the AVX2 half is kernel_avx2.h); EXACTNESS_NATIVE=emulate builds it against
// avx512_emulated.h.
//
// The limb kernel's accumulation, per group of 32: int8 dots with AVX-512 VNNI (vpdpbusd,
// u8 x s8 -> s32, 64 products per instruction, never saturating) on the activation limbs biased
// by +128 to make them unsigned, corrected exactly once per group:
//     D'_j = sum (limb_j + 128) * q, |D'_j| <= 32 * 255 * 128 < 2**31 (proofs: vnni-dot)
//     P = D'_0 - 128 * sum_k q                              (one limb)
//     P = 256 * D'_1 + (D'_0 - 32768 * sum_k q)             (two: 16-bit activations)
//     P = 2**16 * P_hi + P_lo, P_hi = 256 * D'_3 + (D'_2 - 32768 * sum_k q),
//                              P_lo = 256 * D'_1 + D'_0      (four: 32-bit activations)
// (proofs: vnni-recombine, vnni-four-limbs), where the corrected limb's sum starts at the
// correction instead of 0; then T += P * c in int64 (c = ms << shift, an int32: vpmuldq's signed
// 32 x 32 -> 64 is exact), with four limbs as (P_hi * c << 16) + P_lo * c (vnni-four-limb-terms).
// A vector holds a block's 16 lanes (cpu_kernel.c's block layout): vpmuldq's even lanes are
// rows 0..7 of the block and its odd ones, shifted down, rows 8..15.
#define KERNEL_SPANS 1    // the span kernel (exact_linear_spans) is built
#define KERNEL_DERIVED 1  // layers derived ahead (NativeWeights) too, not only read in place
#define ACT_ROW_BYTES(K) (K)  // a row of x in a limb plane: its K bytes
// activation rows per weight load, in both kernels: 2 x 4 dot and 2 x 4 int64 registers
// (BY_ROWS lists the tails 1..3: change both together)
#define TILE_ROWS 4
// CALL(R, ...) for the `rows` (1..TILE_ROWS) activation rows of a tile, R a compile-time constant
#define BY_ROWS(rows, CALL, ...)                         \
    switch (rows) {                                      \
        case 1: CALL(1, __VA_ARGS__); break;             \
        case 2: CALL(2, __VA_ARGS__); break;             \
        case 3: CALL(3, __VA_ARGS__); break;             \
        default: CALL(TILE_ROWS, __VA_ARGS__); break;    \
    }

static inline __m512i broadcast4(const uint8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

// formats.round_scaled, 8 lanes at a time: the bit pattern of RNE(m * 2**e) in a format of
// `mant` stored bits and `expo` exponent bits (bf16 7/8, fp16 10/5, fp32 23/8), |m| < 2**63.
// An exact zero is +0.0; a nonzero value that underflows keeps its sign.
ALWAYS_INLINE __m512i round8(__m512i m, __m512i e, int mant, int expo) {
    const __m512i one = _mm512_set1_epi64(1), zero = _mm512_setzero_si512();
    const int64_t p = mant + 1, bias = (1 << (expo - 1)) - 1, emax = (1 << expo) - 1;
    const __m512i a = _mm512_abs_epi64(m);
    const __m512i length = _mm512_sub_epi64(_mm512_set1_epi64(64), _mm512_lzcnt_epi64(a));
    // q: the exponent of the result's last place (at least the subnormals' one); s = q - e, the
    // right shift of a (s <= 0: an exact left shift)
    __m512i q = _mm512_add_epi64(e, _mm512_sub_epi64(length, _mm512_set1_epi64(p)));
    q = _mm512_max_epi64(q, _mm512_set1_epi64(1 - bias - mant));
    const __m512i s = _mm512_sub_epi64(q, e);
    const __mmask8 right = _mm512_cmpgt_epi64_mask(s, zero);
    const __m512i kept = _mm512_srlv_epi64(a, s);  // 0 for s >= 64
    const __m512i rem = _mm512_and_si512(a, _mm512_sub_epi64(_mm512_sllv_epi64(one, s), one));
    const __m512i half = _mm512_sllv_epi64(one, _mm512_sub_epi64(s, one));
    const __mmask8 above = _mm512_cmpgt_epu64_mask(rem, half);
    const __mmask8 odd = _mm512_test_epi64_mask(kept, one);
    const __mmask8 tie_to_even = _mm512_cmpeq_epi64_mask(rem, half) & odd;
    __m512i n = _mm512_mask_add_epi64(kept, (above | tie_to_even) & right, kept, one);
    n = _mm512_mask_mov_epi64(_mm512_sllv_epi64(a, _mm512_sub_epi64(zero, s)), right, n);
    // s >= 64: under half the smallest step (length <= 63 < s), so 0
    n = _mm512_maskz_mov_epi64(_mm512_cmplt_epi64_mask(s, _mm512_set1_epi64(64)), n);
    const __mmask8 carry = _mm512_cmpeq_epi64_mask(n, _mm512_set1_epi64(1ll << p));
    n = _mm512_mask_srli_epi64(n, carry, n, 1);
    q = _mm512_mask_add_epi64(q, carry, q, one);
    const __m512i field = _mm512_add_epi64(q, _mm512_set1_epi64(mant + bias));
    const __m512i fraction = _mm512_and_si512(n, _mm512_set1_epi64((1ll << mant) - 1));
    __m512i bits = _mm512_or_si512(_mm512_slli_epi64(field, mant), fraction);
    const __mmask8 overflow = _mm512_cmpge_epi64_mask(field, _mm512_set1_epi64(emax));
    bits = _mm512_mask_mov_epi64(bits, overflow, _mm512_set1_epi64(emax << mant));  // inf
    const __mmask8 subnormal = _mm512_cmplt_epi64_mask(n, _mm512_set1_epi64(1ll << mant));
    bits = _mm512_mask_mov_epi64(bits, subnormal, n);  // exponent field 0 (and 0 for m = 0)
    const __mmask8 negative = _mm512_cmplt_epi64_mask(m, zero);
    return _mm512_mask_or_epi64(bits, negative, bits, _mm512_set1_epi64(1ll << (mant + expo)));
}

// round8 where every lane's result is a normal number reached by a right shift (the usual case:
// |T| >= 2**p, far from the format's ends), in half its instructions; any other vector goes to
// round8. RNE as one add, (a + 2**(s-1) - 1 + the last kept bit) >> s, and the significand's carry
// moves into the exponent field by the add that joins them (to infinity from the largest binade).
// Since the rounding overlaps the next tile's dots (Pending), fewer instructions pay: -0.8%
// (gate/up) and -1.7% (down) at M = 128, measured.
ALWAYS_INLINE __m512i round8_normal(__m512i m, __m512i e, int mant, int expo) {
    const int64_t p = mant + 1, bias = (1 << (expo - 1)) - 1, emax = (1 << expo) - 1;
    const __m512i one = _mm512_set1_epi64(1), zero = _mm512_setzero_si512();
    const __m512i a = _mm512_abs_epi64(m), lz = _mm512_lzcnt_epi64(a);
    const __m512i s = _mm512_sub_epi64(_mm512_set1_epi64(64 - p), lz);  // the bits dropped
    // the leading bit's biased exponent less one, e + (63 - lz) + bias - 1
    const __m512i field = _mm512_sub_epi64(_mm512_add_epi64(e, _mm512_set1_epi64(62 + bias)), lz);
    const __mmask8 normal = _mm512_cmpgt_epi64_mask(s, zero) &
                            _mm512_cmpge_epi64_mask(field, zero) &
                            _mm512_cmplt_epi64_mask(field, _mm512_set1_epi64(emax - 1));
    if (normal != 0xFF) return round8(m, e, mant, expo);
    const __m512i last_kept = _mm512_and_si512(_mm512_srlv_epi64(a, s), one);
    const __m512i below_half =
        _mm512_sub_epi64(_mm512_sllv_epi64(one, _mm512_sub_epi64(s, one)), one);
    const __m512i n =
        _mm512_srlv_epi64(_mm512_add_epi64(_mm512_add_epi64(a, below_half), last_kept), s);
    const __m512i bits = _mm512_add_epi64(_mm512_slli_epi64(field, mant), n);
    return _mm512_mask_or_epi64(bits, _mm512_cmplt_epi64_mask(m, zero), bits,
                                _mm512_set1_epi64(1ll << (mant + expo)));
}

// 8 bit patterns from round8 or round8_normal stored at out[i .. i + 8) as 16- or 32-bit values,
// the first `left` of them (all 8 when left >= 8, none when left <= 0).
ALWAYS_INLINE void store_bits(void *out, int64_t i, int64_t left, __m512i bits, int wide) {
    const __mmask8 live = left >= 8 ? 0xFF : left <= 0 ? 0 : (__mmask8)((1u << left) - 1);
    if (wide) {
        _mm256_mask_storeu_epi32((uint32_t *)out + i, live, _mm512_cvtepi64_epi32(bits));
    } else {
        _mm_mask_storeu_epi16((uint16_t *)out + i, live, _mm512_cvtepi64_epi16(bits));
    }
}

// Activation row i's T for the 16 columns from n0 (rows n0 .. n0 + 7 even, n0 + 8 .. 15 odd),
// stored as T or rounded once into y.
ALWAYS_INLINE void finish(Out o, int i, int64_t n0, int64_t Np, __m512i even, __m512i odd) {
    if (o.y) {  // the one rounding: T never reaches memory
        const __m512i e_r = _mm512_set1_epi64(o.e_r[i]);
        const int wide = o.mant + o.expo + 1 == 32;
        for (int h = 0; h < 2; h++) {
            const __m512i e = _mm512_add_epi64(e_r, _mm512_loadu_si512(o.emin + n0 + 8 * h));
            store_bits(o.y, i * o.ld + n0 + 8 * h, o.N - n0 - 8 * h,
                       round8_normal(h ? odd : even, e, o.mant, o.expo), wide);
        }
    } else {
        _mm512_storeu_si512(o.t + i * Np + n0, even);
        _mm512_storeu_si512(o.t + i * Np + n0 + 8, odd);
    }
}

// A group's P * c in int64 lanes from four limbs' P_hi and P_lo (int32 in the even lanes):
// (P_hi * c << 16) + P_lo * c, each product an exact vpmuldq.
ALWAYS_INLINE __m512i four_limb_term(__m512i p_hi, __m512i p_lo, __m512i c) {
    return _mm512_add_epi64(_mm512_slli_epi64(_mm512_mul_epi32(p_hi, c), 16),
                            _mm512_mul_epi32(p_lo, c));
}

// The limb whose sum carries the bias correction: the low one, or the high pair's low one.
ALWAYS_INLINE int corrected_limb(int limbs) { return limbs == 4 ? 2 : 0; }

// What the corrected limb's sum starts at, per lane: -(sum_k q << 7) for one limb, << 15 else.
ALWAYS_INLINE __m512i correction(__m512i wsum_g, int limbs) {
    return _mm512_sub_epi32(_mm512_setzero_si512(),
                            _mm512_slli_epi32(wsum_g, limbs == 1 ? 7 : 15));
}

// A byte vector of 4-bit pairs (nibble layout) as its two steps' weight bytes, q in [-8, 7].
ALWAYS_INLINE void unpack_pair(__m512i pair, __m512i *low, __m512i *high) {
    const __m512i low4 = _mm512_set1_epi8(15), eight = _mm512_set1_epi8(8);
    *low = _mm512_sub_epi8(_mm512_and_si512(pair, low4), eight);
    *high = _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16(pair, 4), low4), eight);
}

// One row's group: P from its limbs' dots d[l] (the corrected limb's started at the correction),
// times the group's factors c, added to the row's T (rows 0..7 of the block in even, 8..15 in
// odd). Both kernels' combine (exact_linear_limbs's tile, cpu_amx.c's tiles).
ALWAYS_INLINE void add_group(const __m512i *d, int limbs, __m512i c_even, __m512i c_odd,
                             __m512i *even, __m512i *odd) {
    if (limbs == 4) {
        const __m512i p_hi = _mm512_add_epi32(_mm512_slli_epi32(d[3], 8), d[2]);
        const __m512i p_lo = _mm512_add_epi32(_mm512_slli_epi32(d[1], 8), d[0]);
        *even = _mm512_add_epi64(*even, four_limb_term(p_hi, p_lo, c_even));
        *odd = _mm512_add_epi64(*odd, four_limb_term(_mm512_srli_epi64(p_hi, 32),
                                                     _mm512_srli_epi64(p_lo, 32), c_odd));
        return;
    }
    __m512i p = d[0];
    if (limbs == 2) p = _mm512_add_epi32(_mm512_slli_epi32(d[1], 8), p);
    *even = _mm512_add_epi64(*even, _mm512_mul_epi32(p, c_even));
    *odd = _mm512_add_epi64(*odd, _mm512_mul_epi32(_mm512_srli_epi64(p, 32), c_odd));
}

// T for `rows` activation rows (a compile-time constant at every call; row i's limb l at
// a[i] + l * plane) against weight block wb, whose first column is n0; its group g's weight sums
// and factors at wsum + g * ws and c + g * ws.
ALWAYS_INLINE void tile(const uint8_t *const *a, int64_t plane, const uint8_t *wb,
                        const int32_t *wsum, const int32_t *c, int64_t ws, Out o, int64_t n0,
                        int64_t K, int64_t Np, const int rows, const int limbs,
                        const int nibbles) {
    __m512i acc_even[TILE_ROWS], acc_odd[TILE_ROWS];
    FOR_ROWS(i) acc_even[i] = acc_odd[i] = _mm512_setzero_si512();
    const int corrected = corrected_limb(limbs);
    for (int64_t g = 0; g < K / 32; g++) {
        __m512i d[TILE_ROWS][4];
        // the correction starts that limb's sum, so it costs a register move, not an add
        const __m512i start = correction(_mm512_loadu_si512(wsum + g * ws), limbs);
        FOR_ROWS(i) FOR_LIMBS(l) d[i][l] = l == corrected ? start : _mm512_setzero_si512();
        for (int j = 0; j < 8; j += 2) {
            __m512i wv[2];
            if (nibbles) {
                unpack_pair(_mm512_loadu_si512(wb + (g * 4 + j / 2) * 64), &wv[0], &wv[1]);
            } else {
                wv[0] = _mm512_loadu_si512(wb + (g * 8 + j) * 64);
                wv[1] = _mm512_loadu_si512(wb + (g * 8 + j + 1) * 64);
            }
            for (int h = 0; h < 2; h++) {
                const int64_t k = g * 32 + (j + h) * 4;
                FOR_ROWS(i) FOR_LIMBS(l) {
                    d[i][l] = _mm512_dpbusd_epi32(d[i][l], broadcast4(a[i] + l * plane + k),
                                                  wv[h]);
                }
            }
        }
        const __m256i *cg = (const __m256i *)(c + g * ws);
        const __m512i c_even = _mm512_cvtepi32_epi64(_mm256_loadu_si256(cg));
        const __m512i c_odd = _mm512_cvtepi32_epi64(_mm256_loadu_si256(cg + 1));
        FOR_ROWS(i) add_group(d[i], limbs, c_even, c_odd, &acc_even[i], &acc_odd[i]);
    }
    FOR_ROWS(i) finish(o, i, n0, Np, acc_even[i], acc_odd[i]);
}

// 16-bit activations against 4-bit weights, per span of groups (exact_linear_spans): the
// activations whole, as int16 (quantize_limbs mode 0), against s16 weights with the scales folded
// in, q * f, expanded per block of 16 weight rows into a scratch [K/4][2][16][2] int16: for each
// 4-k step, the pairs (k0, k2) and (k1, k3) of every lane (lanes in LANE_ROWS order, as above).
// vpdpwssd (s16 x s16, pairs summed into s32, wrapping) sums each row's pairs (k0, k2) and
// (k1, k3) in two int32 chains. Each block of 16 weight rows is one of two kinds, certified when
// the weights load (vnni_layout.span_scales):
// - unshifted (unshifted[b] = 1): f = c = ms << shift itself, and every chain of every group
//   holds 32767 * |f| * sum |q| < 2**31. The even lanes' chains start at 2**31, so each 64-bit
//   lane of a chain's sums reads V = hi * 2**32 + lo + 2**31 exactly, and per group, without a
//   shift: A += V, H += V >> 32 (= hi); at the tile's end, rows 8..15 are H and rows 0..7 are
//   A - ((H + G) << 32), the 2 G biases removed, exact mod 2**64 (proofs: span-unshifted).
// - spans: f = c >> base, base the largest power of two dividing every c of the row's span, and
//   spans of groups taken while 32767 * sum |q * f| < 2**31 bounds every sum, hence the wrapped
//   int32 of both chains together is exact (a span of one group always qualifies: proofs,
//   span-fold and span-group). At a span's end, T += sum << base in int64 (two shifts).
// Both give the same T as exact_linear_limbs. f [Np/16][G][16] int16 in lane order; rsh
// [Np/16][G][16] int8 = 32 - base in row order (read at span ends); ends [Np/16][G] uint8: 1 where
// a span ends.
ALWAYS_INLINE void expand(const uint8_t *wb, const int16_t *f, int16_t *s, int64_t K) {
    const __m512i flip = _mm512_set1_epi8((char)0x88);  // nibble q + 8 -> 4-bit two's complement
    for (int64_t g = 0; g < K / 32; g++) {
        const __m512i f32 =
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(f + g * 16)));
        const __m512i f2 = _mm512_or_si512(f32, _mm512_slli_epi32(f32, 16));  // f in both words
        for (int j = 0; j < 8; j += 2) {  // one byte vector: steps j (low nibbles) and j + 1
            const __m512i x =
                _mm512_xor_si512(_mm512_loadu_si512(wb + (g * 4 + j / 2) * 64), flip);
            int16_t *o = s + (g * 8 + j) * 64;
            // a lane's low word holds, low to high, the nibbles of k0 of step j, k0 of step j + 1,
            // k1 of step j, k1 of step j + 1; its high word the same of k2, k3. Shifting one
            // nibble to the top of its word and back down sign-extends it.
            _mm512_storeu_si512(o, _mm512_mullo_epi16(
                _mm512_srai_epi16(_mm512_slli_epi16(x, 12), 12), f2));       // step j: k0, k2
            _mm512_storeu_si512(o + 32, _mm512_mullo_epi16(
                _mm512_srai_epi16(_mm512_slli_epi16(x, 4), 12), f2));        // step j: k1, k3
            _mm512_storeu_si512(o + 64, _mm512_mullo_epi16(
                _mm512_srai_epi16(_mm512_slli_epi16(x, 8), 12), f2));        // step j + 1: k0, k2
            _mm512_storeu_si512(o + 96, _mm512_mullo_epi16(_mm512_srai_epi16(x, 12), f2));
        }
    }
}

// Each group's 16 values v [G][16] set to its span's: those at the span's end (ends [G], 1 where a
// span ends; the last group always does). The span builders' twin of vnni_layout.at_span_ends.
static void at_span_ends(int8_t *v, const uint8_t *ends, int64_t G) {
    for (int64_t g = G - 2; g >= 0; g--) {
        if (!ends[g]) memcpy(v + g * 16, v + (g + 1) * 16, 16);
    }
}

#define SPAN_SIZE_LIMIT 65538  // dataflow.span_size_limit(16): the most sum |f| * sum |q| a span
#define SPAN_FOLD_LIMIT 4095   // dataflow.span_fold_limit(4): the most |f| against 4-bit weights

// A block's span scales, built per block (the twin of vnni_layout.span_scales, checked against it
// by the suite): from its 4-bit words wb (the nibble layout, 4 vectors of 16 lanes x 4 bytes a
// group) and its factors c (row order, `stride` int32 from one group to the next), f [G][16] int16
// in lane order, rsh [G][16] int8 = 32 - base in row order and ends [G] uint8; returns whether
// the block is unshifted. sc: scratch of G 16 int32 (each group's sum |q|, row order). The rules are span_scales': unshifted where every |c| <= SPAN_FOLD_LIMIT and
// |c| * its larger chain's sum |q| <= SPAN_SIZE_LIMIT (f = c, every group its own span); else
// spans taken greedily while, for every row, sum |c| * sum |q| and the largest |c|, over the
// largest power of two dividing every c of the span, stay within the two limits.
static int span_block_scales(const uint8_t *wb, const int32_t *c, int64_t stride, int64_t G,
                             int16_t *f, int8_t *rsh, uint8_t *ends, int32_t *sc) {
    const __m512i low4 = _mm512_set1_epi8(15), eight = _mm512_set1_epi8(8);
    const __m512i even_bytes = _mm512_set1_epi16(1), odd_bytes = _mm512_set1_epi16(256);
    const __m512i ones = _mm512_set1_epi16(1);
    int32_t *q_sum = sc;
    int32_t lanes_sum[16], lanes_chain[16];
    int unshifted = 1;
    for (int64_t g = 0; g < G; g++) {
        __m512i sum = _mm512_setzero_si512();  // per byte: |q| of both nibbles, 4 vectors (<= 64)
        for (int v = 0; v < 4; v++) {
            const __m512i x = _mm512_loadu_si512(wb + (g * 4 + v) * 64);
            sum = _mm512_add_epi8(sum, _mm512_add_epi8(
                _mm512_abs_epi8(_mm512_sub_epi8(_mm512_and_si512(x, low4), eight)),
                _mm512_abs_epi8(_mm512_sub_epi8(
                    _mm512_and_si512(_mm512_srli_epi16(x, 4), low4), eight))));
        }
        // a lane's bytes 0, 2 (its k0, k2: one chain) and 1, 3 (k1, k3: the other)
        const __m512i chain0 = _mm512_madd_epi16(_mm512_maddubs_epi16(sum, even_bytes), ones);
        const __m512i chain1 = _mm512_madd_epi16(_mm512_maddubs_epi16(sum, odd_bytes), ones);
        _mm512_storeu_si512(lanes_sum, _mm512_add_epi32(chain0, chain1));
        _mm512_storeu_si512(lanes_chain, _mm512_max_epi32(chain0, chain1));
        for (int l = 0; l < 16; l++) {
            const int r = LANE_ROW(l);
            const int64_t a = c[g * stride + r] < 0 ? -(int64_t)c[g * stride + r]
                                                    : c[g * stride + r];
            q_sum[g * 16 + r] = lanes_sum[l];
            unshifted &= a <= SPAN_FOLD_LIMIT && a * lanes_chain[l] <= SPAN_SIZE_LIMIT;
        }
    }
    const int64_t never = (int64_t)1 << 40;  // "no nonzero factor yet": divides nothing
    int64_t div[16], size[16], top[16];
    for (int64_t g = 0; g < G; g++) {
        int fits = g > 0 && !unshifted;
        for (int r = 0; r < 16 && fits; r++) {
            const int64_t v = c[g * stride + r], a = v < 0 ? -v : v, bit = v ? (v & -v) : never;
            const int64_t d = bit < div[r] ? bit : div[r], t = a > top[r] ? a : top[r];
            fits = (size[r] + a * q_sum[g * 16 + r]) / d <= SPAN_SIZE_LIMIT &&
                   t / d <= SPAN_FOLD_LIMIT;
        }
        if (!fits && g > 0) ends[g - 1] = 1;
        for (int r = 0; r < 16; r++) {
            const int64_t v = c[g * stride + r], a = v < 0 ? -v : v, bit = v ? (v & -v) : never;
            div[r] = fits && div[r] < bit ? div[r] : bit;  // the span's, or a new span's
            size[r] = (fits ? size[r] : 0) + a * q_sum[g * 16 + r];
            top[r] = fits && top[r] > a ? top[r] : a;
            const int base = unshifted || div[r] == never ? 0 : __builtin_ctzll((uint64_t)div[r]);
            rsh[g * 16 + r] = (int8_t)(32 - base);
        }
        ends[g] = 0;
    }
    ends[G - 1] = 1;
    at_span_ends(rsh, ends, G);  // each group takes its span's base: the span end's
    for (int64_t g = 0; g < G; g++) {
        for (int l = 0; l < 16; l++) {
            const int r = LANE_ROW(l);
            f[g * 16 + l] = (int16_t)(c[g * stride + r] >> (32 - rsh[g * 16 + r]));
        }
    }
    return unshifted;
}

// d += the pairs of v times the two int16 at p, broadcast to every lane: vpdpwssd with the
// broadcast embedded in its memory operand (GCC 12 loads it into a register of its own, one more
// instruction per dot: 3% of the kernel's time, measured); avx512_emulated.h has its own, no asm
#ifndef DOT_BROADCAST
#define DOT_BROADCAST(d, v, p) \
    __asm__("vpdpwssd %2%{1to16%}, %1, %0" : "+v"(d) : "v"(v), "m"(*(const int32_t *)(p)))
#endif

// A tile's sums waiting for their rounding (finish), one row during each of the next tile's first
// groups: the rounding's long dependency chains then run beside that tile's dots instead of
// between two tiles, where they filled the reorder window (-0.8% at M = 128, measured)
typedef struct {
    __m512i sums[2 * TILE_ROWS];
    Out o;
    int64_t n0;
    int rows;
} Pending;

ALWAYS_INLINE void finish_pending(Pending *p, int i, int64_t Np) {
    finish(p->o, i, p->n0, Np, p->sums[2 * i], p->sums[2 * i + 1]);
}

// T for `rows` activation rows (row i's words at a[i]) against the expanded block s, of the kind
// `unshifted` (a compile-time constant, as rows).
ALWAYS_INLINE void span_tile(const int16_t *const *a, const int16_t *s, const int8_t *rsh,
                             const uint8_t *ends, Out o, int64_t n0, int64_t K, int64_t Np,
                             Pending *p, const int rows, const int unshifted) {
    const __m512i high = _mm512_set1_epi64((int64_t)0xFFFFFFFF00000000ull);
    // unshifted blocks: 2**31 in the even lanes' chains, 0 in the odd ones
    const __m512i start = unshifted ? _mm512_set1_epi64(1ll << 31) : _mm512_setzero_si512();
    // two sums per row (pairs (k0, k2) and (k1, k3)): twice the independent dependency chains
    __m512i even[TILE_ROWS], odd[TILE_ROWS], d0[TILE_ROWS], d1[TILE_ROWS];
    FOR_ROWS(i) {
        even[i] = odd[i] = _mm512_setzero_si512();
        d0[i] = d1[i] = start;
    }
    const int before = p->rows;
    for (int64_t g = 0; g < K / 32; g++) {
        if (g < before) finish_pending(p, g, Np);
        for (int j = 0; j < 8; j++) {
            const __m512i v0 = _mm512_loadu_si512(s + (g * 8 + j) * 64);
            const __m512i v1 = _mm512_loadu_si512(s + (g * 8 + j) * 64 + 32);
            FOR_ROWS(i) {
                const int16_t *pair = a[i] + g * 32 + j * 4;
                DOT_BROADCAST(d0[i], v0, pair);      // k0, k2
                DOT_BROADCAST(d1[i], v1, pair + 2);  // k1, k3
            }
        }
        if (unshifted) {  // even: A, odd: H; each chain on its own (only it is bounded)
            FOR_ROWS(i) {
                even[i] = _mm512_add_epi64(even[i], _mm512_add_epi64(d0[i], d1[i]));
                odd[i] = _mm512_add_epi64(odd[i], _mm512_add_epi64(_mm512_srai_epi64(d0[i], 32),
                                                                   _mm512_srai_epi64(d1[i], 32)));
                d0[i] = d1[i] = start;
            }
        } else if (ends[g]) {
            const __m128i shifts = _mm_loadu_si128((const __m128i *)(rsh + g * 16));
            const __m512i r_even = _mm512_cvtepi8_epi64(shifts);  // rows 0..7
            const __m512i r_odd = _mm512_cvtepi8_epi64(_mm_srli_si128(shifts, 8));
            FOR_ROWS(i) {
                const __m512i d = _mm512_add_epi32(d0[i], d1[i]);  // exact: the span's bound
                // the even lanes' int32 moved up, then shifted down by 32 - base: sum << base
                even[i] = _mm512_add_epi64(even[i],
                                           _mm512_srav_epi64(_mm512_slli_epi64(d, 32), r_even));
                odd[i] = _mm512_add_epi64(odd[i],
                                          _mm512_srav_epi64(_mm512_and_si512(d, high), r_odd));
                d0[i] = d1[i] = _mm512_setzero_si512();
            }
        }
    }
    if (unshifted) {  // rows 0..7: A - ((H + G) << 32), mod 2**64
        const __m512i groups = _mm512_set1_epi64(K / 32);
        FOR_ROWS(i) {
            even[i] = _mm512_sub_epi64(even[i],
                                       _mm512_slli_epi64(_mm512_add_epi64(odd[i], groups), 32));
        }
    }
    for (int i = K / 32; i < before; i++) finish_pending(p, i, Np);  // fewer groups than rows
    FOR_ROWS(i) {
        p->sums[2 * i] = even[i];
        p->sums[2 * i + 1] = odd[i];
    }
    p->o = o;
    p->n0 = n0;
    p->rows = rows;
}

#define SPAN_TILE(R, S, UNSHIFTED) \
    span_tile(a_rows, S, rsh_b, ends_b, o, b * 16, K, Np, &pending, R, UNSHIFTED)

// T [M, Np] into t, or (y not NULL) the rounded output y [M, N] (see Out); w in the nibble layout.
void exact_linear_spans(const int16_t *a, const uint8_t *w, const int16_t *f, const int8_t *rsh,
                        const uint8_t *ends, const uint8_t *unshifted, int64_t *t, int64_t M,
                        int64_t K, int64_t Np, void *y, const int64_t *e_r, const int64_t *emin,
                        int64_t N, int mant, int expo) {
    const int64_t G = K / 32;
#pragma omp parallel
    {
        int16_t *scratch = aligned_alloc(64, K * 16 * sizeof(int16_t));  // 16 rows x K, s16
        Pending pending = {.rows = 0};
#pragma omp for schedule(static) nowait
        for (int64_t b = 0; b < Np / 16; b++) {
            expand(w + b * K * 8, f + b * G * 16, scratch, K);
            const int8_t *rsh_b = rsh + b * G * 16;
            const uint8_t *ends_b = ends + b * G;
            for (int64_t r = 0; r < M; r += TILE_ROWS) {
                const Out o = tile_out(t, y, e_r, emin, r, N, N, Np, mant, expo);
                const int64_t rows = M - r < TILE_ROWS ? M - r : TILE_ROWS;
                ROW_POINTERS(const int16_t *, a_rows, a, r + (i < rows ? i : 0), K);
                if (unshifted[b]) BY_ROWS(rows, SPAN_TILE, scratch, 1)
                else BY_ROWS(rows, SPAN_TILE, scratch, 0)
            }
        }
        for (int i = 0; i < pending.rows; i++) finish_pending(&pending, i, Np);  // the last tile
        free(scratch);
    }
}

// 16 values of x (format 0 bf16, 1 fp16, 2 fp32) as floats: every one exactly.
ALWAYS_INLINE __m512 load16(const void *x, int64_t i, int format) {
    if (format == 2) return _mm512_loadu_ps((const float *)x + i);
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)x + i));
    if (format == 1) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// RNE(v * scale) for 8 floats, as int32: the product is exact in float64 (a power-of-two scaling
// of a <= 24-bit value, far from float64's limits), so this is the one rounding.
ALWAYS_INLINE __m256i scaled_integers(__m256 v, __m512d scale) {
    const __m512d exact = _mm512_mul_pd(_mm512_cvtps_pd(v), scale);
    return _mm512_cvt_roundpd_epi32(exact, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

// qa = RNE(x * 2**-e_r[r]), stored into `out` by `mode`: 1, 2 or 4, that many limbs
// [mode][M][K], dataflow.activation_limbs biased by +128, which are the bytes of
// qa + 2**(8 mode - 1), lowest first; 0, qa itself as int16 [M][K], in each 4 k the order
// 0, 2, 1, 3 (exact_linear_spans' pairs). With `order`, what the kernels read against 4-bit words
// in place (prepare_block), whose nibbles hold each 8 k in the order 0, 2, 4, 6, 1, 3, 5, 7: each
// 8 k of a limb in that order, and the words in that order's pairs: 0, 4, 2, 6, 1, 5, 3, 7. K is a
// multiple of 32.
static void quantize_into(const void *x, int format, int64_t M, int64_t K, const int64_t *e_r,
                          uint8_t *out, int mode, int order) {
    // 2**(8 mode - 1), added mod 2**32: at mode 4, qa + 2**31 as an unsigned pattern
    const __m512i bias = _mm512_set1_epi32((int32_t)(1u << (8 * (mode ? mode : 1) - 1)));
    const __m512i pairs = order ? _mm512_setr_epi32(0, 4, 2, 6, 1, 5, 3, 7, 8, 12, 10, 14, 9, 13,
                                                    11, 15)
                                : _mm512_setr_epi32(0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12, 14,
                                                    13, 15);
    const __m512i nibble_order =
        _mm512_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15);
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < M; r++) {
        const union { uint64_t u; double d; } power = {(uint64_t)(1023 - e_r[r]) << 52};
        const __m512d scale = _mm512_set1_pd(power.d);  // 2**-e_r, from its bit pattern
        for (int64_t k = r * K; k < (r + 1) * K; k += 16) {
            const __m512 v = load16(x, k, format);
            const __m512i qa = _mm512_inserti64x4(
                _mm512_castsi256_si512(scaled_integers(_mm512_castps512_ps256(v), scale)),
                scaled_integers(_mm512_extractf32x8_ps(v, 1), scale), 1);
            if (mode == 0) {
                _mm256_storeu_si256((__m256i *)((int16_t *)out + k),
                                    _mm512_cvtepi32_epi16(_mm512_permutexvar_epi32(pairs, qa)));
                continue;
            }
            const __m512i biased =
                _mm512_add_epi32(order ? _mm512_permutexvar_epi32(nibble_order, qa) : qa, bias);
            for (int l = 0; l < mode; l++) {  // vpmovdb keeps each lane's low byte
                _mm_storeu_si128((__m128i *)(out + l * M * K + k),
                                 _mm512_cvtepi32_epi8(_mm512_srli_epi32(biased, 8 * l)));
            }
        }
    }
}

// y[r, n] = round8_normal(t[r, n], e_r[r] + emin[n]) for n < N, written as 16- or 32-bit patterns
// (the output tensor itself).
void round_rows(const int64_t *t, int64_t ld, const int64_t *e_r, const int64_t *emin,
                int64_t M, int64_t N, int mant, int expo, void *out) {
    const int wide = mant + expo + 1 == 32;
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < M; r++) {
        const __m512i er = _mm512_set1_epi64(e_r[r]);
        for (int64_t n = 0; n < N; n += 8) {
            const __mmask8 live = N - n >= 8 ? 0xFF : (__mmask8)((1u << (N - n)) - 1);
            const __m512i e = _mm512_add_epi64(er, _mm512_maskz_loadu_epi64(live, emin + n));
            store_bits(out, r * N + n, N - n,
                       round8_normal(_mm512_maskz_loadu_epi64(live, t + r * ld + n), e, mant,
                                     expo), wide);
        }
    }
}

// r[j] lane i = r[i] lane j (a 16 x 16 transpose of dwords): 64 shuffles, no memory.
ALWAYS_INLINE void transpose16(__m512i *r) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {  // lanes of 128 bits: (r_i, r_i+1) element pairs
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {  // u[4 a + c]: rows 4 a .. 4 a + 3 of element 4 L + c
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int c = 0; c < 4; c++) {  // the four quads of rows of element 4 L + c, lane L
        const __m512i x0 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x88);
        const __m512i x1 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xDD);
        const __m512i y0 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x88);
        const __m512i y1 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xDD);
        t[c] = _mm512_shuffle_i32x4(x0, y0, 0x88);
        t[4 + c] = _mm512_shuffle_i32x4(x1, y1, 0x88);
        t[8 + c] = _mm512_shuffle_i32x4(x0, y0, 0xDD);
        t[12 + c] = _mm512_shuffle_i32x4(x1, y1, 0xDD);
    }
    for (int i = 0; i < 16; i++) r[i] = t[i];
}

// Block b of a layer read in place, built per forward by the thread that runs it: its words w (the
// limb kernel's layout), weight sums wsum [G][16] (lane order) and factors c [G][16] (row order),
// from the live buffers; its rows' emin and flags written to L->emin and L->flags. sc: scratch
// of 2 G 16 int32. Rows past N read nothing and count as zero weights and scales.
// - 4-bit words: lane l's vector j is row LANE_ROWS[l]'s word j itself (k = 8 j .. 8 j + 7, each
//   q + 8): its bytes' low nibbles hold k 0, 2, 4, 6 and their high ones k 1, 3, 5, 7, the nibble
//   layout's pair of 4-k steps for activations in the order 0, 2, 4, 6, 1, 3, 5, 7 of each 8 k
//   (quantize_into's `order`). 8-bit words: row LANE_ROWS[l]'s word j (k = 4 j .. 4 j + 3) less
//   128 a byte, the byte layout itself. wsum: sum_k q of each group, from the same words. Both by
//   16 x 16 transposes of 16 rows' next 16 words (transpose16).
// - the scales (modules.certify's, in lanes), transposed the same way, 16 groups at a time: ms
//   and es of each finite scale (a non-finite one counts as 0 and flags its row), emin the least
//   es of the row's nonzero scales (0 if none), the spread the largest es - emin; where the
//   spread is at most `limit`, c = ms << (es - emin) (an int32: proofs, scale-factor), else c = 0
//   and the row flagged slow.
static Block prepare_block(const Layer *L, int64_t b, uint8_t *w, int32_t *wsum, int32_t *c,
                           int32_t *sc) {
    const int64_t K = L->K, G = K / 32, rows = L->N - b * 16 < 16 ? L->N - b * 16 : 16;
    const int nibbles = L->bits == 4;
    const int64_t words = K * L->bits / 32, per_group = nibbles ? 4 : 8;
    const __m512i zero = _mm512_setzero_si512();
    const __m512i ones = _mm512_set1_epi8(1), low4 = _mm512_set1_epi8(15);
    __m512i r[16];
    for (int64_t j0 = 0; j0 < words; j0 += 16) {  // 16 words of each row: 2 or 4 groups
        const int64_t count = words - j0 < 16 ? words - j0 : 16;  // a multiple of per_group
        const __mmask16 some = (__mmask16)((1u << count) - 1);
        for (int l = 0; l < 16; l++) {
            const int row = LANE_ROW(l);
            const int32_t *at = L->packed + (b * 16 + row) * words + j0;
            // 16 rows are 16 streams, more than the hardware prefetchers follow: ask for each
            // row's words ahead (past the row's end, the next block's row's), and its scales
            const int64_t ahead = j0 + PREFETCH_WORDS, next = b * 16 + 16 + row;
            if (ahead < words && row < rows) {
                _mm_prefetch((const char *)(at + PREFETCH_WORDS), _MM_HINT_T0);
            } else if (ahead >= words && next < L->N) {
                _mm_prefetch((const char *)(L->packed + next * words + ahead - words), _MM_HINT_T0);
            }
            if (j0 / 16 * 32 < G && row < rows) {  // a line of 32 scales a chunk
                _mm_prefetch((const char *)(L->scale + (b * 16 + row) * G + j0 / 16 * 32),
                             _MM_HINT_T0);
            }
            r[l] = row < rows ? _mm512_mask_loadu_epi32(zero, some, at) : zero;
        }
        transpose16(r);
        for (int64_t j = 0; j < count; j += per_group) {
            const int64_t g = (j0 + j) / per_group;
            __m512i sum = zero;
            if (nibbles) {  // a byte's two nibbles, at most 30; four words' at most 120
                __m512i nibble_sums = zero;
                for (int i = 0; i < 4; i++) {
                    const __m512i v = r[j + i];
                    _mm512_storeu_si512(w + (j0 + j + i) * 64, v);
                    nibble_sums = _mm512_add_epi8(nibble_sums, _mm512_add_epi8(
                        _mm512_and_si512(v, low4),
                        _mm512_and_si512(_mm512_srli_epi16(v, 4), low4)));
                }
                sum = _mm512_dpbusd_epi32(zero, nibble_sums, ones);
            } else {
                for (int i = 0; i < 8; i++) {
                    const __m512i v = r[j + i];
                    _mm512_storeu_si512(w + (j0 + j + i) * 64,
                                        _mm512_xor_si512(v, _mm512_set1_epi8((char)0x80)));
                    sum = _mm512_dpbusd_epi32(sum, v, ones);
                }
            }
            _mm512_storeu_si512(wsum + g * 16, _mm512_sub_epi32(
                sum, _mm512_set1_epi32(nibbles ? 8 * 32 : 128 * 32)));
        }
    }
    const __m512i big = _mm512_set1_epi32(1 << 20);
    __m512i emin = big, emax = _mm512_sub_epi32(zero, big);
    __mmask16 nonfinite = 0;
    int32_t *ms_of = sc, *es_of = sc + G * 16;
    for (int64_t g0 = 0; g0 < G; g0 += 16) {
        const int64_t count = G - g0 < 16 ? G - g0 : 16;
        const __mmask16 some = (__mmask16)((1u << count) - 1);
        for (int i = 0; i < 16; i++) {
            r[i] = i < rows ? _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(
                                  some, L->scale + (b * 16 + i) * G + g0))
                            : zero;
        }
        transpose16(r);  // r[j]: group g0 + j's scale bits, rows in order
        for (int64_t j = 0; j < count; j++) {
            const __m512i bits = r[j];
            const __m512i field =
                _mm512_and_si512(_mm512_srli_epi32(bits, 7), _mm512_set1_epi32(255));
            const __m512i frac = _mm512_and_si512(bits, _mm512_set1_epi32(127));
            const __mmask16 normal = _mm512_test_epi32_mask(field, field);
            const __mmask16 finite = ~_mm512_cmpeq_epi32_mask(field, _mm512_set1_epi32(255));
            nonfinite |= ~finite;
            const __m512i m = _mm512_maskz_mov_epi32(
                finite, _mm512_mask_or_epi32(frac, normal, frac, _mm512_set1_epi32(128)));
            // s = ms * 2**es: es = field - 127 - 7 (normal), 1 - 127 - 7 (subnormal)
            const __m512i es = _mm512_mask_sub_epi32(_mm512_set1_epi32(-133), normal, field,
                                                     _mm512_set1_epi32(134));
            const __mmask16 negative = _mm512_test_epi32_mask(bits, _mm512_set1_epi32(0x8000));
            const __mmask16 nonzero = _mm512_test_epi32_mask(m, m);
            emin = _mm512_mask_min_epi32(emin, nonzero, emin, es);
            emax = _mm512_mask_max_epi32(emax, nonzero, emax, es);
            _mm512_storeu_si512(ms_of + (g0 + j) * 16, _mm512_mask_sub_epi32(m, negative, zero, m));
            _mm512_storeu_si512(es_of + (g0 + j) * 16, es);
        }
    }
    const __mmask16 live = (__mmask16)((1u << rows) - 1);
    const __mmask16 any = ~_mm512_cmpeq_epi32_mask(emin, big);
    emin = _mm512_maskz_mov_epi32(any, emin);
    const __mmask16 slow = _mm512_cmpgt_epi32_mask(
        _mm512_maskz_sub_epi32(any, emax, emin), _mm512_set1_epi32(L->limit));
    for (int64_t g = 0; g < G; g++) {
        const __m512i ms = _mm512_loadu_si512(ms_of + g * 16);
        const __m512i shift = _mm512_maskz_sub_epi32(_mm512_test_epi32_mask(ms, ms),
                                                     _mm512_loadu_si512(es_of + g * 16), emin);
        _mm512_storeu_si512(c + g * 16,
                            _mm512_maskz_mov_epi32(~slow, _mm512_sllv_epi32(ms, shift)));
    }
    const __m512i flags = _mm512_or_si512(
        _mm512_maskz_mov_epi32(slow & live, _mm512_set1_epi32(FLAG_SLOW)),
        _mm512_maskz_mov_epi32(nonfinite & live, _mm512_set1_epi32(FLAG_NONFINITE)));
    _mm_storeu_si128((__m128i *)(L->flags + b * 16), _mm512_cvtepi32_epi8(flags));
    _mm512_storeu_si512(L->emin + b * 16, _mm512_cvtepi32_epi64(_mm512_castsi512_si256(emin)));
    _mm512_storeu_si512(L->emin + b * 16 + 8,
                        _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(emin, 1)));
    return (Block){w, wsum, c, 16, nibbles};
}
