// The C kernel's AVX2 half (cpu_kernel.c holds the rest), for every x86-64 CPU without AVX-512
// VNNI: AMD Zen 2 and 3 (EPYC Rome, Milan), Intel before Ice Lake; it runs natively on every
// AVX-512 CPU too. It reads the checkpoint's words in place, row by row: each weight row's words
// are loaded as they are stored, 8 at a time, and dotted with activation vectors that were put
// in the words' order once, when x was quantized. No words are copied or transposed, and no
// weight sums are taken: the offsets are corrected on the activations' side, once per row of x.
// (The AVX-512 half broadcasts 4 k of x against 16 weight rows instead: vpdpbusd's 64 products an
// instruction repay its transposes; vpmaddubsw's 32 do not.)
//
// The activations (quantize_into): qa's L bytes as two's complement, b_0 .. b_{L-2} unsigned
// (u8) and the top one b_{L-1} signed (s8), qa = sum_l 256**l b_l: no offset. A row of x holds
// them plane by plane, ACT_ROW_BYTES(K) apart: limb l of row r at planes + l * plane + r * row.
// Against 4-bit words they are in the words' order, each 64 k as its 32 even k then its 32 odd
// k: byte 4j + i of 8 words holds k 8j + 2i in its low nibble and 8j + 2i + 1 in its high one, so
// k = 2b and 2b + 1 of the chunk face byte b. Against 8-bit words, each 32 k as its 16 even k
// then its 16 odd k (vpmaddwd's pairs). After the limbs, in plane 0 only, each group's sums
// S = sum_k qa (L <= 2), or S_lo = sum_k (qa & 0xFFFF) and S_hi = sum_k (qa >> 16) (L = 4), as
// int32 [G8] each (G8: G rounded up to 8, zeros past G), in the factors' order (below).
//
// The group dot, per 8 words (a chunk), from the stored fields w = q + 8 (4-bit, in [0, 15]) or
// q + 128 (8-bit, in [0, 255]):
// - 4-bit: vpmaddubsw (u8 x s8 pairs summed into int16, saturating past +-32767) of an unsigned
//   limb b and w as s8, or of w as u8 and the signed top limb: two of them a chunk (low and high
//   nibbles), |sum| <= 2 * 2 * 255 * 15 = 15300, never saturating (proofs: avx2-nibble-pairs).
//   vpmaddwd by ones then sums each word's 8 products into int32: D_l.
// - 8-bit: vpmaddubsw would saturate (255 * 255), so vpmaddwd (s16 x s16, pairs summed exactly
//   into int32) takes w and b widened to 16 bits: D_l (proofs: avx2-byte-words).
// Then P' = sum_l 256**l D_l = sum_k w * qa, and P = P' - o * S = sum_k q * qa (o = 8 or 128),
// summed over a group's words by vphaddd, each partial sum a sum of the group's products
// (proofs: avx2-group-sum; with four limbs P = 2**16 * P_hi + P_lo, each half so). Then
// T += P * c in int64 (vpmuldq, exact), and T is rounded once: formats.round_scaled in scalar C
// (round1), 16 outputs a tile row against the K / 32 groups of vector work that made them.
// The 4-bit reduction leaves each 8 groups in the order 0, 2, 4, 6, 1, 3, 5, 7 (two chunks of
// four words each summed by two vphaddd), and prepare_block stores their factors c so.

#define KERNEL_SPANS 0    // no span kernel (exact_linear_spans, span_block_scales) in this build
#define KERNEL_DERIVED 0  // layers read in place only: no derived block layout (exact_linear_limbs)
#define TILE_ROWS 2       // rows of x a weight row's words are loaded for
// CALL(R, ...) for the `rows` (1..TILE_ROWS) activation rows of a tile, R a compile-time constant
#define BY_ROWS(rows, CALL, ...)                         \
    switch (rows) {                                      \
        case 1: CALL(1, __VA_ARGS__); break;             \
        default: CALL(TILE_ROWS, __VA_ARGS__); break;    \
    }
