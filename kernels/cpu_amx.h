/* kvfleet CPU kernels: linear layers on AMX tiles (bf16 x bf16, float32 sums), for CPUs with
 * AMX-BF16 (Intel Sapphire Rapids and later). Compiled into the `amx` build variant only
 * (cpu_lib.py: -mamx-tile -mamx-bf16); elsewhere KV_HAVE_AMX is 0 and none of this exists.
 *
 * Contract: y[m * ldy + n - n0] = finish_dot(sum_k bf16(x[m, k]) * bf16(dequant(w)[n, k])) for
 * m < M, n0 <= n < n1, a kv_matrix in any format (cpu_gemv.h): each dequantized weight (int4's
 * q * scale + shift, int8g's q * scale (+ shift), int8's q, bf16 as stored, fp32) rounded to bf16 to nearest
 * even, int8's per-channel scale and the bias applied after the sum as everywhere (finish_dot).
 * The activations are rounded to bf16 once per phase by kv_amx_pack_x, into the tiles' order.
 *
 * Batch invariance: every output is one tile accumulation over K in 32-wide blocks, in the same
 * order whatever M is; the tile unit computes each (channel, token) dot on its own, so a row's
 * result is the same bits alone, in any batch and at any position in it (tests/unit/kernels check
 * it bitwise; so did a probe on a Xeon with AMX: 1, 5 and 16 tokens per tile give equal bits).
 * What one tdpbf16ps adds to an output, measured (tests/unit/kernels/test_cpu_amx.py): c + (E + O),
 * E and O sequential fp32 sums of the even and odd products of its 16 pairs, FTZ/DAZ; another
 * kernel gives these bits only in that order (docs/performance.md, "AMX tiles at one row").
 *
 * Layout. Weights are the A operand: 16 channels x 32 bf16 of K, row-major, which is how a
 * dequantized weight row lies, so each weight block is widened straight into a small buffer
 * (KV_AMX_CH channels x K, reused for every group of tokens; kv_bf16_blocks, cpu_dpbf16.h, as
 * the dot-product kernels widen them); bf16 weights need no widening: the tiles load them as
 * stored, 2K bytes a row (amx_direct; the same values in the same order, so the same bits --
 * tests/unit/kernels/test_cpu_amx.py checks them against fp32 weights of equal values, which
 * take the widening path). Activations are the B operand:
 * for each 16 tokens and each 32-wide block of K, 16 rows (the K pairs 2r, 2r + 1) of 16 tokens x
 * 2 bf16 ("VNNI" pairs), written by kv_amx_pack_x. C tiles: 16 channels x up to 16 tokens. Two
 * paths (amx_configure): up to 16 tokens (decode), three channel tiles against one token tile,
 * their weights widened KV_AMX_KC blocks of K at a time; more tokens, four C tiles (2 channel tiles
 * x 2 token tiles), two A and two B: 32 channels x 32 tokens per pass, the channels' whole rows
 * widened once for every pass. Both sum each output over K in the same order.
 *
 * Linux hands out the tile state only on request: kv_amx_ready asks once per process
 * (arch_prctl ARCH_REQ_XCOMP_PERM) and says whether it was granted.
 */
#ifndef KVFLEET_CPU_AMX_H
#define KVFLEET_CPU_AMX_H

#include "cpu_dpbf16.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define KV_HAVE_AMX 1

#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define KV_AMX_CH 32      /* channels widened per pass: two A tiles */
#define KV_AMX_TOK 32     /* tokens per pass: two B tiles */
#define KV_AMX_KC 8       /* 32-wide blocks of K widened at a time on the narrow path: 3 x 8 KiB */

/* 1 when this process may use the tile registers (asked once; later calls return the answer). */
static inline int kv_amx_ready(void) {
    static int state;   /* 0: not asked, 1: granted, -1: refused */
    if (state == 0) state = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0 ? 1 : -1;
    return state == 1;
}

/* Elements (uint16) of kv_amx_pack_x's output for M rows of K. */
static inline int64_t kv_amx_packed_size(int64_t M, int64_t K) { return (M + 15) / 16 * 16 * K; }

/* Rows m0 .. m0 + 15 of x [M, K] float32 (rows ldx apart; m0 a multiple of 16) -> their tile of xb
 * (kv_amx_pack_x), rounded to bf16 to nearest even: per 32-wide block, each row's 16 pairs (as
 * dwords) transposed so that tile row r holds pair r of every token. Rows past M are zero. */
