// The AVX-512 intrinsics cpu_vnni.c uses, in portable C, for a CPU without AVX-512 VNNI: SIMDe
// (the simde-py package's headers) for all but the sixteen that SIMDe 0.8 lacks, written below
// lane by lane from Intel's definitions. vnni_library.py compiles the kernel against this file in
// place of <immintrin.h> when EXACTNESS_NATIVE=emulate (the suite sets it on such a CPU). So the
// kernel's layouts, limbs, combine and rounding are verified on every machine; the real
// instructions differ only in these intrinsics, which the self-check covers where they run. For
// verification, not speed.
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <math.h>
#include <simde/x86/avx512.h>
#include <stdint.h>
#include <string.h>

#define EMULATED_LANES(type, name, v) type name[64 / sizeof(type)]; memcpy(name, &(v), 64)

static inline simde__mmask8 emulated_cmplt_epi64_mask(simde__m512i a, simde__m512i b) {
    EMULATED_LANES(int64_t, x, a);
    EMULATED_LANES(int64_t, y, b);
    simde__mmask8 k = 0;
    for (int i = 0; i < 8; i++) k |= (simde__mmask8)((x[i] < y[i]) << i);
    return k;
}

static inline simde__mmask8 emulated_cmpgt_epu64_mask(simde__m512i a, simde__m512i b) {
    EMULATED_LANES(uint64_t, x, a);
    EMULATED_LANES(uint64_t, y, b);
    simde__mmask8 k = 0;
    for (int i = 0; i < 8; i++) k |= (simde__mmask8)((x[i] > y[i]) << i);
    return k;
}

// vpgatherdd with a merge mask: lane i, where k has it, the dword at base + index[i] * scale
// (bytes); elsewhere src's lane, and no read
static inline simde__m512i emulated_mask_i32gather_epi32(simde__m512i src, simde__mmask16 k,
                                                         simde__m512i index, const void *base,
                                                         int scale) {
    EMULATED_LANES(int32_t, s, src);
    EMULATED_LANES(int32_t, at, index);
    for (int i = 0; i < 16; i++)
        if ((k >> i) & 1) memcpy(&s[i], (const char *)base + (int64_t)at[i] * scale, 4);
    memcpy(&src, s, 64);
    return src;
}

// vplzcntq: 64 for a zero lane
static inline simde__m512i emulated_lzcnt_epi64(simde__m512i a) {
    EMULATED_LANES(uint64_t, x, a);
    for (int i = 0; i < 8; i++) x[i] = x[i] ? (uint64_t)__builtin_clzll(x[i]) : 64;
    memcpy(&a, x, 64);
    return a;
}

// vpsrlq with a merge mask: lanes off in k keep src; a count past 63 gives 0
static inline simde__m512i emulated_mask_srli_epi64(simde__m512i src, simde__mmask8 k,
                                                    simde__m512i a, unsigned int count) {
    EMULATED_LANES(uint64_t, s, src);
    EMULATED_LANES(uint64_t, x, a);
    for (int i = 0; i < 8; i++)
        if ((k >> i) & 1) s[i] = count > 63 ? 0 : x[i] >> count;
    memcpy(&src, s, 64);
    return src;
}

// vcvtpd2dq under the rounding its immediate names (the low two bits: nearest even, down, up,
// toward zero), each exact here: cpu_vnni.c's values fit int32
static inline simde__m256i emulated_cvt_roundpd_epi32(simde__m512d a, int rounding) {
    double x[8];
    int32_t y[8];
    memcpy(x, &a, 64);
    for (int i = 0; i < 8; i++) {
        const double r = (rounding & 3) == 0 ? nearbyint(x[i]) : (rounding & 3) == 1 ? floor(x[i])
                       : (rounding & 3) == 2 ? ceil(x[i]) : trunc(x[i]);
        y[i] = (int32_t)r;
    }
    simde__m256i out;
    memcpy(&out, y, 32);
    return out;
}

// vpmovqw: each lane's low 16 bits
static inline simde__m128i emulated_cvtepi64_epi16(simde__m512i a) {
    EMULATED_LANES(int64_t, x, a);
    int16_t y[8];
    for (int i = 0; i < 8; i++) y[i] = (int16_t)x[i];
    simde__m128i out;
    memcpy(&out, y, 16);
    return out;
}

// masked stores: only the lanes on in k are written
static inline void emulated_mask_storeu_epi32_256(void *p, simde__mmask8 k, simde__m256i a) {
    int32_t x[8];
    memcpy(x, &a, 32);
    for (int i = 0; i < 8; i++)
        if ((k >> i) & 1) memcpy((int32_t *)p + i, &x[i], 4);
}

static inline void emulated_mask_storeu_epi16_128(void *p, simde__mmask8 k, simde__m128i a) {
    int16_t x[8];
    memcpy(x, &a, 16);
    for (int i = 0; i < 8; i++)
        if ((k >> i) & 1) memcpy((int16_t *)p + i, &x[i], 2);
}

// vpmovsxdq, vpmovsxbq: sign extensions to 64 bits (the low 8 lanes of a)
static inline simde__m512i emulated_cvtepi32_epi64(simde__m256i a) {
    int32_t x[8];
    int64_t y[8];
    memcpy(x, &a, 32);
    for (int i = 0; i < 8; i++) y[i] = x[i];
    simde__m512i out;
    memcpy(&out, y, 64);
    return out;
}