#define GROUPS8(K) (((K) / 32 + 7) / 8 * 8)  // G8: a row's groups, rounded up to 8
#ifndef PREFETCH_ROW_WORDS
#define PREFETCH_ROW_WORDS 2048  // how far ahead the tile asks for a row's words (measured)
#endif
// one row of x in a limb plane: its limbs, K rounded up to a whole chunk of 64, then (plane 0)
// its group sums S_lo, S_hi as int32 [G8] each
#define ACT_ROW_BYTES(K) (((K) + 63) / 64 * 64 + 8 * GROUPS8(K))

// formats.round_scaled: the bit pattern of RNE(m * 2**e) in a format of `mant` stored bits and
// `expo` exponent bits (bf16 7/8, fp16 10/5, fp32 23/8), |m| < 2**63. An exact zero is +0.0; a
// nonzero value that underflows keeps its sign.
static inline uint32_t round1(int64_t m, int64_t e, int mant, int expo) {
    if (m == 0) return 0;
    const int64_t p = mant + 1, bias = (1 << (expo - 1)) - 1, emax = (1 << expo) - 1;
    const uint32_t sign = m < 0 ? 1u << (mant + expo) : 0;
    const uint64_t a = m < 0 ? -(uint64_t)m : (uint64_t)m;
    const int64_t length = 64 - __builtin_clzll(a);
    // q: the exponent of the result's last place (at least the subnormals' one); s = q - e, the
    // right shift of a (s <= 0: an exact left shift, by less than p)
    int64_t q = e + length - p;
    if (q < 1 - bias - mant) q = 1 - bias - mant;
    const int64_t s = q - e;
    uint64_t n;
    if (s <= 0) {
        n = a << -s;
    } else if (s > length) {
        n = 0;  // under half the smallest step
    } else {
        n = a >> s;  // s <= length <= 63
        const uint64_t rem = a & ((1ull << s) - 1), half = 1ull << (s - 1);
        n += rem > half || (rem == half && (n & 1));
    }
    if (n == 1ull << p) {  // the rounding carried into the next binade
        n >>= 1;
        q++;
    }
    if (n < 1ull << mant) return sign | (uint32_t)n;  // subnormal, or zero: exponent field 0
    const int64_t field = q + mant + bias;
    if (field >= emax) return sign | (uint32_t)(emax << mant);  // infinity
    return sign | (uint32_t)(field << mant) | (uint32_t)(n & ((1ull << mant) - 1));
}

// out[i] = round1(m, e) as a 16- or 32-bit pattern
ALWAYS_INLINE void store_rounded(void *out, int64_t i, int64_t m, int64_t e, int mant, int expo) {
    const uint32_t bits = round1(m, e, mant, expo);
    if (mant + expo + 1 == 32) {
        ((uint32_t *)out)[i] = bits;
    } else {
        ((uint16_t *)out)[i] = (uint16_t)bits;
    }
}

// Activation row i's T for the 16 columns from n0 (t[n]: column n0 + n), stored as T or rounded
// once into y.
ALWAYS_INLINE void finish(Out o, int i, int64_t n0, int64_t Np, const int64_t *t) {
    const int64_t count = o.N - n0 < 16 ? o.N - n0 : 16;
    for (int64_t n = 0; n < count; n++) {
        if (o.y) {
            store_rounded(o.y, i * o.ld + n0 + n, t[n], o.e_r[i] + o.emin[n0 + n], o.mant,
                          o.expo);
        } else {
            o.t[i * Np + n0 + n] = t[n];
        }
    }
}

