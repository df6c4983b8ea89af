// The AMX kernel (Intel Xeon, Sapphire Rapids on): an int8 GEMM on tiles with the scales folded
// into the weights, summed over spans of groups. amx_library.py appends this file to cpu_vnni.c,
// so the quantization (quantize_into: biased u8 limbs), the layer (Layer: derived, or the
// checkpoint's buffers read in place by prepare_block) and the one rounding (finish) are that
// file's. Everything below is built per block of 16 weight rows by the thread that runs it, in C,
// from the block's words, weight sums and factors: its spans (amx_block_spans), then its digit
// planes (fold_block). Nothing is derived ahead or kept between forwards.
//
// Per block of 16 weight rows, a span of consecutive groups shares, per row n, one base b_n: every
// factor c = ms << shift of the row's groups in the span is a multiple of 2**b_n, and
// f = c >> b_n fits |q * f| <= 32767 (amx_block_spans picks the spans greedily; one group
// always fits). The folded weights wf = q * f are split into two digits, wf = 256 * hi + lo, lo in
// [0, 255] (u8), hi in [-128, 127] (s8) (proofs: amx-span-digits). With the activations' L biased
// limbs u_i = a_i + 128 (qa = sum_i 256**i u_i - B, B = 2**(8 L - 1)):
//     D_ij = sum_{k in span} u_i[k] * digit_j[k]       (tdpbuud for lo, tdpbusd for hi)
// in int32 tiles, never wrapping: at most AMX_SPAN_GROUPS groups a span (proofs: amx-span-dot);
// at the span's end, in int64, E = sum_ij D_ij << 8 (i + j) = sum_{k in span} (qa + B) * wf and
// T += E << b_n; T starts at -B * R, R = sum_k q * c per row (proofs: amx-span-combine). So the
// int64 combine runs once a span, not once a group, and the tiles do all the dots: 2 L of them per
// 64 k, at the full K of a tile.
//
// The expansion: per block, the weights times their f into the two digit planes (B tiles: per 64-k
// step 16 rows of 64 bytes, row r the 4-k step r of 16 lanes x 4 k, in cpu_vnni.c's LANE_ROWS
// order). A 64-k step holds two groups; where a span ends after the first, the step is taken twice,
// each time with the other group's weights zero. The limb planes are read 64 bytes a row from the
// step's first k: with an odd group count the last step reads 32 bytes past a row, whose weights
// are zero (the planes have 64 bytes of slack after them: amx_plane_bytes).
// Tiles: C 0..3 (limb i, digit j at 2 i + j: rows x 16 int32), A 4, 5 (limb i: rows x 64 bytes),
// B 6 (lo), 7 (hi) (16 x 64 bytes).
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

#define AMX_ROWS 16          // activation rows per tile: all a tile holds
#define AMX_STEP_K 64        // k per tile step: a row of an A tile, 16 rows of B
#define AMX_SPAN_GROUPS 1024 // the most groups a span sums in int32 (dataflow.AMX_SPAN_GROUPS)

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

// ldtilecfg through an asm whose memory operand is the whole 64-byte config, so the compiler keeps
// every store to it, whatever the compiler and its flags. Not _tile_loadconfig: GCC 12's asm names
// only the config's first 8 bytes as read, so at -O3 the stores of colsb and rows were dropped,
// every tile had 0 rows and the first tileloadd raised #UD (issue 39). The emulation reads the
// bytes through this same operand (amx_emulated.h's LDTILECFG).
#ifndef LDTILECFG
#define LDTILECFG(config) __asm__ volatile("ldtilecfg %0" : : "m"(config))
#endif

// ldtilecfg for tiles of `rows` activation rows (C and A); B always 16 rows of 64 bytes
static void configure_tiles(int rows) {
    TileConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 6; t++) {  // C 0..3, A 4, 5: a row of 16 int32 or of 64 bytes
        cfg.rows[t] = (uint8_t)rows;
        cfg.colsb[t] = 64;
    }
    cfg.rows[6] = cfg.rows[7] = AMX_STEP_K / 4;
    cfg.colsb[6] = cfg.colsb[7] = 64;
    LDTILECFG(cfg);
}