static inline void kv_amx_pack_tile(const float *x, int64_t ldx, int64_t M, int64_t K, uint16_t *xb, int64_t m0) {
    const int64_t KB = K / 32;
    for (int64_t kb = 0; kb < KB; kb++) {
        __m512i r[16];
        for (int64_t i = 0; i < 16; i++) {
            const float *row = x + (m0 + i) * ldx + 32 * kb;
            r[i] = m0 + i < M ? (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(row + 16), _mm512_loadu_ps(row))
                              : _mm512_setzero_si512();
        }
        kv_transpose16(r);
        uint16_t *dst = xb + ((m0 / 16) * KB + kb) * 512;
        for (int i = 0; i < 16; i++) _mm512_storeu_si512(dst + 32 * i, r[i]);
    }
}

/* x [M, K] float32 (rows ldx apart) -> xb in the B tiles' order (above), tile after tile. */
static inline void kv_amx_pack_x(const float *x, int64_t ldx, int64_t M, int64_t K, uint16_t *xb) {
    for (int64_t m0 = 0; m0 < M; m0 += 16) kv_amx_pack_tile(x, ldx, M, K, xb, m0);
}

/* The whole row n into its channel tile `tile`, row r, of the tile-ordered wb [tiles][K / 32][16][32]. */
static inline void amx_widen_row(const kv_matrix *m, int64_t n, uint16_t *wb, int64_t tile, int64_t r) {
    kv_bf16_blocks(m, n, 0, m->K / 32, wb + (tile * (m->K / 32) * 16 + r) * 32, 512);
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} kv_tilecfg;

/* The tile registers are not renamed: a tile is loaded again only once the product reading it
 * is done, so each accumulator's chain (load, multiply) runs at the product's latency, and speed
 * comes from independent chains. Two layouts, by the tokens of the call:
 * - wide (t1 >= 0; more than 16 tokens): 0..3 C (channel tile a, token tile b at 2b + a), 4, 5 A,
 *   6, 7 B; t0, t1 tokens in each B tile (t1 = 0: the second unused); four chains;
 * - narrow (t1 < 0; at most 16 tokens, t0 of them): 0..2 C, 3..5 A, 6 B: three channel tiles
 *   against one token tile, three chains.
 * Loaded only when the thread's tile configuration differs: read back from the CPU (sttilecfg),
 * never remembered in a variable, because another copy of these kernels in the process (another
 * ISA variant or build of the library: a test opens several) configures the same thread's tiles
 * too; a remembered key then skipped the load and the next product used a tile the other copy had
 * left unconfigured (SIGILL). */
static inline void amx_configure(int t0, int t1) {
    kv_tilecfg c, now;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    if (t1 < 0) {
        for (int i = 0; i < 7; i++) { c.rows[i] = 16; c.colsb[i] = (uint16_t)(i >= 3 && i < 6 ? 64 : 4 * t0); }
    } else {
        const int tok[2] = {t0, t1 ? t1 : t0};
        for (int i = 0; i < 4; i++) { c.rows[i] = 16; c.colsb[i] = (uint16_t)(4 * tok[i / 2]); }
        for (int i = 4; i < 6; i++) { c.rows[i] = 16; c.colsb[i] = 64; }
        for (int i = 6; i < 8; i++) { c.rows[i] = 16; c.colsb[i] = (uint16_t)(4 * tok[i - 6]); }
    }
    memset(&now, 0, sizeof now);
    _tile_storeconfig(&now);   /* all zero when the thread has no configuration */
    if (memcmp(&now, &c, sizeof c) != 0) _tile_loadconfig(&c);
}

/* One C tile (channels c0 .. c0 + 15, tokens t0 .., `nt` of them) finished into y: stored,
 * transposed to token rows, then finish_dot's scale and bias as vectors (the same two roundings). */
static inline void amx_store(const kv_matrix *m, int tile, int64_t c0, int64_t t0, int nt, int64_t n0, float *y,
                             int64_t ldy) {
    __m512i r[16];
    switch (tile) {   /* the tile number must be an immediate */
    case 0: _tile_stored(0, r, 64); break;
    case 1: _tile_stored(1, r, 64); break;
    case 2: _tile_stored(2, r, 64); break;
    default: _tile_stored(3, r, 64); break;
    }
    kv_transpose16(r);   /* r[t]: token t's 16 channels */
    const __m512 scale = m->fmt == KV_INT8 ? _mm512_loadu_ps(m->scale + c0) : _mm512_set1_ps(1.0f);
    const __m512 bias = m->bias ? _mm512_loadu_ps(m->bias + c0) : _mm512_setzero_ps();
    for (int t = 0; t < nt; t++) {
        __m512 v = _mm512_castsi512_ps(r[t]);
        if (m->fmt == KV_INT8) v = _mm512_mul_ps(v, scale);
        if (m->bias) v = _mm512_add_ps(v, bias);
        _mm512_storeu_ps(y + (t0 + t) * ldy + c0 - n0, v);
    }
}

