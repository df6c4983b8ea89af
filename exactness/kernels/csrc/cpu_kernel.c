// The C kernel: the exact layer forward and an MoE layer's grouped call, in one source for every
// x86 ISA it is built for. What differs by ISA is a file of its own, as gemmlowp keeps a kernel
// file per architecture: kernel_avx512.h (AVX-512 VNNI) and kernel_avx2.h (AVX2, on every x86-64
// CPU this project runs on). vnni_library.py puts one of them in place of the #include
// "kernel_isa.h" below and builds each as a library of its own. This file holds what they share:
// the layer (Layer: derived, or the checkpoint's buffers read in place), where a tile's result
// goes (Out), the row exponents, and the driver of one call (exact_grouped: quantize once, then
// every expert's blocks of 16 weight rows shared among the threads, each rounded once in
// registers).
//
// Every ISA runs the same dataflow (docs/SPEC.md section 12): activations quantized per row into
// the limbs of dataflow.py, the bytes of qa + 2**(8 L - 1) (u8, biased by 128 each); per group of
// 32 k, the biased dots D'_j = sum (limb_j + 128) * q summed in int32 and corrected once by the
// weight sums; P * c added to T in int64; T rounded once. An ISA file provides:
// - TILE_ROWS, BY_ROWS: the activation rows of a tile, and the switch over a tail's size;
// - tile(): one tile of the limb kernel, its T stored or rounded into y (finish);
// - prepare_block(): a block of 16 weight rows read in place into the block layout below;
// - quantize_into(): the activations' limbs; round_rows(): the rounding as a pass of its own;
// - KERNEL_SPANS: 1 where it also holds the span kernel (exact_linear_spans, span_block_scales).
//
// The block layout every ISA reads: weights in blocks of 16 rows, [Np/16][K/4][16][4] int8, or,
// when every weight fits 4 bits, [Np/16][K/8][16][4] bytes holding the 4-bit pairs
// (q_j + 8) | (q_{j+1} + 8) << 4 of consecutive 4-k steps j, j + 1. Lane 2i of block b is weight
// row 16 b + i and lane 2i + 1 is row 16 b + 8 + i (LANE_ROW), so the even 32-bit lanes (and the
// odd ones, shifted down) are 8 rows each in natural order. wsum [G][Np] int32 in that lane
// order; c [G][Np] int32 in row order; the limbs [L][M][K] uint8 (limb + 128: `plane` bytes from
// one limb to the next); t [M][Np] int64.
#include <immintrin.h>  // the intrinsics of both ISA files (avx512_emulated.h's, emulated)
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifndef ALWAYS_INLINE  // avx512_emulated.h lets the compiler choose: minutes of build otherwise
#define ALWAYS_INLINE static inline __attribute__((always_inline))
#endif
#define LANE_ROW(l) (((l) & 1) * 8 + (l) / 2)  // the weight row in lane l of a block (LANE_ROWS)
// for i in 0 .. rows - 1, unrolled whole: GCC otherwise keeps per-row arrays of sums on the stack
#define FOR_ROWS(i) _Pragma("GCC unroll 8") for (int i = 0; i < rows; i++)
// likewise for the `limbs` (1, 2 or 4, a compile-time constant) of an activation
#define FOR_LIMBS(l) _Pragma("GCC unroll 4") for (int l = 0; l < limbs; l++)
// Where a tile's result goes: T (int64, row stride Np), or, when y is set, the rounded output
// itself: y[r, n] = round8_normal(T, e_r[r] + emin[n]) as bit patterns (N columns, row stride
// ld), straight from the registers. emin is padded to Np; e_r and y start at the tile's first row.
typedef struct {
    int64_t *t;
    void *y;
    const int64_t *e_r, *emin;
    int64_t N, ld;
    int mant, expo;
} Out;

