// The CPU twin of the Triton kernel: per group of 32, int8 dots with AVX-512 VNNI (vpdpbusd,
// u8 x s8 -> s32, 64 products per instruction, never saturating), then P * ms << shift into
// int64 accumulators. 16 output rows (weight rows n) per vector, 4 activation rows per weight
// load. The integers are dataflow.py's: signed int8 limbs (qa - 128 = hi * 256 + lo for 16-bit
// activations), fed to vpdpbusd biased by +128 to make them unsigned and corrected exactly:
//     D = D' - 128 * sum_k q   (D' = sum (limb + 128) * q, |D'| <= 32 * 255 * 128 < 2**31)
//     P = 256 * D_hi + D_lo + 128 * sum_k q        (two limbs)   or   P = D_lo   (one limb)
// Layouts: w [Np/16][K/4][16][4] int8 (lane l of block b is weight row 16 b + l);
// wsum [G][Np] int32; c [G][Np] int64 (ms << shift); a_lo, a_hi [M][K] uint8 (limb + 128);
// t [M][Np] int64.
#include <immintrin.h>
#include <stdint.h>

// acc += P * c, c = ms << shift (|c| < 2**31, so vpmuldq's signed 32 x 32 -> 64 is exact)
static inline void combine(__m512i p, const int64_t *c, __m512i *acc) {
    __m512i p0 = _mm512_cvtepi32_epi64(_mm512_castsi512_si256(p));
    __m512i p1 = _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(p, 1));
    acc[0] = _mm512_add_epi64(acc[0], _mm512_mul_epi32(p0, _mm512_loadu_si512(c)));
    acc[1] = _mm512_add_epi64(acc[1], _mm512_mul_epi32(p1, _mm512_loadu_si512(c + 8)));
}

#define ROWS 4

void exact_linear_vnni(const uint8_t *a_lo, const uint8_t *a_hi, const int8_t *w,
                       const int32_t *wsum, const int64_t *c, int64_t *t,
                       int64_t M, int64_t K, int64_t Np, int two_limbs) {
    const int64_t G = K / 32, blocks = Np / 16;
    const __m512i bias = _mm512_set1_epi32(128);
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        const int8_t *wb = w + b * (K / 4) * 64;
        for (int64_t r0 = 0; r0 < M; r0 += ROWS) {
            const int64_t rows = M - r0 < ROWS ? M - r0 : ROWS;
            __m512i acc[ROWS][2];
            for (int i = 0; i < ROWS; i++) acc[i][0] = acc[i][1] = _mm512_setzero_si512();
            for (int64_t g = 0; g < G; g++) {
                __m512i dlo[ROWS], dhi[ROWS];
                for (int i = 0; i < ROWS; i++) dlo[i] = dhi[i] = _mm512_setzero_si512();
                for (int64_t j = 0; j < 8; j++) {
                    const __m512i wv = _mm512_loadu_si512(wb + (g * 8 + j) * 64);
                    const int64_t k = g * 32 + j * 4;
                    for (int i = 0; i < rows; i++) {
                        const int32_t lo = *(const int32_t *)(a_lo + (r0 + i) * K + k);
                        dlo[i] = _mm512_dpbusd_epi32(dlo[i], _mm512_set1_epi32(lo), wv);
                        if (two_limbs) {
                            const int32_t hi = *(const int32_t *)(a_hi + (r0 + i) * K + k);
                            dhi[i] = _mm512_dpbusd_epi32(dhi[i], _mm512_set1_epi32(hi), wv);
                        }
                    }
                }
                const __m512i ws = _mm512_loadu_si512(wsum + g * Np + b * 16);
                const __m512i corr = _mm512_mullo_epi32(bias, ws);
                for (int i = 0; i < rows; i++) {
                    __m512i p = _mm512_sub_epi32(dlo[i], corr);  // D_lo
                    if (two_limbs) {
                        const __m512i d_hi = _mm512_sub_epi32(dhi[i], corr);
                        p = _mm512_add_epi32(_mm512_add_epi32(_mm512_slli_epi32(d_hi, 8), p), corr);
                    }
                    combine(p, c + g * Np + b * 16, acc[i]);
                }
            }
            for (int i = 0; i < rows; i++) {
                _mm512_storeu_si512(t + (r0 + i) * Np + b * 16, acc[i][0]);
                _mm512_storeu_si512(t + (r0 + i) * Np + b * 16 + 8, acc[i][1]);
            }
        }
    }
}

// dataflow.activation_limbs, biased for vpdpbusd: one limb (|qa| <= 127) as qa + 128, or two as
// lo + 128, hi + 128 with qa - 128 = hi * 256 + lo, lo and hi in [-128, 127].
void split_limbs(const int32_t *qa, uint8_t *lo, uint8_t *hi, int64_t count, int two_limbs) {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < count; i++) {
        if (!two_limbs) {
            lo[i] = (uint8_t)(qa[i] + 128);
            continue;
        }
        const int32_t v = qa[i] - 128;
        const int32_t l = ((v + 128) & 255) - 128;
        lo[i] = (uint8_t)(l + 128);
        hi[i] = (uint8_t)(((v - l) >> 8) + 128);
    }
}

// formats.round_scaled, per element: the bit pattern of RNE(t * 2**(e_r[r] + emin[n])) in a
// format of `mant` stored bits and `expo` exponent bits (bf16 7/8, fp16 10/5, fp32 23/8).
// |t| < 2**63. An exact zero is +0.0; a nonzero value that underflows keeps its sign.
void round_rows(const int64_t *t, int64_t ld, const int64_t *e_r, const int64_t *emin,
                int64_t M, int64_t N, int mant, int expo, uint32_t *out) {
    const int64_t p = mant + 1, bias = (1 << (expo - 1)) - 1, emax = (1 << expo) - 1;
    const int64_t qmin = 1 - bias - mant;
    const uint32_t sign_bit = 1u << (mant + expo);
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < M; r++) {
        for (int64_t c = 0; c < N; c++) {
            const int64_t m = t[r * ld + c];
            if (m == 0) {
                out[r * N + c] = 0;
                continue;
            }
            const uint32_t sign = m < 0 ? sign_bit : 0;
            const uint64_t a = m < 0 ? (uint64_t)(-m) : (uint64_t)m;
            const int64_t e = e_r[r] + emin[c];
            const int64_t length = 64 - __builtin_clzll(a);
            int64_t q = e + length - p;
            if (q < qmin) q = qmin;
            uint64_t n;
            if (q <= e) {
                n = a << (e - q);
            } else if (q - e > length) {
                n = 0;  // under half the smallest step
            } else {
                const int64_t s = q - e;
                const uint64_t rem = s == 64 ? a : a & ((1ull << s) - 1), half = 1ull << (s - 1);
                n = s == 64 ? 0 : a >> s;
                if (rem > half || (rem == half && (n & 1))) n++;
            }
            if (n == (1ull << p)) {
                n >>= 1;
                q++;
            }
            uint32_t bits;
            if (n < (1ull << (p - 1))) {
                bits = (uint32_t)n;
            } else {
                const int64_t field = q + mant + bias;
                bits = field >= emax ? (uint32_t)emax << mant
                                     : ((uint32_t)field << mant) | ((uint32_t)n & ((1u << mant) - 1));
            }
            out[r * N + c] = sign | bits;
        }
    }
}
