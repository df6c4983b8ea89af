// The AMX tile instructions cpu_amx.c uses, in portable C, for a CPU without AMX-INT8: ldtilecfg,
// tilerelease, tilezero, tileloadd, tilestored, tdpbusd and tdpbuud, lane by lane from Intel's
// pseudo-code (SDM volume 2, "TDPBUSD", "TDPBUUD"). amx_library.py puts this file before
// cpu_amx.c when EXACTNESS_AMX=emulate
// (the suite sets it on a CPU without AMX), so the kernel's tiling, layouts and combine are
// verified on every machine. The real instructions differ only in these seven, which the AMX
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

// ldtilecfg as the compiler sees it. The asm copies the 64 bytes at &config into this thread's
// emulated_config, and its only memory input is the lvalue `config`, as the real instruction's asm
// reads it. So a store to the config that the compiler may drop before the real instruction is
// dropped here too, and the tiles get what the hardware would be given. cpu_amx.c's LDTILECFG names
// the whole config; GCC 12's _tile_loadconfig (at the end) only its first 8 bytes. Nothing is
// called until the next tile instruction takes the config up (emulated_tile): a call while the
// config lives would make the compiler keep its stores, and hide the bug this is here to show.
static __thread volatile uint8_t emulated_config[64];
static __thread volatile int emulated_pending;
#define LDTILECFG(config)                                                                   \
    do {                                                                                    \
        void *to_ = (void *)emulated_config;                                                \
        __asm__ volatile("lea %1, %%rsi\n\tmov $64, %%ecx\n\trep movsb"                     \
                         : "+D"(to_)                                                        \
                         : "m"(config)                                                      \
                         : "rsi", "rcx");                                                   \
        emulated_pending = 1;                                                               \
    } while (0)

// the config emulated_config holds taken up: palette 1, colsb[t] (16 bits each) at byte 16 + 2 t,
// rows[t] at byte 48 + t; every tile zeroed
static inline void emulated_loadconfig(void) {
    uint8_t c[64];
    for (int i = 0; i < 64; i++) c[i] = emulated_config[i];
    emulated_pending = 0;
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

// a tile number that names a configured tile, else a fault (#UD on the hardware: a tile of 0 rows
// or 0 bytes a row is not configured)
static inline EmulatedTile *emulated_tile(int t) {
    if (emulated_pending) emulated_loadconfig();
    if (!emulated_configured || t < 0 || t > 7 || !emulated_tiles[t].rows ||
        !emulated_tiles[t].colsb) {
        emulated_fault();
        return NULL;
    }
    return &emulated_tiles[t];
}

static inline void emulated_release(void) { emulated_configured = emulated_pending = 0; }

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

// tdpbusd (u8 x s8) and tdpbuud (u8 x u8): C[m][n] += sum_k sum_j A[m][4k + j] * B[k][4n + j],
// int32 lanes that wrap
static inline void emulated_dot(int c, int a, int b, int b_signed) {
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
                    const uint8_t w = tb->data[k][4 * n + j];
                    acc += (uint32_t)((int32_t)ta->data[m][4 * k + j] *
                                      (b_signed ? (int32_t)(int8_t)w : (int32_t)w));
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

// GCC 12's _tile_loadconfig (amxtileintrin.h): its asm's operand is *(const void **)config, the
// config's first 8 bytes alone
#define _tile_loadconfig(config) LDTILECFG(*(const void **)(config))
#define _tile_release emulated_release
#define _tile_zero emulated_zero
#define _tile_loadd emulated_loadd
#define _tile_stored emulated_stored
#define _tile_dpbusd(c, a, b) emulated_dot(c, a, b, 1)
#define _tile_dpbuud(c, a, b) emulated_dot(c, a, b, 0)