// The chunk's dot of 8 words w of 4-bit fields (q + 8) with one row of x: per word, in int32,
// sum_l 256**l D_l over its 8 k (two int32 halves, low = limbs 0 and 1, high = limbs 2 and 3,
// where limbs == 4). a: the chunk's 64 bytes of limb 0 (evens, then odds); limb l at a + l *
// plane. The low limbs are u8 and take w as s8 (in [0, 15]); the top limb is s8 and takes w as
// u8.
ALWAYS_INLINE void nibble_dots(__m256i w, const uint8_t *a, int64_t plane, const int limbs,
                               __m256i *low, __m256i *high) {
    const __m256i low4 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    const __m256i even = _mm256_and_si256(w, low4);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi16(w, 4), low4);
    __m256i d[4];
    for (int l = 0; l < limbs; l++) {
        const __m256i a_even = _mm256_loadu_si256((const __m256i *)(a + l * plane));
        const __m256i a_odd = _mm256_loadu_si256((const __m256i *)(a + l * plane + 32));
        const __m256i pairs = l == limbs - 1
            ? _mm256_add_epi16(_mm256_maddubs_epi16(even, a_even),
                               _mm256_maddubs_epi16(odd, a_odd))
            : _mm256_add_epi16(_mm256_maddubs_epi16(a_even, even),
                               _mm256_maddubs_epi16(a_odd, odd));
        d[l] = _mm256_madd_epi16(pairs, ones);
    }
    *low = limbs == 1 ? d[0] : _mm256_add_epi32(_mm256_slli_epi32(d[1], 8), d[0]);
    if (limbs == 4) *high = _mm256_add_epi32(_mm256_slli_epi32(d[3], 8), d[2]);
}

// Each 32-bit lane's dot of its 4 fields w (q + 128, as u8) with 4 bytes of one limb of x:
// `even` and `odd` the limb's bytes of the lanes' even and odd k (16 each), zero-extended
// (unsigned limbs) or sign-extended (the top limb) to 16 bits. vpmaddwd's products and pair
// sums are exact in int32; vpmaddubsw's pairs would saturate here.
ALWAYS_INLINE __m256i byte_dots(__m256i w, __m256i even, __m256i odd) {
    const __m256i low_byte = _mm256_set1_epi16(255);
    return _mm256_add_epi32(_mm256_madd_epi16(_mm256_and_si256(w, low_byte), even),
                            _mm256_madd_epi16(_mm256_srli_epi16(w, 8), odd));
}

// The chunk's dot of 8 words w of 8-bit fields (q + 128) with one row of x, as nibble_dots:
// a holds the chunk's 32 bytes of limb 0 (16 even k, then 16 odd k).
ALWAYS_INLINE void byte_word_dots(__m256i w, const uint8_t *a, int64_t plane, const int limbs,
                                  __m256i *low, __m256i *high) {
    __m256i d[4];
    for (int l = 0; l < limbs; l++) {
        const __m128i even = _mm_loadu_si128((const __m128i *)(a + l * plane));
        const __m128i odd = _mm_loadu_si128((const __m128i *)(a + l * plane + 16));
        d[l] = l == limbs - 1
            ? byte_dots(w, _mm256_cvtepi8_epi16(even), _mm256_cvtepi8_epi16(odd))
            : byte_dots(w, _mm256_cvtepu8_epi16(even), _mm256_cvtepu8_epi16(odd));
    }
    *low = limbs == 1 ? d[0] : _mm256_add_epi32(_mm256_slli_epi32(d[1], 8), d[0]);
    if (limbs == 4) *high = _mm256_add_epi32(_mm256_slli_epi32(d[3], 8), d[2]);
}

// The int64 lanes of P * c: P and c int32, each lane pair (2m, 2m + 1) a product each.
ALWAYS_INLINE __m256i times_factors(__m256i p, __m256i c) {
    return _mm256_add_epi64(_mm256_mul_epi32(p, c), _mm256_mul_epi32(_mm256_srli_epi64(p, 32),
                                                                     _mm256_srli_epi64(c, 32)));
}

