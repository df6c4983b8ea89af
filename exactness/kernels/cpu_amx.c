// exact_linear_vnni's dataflow with its dots on AMX tiles (Intel Xeon, Sapphire Rapids on). amx.py
// appends this file to cpu_vnni.c, so the quantization, the combine (add_group), the weight
// layout (NativeWeights) and the one rounding (finish) are that file's; only the dots differ.
//
// Per block of 16 weight rows and up to 16 activation rows, per group of 32 k, each limb l:
//     C_l[m][n] = sum_k (limb_l[m][k] + 128) * q[n][k]      (tdpbusd, u8 x s8 -> s32)
// in a tile zeroed per group, since every group has a scale of its own. That is vpdpbusd's biased
// dot D'_l, in the same int32 (proofs: amx-tile-dot, and vnni-dot for the lanes it sums). The
// tiles are stored and each row combined as exact_linear_vnni combines its registers: the
// correction added to the corrected limb, then add_group (proofs: vnni-recombine,
// vnni-four-limbs). Up to two limbs, two groups go at once (tiles 0, 1 and 2, 3), so the tile
// unit has two independent dots in flight; an odd group count leaves one group, the K tail.
//
// Tiles: A (activations, a limb's rows x 32 bytes, K bytes apart in its plane) 4 and 7; B (the
// block's weights for one group: 8 rows of 64 bytes, the 16 lanes' 4 k each, LANE_ROWS order,
// as vpdpbusd reads them) 5 and 6; C (dots, rows x 16 int32) 0..3. Weights in the nibble layout
// are unpacked per block into a scratch of bytes first (unpack_pair).
#ifndef AMX_EMULATED
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

// the kernel may use the tile state only once the OS grants it (Linux 5.16 on)
int amx_request(void) {
    return (int)syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */);
}

int64_t amx_faults(void) { return 0; }  // the hardware faults for itself
#endif

#define AMX_ROWS 16  // activation rows per tile: all a tile holds

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

// ldtilecfg for tiles of `rows` activation rows (C and A), B always 8 rows of 64 bytes
static void configure_tiles(int rows) {
    TileConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 4; t++) {
        cfg.rows[t] = (uint8_t)rows;
        cfg.colsb[t] = 64;
    }
    cfg.rows[4] = cfg.rows[7] = (uint8_t)rows;
    cfg.colsb[4] = cfg.colsb[7] = 32;
    cfg.rows[5] = cfg.rows[6] = 8;
    cfg.colsb[5] = cfg.colsb[6] = 64;
    _tile_loadconfig(&cfg);
}

// the block's nibble-layout weights as bytes, [K/4][16][4] (the byte layout exact_linear_vnni
// reads): one B tile per 512 bytes
static void unpack_block(const uint8_t *wb, uint8_t *bytes, int64_t K) {
    for (int64_t s = 0; s < K / 8; s++) {  // byte vector s holds 4-k steps 2 s and 2 s + 1
        __m512i low, high;
        unpack_pair(_mm512_loadu_si512(wb + s * 64), &low, &high);
        _mm512_storeu_si512(bytes + 2 * s * 64, low);
        _mm512_storeu_si512(bytes + (2 * s + 1) * 64, high);
    }
}

// the stored dots of one group (dots[l][m], row m of limb l) added to the tile's T rows
static void combine_dots(int32_t (*dots)[AMX_ROWS][16], const int32_t *wsum_g,
                         const int32_t *c_g, int limbs, int rows, __m512i *even, __m512i *odd) {
    const __m512i start = correction(_mm512_loadu_si512(wsum_g), limbs);
    const __m512i c_even = _mm512_cvtepi32_epi64(_mm256_loadu_si256((const __m256i *)c_g));
    const __m512i c_odd = _mm512_cvtepi32_epi64(_mm256_loadu_si256((const __m256i *)c_g + 1));
    const int corrected = corrected_limb(limbs);
    for (int m = 0; m < rows; m++) {
        __m512i d[4];
        for (int l = 0; l < 4; l++) {
            d[l] = l < limbs ? _mm512_loadu_si512(dots[l][m]) : _mm512_setzero_si512();
        }
        d[corrected] = _mm512_add_epi32(d[corrected], start);
        add_group(d, limbs, c_even, c_odd, &even[m], &odd[m]);
    }
}

// limb L's dot of group g (activations at a, weights at wb) into tile C through tiles A and B
#define LIMB_DOT(C, A, B, L, g)                                        \
    do {                                                               \
        _tile_zero(C);                                                 \
        _tile_loadd(A, a + (L) * plane + (g) * 32, K);                 \
        _tile_dpbusd(C, A, B);                                         \
    } while (0)

