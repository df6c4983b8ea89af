// The AMX tile instructions cpu_amx.c uses, in portable C, for a CPU without AMX-INT8: ldtilecfg,
// tilerelease, tilezero, tileloadd, tilestored and tdpbusd, lane by lane from Intel's pseudo-code
// (SDM volume 2, "TDPBUSD"). amx.py puts this file before cpu_amx.c when EXACTNESS_AMX=emulate
// (the suite sets it on a CPU without AMX), so the kernel's tiling, layouts and combine are
// verified on every machine. The real instructions differ only in these six, which the AMX
// kernel's self-check covers where they run. Where the hardware would fault (a tile used before
// ldtilecfg, shapes tdpbusd cannot multiply, more than 16 rows or 64 bytes a row), this counts a
// fault that amx_faults() reports and the self-check refuses. For verification, not speed.
#define AMX_EMULATED 1
#include <stdint.h>
#include <string.h>

typedef struct {
    uint8_t data[16][64];
    int rows, colsb;
} EmulatedTile;

static __thread EmulatedTile emulated_tiles[8];
static __thread int emulated_configured;
static int64_t emulated_faults;

static inline void emulated_fault(void) {
    __atomic_add_fetch(&emulated_faults, 1, __ATOMIC_RELAXED);
}

// a tile number that names a configured tile, else a fault
static inline EmulatedTile *emulated_tile(int t) {
    if (!emulated_configured || t < 0 || t > 7) {
        emulated_fault();
        return NULL;
    }
    return &emulated_tiles[t];
}

// ldtilecfg: palette 1, colsb[t] (16 bits each) at byte 16 + 2 t, rows[t] at byte 48 + t; every
// tile zeroed
static inline void emulated_loadconfig(const void *config) {
    const uint8_t *c = (const uint8_t *)config;
    if (c[0] != 1 || c[1] != 0) {
        emulated_fault();
        return;
    }
    for (int t = 0; t < 8; t++) {
        const int colsb = c[16 + 2 * t] | c[17 + 2 * t] << 8, rows = c[48 + t];
        if (colsb > 64 || rows > 16) emulated_fault();
        emulated_tiles[t].colsb = colsb > 64 ? 64 : colsb;
        emulated_tiles[t].rows = rows > 16 ? 16 : rows;
        memset(emulated_tiles[t].data, 0, sizeof emulated_tiles[t].data);
    }
    emulated_configured = 1;
}

static inline void emulated_release(void) { emulated_configured = 0; }

static inline void emulated_zero(int t) {
    EmulatedTile *x = emulated_tile(t);
    if (x) memset(x->data, 0, sizeof x->data);
}

// tileloadd: rows of colsb bytes, `stride` bytes apart; the rest of the tile zeroed
static inline void emulated_loadd(int t, const void *base, int64_t stride) {
    EmulatedTile *x = emulated_tile(t);
    if (!x) return;
    memset(x->data, 0, sizeof x->data);
    for (int r = 0; r < x->rows; r++) {
        memcpy(x->data[r], (const uint8_t *)base + r * stride, x->colsb);
    }
}

static inline void emulated_stored(int t, void *base, int64_t stride) {
    EmulatedTile *x = emulated_tile(t);
    if (!x) return;
    for (int r = 0; r < x->rows; r++) memcpy((uint8_t *)base + r * stride, x->data[r], x->colsb);
}

// tdpbusd: C[m][n] += sum_k sum_j u8(A[m][4k + j]) * s8(B[k][4n + j]), int32 lanes that wrap
static inline void emulated_dpbusd(int c, int a, int b) {
    EmulatedTile *tc = emulated_tile(c), *ta = emulated_tile(a), *tb = emulated_tile(b);
    if (!tc || !ta || !tb) return;
    if (tc->rows != ta->rows || tc->colsb != tb->colsb || ta->colsb != 4 * tb->rows ||
        tc->colsb % 4 || ta->colsb % 4) {
        emulated_fault();
        return;
    }
    for (int m = 0; m < tc->rows; m++) {
        for (int n = 0; n < tc->colsb / 4; n++) {
            uint32_t acc;
            memcpy(&acc, tc->data[m] + 4 * n, 4);
            for (int k = 0; k < ta->colsb / 4; k++) {
                for (int j = 0; j < 4; j++) {
                    acc += (uint32_t)((int32_t)ta->data[m][4 * k + j] *
                                      (int32_t)(int8_t)tb->data[k][4 * n + j]);
                }
            }
            memcpy(tc->data[m] + 4 * n, &acc, 4);
        }
    }
}

// faults counted since the library loaded (the self-check wants none)
int64_t amx_faults(void) { return __atomic_load_n(&emulated_faults, __ATOMIC_RELAXED); }

// the tile state needs no permission here
int amx_request(void) { return 0; }

#define _tile_loadconfig emulated_loadconfig
#define _tile_release emulated_release
#define _tile_zero emulated_zero
#define _tile_loadd emulated_loadd
#define _tile_stored emulated_stored
#define _tile_dpbusd emulated_dpbusd
