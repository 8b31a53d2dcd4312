/* kvfleet CPU kernels: linear layers as bf16 dot products (AVX512-BF16's vdpbf16ps, 32
 * multiply-adds per instruction into 16 float32 lanes), for CPUs with AVX512-BF16 and no AMX
 * (AMD Zen 4 and later, Intel Cooper Lake). Compiled into the `avx512_bf16` and `amx` build
 * variants (KV_HAVE_DPBF16); elsewhere none of this exists. Also the bf16 widening of every weight
 * format, which the AMX kernels (cpu_amx.h) share.
 *
 * Contract: y[m * ldy + n - n0] = finish_dot(dot(m, n)) for m < M, n0 <= n < n1, a kv_matrix in any
 * format (cpu_gemv.h), K a multiple of 32, where dot sums bf16(x[m, k]) * bf16(dequant(w)[n, k]) in
 * one fixed order: one float32 accumulator of 16 lanes takes K's 32-wide blocks in order (block
 * kb, k = 32 kb .. 32 kb + 31: lane i adds the pair k = 32 kb + 2i, 2i + 1, one vdpbf16ps), then
 * its lanes are summed in one fixed tree (dp_reduce16). Each dequantized weight (int4's q * scale + shift,
 * int8g's q * scale (+ shift), int8's q, bf16 as stored, fp32) is rounded to bf16 to nearest even, int8's
 * per-channel scale and the bias applied after the sum (finish_dot), as on the AMX tiles. The
 * activations are rounded to bf16 once per phase by kv_dp_pack_rows, row after row (K apart).
 *
 * Batch invariance: every (row, channel) sum runs that one order whatever M is, whichever tile
 * (KV_DP_W channels x KV_DP_R rows, or fewer at the edges) it falls in, so a row's result is the
 * same bits alone and in any batch (tests/unit/kernels check it bitwise).
 *
 * Layout: a task's weights are widened KV_DP_W channels at a time into a per-thread buffer (each
 * channel's K bf16 in order: the rows are read as one stream), then summed against the step's rows
 * KV_DP_R at a time; the KV_DP_W x KV_DP_R accumulators stay in registers and are reduced together.
 */
#ifndef KVFLEET_CPU_DPBF16_H
#define KVFLEET_CPU_DPBF16_H

#include "cpu_gemv.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define KV_HAVE_DPBF16 1

#include <stdlib.h>

enum { KV_DP_W = 4, KV_DP_R = 4 };   /* 16 accumulators, reduced together (dp_reduce16) */

/* Blocks kb0 .. kb1 - 1 (32 weights each) of weight row n of m, dequantized and rounded to bf16;
 * block kb at dst + (kb - kb0) * stride. The row's pointers and group index are worked out once
 * (a division per 32 weights cost more than the widening itself). */
KV_ALWAYS_INLINE void kv_bf16_blocks(const kv_matrix *m, int64_t n, int64_t kb0, int64_t kb1, uint16_t *dst,
                                     int64_t stride) {
    const int64_t K = m->K, G = m->group ? m->group : 32;
    dst -= kb0 * stride;   /* block kb at dst + kb * stride */
    /* the groups of blocks kb0 .. kb1 - 1, widened when stored float16 (kv_groups) */
    const int64_t g0 = gidx(32 * kb0, G), g1 = kb1 > kb0 ? gidx(32 * kb1 - 1, G) + 1 : g0;
    float sb[g1 - g0 + 1], tb[g1 - g0 + 1];
    if (m->fmt == KV_INT4) {   /* byte j: k = j (low nibble), k = 16 + j (high nibble) */
        /* Per group, the 16 values q * scale + shift (q = 0 .. 15) rounded to bf16 once, then each
         * block's 32 nibbles look theirs up (vpermw): the same FMA and rounding per weight as
         * widening each one, a third of the instructions. */
        const uint8_t *w = (const uint8_t *)m->w + n * (K / 2);
        const float *sc = kv_groups(m, m->scale, n, g0, g1, sb), *sh = kv_groups(m, m->shift, n, g0, g1, tb);
        const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        const __m512i shifts = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
        const __m512i low4 = _mm512_set1_epi16(15);
        int64_t g_loaded = -1;
        __m512i table = _mm512_setzero_si512();
        for (int64_t kb = kb0; kb < kb1; kb++) {
            const int64_t g = gidx(32 * kb, G);
            if (g != g_loaded) {
                const __m512 v = _mm512_fmadd_ps(iota, _mm512_set1_ps(sc[g]), _mm512_set1_ps(sh[g]));
                table = _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(v));
                g_loaded = g;
            }
            const __m256i b = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(w + 16 * kb)));
            const __m512i idx = _mm512_and_si512(_mm512_srlv_epi16(_mm512_cvtepu8_epi16(b), shifts), low4);
            _mm512_storeu_si512(dst + kb * stride, _mm512_permutexvar_epi16(idx, table));
        }
    } else if (m->fmt == KV_INT8G) {   /* q * scale (+ shift) per 16 weights (G a multiple of 16) */
        const int8_t *w = kv_i8g_row(m, n);
        const uint8_t *hb = kv_hb_row(m, n);
        const float *sc = kv_groups(m, m->scale, n, g0, g1, sb), *sh = kv_groups(m, m->shift, n, g0, g1, tb);
#define KV_I8G_BLOCKS(SH, Q5)                                                                           \
        for (int64_t kb = kb0; kb < kb1; kb++) {                                                        \
            const __m512 lo = dq_i8g_16(w, hb, 32 * kb, sc, sh, gidx(32 * kb, G), SH, Q5);              \
            const __m512 hi = dq_i8g_16(w, hb, 32 * kb + 16, sc, sh, gidx(32 * kb + 16, G), SH, Q5);    \
            _mm512_storeu_si512(dst + kb * stride, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));               \
        }
        if (hb && sh) { KV_I8G_BLOCKS(1, 1) }
        else if (hb) { KV_I8G_BLOCKS(0, 1) }
        else if (sh) { KV_I8G_BLOCKS(1, 0) }
        else { KV_I8G_BLOCKS(0, 0) }