// The Out of the tile whose first activation row is r (y's rows ld values apart).
static inline Out tile_out(int64_t *t, void *y, const int64_t *e_r, const int64_t *emin, int64_t r,
                           int64_t N, int64_t ld, int64_t Np, int mant, int expo) {
    const int bytes = mant + expo + 1 == 32 ? 4 : 2;
    return y ? (Out){0, (char *)y + r * ld * bytes, e_r + r, emin, N, ld, mant, expo}
             : (Out){t + r * Np, 0, 0, 0, N, ld, mant, expo};
}

// Each row of a tile reads its activations through a pointer of its own (row i at rows[i]): the
// rows of one call (M consecutive ones) and an expert's routed rows (gathered) alike.
#define ROW_POINTERS(type, name, base, row_of, stride)      \
    type name[TILE_ROWS];                                   \
    for (int i = 0; i < TILE_ROWS; i++) name[i] = (base) + (row_of) * (stride)

// What a grouped call reads of a layer, one of two kinds:
// - in place (packed set: vnni_layout.InPlace, a forward's): the checkpoint's live buffers, each
//   block of 16 weight rows built by prepare_block as its thread reaches it; emin and flags are
//   this forward's outputs.
// - derived (packed NULL: vnni_layout.NativeWeights.layer): the two accumulation kernels' layouts
//   built ahead, emin given. f, rsh, ends and unshifted are NULL until the span kernel first runs.
typedef struct {
    const uint8_t *w;
    const int32_t *wsum, *c;
    const int16_t *f;
    const int8_t *rsh;
    const uint8_t *ends, *unshifted;
    int64_t *emin;  // padded to Np: given (derived), or written per block (in place)
    int64_t K, Np, N;
    int32_t nibbles;
    const int32_t *packed;  // weight_packed [N][K bits / 32], or NULL
    const uint16_t *scale;  // weight_scale [N][G], bf16 bits
    uint8_t *flags;         // [Np]: FLAG_SLOW, FLAG_NONFINITE per row, written per block
    int32_t bits, limit;    // the weights' width; dataflow.certified_spread
} Layer;

#ifndef PREFETCH_WORDS
#define PREFETCH_WORDS 48  // how far ahead prepare_block asks for each row's words (measured)
#endif
#define FLAG_SLOW 1       // the row's scale spread is past `limit`: its factors are 0 here
#define FLAG_NONFINITE 2  // the row holds a non-finite scale, counted as 0 here

// One block of 16 weight rows as a kernel reads it: in kernel_avx512.h's block layout, the
// weights w (4-bit pairs where `nibbles`), the weight sums wsum [G] of 16 int32 in lane order and
// the factors c [G] of 16 int32 in row order, `stride` int32 from one group to the next (Np for a
// derived layer, 16 for a block read in place); in kernel_avx2.h's, the words where they are and
// the factors c [16][stride] (prepare_block says).
typedef struct {
    const uint8_t *w;
    const int32_t *wsum, *c;
    int64_t stride;
    int nibbles;
} Block;

#include "kernel_isa.h"  // the ISA's half: kernel_avx512.h or kernel_avx2.h (vnni_library.py)

#define TILE(R, LIMBS, NIB) \
    tile(a_rows, plane, wb, wsum_b, c_b, ws, o, b * 16, K, Np, R, LIMBS, NIB)
#define TILES(LIMBS, NIB) BY_ROWS(rows, TILE, LIMBS, NIB)
// every (limbs, nibbles) the limb kernel takes, each a kernel of its own
#define LIMB_TILES(limbs, nibbles)                                   \
    if (limbs == 4 && nibbles) TILES(4, 1) else if (limbs == 4) TILES(4, 0)    \
    else if (limbs == 2 && nibbles) TILES(2, 1) else if (limbs == 2) TILES(2, 0) \
    else if (nibbles) TILES(1, 1) else TILES(1, 0)