// The block's spans (the twin of amx_layout.amx_spans, checked against it by the suite): groups are
// taken into a span greedily while, for every row, the largest |c| of the span over the largest
// power of two dividing all its c (2**base) is at most fold_limit (then every q * (c >> base) is
// an s16: proofs, amx-span-digits), and the span holds at most AMX_SPAN_GROUPS groups. A group
// alone always fits: c >> its low bit is |ms| <= 255. Out: f [G][16] int16 in lane order
// (c >> its span's base), base [G][16] int8 in row order (each group's span's), ends [G] uint8
// (1 where a span ends) and rsum [16] int64 R = sum_k q * c in row order.
static void amx_block_spans(const Block *blk, int64_t G, int64_t fold_limit, int16_t *f,
                            int8_t *base, uint8_t *ends, int64_t *rsum) {
    const int64_t never = (int64_t)1 << 40;  // "no nonzero factor yet": divides nothing
    int64_t low[16], top[16], length = 0;
    for (int64_t g = 0; g < G; g++) {
        const int32_t *c = blk->c + g * blk->stride;
        int fits = g > 0 && length < AMX_SPAN_GROUPS;
        for (int r = 0; r < 16 && fits; r++) {
            const int64_t v = c[r], bit = v ? (v & -v) : never, a = v < 0 ? -v : v;
            const int64_t l = bit < low[r] ? bit : low[r], t = a > top[r] ? a : top[r];
            fits = t / l <= fold_limit;
        }
        if (!fits && g > 0) ends[g - 1] = 1;
        for (int r = 0; r < 16; r++) {
            const int64_t v = c[r], bit = v ? (v & -v) : never, a = v < 0 ? -v : v;
            low[r] = fits && low[r] < bit ? low[r] : bit;  // the span's min, or a new span's
            top[r] = fits && top[r] > a ? top[r] : a;
            base[g * 16 + r] = (int8_t)(low[r] == never ? 0 : __builtin_ctzll((uint64_t)low[r]));
        }
        ends[g] = 0;
        length = fits ? length + 1 : 1;
    }
    ends[G - 1] = 1;
    at_span_ends(base, ends, G);  // each group takes its span's base: the span end's
    for (int r = 0; r < 16; r++) rsum[r] = 0;
    for (int64_t g = 0; g < G; g++) {
        const int32_t *c = blk->c + g * blk->stride, *ws = blk->wsum + g * blk->stride;
        for (int l = 0; l < 16; l++) {
            const int r = LANE_ROW(l);
            f[g * 16 + l] = (int16_t)(c[r] >> base[g * 16 + r]);
            rsum[r] += (int64_t)ws[l] * c[r];
        }
    }
}

// One 4-k step of 16 lanes (q: 64 s8, lane-major) times its lanes' f (fa: lanes 0..7, fb: 8..15,
// each f four times) into its lo and hi digit rows. |q * f| <= 32767: vpmullw is exact.
ALWAYS_INLINE void fold_step(__m512i q, __m512i fa, __m512i fb, uint8_t *lo, uint8_t *hi) {
    const __m512i wa = _mm512_mullo_epi16(_mm512_cvtepi8_epi16(_mm512_castsi512_si256(q)), fa);
    const __m512i wb = _mm512_mullo_epi16(_mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(q, 1)),
                                          fb);
    _mm256_storeu_si256((__m256i *)lo, _mm512_cvtepi16_epi8(wa));  // the low bytes: lo as u8
    _mm256_storeu_si256((__m256i *)(lo + 32), _mm512_cvtepi16_epi8(wb));
    _mm256_storeu_si256((__m256i *)hi, _mm512_cvtepi16_epi8(_mm512_srai_epi16(wa, 8)));
    _mm256_storeu_si256((__m256i *)(hi + 32), _mm512_cvtepi16_epi8(_mm512_srai_epi16(wb, 8)));
}