#undef KV_I8G_BLOCKS
    } else if (m->fmt == KV_INT8) {   /* int8 unscaled (finish_dot scales) */
        const int8_t *w = (const int8_t *)m->w + n * K;
        for (int64_t kb = kb0; kb < kb1; kb++) {
            const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(w + 32 * kb))));
            const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(w + 32 * kb + 16))));
            _mm512_storeu_si512(dst + kb * stride, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
        }
    } else if (m->fmt == KV_BF16) {
        const uint16_t *w = (const uint16_t *)m->w + n * K;
        for (int64_t kb = kb0; kb < kb1; kb++) _mm512_storeu_si512(dst + kb * stride, _mm512_loadu_si512(w + 32 * kb));
    } else {
        const float *w = (const float *)m->w + n * K;
        for (int64_t kb = kb0; kb < kb1; kb++)
            _mm512_storeu_si512(dst + kb * stride, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(w + 32 * kb + 16),
                                                                               _mm512_loadu_ps(w + 32 * kb)));
    }
}

/* A per-thread buffer of at least `elems` uint16 (grown as needed, never freed: one per thread;
 * the AMX and the dot-product kernels share it). NULL when out of memory. */
static inline uint16_t *kv_bf16_buffer(int64_t elems) {
    static __thread uint16_t *buf;
    static __thread int64_t size;
    if (size < elems) {
        free(buf);
        buf = aligned_alloc(64, (size_t)((elems * 2 + 63) / 64 * 64));
        size = buf ? elems : 0;
    }
    return buf;
}

/* Rows m0 .. m1 - 1 of x [., K] float32 (rows ldx apart) rounded to bf16 to nearest even into
 * xb (row m at xb + m * K). */
static inline void kv_dp_pack_rows(const float *x, int64_t ldx, int64_t K, int64_t m0, int64_t m1, uint16_t *xb) {
    for (int64_t m = m0; m < m1; m++)
        for (int64_t k = 0; k < K; k += 32)
            _mm512_storeu_si512(xb + m * K + k, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + m * ldx + k + 16),
                                                                             _mm512_loadu_ps(x + m * ldx + k)));
}

/* Sixteen sums at once: lane 4 e + t of the result is the sum of v[4 t + e]'s 16 lanes, each in the
 * one tree ((a0 + a2) + (a1 + a3)), a_j = (v[j] + v[j + 8]) + (v[j + 4] + v[j + 12]) (the tree of
 * GCC's _mm512_reduce_add_ps), whatever the other fifteen hold: 15 adds and 30 shuffles where one
 * sum at a time took ~8 instructions each. */