#if KERNEL_DERIVED
// T [M, Np] into t, or (y not NULL) the rounded output y [M, N] (see Out), from the `limbs`
// limbs [L][M][K] of the activations, against a layer derived ahead (w, wsum, c).
void exact_linear_limbs(const uint8_t *limb_planes, const uint8_t *w, const int32_t *wsum,
                        const int32_t *c, int64_t *t, int64_t M, int64_t K, int64_t Np, int limbs,
                        int nibbles, void *y, const int64_t *e_r, const int64_t *emin, int64_t N,
                        int mant, int expo) {
    const int64_t plane = M * K;
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < Np / 16; b++) {
        const uint8_t *wb = w + b * K * (nibbles ? 8 : 16);
        const int32_t *wsum_b = wsum + b * 16, *c_b = c + b * 16;
        const int64_t ws = Np;
        for (int64_t r = 0; r < M; r += TILE_ROWS) {
            const int64_t rows = M - r < TILE_ROWS ? M - r : TILE_ROWS;
            ROW_POINTERS(const uint8_t *, a_rows, limb_planes, r + (i < rows ? i : 0), K);
            const Out o = tile_out(t, y, e_r, emin, r, N, N, Np, mant, expo);
            LIMB_TILES(limbs, nibbles)
        }
    }
}
#endif

// The bytes a row of x takes in each limb plane (quantize_limbs, exact_grouped's scratch).
int64_t act_row_bytes(int64_t K) { return ACT_ROW_BYTES(K); }

// quantize.quantize_activations' row exponents: e_r = the exponent of amax_r (the largest |x|
// of the row, found as the largest magnitude bit pattern, which orders like |x|) plus the least t
// with amax <= Qa * 2**t; 0 for a zero row. x: a format of `mant` stored and `expo` exponent
// bits, 16 or 32 bits wide. Returns how many rows hold a non-finite value (their e_r is junk).
int64_t row_exponents(const void *x, int mant, int expo, int64_t qmax, int64_t M, int64_t K,
                   int64_t *e_r) {
    const int wide = mant + expo + 1 == 32;
    int64_t non_finite = 0;
#pragma omp parallel for schedule(static) reduction(+ : non_finite) if (M > 1)  // one row: no team
    for (int64_t r = 0; r < M; r++) {
        uint32_t amax = 0;
        for (int64_t k = r * K; k < (r + 1) * K; k++) {
            const uint32_t a = wide ? ((const uint32_t *)x)[k] & 0x7FFFFFFFu
                                    : ((const uint16_t *)x)[k] & 0x7FFFu;
            amax = a > amax ? a : amax;
        }
        const int64_t field = amax >> mant, frac = amax & ((1u << mant) - 1);
        non_finite += field == (1 << expo) - 1;
        const int64_t am = field ? frac | (1ll << mant) : frac;
        const int64_t ae = (2 - (1 << (expo - 1)) - mant) + (field ? field - 1 : 0);
        const int64_t t0 = (64 - __builtin_clzll(am | 1)) - (64 - __builtin_clzll(qmax));
        const int fits = t0 >= 0 ? am <= qmax << t0 : am << -t0 <= qmax;
        e_r[r] = am == 0 ? 0 : ae + t0 + !fits;
    }
    return non_finite;
}

void quantize_limbs(const void *x, int format, int64_t M, int64_t K, const int64_t *e_r,
                    uint8_t *out, int mode) {
    quantize_into(x, format, M, K, e_r, out, mode, 0);
}

// Block b of layer L: built into the scratch (words, wsum, c; sc, prepare_block's) where the layer
// is read in place, its rows' emin and flags written; else pointing into the derived layer.
ALWAYS_INLINE Block block_of(const Layer *L, int64_t b, uint8_t *words, int32_t *wsum, int32_t *c,
                             int32_t *sc) {
    if (L->packed || !KERNEL_DERIVED) return prepare_block(L, b, words, wsum, c, sc);
    return (Block){L->w + b * L->K * (L->nibbles ? 8 : 16), L->wsum + b * 16, L->c + b * 16,
                   L->Np, L->nibbles};
}