// Group g of block wb folded into 8 rows of each digit plane (lo, hi), or zeros where g < 0.
static void fold_group(const uint8_t *wb, const int16_t *f, int64_t g, int nibbles, uint8_t *lo,
                       uint8_t *hi) {
    if (g < 0) {
        memset(lo, 0, 8 * 64);
        memset(hi, 0, 8 * 64);
        return;
    }
    const __m512i lanes = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(f + g * 16)));
    static const int16_t lane_of[32] = {0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3,
                                        4, 4, 4, 4, 5, 5, 5, 5, 6, 6, 6, 6, 7, 7, 7, 7};
    const __m512i quad = _mm512_loadu_si512(lane_of);  // byte 4 l + t of a row: lane l
    const __m512i fa = _mm512_permutexvar_epi16(quad, lanes);
    const __m512i fb = _mm512_permutexvar_epi16(_mm512_add_epi16(quad, _mm512_set1_epi16(8)),
                                                lanes);
    for (int j = 0; j < 8; j += 2) {  // 4-k steps 8 g + j and 8 g + j + 1
        __m512i q0, q1;
        if (nibbles) {
            unpack_pair(_mm512_loadu_si512(wb + (g * 4 + j / 2) * 64), &q0, &q1);
        } else {
            q0 = _mm512_loadu_si512(wb + (g * 8 + j) * 64);
            q1 = _mm512_loadu_si512(wb + (g * 8 + j + 1) * 64);
        }
        fold_step(q0, fa, fb, lo + j * 64, hi + j * 64);
        fold_step(q1, fa, fb, lo + (j + 1) * 64, hi + (j + 1) * 64);
    }
}

// Every block's spans (amx_block_spans) into f [Np/16][G][16], base [Np/16][G][16], ends
// [Np/16][G] and rsum [Np]: amx_layout.amx_spans' shapes, for the suite to compare the two.
// Returns 0, or -1 without memory.
int64_t amx_layer_spans(const Layer *L, int64_t fold_limit, int16_t *f, int8_t *base,
                        uint8_t *ends, int64_t *rsum) {
    const int64_t K = L->K, G = K / 32;
    uint8_t *words = aligned_alloc(64, K * 16 + 4 * G * 16 * 4);
    if (!words) return -1;
    int32_t *wsum = (int32_t *)(words + K * 16), *c = wsum + G * 16;
    for (int64_t b = 0; b < L->Np / 16; b++) {
        const Block blk = block_of(L, b, words, wsum, c, c + G * 16);
        amx_block_spans(&blk, G, fold_limit, f + b * G * 16, base + b * G * 16, ends + b * G,
                        rsum + b * 16);
    }
    free(words);
    return 0;
}

// The block's steps folded into the digit planes lo, hi (1024 bytes a step each): step s reads the
// activations from k = AMX_STEP_K * from[s], and end[s] is the group whose span ends with it (-1:
// none). Returns the number of steps (at most G).
static int64_t fold_block(const Block *blk, int64_t G, const int16_t *f, const uint8_t *ends,
                          uint8_t *lo, uint8_t *hi, int32_t *from, int32_t *end) {
    const uint8_t *wb = blk->w;
    int64_t s = 0;
    for (int64_t g = 0; g < G; g += 2, s++) {
        const int pair = g + 1 < G && !ends[g];  // both groups in one span: one step
        fold_group(wb, f, g, blk->nibbles, lo + s * 1024, hi + s * 1024);
        fold_group(wb, f, pair ? g + 1 : -1, blk->nibbles, lo + s * 1024 + 512,
                   hi + s * 1024 + 512);
        from[s] = (int32_t)(g / 2);
        end[s] = (int32_t)(pair ? (ends[g + 1] ? g + 1 : -1) : g);
        if (!pair && g + 1 < G) {  // the span ended with group g: g + 1 again, g zero
            s++;
            fold_group(wb, f, -1, blk->nibbles, lo + s * 1024, hi + s * 1024);
            fold_group(wb, f, g + 1, blk->nibbles, lo + s * 1024 + 512, hi + s * 1024 + 512);
            from[s] = (int32_t)(g / 2);
            end[s] = (int32_t)(ends[g + 1] ? g + 1 : -1);
        }
    }
    return s;
}