// One row of x's part of T for a weight row: the groups' sums P (8 of them in lanes, the
// order of `c`), corrected by the activations' offset sums (o * S) and times the factors c,
// added into the int64 lanes t. With four limbs, P = 2**16 * P_hi + P_lo.
ALWAYS_INLINE __m256i add_groups(__m256i t, __m256i p_low, __m256i p_high, __m256i s_low,
                                 __m256i s_high, __m256i c, const int limbs, const int shift) {
    p_low = _mm256_sub_epi32(p_low, _mm256_slli_epi32(s_low, shift));
    if (limbs < 4) return _mm256_add_epi64(t, times_factors(p_low, c));
    p_high = _mm256_sub_epi32(p_high, _mm256_slli_epi32(s_high, shift));
    return _mm256_add_epi64(t, _mm256_add_epi64(_mm256_slli_epi64(times_factors(p_high, c), 16),
                                                times_factors(p_low, c)));
}

// The 8 words from word j of a row of `words` (fewer at its end: masked, none read past it).
ALWAYS_INLINE __m256i row_words(const int32_t *row, int64_t j, int64_t words) {
    if (j + 8 <= words) return _mm256_loadu_si256((const __m256i *)(row + j));
    const __m256i some = _mm256_cmpgt_epi32(_mm256_set1_epi32((int32_t)(words - j)),
                                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    return _mm256_maskload_epi32(row + j, some);
}

// S_lo and S_hi of x's row a (plane 0) for the 8 groups from g (in the order of the factors,
// as quantize_into stores them)
ALWAYS_INLINE void group_sums(const uint8_t *a, int64_t K, int64_t g, __m256i *lo, __m256i *hi) {
    const int32_t *s = (const int32_t *)(a + (K + 63) / 64 * 64);
    *lo = _mm256_loadu_si256((const __m256i *)(s + g));
    *hi = _mm256_loadu_si256((const __m256i *)(s + GROUPS8(K) + g));
}

// Four groups' sums from their words' dots p[0..3] (int32 lanes; 8-bit words: a group's 8 words
// a vector), in order: vphaddd twice, then the two 128-bit halves added.
ALWAYS_INLINE __m128i four_groups(const __m256i *p) {
    const __m256i sum = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]),
                                          _mm256_hadd_epi32(p[2], p[3]));
    return _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
}

// The sums P of 8 groups from g (P_lo in low, P_hi in high with four limbs) of `rows` rows of x
// against one weight row's words (`words` of them): 4-bit, 4 chunks of 8 words, each group's 4
// words summed by two vphaddd (groups in lanes 0, 2, 4, 6, 1, 3, 5, 7); 8-bit, 8 chunks, each a
// group. `tail` (a compile-time constant): the row's last groups, words past it read as zeros.
ALWAYS_INLINE void eight_groups(const int32_t *row, const uint8_t *const *a, int64_t plane,
                                int64_t words, int64_t g, const int rows, const int limbs,
                                const int nibbles, const int tail, __m256i *low, __m256i *high) {
    const int chunks = nibbles ? 4 : 8;
    __m256i pl[TILE_ROWS][8], ph[TILE_ROWS][8];
    for (int h = 0; h < chunks; h++) {
        const int64_t j = (nibbles ? g / 2 : g) * 8 + 8 * h;  // the chunk's first word
        if (tail && j >= words) {
            FOR_ROWS(i) pl[i][h] = ph[i][h] = _mm256_setzero_si256();
            continue;
        }
        const __m256i w = tail ? row_words(row, j, words)
                               : _mm256_loadu_si256((const __m256i *)(row + j));
        // a line of words PREFETCH_ROW_WORDS ahead (past the row's end, the next row's): a
        // thread streams its rows from memory, and the hardware's prefetch stops at each page
        if (!tail && h % 2 == 0) _mm_prefetch((const char *)(row + j + PREFETCH_ROW_WORDS),
                                              _MM_HINT_T0);
        FOR_ROWS(i) {
            if (nibbles) {
                nibble_dots(w, a[i] + j * 8, plane, limbs, &pl[i][h], &ph[i][h]);
            } else {
                byte_word_dots(w, a[i] + j * 4, plane, limbs, &pl[i][h], &ph[i][h]);
            }
        }
    }
    FOR_ROWS(i) {
        if (nibbles) {
            low[i] = _mm256_hadd_epi32(_mm256_hadd_epi32(pl[i][0], pl[i][1]),
                                       _mm256_hadd_epi32(pl[i][2], pl[i][3]));
            if (limbs == 4) {
                high[i] = _mm256_hadd_epi32(_mm256_hadd_epi32(ph[i][0], ph[i][1]),
                                            _mm256_hadd_epi32(ph[i][2], ph[i][3]));
            }
        } else {
            low[i] = _mm256_setr_m128i(four_groups(pl[i]), four_groups(pl[i] + 4));
            if (limbs == 4) high[i] = _mm256_setr_m128i(four_groups(ph[i]), four_groups(ph[i] + 4));
        }
    }
}