/* bf16 weights are already A tiles: rows n .. n + 15 of w [N, K], 64 bytes of block kb each, 2K
 * bytes apart (amx_direct). The tiles load them from the matrix itself: no widening copy, which
 * was most of a bf16 call's time (one thread, 12 rows, [1536, 576] x 24 matrices from L3: 0.41 ->
 * 0.08 ms a call). amx_prefetch_block: block kb of `count` rows from n, one line each (the next
 * group's, while this group multiplies), into L2; it bought the wide path 20 %, the narrow one
 * nothing measurable (docs/performance.md, "bf16 weights as A tiles"). */
static inline const uint16_t *amx_direct(const kv_matrix *m, int64_t n, int64_t kb) {
    return (const uint16_t *)m->w + n * m->K + 32 * kb;
}
static inline void amx_prefetch_block(const kv_matrix *m, int64_t n, int64_t count, int64_t kb) {
    const char *p = (const char *)amx_direct(m, n, kb);
    count = n + count <= m->N ? count : m->N - n;   /* none past the matrix */
    for (int64_t j = 0; j < count; j++) _mm_prefetch(p + j * 2 * m->K, _MM_HINT_T1);
}

/* At most 16 tokens, bf16 weights: amx_rows_narrow's tiles and order (so its bits), the A tiles
 * loaded from w. */
static inline void amx_rows_narrow_bf16(const kv_matrix *m, const uint16_t *xb, int M, int64_t n0, int64_t n1,
                                        float *y, int64_t ldy) {
    const int64_t KB = m->K / 32, ld = 2 * m->K;
    amx_configure(M, -1);
    for (int64_t n = n0; n < n1; n += 48) {
        const int nc = (int)((n1 - n) / 16 < 3 ? (n1 - n) / 16 : 3);
        _tile_zero(0); _tile_zero(1); _tile_zero(2);
        for (int64_t kb = 0; kb < KB; kb++) {
            amx_prefetch_block(m, n + 16 * nc, 16 * nc, kb);   /* the next group */
            _tile_loadd(6, xb + kb * 512, 64);
            _tile_loadd(3, amx_direct(m, n, kb), ld);
            _tile_dpbf16ps(0, 3, 6);
            if (nc > 1) { _tile_loadd(4, amx_direct(m, n + 16, kb), ld); _tile_dpbf16ps(1, 4, 6); }
            if (nc > 2) { _tile_loadd(5, amx_direct(m, n + 32, kb), ld); _tile_dpbf16ps(2, 5, 6); }
        }
        for (int c = 0; c < nc; c++) amx_store(m, c, n + 16 * c, 0, M, n0, y, ldy);
    }
}

/* At most 16 tokens (decode): three channel tiles at a time. Their weights are widened row after
 * row first (one sequential stream per thread, prefetched ahead: interleaving the rows block by
 * block made 48 streams that the hardware prefetcher did not follow), into wb [48, K]. */
static inline void amx_rows_narrow(const kv_matrix *m, const uint16_t *xb, int M, int64_t n0, int64_t n1, float *y,
                                   int64_t ldy, uint16_t *wb) {
    const int64_t KB = m->K / 32;
    amx_configure(M, -1);
    for (int64_t n = n0; n < n1; n += 48) {
        const int nc = (int)((n1 - n) / 16 < 3 ? (n1 - n) / 16 : 3);
        _tile_zero(0); _tile_zero(1); _tile_zero(2);
        for (int64_t kb0 = 0; kb0 < KB; kb0 += KV_AMX_KC) {   /* the widened chunk stays in L1 */
            const int64_t kb1 = kb0 + KV_AMX_KC < KB ? kb0 + KV_AMX_KC : KB;
            if (kb0 == 0) prefetch_rows(m, n + 16 * nc, 16 * nc);   /* the next channels' weights */
            for (int j = 0; j < 16 * nc; j++)
                kv_bf16_blocks(m, n + j, kb0, kb1, wb + ((j / 16) * KV_AMX_KC * 16 + j % 16) * 32, 512);
            for (int64_t kb = kb0; kb < kb1; kb++) {
                const uint16_t *a = wb + (kb - kb0) * 512;
                _tile_loadd(6, xb + kb * 512, 64);
                _tile_loadd(3, a, 64);
                _tile_dpbf16ps(0, 3, 6);
                if (nc > 1) { _tile_loadd(4, a + KV_AMX_KC * 512, 64); _tile_dpbf16ps(1, 4, 6); }
                if (nc > 2) { _tile_loadd(5, a + 2 * KV_AMX_KC * 512, 64); _tile_dpbf16ps(2, 5, 6); }
            }
        }
        for (int c = 0; c < nc; c++) amx_store(m, c, n + 16 * c, 0, M, n0, y, ldy);
    }
}