// One grouped call (exact_grouped): the rows routed to each of `experts` experts, each expert's
// rows against its `parts` layers (gate and up: 2; down: 1), which share K and N. The routed rows
// are numbered in expert order: expert e's are offsets[e] .. offsets[e + 1], and routed row r reads
// row source[r] of x (source NULL: row r). y [rows, parts * N] holds routed row r's output of
// part p at columns p * N .. p * N + N. spans[e] = 1 sends expert e through the span kernel (its
// layers' span scales built), else the limb kernel.
typedef struct {
    const Layer *const *layers;  // [experts * parts]: expert e's part p at e * parts + p
    const int64_t *offsets;      // [experts + 1]
    const int64_t *source;       // [rows] or NULL
    const uint8_t *spans;        // [experts]
    int64_t experts, parts;
} Grouped;

// Whether a layer goes through the span kernel where its expert asks: with its span scales derived
// (NativeWeights.spans), or, read in place, with 4-bit words (its scales then built per block).
static inline int takes_spans(const Layer *L, int asked) {
    return KERNEL_SPANS && asked && (L->packed ? L->bits == 4 : L->f != NULL);
}

// The accumulation of a grouped call: for each expert and part in turn, its blocks of 16 weight
// rows shared among the threads (a static share, no barrier between experts), each block against
// all the expert's rows. So a thread keeps an expert's activation rows in its caches across its
// blocks, and every expert's work is split evenly, however unevenly the rows are routed. An
// expert takes the span kernel where spans[e] asks and its layer holds span scales, else the
// limb kernel (exact_grouped quantizes x for both where that can happen). A layer read in place
// has its span scales built per block too (span_block_scales), into the thread's block.
static void grouped_tiles(const Grouped *gr, const int16_t *words, const uint8_t *limb_planes,
                          int64_t plane, int limbs, const int64_t *e_rows, void *y, int64_t *t,
                          int mant, int expo, uint8_t *blocks, int64_t block_bytes) {
    const Layer *first = gr->layers[0];
    const int64_t K = first->K, Np = first->Np, N = first->N, G = K / 32, ld = gr->parts * N;
    const int bytes = mant + expo + 1 == 32 ? 4 : 2;
#pragma omp parallel
    {
        int16_t *scratch = words ? aligned_alloc(64, K * 16 * sizeof(int16_t)) : NULL;
        // a block read in place: its words (at most a byte a weight), wsum, c, the decoded
        // scales (prepare_block), then its span scales (span_block_scales: f, rsh, ends)
        uint8_t *block = blocks ? blocks + omp_get_thread_num() * block_bytes : NULL;
        int32_t *block_wsum = block ? (int32_t *)(block + K * 16) : NULL;
        int32_t *block_c = block ? block_wsum + G * 16 : NULL;
#if KERNEL_SPANS
        int16_t *block_f = block ? (int16_t *)(block_c + 3 * G * 16) : NULL;
        int8_t *block_rsh = block ? (int8_t *)(block_f + G * 16) : NULL;
        uint8_t *block_ends = block ? (uint8_t *)(block_rsh + G * 16) : NULL;
        Pending pending = {.rows = 0};
#endif
        for (int64_t e = 0; e < gr->experts; e++) {
            const int64_t start = gr->offsets[e], end = gr->offsets[e + 1];
            for (int64_t p = 0; p < gr->parts; p++) {
                const Layer *L = gr->layers[e * gr->parts + p];
#if KERNEL_SPANS
                const int spans = takes_spans(L, gr->spans[e]) && scratch;
#endif
                char *y_part = y ? (char *)y + p * N * bytes : NULL;
#pragma omp for schedule(static) nowait
                for (int64_t b = 0; b < Np / 16; b++) {
                    const Block blk = block_of(L, b, block, block_wsum, block_c,
                                               block_c + G * 16);
                    const uint8_t *wb = blk.w;
                    const int32_t *wsum_b = blk.wsum, *c_b = blk.c;
                    const int64_t ws = blk.stride;
                    const int nibbles = blk.nibbles;
#if KERNEL_SPANS
                    int unshifted = 0;
                    const int8_t *rsh_b = NULL;
                    const uint8_t *ends_b = NULL;
                    if (spans && L->packed) {
                        unshifted = span_block_scales(blk.w, blk.c, blk.stride, G, block_f,
                                                      block_rsh, block_ends, block_c + G * 16);
                        expand(blk.w, block_f, scratch, K);
                        rsh_b = block_rsh, ends_b = block_ends;
                    } else if (spans) {
                        expand(L->w + b * K * 8, L->f + b * G * 16, scratch, K);
                        rsh_b = L->rsh + b * G * 16, ends_b = L->ends + b * G;
                        unshifted = L->unshifted[b];
                    }
#endif
                    for (int64_t r = start; r < end; r += TILE_ROWS) {
                        const int64_t rows = end - r < TILE_ROWS ? end - r : TILE_ROWS;
#define ROW(i) (gr->source ? gr->source[r + (i < rows ? i : 0)] : r + (i < rows ? i : 0))
                        const Out o = tile_out(t, y_part, e_rows, L->emin, r, N, ld, Np, mant,
                                               expo);
#if KERNEL_SPANS
                        if (spans) {
                            ROW_POINTERS(const int16_t *, a_rows, words, ROW(i), K);
                            if (unshifted) BY_ROWS(rows, SPAN_TILE, scratch, 1)
                            else BY_ROWS(rows, SPAN_TILE, scratch, 0)
                            continue;
                        }
#endif
                        ROW_POINTERS(const uint8_t *, a_rows, limb_planes, ROW(i),
                                     ACT_ROW_BYTES(K));
                        LIMB_TILES(limbs, nibbles)
#undef ROW
                    }
                }
            }
        }
#if KERNEL_SPANS
        for (int i = 0; i < pending.rows; i++) finish_pending(&pending, i, Np);  // the last tile
#endif
        free(scratch);
    }
}