// T for `rows` rows of x (a compile-time constant; row i's limb l at a[i] + l * plane) against
// the 16 weight rows of block wb (row n's words at wb + n * words * 4, read in place) whose first
// column is n0: rows past N are not read. c: the block's factors, [16][ws = G8] (prepare_block).
ALWAYS_INLINE void tile(const uint8_t *const *a, int64_t plane, const uint8_t *wb,
                        const int32_t *wsum, const int32_t *c, int64_t ws, Out o, int64_t n0,
                        int64_t K, int64_t Np, const int rows, const int limbs,
                        const int nibbles) {
    (void)wsum;
    const int64_t words = K * (nibbles ? 4 : 8) / 32, G = K / 32, whole = G / 8 * 8;
    const int shift = nibbles ? 3 : 7;  // o = 8 or 128: the fields' offset
    const int64_t count = o.N - n0 < 16 ? o.N - n0 : 16;
    int64_t t[TILE_ROWS][16];
    for (int64_t n = 0; n < count; n++) {
        const int32_t *row = (const int32_t *)wb + n * words;
        const int32_t *cn = c + n * ws;
        __m256i acc[TILE_ROWS];
        FOR_ROWS(i) acc[i] = _mm256_setzero_si256();
        for (int64_t g = 0; g < G; g += 8) {
            __m256i low[TILE_ROWS], high[TILE_ROWS];
            FOR_ROWS(i) low[i] = high[i] = _mm256_setzero_si256();
            if (g < whole) {
                eight_groups(row, a, plane, words, g, rows, limbs, nibbles, 0, low, high);
            } else {
                eight_groups(row, a, plane, words, g, rows, limbs, nibbles, 1, low, high);
            }
            const __m256i cg = _mm256_loadu_si256((const __m256i *)(cn + g));
            FOR_ROWS(i) {
                __m256i s_low, s_high;
                group_sums(a[i], K, g, &s_low, &s_high);
                acc[i] = add_groups(acc[i], low[i], high[i], s_low, s_high, cg, limbs, shift);
            }
        }
        FOR_ROWS(i) {
            int64_t v[4];
            _mm256_storeu_si256((__m256i *)v, acc[i]);
            t[i][n] = v[0] + v[1] + v[2] + v[3];
        }
    }
    FOR_ROWS(i) finish(o, i, n0, Np, t[i]);
}

// 8 values of x (format 0 bf16, 1 fp16, 2 fp32) as floats: every one exactly.
ALWAYS_INLINE __m256 load8(const void *x, int64_t i, int format) {
    if (format == 2) return _mm256_loadu_ps((const float *)x + i);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)x + i));
    if (format == 1) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// RNE(v * scale) for 4 floats, as int32: the product is exact in float64 (a power-of-two scaling