/* The contract at the top: n1 - n0 a multiple of 16, K of 32; xb from kv_amx_pack_x of M rows.
 * Returns 0, or -1 when the widening buffer could not be allocated. */
static inline int kv_amx_rows(const kv_matrix *m, const uint16_t *xb, int64_t M, int64_t n0, int64_t n1, float *y,
                              int64_t ldy) {
    const int64_t K = m->K, KB = K / 32;
    const int direct = m->fmt == KV_BF16;   /* bf16 rows are A tiles as stored (amx_direct) */
    if (direct && M <= 16) {
        amx_rows_narrow_bf16(m, xb, (int)M, n0, n1, y, ldy);
        return 0;
    }
    /* the widening buffer; the narrow path's is 3 tiles x KC blocks */
    uint16_t *wb = direct ? NULL : kv_bf16_buffer(48 * K > 3 * KV_AMX_KC * 512 ? 48 * K : 3 * KV_AMX_KC * 512);
    if (!direct && !wb) return -1;
    if (M <= 16) {
        amx_rows_narrow(m, xb, (int)M, n0, n1, y, ldy, wb);
        return 0;
    }
    for (int64_t n = n0; n < n1; n += KV_AMX_CH) {
        const int two = n1 - n > 16;
        if (!direct) {
            prefetch_rows(m, n + 32, 8);
            for (int64_t j = 0; j < (two ? 32 : 16); j++) {
                if (j % 8 == 0) prefetch_rows(m, n + 40 + j, 8);
                amx_widen_row(m, n + j, wb, j / 16, j % 16);
            }
        }
        /* the two channel tiles' blocks: widened (wb, rows 64 bytes apart) or as stored (w, 2K apart) */
        const uint16_t *a0 = direct ? amx_direct(m, n, 0) : wb, *a1 = direct ? amx_direct(m, n + 16, 0) : wb + KB * 512;
        const int64_t as = direct ? 32 : 512, ald = direct ? 2 * K : 64;
        for (int64_t t0 = 0; t0 < M; t0 += KV_AMX_TOK) {
            const int nt0 = (int)(M - t0 < 16 ? M - t0 : 16);
            const int nt1 = (int)(M - t0 - 16 <= 0 ? 0 : M - t0 - 16 < 16 ? M - t0 - 16 : 16);
            amx_configure(nt0, nt1);
            _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
            const uint16_t *b0 = xb + (t0 / 16) * KB * 512, *b1 = b0 + KB * 512;
            for (int64_t kb = 0; kb < KB; kb++) {
                if (direct && t0 == 0) amx_prefetch_block(m, n + KV_AMX_CH, two ? 32 : 16, kb);
                _tile_loadd(4, a0 + kb * as, ald);
                _tile_loadd(6, b0 + kb * 512, 64);
                _tile_dpbf16ps(0, 4, 6);
                if (two) {
                    _tile_loadd(5, a1 + kb * as, ald);
                    _tile_dpbf16ps(1, 5, 6);
                }
                if (nt1) {
                    _tile_loadd(7, b1 + kb * 512, 64);
                    _tile_dpbf16ps(2, 4, 7);
                    if (two) _tile_dpbf16ps(3, 5, 7);
                }
            }
            amx_store(m, 0, n, t0, nt0, n0, y, ldy);
            if (two) amx_store(m, 1, n + 16, t0, nt0, n0, y, ldy);
            if (nt1) {
                amx_store(m, 2, n, t0 + 16, nt1, n0, y, ldy);
                if (two) amx_store(m, 3, n + 16, t0 + 16, nt1, n0, y, ldy);
            }
        }
    }
    return 0;
}

#else
#define KV_HAVE_AMX 0
#endif

#endif