// vnni_calls.grouped (and vnni_calls.linear, one expert of one part) in one call (Python between
// the passes cost more than the passes' own bookkeeping, measured): x [M, K] (format 0 bf16, 1
// fp16, 2 fp32, of mant_x and expo_x bits) quantized once, as the words the span kernel reads and
// the `limbs` limbs the limb kernel reads (quantize_limbs modes 0 and `limbs`), each only where an
// expert reads it; then every expert's routed rows, rounded once into y (mant, expo). The quantized
// x goes into `scratch` where its scratch_bytes hold it (a caller that keeps one across calls saves
// the page faults of a fresh allocation), else into one of its own. Returns how many rows of x hold
// a non-finite value (y unwritten then), -1 when a scratch could not be allocated, -2 when the
// layers mix the two kinds (in place and derived) or, in place, widths, or -3 for a derived layer
// in a build that reads layers in place only. With y NULL, T itself goes to t [rows][Np] (one
// part: the self-checks'), unrounded.
int64_t exact_grouped(const Grouped *gr, const void *x, int format, int mant_x, int expo_x,
                      int64_t qmax, int limbs, int64_t M, void *y, int64_t *t, int mant, int expo,
                      uint8_t *scratch, int64_t scratch_bytes) {
    const int64_t K = gr->layers[0]->K, rows = gr->offsets[gr->experts];
    // words where an expert asks for the span kernel; limbs where one does not, or where a layer
    // it would take lacks span scales (grouped_tiles then takes the limb kernel)
    int any_spans = 0, any_limbs = 0;
    const Layer *first = gr->layers[0];
    if (!KERNEL_DERIVED && !first->packed) return -3;
    for (int64_t e = 0; e < gr->experts; e++) {
        for (int64_t p = 0; p < gr->parts; p++) {
            const Layer *layer = gr->layers[e * gr->parts + p];
            any_spans |= takes_spans(layer, gr->spans[e]);
            any_limbs |= !takes_spans(layer, gr->spans[e]);
            // one kind of layer a call: the activations' order follows it
            if (!layer->packed != !first->packed || (layer->packed && layer->bits != first->bits))
                return -2;
        }
    }
    // a block of each thread's, for the layers read in place (prepare_block, span_block_scales)
    const int64_t G = K / 32;
    const int64_t block_bytes = (K * 16 + 4 * G * 16 * (int64_t)sizeof(int32_t) + G * 16 * 3 + G +
                                 63) / 64 * 64;
    uint8_t *blocks = first->packed ? aligned_alloc(64, block_bytes * omp_get_max_threads())
                                    : NULL;
    if (first->packed && !blocks) return -1;
    // on 64 bytes (malloc's 16 measured 0.1 ms slower): in the caller's scratch where it holds
    // both (vnni_calls.scratch_bytes), else allocated here
    const int64_t words_bytes = any_spans ? (M * K * 2 + 63) / 64 * 64 : 0;
    const int64_t limbs_bytes = any_limbs ? (M * ACT_ROW_BYTES(K) * limbs + 63) / 64 * 64 : 0;
    const int own = !scratch || scratch_bytes < words_bytes + limbs_bytes;
    uint8_t *block = own ? aligned_alloc(64, words_bytes + limbs_bytes + 64) : scratch;
    int16_t *words = any_spans && block ? (int16_t *)block : NULL;
    uint8_t *planes = any_limbs && block ? block + words_bytes : NULL;
    int64_t *e_r = malloc(M * sizeof(int64_t)), *e_rows = malloc(rows * sizeof(int64_t));
    int64_t bad = e_r && e_rows && block ? row_exponents(x, mant_x, expo_x, qmax, M, K, e_r) : -1;
    if (bad == 0) {
        if (words) {
            quantize_into(x, format, M, K, e_r, (uint8_t *)words, 0,
                          first->packed && first->bits == 4);
        }
        if (planes) {
            quantize_into(x, format, M, K, e_r, planes, limbs,
                          first->packed && first->bits == 4);
        }
        for (int64_t r = 0; r < rows; r++) e_rows[r] = e_r[gr->source ? gr->source[r] : r];
        grouped_tiles(gr, words, planes, M * ACT_ROW_BYTES(K), limbs, e_rows, y, t, mant, expo,
                      blocks, block_bytes);
    }
    free(blocks);
    free(e_r);
    free(e_rows);
    if (own) free(block);
    return bad;
}

#if KERNEL_SPANS
// Every block's span scales (span_block_scales) of a layer with 4-bit words, derived (its
// NativeWeights' words and factors) or read in place (prepare_block), into f [Np/16][G][16],
// rsh [Np/16][G][16], ends [Np/16][G] and unshifted [Np/16]: vnni_layout.span_scales' shapes, for
// the suite to compare the two. Returns 0, or -1 without memory.
int64_t span_layer_scales(const Layer *L, int16_t *f, int8_t *rsh, uint8_t *ends,
                          uint8_t *unshifted) {
    const int64_t K = L->K, G = K / 32;
    uint8_t *words = aligned_alloc(64, K * 16 + 4 * G * 16 * 4);
    if (!words) return -1;
    int32_t *wsum = (int32_t *)(words + K * 16), *c = wsum + G * 16;
    for (int64_t b = 0; b < L->Np / 16; b++) {
        const Block blk = block_of(L, b, words, wsum, c, c + G * 16);
        unshifted[b] = (uint8_t)span_block_scales(blk.w, blk.c, blk.stride, G, f + b * G * 16,
                                                  rsh + b * G * 16, ends + b * G, c + G * 16);
    }
    free(words);
    return 0;
}
#endif