// One span's stored dots (dots[2 i + j][m]: limb i, digit j, row m, 16 int32 lanes) into the rows'
// T: E = sum_ij D_ij << 8 (i + j) in int64, then T += E << b_n (base: the span's b_n, row order).
// Lane 2 r of a dot row is weight row r and lane 2 r + 1 row 8 + r (LANE_ROWS): t[m] holds rows
// 0..7, then 8..15.
static void add_span(int32_t (*dots)[AMX_ROWS][16], const int8_t *base, int limbs, int rows,
                     int64_t (*t)[16]) {
    const __m512i b_even = _mm512_cvtepi8_epi64(_mm_loadl_epi64((const __m128i *)base));
    const __m512i b_odd = _mm512_cvtepi8_epi64(_mm_loadl_epi64((const __m128i *)(base + 8)));
    for (int m = 0; m < rows; m++) {
        __m512i even = _mm512_setzero_si512(), odd = _mm512_setzero_si512();
        for (int i = 0; i < limbs; i++) {
            for (int j = 0; j < 2; j++) {
                const __m512i d = _mm512_loadu_si512(dots[2 * i + j][m]);
                const int shift = 8 * (i + j);
                even = _mm512_add_epi64(
                    even, _mm512_slli_epi64(_mm512_srai_epi64(_mm512_slli_epi64(d, 32), 32),
                                            shift));
                odd = _mm512_add_epi64(odd, _mm512_slli_epi64(_mm512_srai_epi64(d, 32), shift));
            }
        }
        _mm512_storeu_si512(t[m], _mm512_add_epi64(_mm512_loadu_si512(t[m]),
                                                   _mm512_sllv_epi64(even, b_even)));
        _mm512_storeu_si512(t[m] + 8, _mm512_add_epi64(_mm512_loadu_si512(t[m] + 8),
                                                       _mm512_sllv_epi64(odd, b_odd)));
    }
}

// T for `rows` activation rows from row pointer a (limb i at a + i * plane, rows K bytes apart)
// against the block's folded steps (base and rsum: its spans'), rounded or stored by finish.
static void amx_tile(int64_t K, int64_t b, const int8_t *base, const int64_t *rsum,
                     const uint8_t *a, int64_t plane, const uint8_t *lo, const uint8_t *hi,
                     const int32_t *from, const int32_t *end, int64_t steps, int limbs, int rows,
                     int64_t Np, Out o) {
    int32_t dots[4][AMX_ROWS][16] __attribute__((aligned(64)));
    int64_t t[AMX_ROWS][16] __attribute__((aligned(64)));
    // T starts at -B * R: B = 2**(8 L - 1), the limbs' bias
    const __m512i r_even = _mm512_slli_epi64(_mm512_loadu_si512(rsum), 8 * limbs - 1);
    const __m512i r_odd = _mm512_slli_epi64(_mm512_loadu_si512(rsum + 8), 8 * limbs - 1);
    for (int m = 0; m < rows; m++) {
        _mm512_storeu_si512(t[m], _mm512_sub_epi64(_mm512_setzero_si512(), r_even));
        _mm512_storeu_si512(t[m] + 8, _mm512_sub_epi64(_mm512_setzero_si512(), r_odd));
    }
    for (int64_t s = 0; s < steps;) {
        _tile_zero(0);
        _tile_zero(1);
        if (limbs == 2) {
            _tile_zero(2);
            _tile_zero(3);
        }
        do {  // the span's steps
            const uint8_t *at = a + (int64_t)from[s] * AMX_STEP_K;
            _tile_loadd(6, lo + s * 1024, 64);
            _tile_loadd(7, hi + s * 1024, 64);
            _tile_loadd(4, at, K);
            _tile_dpbuud(0, 4, 6);
            _tile_dpbusd(1, 4, 7);
            if (limbs == 2) {
                _tile_loadd(5, at + plane, K);
                _tile_dpbuud(2, 5, 6);
                _tile_dpbusd(3, 5, 7);
            }
        } while (end[s++] < 0);
        _tile_stored(0, dots[0], 64);  // tile numbers are immediates: no loop
        _tile_stored(1, dots[1], 64);
        if (limbs == 2) {
            _tile_stored(2, dots[2], 64);
            _tile_stored(3, dots[3], 64);
        }
        add_span(dots, base + end[s - 1] * 16, limbs, rows, t);
    }
    for (int m = 0; m < rows; m++) {
        finish(o, m, b * 16, Np, _mm512_loadu_si512(t[m]), _mm512_loadu_si512(t[m] + 8));
    }
}

// The bytes of the limb planes amx_tiles reads: L planes [M][K], then 64 bytes of slack.
int64_t amx_plane_bytes(int64_t M, int64_t K, int limbs) { return limbs * M * K + 64; }

// The bytes of a thread's scratch for a layer of K: its block read in place (words, wsum, c and
// prepare_block's decoded scales), its spans (f, base, ends, rsum), its digit planes and steps.
static int64_t amx_scratch_bytes(int64_t K) {
    const int64_t G = K / 32;
    return K * 16 + 4 * G * 16 * 4 + G * 16 * 3 + G + 16 * 8 + G * 2048 + G * 2 * 4 + 64 * 4;
}