static inline simde__m512i emulated_cvtepi8_epi64(simde__m128i a) {
    int8_t x[16];
    int64_t y[8];
    memcpy(x, &a, 16);
    for (int i = 0; i < 8; i++) y[i] = x[i];
    simde__m512i out;
    memcpy(&out, y, 64);
    return out;
}

// vpsraq: an arithmetic shift; a count past 63 fills with the sign
static inline simde__m512i emulated_srai_epi64(simde__m512i a, unsigned int count) {
    EMULATED_LANES(int64_t, x, a);
    for (int i = 0; i < 8; i++) x[i] = x[i] >> (count > 63 ? 63 : count);
    memcpy(&a, x, 64);
    return a;
}

// vpsravq: per-lane arithmetic shifts; a count past 63 fills with the sign
static inline simde__m512i emulated_srav_epi64(simde__m512i a, simde__m512i count) {
    EMULATED_LANES(int64_t, x, a);
    EMULATED_LANES(uint64_t, c, count);
    for (int i = 0; i < 8; i++) x[i] = x[i] >> (c[i] > 63 ? 63 : c[i]);
    memcpy(&a, x, 64);
    return a;
}

// vcvtps2pd: 8 floats to doubles, exactly
static inline simde__m512d emulated_cvtps_pd(simde__m256 a) {
    float x[8];
    double y[8];
    memcpy(x, &a, 32);
    for (int i = 0; i < 8; i++) y[i] = x[i];
    simde__m512d out;
    memcpy(&out, y, 64);
    return out;
}

// vpmovdw, vpmovdb: each of 16 lanes' low 16 or 8 bits
static inline simde__m256i emulated_cvtepi32_epi16(simde__m512i a) {
    EMULATED_LANES(int32_t, x, a);
    int16_t y[16];
    for (int i = 0; i < 16; i++) y[i] = (int16_t)x[i];
    simde__m256i out;
    memcpy(&out, y, 32);
    return out;
}

static inline simde__m128i emulated_cvtepi32_epi8(simde__m512i a) {
    EMULATED_LANES(int32_t, x, a);
    int8_t y[16];
    for (int i = 0; i < 16; i++) y[i] = (int8_t)x[i];
    simde__m128i out;
    memcpy(&out, y, 16);
    return out;
}

#undef _mm512_cmplt_epi64_mask
#undef _mm512_cmpgt_epu64_mask
#undef _mm512_lzcnt_epi64
#undef _mm512_mask_srli_epi64
#undef _mm512_cvt_roundpd_epi32
#undef _mm512_cvtepi64_epi16
#undef _mm256_mask_storeu_epi32
#undef _mm_mask_storeu_epi16
#undef _mm512_cvtepi32_epi64
#undef _mm512_cvtepi8_epi64
#undef _mm512_srai_epi64
#undef _mm512_srav_epi64
#undef _mm512_cvtps_pd
#undef _mm512_cvtepi32_epi16
#undef _mm512_cvtepi32_epi8
#define _mm512_mask_i32gather_epi32 emulated_mask_i32gather_epi32
#define _mm512_cmplt_epi64_mask emulated_cmplt_epi64_mask
#define _mm512_cmpgt_epu64_mask emulated_cmpgt_epu64_mask
#define _mm512_lzcnt_epi64 emulated_lzcnt_epi64
#define _mm512_mask_srli_epi64 emulated_mask_srli_epi64
#define _mm512_cvt_roundpd_epi32 emulated_cvt_roundpd_epi32
#define _mm512_cvtepi64_epi16 emulated_cvtepi64_epi16
#define _mm256_mask_storeu_epi32 emulated_mask_storeu_epi32_256
#define _mm_mask_storeu_epi16 emulated_mask_storeu_epi16_128
#define _mm512_cvtepi32_epi64 emulated_cvtepi32_epi64
#define _mm512_cvtepi8_epi64 emulated_cvtepi8_epi64
#define _mm512_srai_epi64 emulated_srai_epi64
#ifndef __mmask8
#define __mmask8 simde__mmask8
#endif
#define _mm512_srav_epi64 emulated_srav_epi64
#define _mm512_cvtps_pd emulated_cvtps_pd
#define _mm512_cvtepi32_epi16 emulated_cvtepi32_epi16
#define _mm512_cvtepi32_epi8 emulated_cvtepi32_epi8
#ifndef _MM_FROUND_NO_EXC
#define _MM_FROUND_TO_NEAREST_INT 0
#define _MM_FROUND_TO_NEG_INF 1
#define _MM_FROUND_TO_POS_INF 2
#define _MM_FROUND_TO_ZERO 3
#define _MM_FROUND_NO_EXC 8
#endif
// cpu_vnni.c's vpdpwssd with a broadcast memory operand, as the intrinsics say it
#define DOT_BROADCAST(d, v, p) \
    ((d) = _mm512_dpwssd_epi32((d), (v), broadcast4((const uint8_t *)(p))))
// inlining every emulated lane loop everywhere takes minutes to compile
#define ALWAYS_INLINE static inline