static inline __m512 dp_reduce16(const __m512 v[16]) {
    __m512 w[8], x[4], y[2];
    for (int i = 0; i < 8; i++)   /* lanes j + 8 onto j */
        w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++)   /* j + 4 onto j: a_0 .. a_3, one vector per 128-bit lane */
        x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++) {   /* a0 + a2, a1 + a3 */
        const __m512d p = _mm512_castps_pd(x[2 * i]), q = _mm512_castps_pd(x[2 * i + 1]);
        y[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(p, q)), _mm512_castpd_ps(_mm512_unpackhi_pd(p, q)));
    }
    return _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_ps(y[0], y[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

/* Weight rows j < NW (w + j K, widened) against rows r < R of x (x + r K): one chain per (j, r) over
 * K's blocks, then dp_reduce16 of the 16 (absent ones zero): lane 4 r + j of the result. */
#define KV_DEFINE_DP(NW, R)                                                                               \
    static inline __m512 dp_w##NW##_r##R(const uint16_t *w, const uint16_t *x, int64_t K) {               \
        __m512 a[16];                                                                                     \
        for (int i = 0; i < 16; i++) a[i] = _mm512_setzero_ps();                                          \
        for (int64_t k = 0; k < K; k += 32) {                                                             \
            __m512bh wv[NW];                                                                              \
            for (int j = 0; j < NW; j++) wv[j] = (__m512bh)_mm512_loadu_si512(w + j * K + k);             \
            for (int r = 0; r < R; r++) {                                                                 \
                const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + r * K + k);                          \
                for (int j = 0; j < NW; j++) a[4 * j + r] = _mm512_dpbf16_ps(a[4 * j + r], wv[j], xv);    \
            }                                                                                             \
        }                                                                                                 \
        return dp_reduce16(a);                                                                            \
    }
KV_DEFINE_DP(4, 4) KV_DEFINE_DP(4, 3) KV_DEFINE_DP(4, 2) KV_DEFINE_DP(4, 1)
KV_DEFINE_DP(3, 4) KV_DEFINE_DP(3, 3) KV_DEFINE_DP(3, 2) KV_DEFINE_DP(3, 1)
KV_DEFINE_DP(2, 4) KV_DEFINE_DP(2, 3) KV_DEFINE_DP(2, 2) KV_DEFINE_DP(2, 1)
KV_DEFINE_DP(1, 4) KV_DEFINE_DP(1, 3) KV_DEFINE_DP(1, 2) KV_DEFINE_DP(1, 1)

static inline __m512 dp_tile(int nw, int R, const uint16_t *w, const uint16_t *x, int64_t K) {
#define KV_DP_CASE(NW)                                                      \
    switch (R) {                                                            \
    case 4: return dp_w##NW##_r4(w, x, K);                                  \
    case 3: return dp_w##NW##_r3(w, x, K);                                  \
    case 2: return dp_w##NW##_r2(w, x, K);                                  \
    default: return dp_w##NW##_r1(w, x, K);                                 \
    }
    switch (nw) {
    case 4: KV_DP_CASE(4)
    case 3: KV_DP_CASE(3)
    case 2: KV_DP_CASE(2)
    default: KV_DP_CASE(1)
    }
#undef KV_DP_CASE
}

/* The contract at the top; xb from kv_dp_pack_rows of the M rows. Returns 0, or -1 when the
 * widening buffer could not be allocated. */
static inline int kv_dp_rows(const kv_matrix *m, const uint16_t *xb, int64_t M, int64_t n0, int64_t n1, float *y,
                             int64_t ldy) {
    const int64_t K = m->K;
    uint16_t *wb = kv_bf16_buffer(KV_DP_W * K);
    if (!wb) return -1;
    for (int64_t n = n0; n < n1; n += KV_DP_W) {
        const int nw = (int)(n1 - n < KV_DP_W ? n1 - n : KV_DP_W);
        const __mmask8 cols = (__mmask8)((1u << nw) - 1);
        /* finish_dot as vectors: the int8 scale, then the bias, per channel (the same two roundings) */
        const __m128 scale = m->fmt == KV_INT8 ? _mm_maskz_loadu_ps(cols, m->scale + n) : _mm_set1_ps(1.0f);
        const __m128 bias = m->bias ? _mm_maskz_loadu_ps(cols, m->bias + n) : _mm_setzero_ps();
        prefetch_rows(m, n + 2 * KV_DP_W, nw);   /* the next group but one */
        for (int j = 0; j < nw; j++) kv_bf16_blocks(m, n + j, 0, K / 32, wb + j * K, 32);
        for (int64_t m0 = 0; m0 < M; m0 += KV_DP_R) {
            const int R = (int)(M - m0 < KV_DP_R ? M - m0 : KV_DP_R);
            float sums[16];
            _mm512_storeu_ps(sums, dp_tile(nw, R, wb, xb + m0 * K, K));
            for (int r = 0; r < R; r++) {
                __m128 v = _mm_loadu_ps(sums + 4 * r);
                if (m->fmt == KV_INT8) v = _mm_mul_ps(v, scale);
                if (m->bias) v = _mm_add_ps(v, bias);
                _mm_mask_storeu_ps(y + (m0 + r) * ldy + n - n0, cols, v);
            }
        }
    }
    return 0;
}

#else
#define KV_HAVE_DPBF16 0
#endif

#endif