// of a <= 24-bit value, far from float64's limits), and rounded to nearest even by its own
// immediate, not by the MXCSR's mode: the one rounding.
ALWAYS_INLINE __m128i scaled_integers(__m128 v, __m256d scale) {
    const __m256d exact = _mm256_mul_pd(_mm256_cvtps_pd(v), scale);
    return _mm256_cvtpd_epi32(
        _mm256_round_pd(exact, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// Row r of x (its K values from x[r K]) into its place `row` of each plane, `mode` and `order`
// compile-time constants (quantize_into's): every division below a shift.
ALWAYS_INLINE void quantize_row(const void *x, int format, int64_t r, int64_t K, int64_t e,
                                uint8_t *row, int64_t plane, const int mode, const int order) {
    const int64_t chunk = order ? 64 : 32, G8 = GROUPS8(K);
    const union { uint64_t u; double d; } power = {(uint64_t)(1023 - e) << 52};
    const __m256d scale = _mm256_set1_pd(power.d);  // 2**-e_r, from its bit pattern
    int32_t *s = (int32_t *)(row + (K + 63) / 64 * 64);
    const int64_t last = K / chunk * chunk;  // the padding of each plane's row: zeros
    for (int l = 0; l < mode; l++) memset(row + l * plane + last, 0, ACT_ROW_BYTES(K) - last);
    for (int64_t k = 0; k < K; k += 8) {
        const __m256 v = load8(x, r * K + k, format);
        int32_t qa[8];
        _mm_storeu_si128((__m128i *)qa, scaled_integers(_mm256_castps256_ps128(v), scale));
        _mm_storeu_si128((__m128i *)(qa + 4), scaled_integers(_mm256_extractf128_ps(v, 1), scale));
        for (int i = 0; i < 8; i++) {
            const int64_t at = k + i, base = at / chunk * chunk, in = at - base;
            const int64_t to = base + (in % 2) * (chunk / 2) + in / 2;  // evens, then odds
            for (int l = 0; l < mode; l++) row[l * plane + to] = (uint8_t)(qa[i] >> (8 * l));
            // the group's place: 4-bit, each 8 groups in the factors' order (tile)
            const int64_t gr = at / 32, to_g = order ? gr / 8 * 8 + gr % 2 * 4 + gr % 8 / 2
                                                     : gr;
            if (mode == 4) {
                s[to_g] += qa[i] & 0xFFFF;
                s[G8 + to_g] += qa[i] >> 16;
            } else {
                s[to_g] += qa[i];
            }
        }
    }
}

#define QUANTIZE_ROW(MODE, ORDER) \
    quantize_row(x, format, r, K, e_r[r], out + r * row_bytes, plane, MODE, ORDER)

// qa = RNE(x * 2**-e_r[r]) as `mode` (1, 2 or 4) limbs in this file's layout (above): each row
// ACT_ROW_BYTES(K) apart in each plane, planes `plane` bytes apart (M rows each), every chunk's
// even k then its odd k (chunks of 64 k with `order`, for 4-bit words read in place, their group
// sums S then in the order of 4-bit factors; else chunks of 32 k), and the group sums S after
// the limbs in plane 0. (Mode 0, the span kernel's int16 words, is not built here.)
static void quantize_into(const void *x, int format, int64_t M, int64_t K, const int64_t *e_r,
                          uint8_t *out, int mode, int order) {
    const int64_t row_bytes = ACT_ROW_BYTES(K), plane = M * row_bytes;
#pragma omp parallel for schedule(static) if (M > 1)  // one row: no team to wake
    for (int64_t r = 0; r < M; r++) {
        if (order && mode == 4) QUANTIZE_ROW(4, 1);
        else if (order && mode == 2) QUANTIZE_ROW(2, 1);
        else if (order) QUANTIZE_ROW(1, 1);
        else if (mode == 4) QUANTIZE_ROW(4, 0);
        else if (mode == 2) QUANTIZE_ROW(2, 0);
        else QUANTIZE_ROW(1, 0);
    }
}

// y[r, n] = round1(t[r, n], e_r[r] + emin[n]) for n < N, written as 16- or 32-bit patterns (the
// output tensor itself).
void round_rows(const int64_t *t, int64_t ld, const int64_t *e_r, const int64_t *emin,
                int64_t M, int64_t N, int mant, int expo, void *out) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < M; r++) {
        for (int64_t n = 0; n < N; n++) {
            store_rounded(out, r * N + n, t[r * ld + n], e_r[r] + emin[n], mant, expo);
        }
    }
}

// A row's G scales (bf16 bits): the least and largest exponent field of its nonzero finite ones,
// a subnormal's counted as 1 (its es is the smallest normal's; es = field - 134), lo > hi where
// there is none; and whether one is non-finite. 16 scales at a time, in 16-bit lanes.
ALWAYS_INLINE void row_fields(const uint16_t *scale, int64_t G, int *lo, int *hi,
                              int *nonfinite) {
    const __m256i ones = _mm256_set1_epi16(1), byte = _mm256_set1_epi16(255);
    const __m256i magnitude = _mm256_set1_epi16(0x7FFF);
    __m256i least = _mm256_set1_epi16(-1), most = _mm256_setzero_si256();
    __m256i bad = _mm256_setzero_si256();
    for (int64_t g = 0; g < G; g += 16) {
        __m256i bits;
        if (g + 16 <= G) {
            bits = _mm256_loadu_si256((const __m256i *)(scale + g));
        } else {  // the row's last scales: none read past it, zeros (no es) after them
            uint16_t part[16] = {0};
            memcpy(part, scale + g, (G - g) * sizeof(uint16_t));
            bits = _mm256_loadu_si256((const __m256i *)part);
        }
        const __m256i field = _mm256_and_si256(_mm256_srli_epi16(bits, 7), byte);
        const __m256i infinite = _mm256_cmpeq_epi16(field, byte);
        const __m256i none = _mm256_or_si256(  // zero or non-finite: no es
            infinite, _mm256_cmpeq_epi16(_mm256_and_si256(bits, magnitude),
                                         _mm256_setzero_si256()));
        const __m256i f = _mm256_max_epu16(field, ones);
        bad = _mm256_or_si256(bad, infinite);
        least = _mm256_min_epu16(least, _mm256_or_si256(f, none));  // none: 0xFFFF
        most = _mm256_max_epu16(most, _mm256_andnot_si256(none, f));  // none: 0
    }
    const __m128i low = _mm_min_epu16(_mm256_castsi256_si128(least),
                                      _mm256_extracti128_si256(least, 1));
    const __m128i high = _mm_max_epu16(_mm256_castsi256_si128(most),
                                       _mm256_extracti128_si256(most, 1));
    *lo = _mm_extract_epi16(_mm_minpos_epu16(low), 0);
    *hi = 0xFFFF - _mm_extract_epi16(_mm_minpos_epu16(_mm_xor_si128(high, _mm_set1_epi16(-1))),
                                     0);
    *nonfinite = !_mm256_testz_si256(bad, bad);
}

// Block b of a layer read in place, as the thread that runs it reads it: its words where they
// are (no copy), and its rows' factors c [16][G8] (int32, row order; each 8 groups in the order
// 0, 2, 4, 6, 1, 3, 5, 7 for 4-bit words; 0 past G) decoded from the live scales, as
// certificate.certify derives them: ms and es of each finite scale (a non-finite one counts as 0
// and flags its row), emin the least es of the row's nonzero scales (0 if none), the spread the
// largest es - emin; where the spread is at most `limit`, c = ms << (es - emin) (an int32:
// proofs, scale-factor), else c = 0 and the row flagged slow. Its rows' emin and flags go to
// L->emin and L->flags. The block's word scratch `w` holds c here (16 * G8 * 4 <= 16 K bytes).
// Rows past N read nothing and count as zero scales.
static Block prepare_block(const Layer *L, int64_t b, uint8_t *w, int32_t *wsum, int32_t *c,
                           int32_t *sc) {
    (void)wsum, (void)c, (void)sc;
    const int64_t K = L->K, G = K / 32, G8 = GROUPS8(K);
    const int64_t rows = L->N - b * 16 < 16 ? L->N - b * 16 : 16;
    const int nibbles = L->bits == 4;
    int32_t *factors = (int32_t *)w;
    const __m256i zero = _mm256_setzero_si256(), byte = _mm256_set1_epi16(255);
    const __m256i nibble_order = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
    if ((b + 1) * 16 < L->N) {  // the next block's scales, which this thread reads next
        const char *next = (const char *)(L->scale + (b + 1) * 16 * G);
        const int64_t bytes = (L->N - (b + 1) * 16 < 16 ? L->N - (b + 1) * 16 : 16) * G * 2;
        for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch(next + i, _MM_HINT_T0);
    }
    for (int64_t n = 0; n < 16; n++) {
        const uint16_t *scale = L->scale + (b * 16 + n) * G;
        int lo = 0xFFFF, hi = 0, nonfinite = 0;  // the row's least and largest exponent fields
        if (n < rows) row_fields(scale, G, &lo, &hi, &nonfinite);
        const int any = lo <= hi, slow = any && hi - lo > L->limit;
        L->emin[b * 16 + n] = any ? lo - 134 : 0;  // es = max(field, 1) - 127 - 7
        L->flags[b * 16 + n] = (uint8_t)((slow ? FLAG_SLOW : 0) |
                                         (nonfinite ? FLAG_NONFINITE : 0));
        int32_t *cn = factors + n * G8;
        for (int64_t g = 0; g < G8; g += 16) {  // 16 scales in 16-bit lanes, then 8 in 32-bit
            __m256i bits = _mm256_setzero_si256();
            if (n < rows && !slow && g + 16 <= G) {
                bits = _mm256_loadu_si256((const __m256i *)(scale + g));
            } else if (n < rows && !slow && g < G) {  // the row's last scales: none read past it
                uint16_t part[16] = {0};
                memcpy(part, scale + g, (G - g) * sizeof(uint16_t));
                bits = _mm256_loadu_si256((const __m256i *)part);
            }
            const __m256i field = _mm256_and_si256(_mm256_srli_epi16(bits, 7), byte);
            // m: the significand, 128 + frac (normal) or frac (subnormal); 0 where non-finite
            const __m256i m = _mm256_andnot_si256(_mm256_cmpeq_epi16(field, byte), _mm256_or_si256(
                _mm256_and_si256(bits, _mm256_set1_epi16(127)),
                _mm256_andnot_si256(_mm256_cmpeq_epi16(field, zero), _mm256_set1_epi16(128))));
            // es - emin = max(field, 1) - lo: in [0, limit] for each nonzero scale of a fast row
            // (a zero scale's m is 0 whatever its count)
            const __m256i shift = _mm256_sub_epi16(_mm256_max_epu16(field, _mm256_set1_epi16(1)),
                                                   _mm256_set1_epi16((int16_t)lo));
            for (int h = 0; h < 2 && g + 8 * h < G8; h++) {
                const __m128i m8 = h ? _mm256_extracti128_si256(m, 1) : _mm256_castsi256_si128(m);
                const __m128i s8 = h ? _mm256_extracti128_si256(shift, 1)
                                     : _mm256_castsi256_si128(shift);
                const __m128i b8 = h ? _mm256_extracti128_si256(bits, 1)
                                     : _mm256_castsi256_si128(bits);
                __m256i f = _mm256_sllv_epi32(_mm256_cvtepu16_epi32(m8), _mm256_cvtepu16_epi32(s8));
                // the scale's sign: its bit 15 as the sign of a 32-bit lane (0 for a zero m)
                f = _mm256_sign_epi32(f, _mm256_slli_epi32(_mm256_cvtepu16_epi32(b8), 16));
                if (nibbles) f = _mm256_permutevar8x32_epi32(f, nibble_order);
                _mm256_storeu_si256((__m256i *)(cn + g + 8 * h), f);
            }
        }
    }
    const int64_t words = K * L->bits / 32;
    return (Block){(const uint8_t *)(L->packed + b * 16 * words), NULL, factors, G8, nibbles};
}