// T [M, Np] into t, or (y not NULL) the rounded output y [M, N], from the `limbs` (1 or 2) biased
// limb planes [L][M][K] (amx_plane_bytes long), against a layer of either kind (cpu_vnni.c's
// Layer): derived (w, wsum, c and emin given) or read in place (each block built by prepare_block
// as its thread reaches it, its rows' emin and flags written to L). Where the layer's 4-bit words
// are read in place, the limbs are in prepare_block's order (quantize_into's `order`). fold_limit:
// dataflow.span_fold_limit of the weights' width. Returns 0, or -1 where a thread could not
// allocate its scratch (nothing written then is to be read).
int64_t amx_tiles(const Layer *L, const uint8_t *limb_planes, int64_t M, int limbs, int64_t *t,
                  void *y, const int64_t *e_r, int mant, int expo, int64_t fold_limit) {
    const int64_t K = L->K, Np = L->Np, G = K / 32, plane = M * K;
    int64_t failed = 0;
#pragma omp parallel reduction(+ : failed)
    {
        uint8_t *mem = aligned_alloc(64, (amx_scratch_bytes(K) + 63) / 64 * 64);
        // 64-byte aligned pieces, largest first: lo, hi, the block's words, then the rest
        uint8_t *lo = mem, *hi = mem + G * 1024, *words = mem + G * 2048;
        int32_t *wsum = (int32_t *)(words + K * 16), *c = wsum + G * 16, *sc = c + G * 16;
        int16_t *f = (int16_t *)(sc + 2 * G * 16);
        int64_t *rsum = (int64_t *)(f + G * 16);
        int32_t *from = (int32_t *)(rsum + 16), *end = from + G;
        int8_t *base = (int8_t *)(end + G);
        uint8_t *ends = (uint8_t *)(base + G * 16);
        int configured = 0;  // the rows the tiles are configured for (0: not yet)
        if (!mem) failed++;
#pragma omp for schedule(static)
        for (int64_t b = 0; b < Np / 16; b++) {
            if (!mem) continue;
            const Block blk = block_of(L, b, words, wsum, c, sc);
            amx_block_spans(&blk, G, fold_limit, f, base, ends, rsum);
            const int64_t steps = fold_block(&blk, G, f, ends, lo, hi, from, end);
            for (int64_t r = 0; r < M; r += AMX_ROWS) {
                const int rows = (int)(M - r < AMX_ROWS ? M - r : AMX_ROWS);
                if (rows != configured) {
                    configure_tiles(rows);
                    configured = rows;
                }
                const Out o = tile_out(t, y, e_r, L->emin, r, L->N, L->N, Np, mant, expo);
                amx_tile(K, b, base, rsum, limb_planes + r * K, plane, lo, hi, from, end, steps,
                         limbs, rows, Np, o);
            }
        }
        if (configured) _tile_release();
        free(mem);
    }
    return failed ? -1 : 0;
}

// The whole forward in one call: x [M, K] (format 0 bf16, 1 fp16, 2 fp32, of mant_x and expo_x
// bits) quantized into `limbs` biased limb planes (in prepare_block's order against 4-bit words
// read in place), then amx_tiles, rounded once into y (mant, expo). Returns how many rows of x
// hold a non-finite value (y unwritten then), or -1 when memory could not be allocated.
int64_t exact_linear_amx(const Layer *L, const void *x, int format, int mant_x, int expo_x,
                         int64_t qmax, int limbs, int64_t M, void *y, int mant, int expo,
                         int64_t fold_limit) {
    const int64_t K = L->K;
    uint8_t *planes = aligned_alloc(64, (amx_plane_bytes(M, K, limbs) + 63) / 64 * 64);
    int64_t *e_r = malloc(M * sizeof(int64_t));
    int64_t bad = planes && e_r ? row_exponents(x, mant_x, expo_x, qmax, M, K, e_r) : -1;
    if (bad == 0) {
        quantize_into(x, format, M, K, e_r, planes, limbs, L->packed && L->bits == 4);
        bad = amx_tiles(L, planes, M, limbs, NULL, y, e_r, mant, expo, fold_limit);
    }
    free(planes);
    free(e_r);
    return bad;
}