// T for `rows` activation rows from row pointer a (limb l at a + l * plane, rows K bytes apart)
// against the block's byte-layout weights wb, whose first column is n0
static void amx_tile(const uint8_t *a, int64_t plane, const uint8_t *wb, const int32_t *wsum,
                     const int32_t *c, Out o, int64_t n0, int64_t K, int64_t Np, int rows,
                     int limbs) {
    int32_t dots[4][AMX_ROWS][16] __attribute__((aligned(64)));
    __m512i even[AMX_ROWS], odd[AMX_ROWS];
    for (int m = 0; m < rows; m++) even[m] = odd[m] = _mm512_setzero_si512();
    const int64_t groups = K / 32;
    int64_t g = 0;
    if (limbs <= 2) {
        for (; g + 1 < groups; g += 2) {  // two groups at once: tiles 0, 1 and 2, 3
            _tile_loadd(5, wb + g * 512, 64);
            _tile_loadd(6, wb + (g + 1) * 512, 64);
            LIMB_DOT(0, 4, 5, 0, g);
            LIMB_DOT(2, 7, 6, 0, g + 1);
            if (limbs == 2) {
                LIMB_DOT(1, 4, 5, 1, g);
                LIMB_DOT(3, 7, 6, 1, g + 1);
            }
            _tile_stored(0, dots[0], 64);
            _tile_stored(2, dots[2], 64);
            if (limbs == 2) {
                _tile_stored(1, dots[1], 64);
                _tile_stored(3, dots[3], 64);
            }
            combine_dots(dots, wsum + g * Np, c + g * Np, limbs, rows, even, odd);
            combine_dots(dots + 2, wsum + (g + 1) * Np, c + (g + 1) * Np, limbs, rows, even,
                         odd);
        }
    }
    for (; g < groups; g++) {  // four limbs: a group at a time; else the K tail
        _tile_loadd(5, wb + g * 512, 64);
        LIMB_DOT(0, 4, 5, 0, g);
        _tile_stored(0, dots[0], 64);
        if (limbs >= 2) {
            LIMB_DOT(1, 4, 5, 1, g);
            _tile_stored(1, dots[1], 64);
        }
        if (limbs == 4) {
            LIMB_DOT(2, 4, 5, 2, g);
            LIMB_DOT(3, 4, 5, 3, g);
            _tile_stored(2, dots[2], 64);
            _tile_stored(3, dots[3], 64);
        }
        combine_dots(dots, wsum + g * Np, c + g * Np, limbs, rows, even, odd);
    }
    for (int m = 0; m < rows; m++) finish(o, m, n0, Np, even[m], odd[m]);
}

// exact_linear_vnni's contract, on AMX tiles: T [M, Np] into t, or (y not NULL) the rounded
// output y [M, N], from the `limbs` limbs [L][M][K] of the activations. Returns 0, or -1 where a
// thread could not allocate its scratch (nothing written then is to be read).
int64_t exact_linear_amx(const uint8_t *limb_planes, const uint8_t *w, const int32_t *wsum,
                         const int32_t *c, int64_t *t, int64_t M, int64_t K, int64_t Np,
                         int limbs, int nibbles, void *y, const int64_t *e_r,
                         const int64_t *emin, int64_t N, int mant, int expo) {
    const int64_t plane = M * K;
    int64_t failed = 0;
#pragma omp parallel reduction(+ : failed)
    {
        uint8_t *bytes = nibbles ? aligned_alloc(64, K * 16) : NULL;
        int configured = 0;  // the rows the tiles are configured for (0: not yet)
        if (nibbles && !bytes) failed++;
#pragma omp for schedule(static)
        for (int64_t b = 0; b < Np / 16; b++) {
            if (nibbles && !bytes) continue;
            const uint8_t *wb = w + b * K * (nibbles ? 8 : 16);
            if (nibbles) {
                unpack_block(wb, bytes, K);
                wb = bytes;
            }
            for (int64_t r = 0; r < M; r += AMX_ROWS) {
                const int rows = (int)(M - r < AMX_ROWS ? M - r : AMX_ROWS);
                if (rows != configured) {
                    configure_tiles(rows);
                    configured = rows;
                }
                const Out o = tile_out(t, y, e_r, emin, r, N, N, Np, mant, expo);
                amx_tile(limb_planes + r * K, plane, wb, wsum + b * 16, c + b * 16, o, b * 16, K,
                         Np, rows, limbs);
            }
        }
        if (configured) _tile_release();
        free(bytes);
    }
    return failed ? -1 : 0;
}
