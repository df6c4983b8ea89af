// The roofline behind docs/PERFORMANCE.md: how many 512-bit dot instructions one core retires per
// second (10 independent accumulators, nothing else in the loop), and what sharing the core with
// the exact combine's instructions costs.
//   cc -O2 -mavx512f -mavx512vnni -mavx512bf16 bench/dot_peak.c -o /tmp/dot_peak && /tmp/dot_peak
#include <stdio.h>
#include <time.h>
#include <immintrin.h>

#define ROUNDS 100000000L
#define TEN(A, B) A "%0\n" B "%1\n" A "%2\n" B "%3\n" A "%4\n" B "%5\n" A "%6\n" B "%7\n" A "%8\n" B "%9\n"

static double seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

#define MEASURE(NAME, A, B)                                                                  \
    do {                                                                                     \
        __m512i r0 = _mm512_setzero_si512(), r1 = r0, r2 = r0, r3 = r0, r4 = r0, r5 = r0,    \
                r6 = r0, r7 = r0, r8 = r0, r9 = r0, w = _mm512_set1_epi32(3);                \
        const double start = seconds();                                                      \
        for (long i = 0; i < ROUNDS; i++) {                                                  \
            __asm__ volatile(TEN(A " %10, %10, ", B " %10, %10, ")                           \
                             : "+v"(r0), "+v"(r1), "+v"(r2), "+v"(r3), "+v"(r4), "+v"(r5),   \
                               "+v"(r6), "+v"(r7), "+v"(r8), "+v"(r9) : "v"(w));             \
        }                                                                                    \
        printf("%-44s %.2f G instructions/s\n", NAME, ROUNDS * 10 / (seconds() - start) / 1e9); \
    } while (0)

int main(void) {
    MEASURE("vpdpbusd (u8 x s8, 64 products)", "vpdpbusd", "vpdpbusd");
    MEASURE("vdpbf16ps (bf16, 32 products: torch's GEMM)", "vdpbf16ps", "vdpbf16ps");
    MEASURE("vpdpbusd + vpmuldq, alternating", "vpdpbusd", "vpmuldq");
    MEASURE("vpdpbusd + vpaddq, alternating", "vpdpbusd", "vpaddq");
    return 0;
}
