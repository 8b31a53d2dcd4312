/* kvfleet CPU kernels: the float32 linear layer for any number of rows (kv_matrix_rows), built on
 * the formats and one-row dot products of cpu_gemv_m1.h; shared by the weight-only quantized
 * linear layers (cpu_woq.c) and the fused decoder (cpu_decoder.c).
 *
 * Contract: y[m * ldy + (n - n0)] = finish_dot(x[m, :] . dequant(w)[n, :]) for m < M, n0 <= n < n1,
 * every row summed in exactly its format's one-row order (cpu_gemv_m1.h), so a row's result does
 * not depend on the rest of the step (bitwise batch-invariant decode). With several rows of x the
 * weights are widened in registers for four rows at a time (up to KV_FEW_ROWS rows) or once into a
 * buffer (more) and summed against every row.
 */
#ifndef KVFLEET_CPU_GEMV_H
#define KVFLEET_CPU_GEMV_H

#include "cpu_gemv_m1.h"

/* Rows of x up to which kv_matrix_rows widens weights in registers (few_rows); above, into a buffer
 * for the tiles (canon_tile). Measured on a Xeon with AMX: at 8 rows the register form was 13 %
 * faster a decode step, at 48 the buffer form 13 %. */
#define KV_FEW_ROWS 8

/* ---- Several rows of x: each row summed exactly as the one-row helper sums it ----
 * With M > 1 rows, each weight row is widened once to float32 (a K-float buffer on the stack, in
 * L1) and summed against every row of x with the arithmetic of its format's one-row helper: the
 * same chains over the same k, the same final reduction. So a row's result is bitwise the same
 * whatever else is in the step (batch-invariant decode), and the widening (int4's unpacking above
 * all) is paid once per weight for all M rows, where it used to be paid once per four rows. */

/* The tiles below sum NW weight rows (w[j], float32) against R rows of x, out[j * R + r], each sum in
 * the one-row order; they differ only in how many sums share a load.
 *
 * The 8-wide order (i4_m1; every format's one-row helper in the avx2 build): four chains over 32-weight
 * blocks (chain c takes k = 32b + 8c .. 32b + 8c + 7), then 8-weight blocks into chain 0, then
 * hsum((a0 + a1) + (a2 + a3)). */
#define KV_DEFINE_CANON8(NW, R)                                                                          \
    static inline void canon8_w##NW##_r##R(const float *const *w, const float *x, int64_t ldx, int64_t K,  \
                                          float *out) {                                                  \
        __m256 a[NW][R][4];                                                                              \
        for (int j = 0; j < NW; j++)                                                                     \
            for (int r = 0; r < R; r++)                                                                  \
                for (int c = 0; c < 4; c++) a[j][r][c] = _mm256_setzero_ps();                            \
        int64_t k = 0;                                                                                   \
        for (; k + 32 <= K; k += 32)                                                                     \
            for (int c = 0; c < 4; c++)                                                                  \
                for (int r = 0; r < R; r++) {                                                            \
                    const __m256 xv = _mm256_loadu_ps(x + r * ldx + k + 8 * c);                          \
                    for (int j = 0; j < NW; j++)                                                         \
                        a[j][r][c] = _mm256_fmadd_ps(_mm256_loadu_ps(w[j] + k + 8 * c), xv, a[j][r][c]); \
                }                                                                                        \
        for (; k + 8 <= K; k += 8)                                                                       \
            for (int r = 0; r < R; r++) {                                                                \
                const __m256 xv = _mm256_loadu_ps(x + r * ldx + k);                                      \
                for (int j = 0; j < NW; j++)                                                             \
                    a[j][r][0] = _mm256_fmadd_ps(_mm256_loadu_ps(w[j] + k), xv, a[j][r][0]);             \
            }                                                                                            \
        for (int j = 0; j < NW; j++)                                                                     \
            for (int r = 0; r < R; r++)                                                                  \
                out[j * R + r] = hsum(_mm256_add_ps(_mm256_add_ps(a[j][r][0], a[j][r][1]),               \
                                                    _mm256_add_ps(a[j][r][2], a[j][r][3])));             \
    }

#ifdef __AVX512F__
/* The 16-wide order of the avx512 one-row helpers (KV_DEFINE_M1; not i4_m1): four chains over
 * 64-weight blocks, 16-weight blocks into chain 0, an 8-weight tail summed on its own, then
 * reduce_add((a0 + a1) + (a2 + a3)) + tail. */
#define KV_DEFINE_CANON16(NW, R)                                                                         \
    static inline void canon16_w##NW##_r##R(const float *const *w, const float *x, int64_t ldx, int64_t K, \
                                           float *out) {                                                 \
        __m512 a[NW][R][4];                                                                              \
        for (int j = 0; j < NW; j++)                                                                     \
            for (int r = 0; r < R; r++)                                                                  \
                for (int c = 0; c < 4; c++) a[j][r][c] = _mm512_setzero_ps();                            \
        int64_t k = 0;                                                                                   \
        for (; k + 64 <= K; k += 64)                                                                     \
            for (int c = 0; c < 4; c++)                                                                  \
                for (int r = 0; r < R; r++) {                                                            \
                    const __m512 xv = _mm512_loadu_ps(x + r * ldx + k + 16 * c);                         \
                    for (int j = 0; j < NW; j++)                                                         \
                        a[j][r][c] = _mm512_fmadd_ps(_mm512_loadu_ps(w[j] + k + 16 * c), xv, a[j][r][c]); \
                }                                                                                        \
        for (; k + 16 <= K; k += 16)                                                                     \
            for (int r = 0; r < R; r++) {                                                                \
                const __m512 xv = _mm512_loadu_ps(x + r * ldx + k);                                      \
                for (int j = 0; j < NW; j++)                                                             \
                    a[j][r][0] = _mm512_fmadd_ps(_mm512_loadu_ps(w[j] + k), xv, a[j][r][0]);             \
            }                                                                                            \
        for (int j = 0; j < NW; j++)                                                                     \
            for (int r = 0; r < R; r++) {                                                                \
                float tail = 0.0f;                                                                       \
                if (k < K) tail = hsum(_mm256_mul_ps(_mm256_loadu_ps(w[j] + k), _mm256_loadu_ps(x + r * ldx + k))); \
                out[j * R + r] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a[j][r][0], a[j][r][1]), \
                                                                    _mm512_add_ps(a[j][r][2], a[j][r][3]))) + tail; \
            }                                                                                            \
    }
/* 3 weight rows x 2 rows of x: 24 accumulators of the 32 registers; each x load serves three
 * weight rows, so x (tens of KiB, from L2) is read a third as often as one row at a time. */
enum { KV_TILE_W = 3, KV_TILE_R = 2 };
KV_DEFINE_CANON16(3, 2) KV_DEFINE_CANON16(3, 1) KV_DEFINE_CANON16(2, 2) KV_DEFINE_CANON16(2, 1)
KV_DEFINE_CANON16(1, 2) KV_DEFINE_CANON16(1, 1)
KV_DEFINE_CANON8(3, 2) KV_DEFINE_CANON8(3, 1) KV_DEFINE_CANON8(2, 2) KV_DEFINE_CANON8(2, 1)
KV_DEFINE_CANON8(1, 2) KV_DEFINE_CANON8(1, 1)
#define KV_TILE(NW, R) canon16_w##NW##_r##R
#define KV_TILE8(NW, R) canon8_w##NW##_r##R
#else
/* 1 weight row x 3 rows of x: 12 accumulators of the 16 registers. */
enum { KV_TILE_W = 1, KV_TILE_R = 3 };
KV_DEFINE_CANON8(1, 3) KV_DEFINE_CANON8(1, 2) KV_DEFINE_CANON8(1, 1)
#define KV_TILE(NW, R) canon8_w##NW##_r##R
#endif

/* out[j * R + r] = x[r, :] . w[j] for nw <= KV_TILE_W weight rows and R <= KV_TILE_R rows of x, in the
 * 16-wide order (wide, avx512 build) or the 8-wide one. */
static inline void canon_tile(int wide, int nw, int R, const float *const *w, const float *x, int64_t ldx,
                              int64_t K, float *out) {
#ifdef __AVX512F__
    if (!wide) {   /* int4: i4_m1's 8-wide order */
        if (nw == 3) { if (R == 2) KV_TILE8(3, 2)(w, x, ldx, K, out); else KV_TILE8(3, 1)(w, x, ldx, K, out); return; }
        if (nw == 2) { if (R == 2) KV_TILE8(2, 2)(w, x, ldx, K, out); else KV_TILE8(2, 1)(w, x, ldx, K, out); return; }
        if (R == 2) KV_TILE8(1, 2)(w, x, ldx, K, out); else KV_TILE8(1, 1)(w, x, ldx, K, out);
        return;
    }
    if (nw == 3) { if (R == 2) KV_TILE(3, 2)(w, x, ldx, K, out); else KV_TILE(3, 1)(w, x, ldx, K, out); return; }
    if (nw == 2) { if (R == 2) KV_TILE(2, 2)(w, x, ldx, K, out); else KV_TILE(2, 1)(w, x, ldx, K, out); return; }
    if (R == 2) KV_TILE(1, 2)(w, x, ldx, K, out); else KV_TILE(1, 1)(w, x, ldx, K, out);
#else
    (void)wide;
    (void)nw;
    if (R == 3) KV_TILE(1, 3)(w, x, ldx, K, out);
    else if (R == 2) KV_TILE(1, 2)(w, x, ldx, K, out);
    else KV_TILE(1, 1)(w, x, ldx, K, out);
#endif
}

/* A few rows of x (R <= 4) against one weight row widened in registers, in the one-row order: the
 * weights are widened once per block for all R rows, without the buffer's store and reload (faster
 * than widen_row + canon_tile up to ~8 rows). Same arithmetic as the tiles, bit for bit. */
#define KV_DEFINE_FEW8(NAME, T, LOAD, R)                                                                \
    static inline void NAME##_r##R(const T *w, const float *x, int64_t ldx, int64_t K, float *out) {    \
        __m256 a[R][4];                                                                                 \
        for (int r = 0; r < R; r++)                                                                     \
            for (int c = 0; c < 4; c++) a[r][c] = _mm256_setzero_ps();                                  \
        int64_t k = 0;                                                                                  \
        for (; k + 32 <= K; k += 32)                                                                    \
            for (int c = 0; c < 4; c++) {                                                               \
                const __m256 wc = LOAD(w + k + 8 * c);                                                  \
                for (int r = 0; r < R; r++)                                                             \
                    a[r][c] = _mm256_fmadd_ps(wc, _mm256_loadu_ps(x + r * ldx + k + 8 * c), a[r][c]);   \
            }                                                                                           \
        for (; k + 8 <= K; k += 8) {                                                                    \
            const __m256 wc = LOAD(w + k);                                                              \
            for (int r = 0; r < R; r++) a[r][0] = _mm256_fmadd_ps(wc, _mm256_loadu_ps(x + r * ldx + k), a[r][0]); \
        }                                                                                               \
        for (int r = 0; r < R; r++)                                                                     \
            out[r] = hsum(_mm256_add_ps(_mm256_add_ps(a[r][0], a[r][1]), _mm256_add_ps(a[r][2], a[r][3]))); \
    }

/* int4 (i4_m1's order): per 32-weight block, widen_i4 once for all R rows. */
#define KV_DEFINE_FEW_I4(R)                                                                             \
    static inline void i4_few_r##R(const uint8_t *w, const float *s, const float *t, int64_t G, const float *x, \
                                   int64_t ldx, int64_t K, float *out) {                                \
        __m256 a[R][4];                                                                                 \
        for (int r = 0; r < R; r++)                                                                     \
            for (int c = 0; c < 4; c++) a[r][c] = _mm256_setzero_ps();                                  \
        for (int64_t k = 0; k < K; k += 32) {                                                           \
            __m256 wv[4];                                                                               \
            widen_i4(w + k / 2, _mm256_set1_ps(s[gidx(k, G)]), _mm256_set1_ps(t[gidx(k, G)]), wv);                \
            for (int c = 0; c < 4; c++)                                                                 \
                for (int r = 0; r < R; r++)                                                             \
                    a[r][c] = _mm256_fmadd_ps(wv[c], _mm256_loadu_ps(x + r * ldx + k + 8 * c), a[r][c]); \
        }                                                                                               \
        for (int r = 0; r < R; r++)                                                                     \
            out[r] = hsum(_mm256_add_ps(_mm256_add_ps(a[r][0], a[r][1]), _mm256_add_ps(a[r][2], a[r][3]))); \
    }
KV_DEFINE_FEW_I4(1) KV_DEFINE_FEW_I4(2) KV_DEFINE_FEW_I4(3) KV_DEFINE_FEW_I4(4)
#ifdef __AVX512F__
/* Six rows in one pass (24 of the 32 registers): a decode step verifying a speculative draft has
 * 1 + k rows of one sequence (k = 4 by default), which four-row passes widened twice. */
KV_DEFINE_FEW_I4(5) KV_DEFINE_FEW_I4(6)
enum { KV_FEW_I4_CHUNK = 6 };
#else
enum { KV_FEW_I4_CHUNK = 4 };
#endif

/* Grouped int8 (i8g_m1's order): each weight block dequantized once for all R rows. */
#ifdef __AVX512F__
#define KV_DEFINE_FEW_I8G(R)                                                                            \
    KV_ALWAYS_INLINE void i8g_few_body_r##R(const int8_t *w, const uint8_t *hb, const float *s, const float *t, \
                                            int64_t G, const float *x, int64_t ldx, int64_t K, float *out, \
                                            int SH, int Q5) {                                           \
        __m512 a[R][4];                                                                                 \
        for (int r = 0; r < R; r++)                                                                     \
            for (int c = 0; c < 4; c++) a[r][c] = _mm512_setzero_ps();                                  \
        int64_t k = 0;                                                                                  \
        for (; k + 64 <= K; k += 64)                                                                    \
            for (int c = 0; c < 4; c++) {                                                               \
                const __m512 wc = dq_i8g_16(w, hb, k + 16 * c, s, t, gidx(k + 16 * c, G), SH, Q5);      \
                for (int r = 0; r < R; r++)                                                             \
                    a[r][c] = _mm512_fmadd_ps(wc, _mm512_loadu_ps(x + r * ldx + k + 16 * c), a[r][c]);  \
            }                                                                                           \
        for (; k + 16 <= K; k += 16) {                                                                  \
            const __m512 wc = dq_i8g_16(w, hb, k, s, t, gidx(k, G), SH, Q5);                            \
            for (int r = 0; r < R; r++) a[r][0] = _mm512_fmadd_ps(wc, _mm512_loadu_ps(x + r * ldx + k), a[r][0]); \
        }                                                                                               \
        for (int r = 0; r < R; r++)                                                                     \
            out[r] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a[r][0], a[r][1]),                \
                                                        _mm512_add_ps(a[r][2], a[r][3])));              \
    }
#else
#define KV_DEFINE_FEW_I8G(R)                                                                            \
    KV_ALWAYS_INLINE void i8g_few_body_r##R(const int8_t *w, const uint8_t *hb, const float *s, const float *t, \
                                            int64_t G, const float *x, int64_t ldx, int64_t K, float *out, \
                                            int SH, int Q5) {                                           \
        __m256 a[R][4];                                                                                 \
        for (int r = 0; r < R; r++)                                                                     \
            for (int c = 0; c < 4; c++) a[r][c] = _mm256_setzero_ps();                                  \
        for (int64_t k = 0; k + 32 <= K; k += 32)                                                       \
            for (int c = 0; c < 4; c++) {                                                               \
                const __m256 wc = dq_i8g_8(w, hb, k + 8 * c, s, t, gidx(k + 8 * c, G), SH, Q5);         \
                for (int r = 0; r < R; r++)                                                             \
                    a[r][c] = _mm256_fmadd_ps(wc, _mm256_loadu_ps(x + r * ldx + k + 8 * c), a[r][c]);   \
            }                                                                                           \
        for (int r = 0; r < R; r++)                                                                     \
            out[r] = hsum(_mm256_add_ps(_mm256_add_ps(a[r][0], a[r][1]), _mm256_add_ps(a[r][2], a[r][3]))); \
    }
#endif
#define KV_DEFINE_FEW_I8G_CALL(R)                                                                       \
    KV_DEFINE_FEW_I8G(R)                                                                                \
    static inline void i8g_few_r##R(const int8_t *w, const uint8_t *hb, const float *s, const float *t, int64_t G, \
                                    const float *x, int64_t ldx, int64_t K, float *out) {               \
        if (hb && t) i8g_few_body_r##R(w, hb, s, t, G, x, ldx, K, out, 1, 1);                           \
        else if (hb) i8g_few_body_r##R(w, hb, s, t, G, x, ldx, K, out, 0, 1);                           \
        else if (t) i8g_few_body_r##R(w, hb, s, t, G, x, ldx, K, out, 1, 0);                            \
        else i8g_few_body_r##R(w, hb, s, t, G, x, ldx, K, out, 0, 0);                                   \
    }
KV_DEFINE_FEW_I8G_CALL(1) KV_DEFINE_FEW_I8G_CALL(2) KV_DEFINE_FEW_I8G_CALL(3) KV_DEFINE_FEW_I8G_CALL(4)

#ifdef __AVX512F__
#define KV_DEFINE_FEW16(NAME, T, LOAD, LOAD16, R)                                                       \
    static inline void NAME##_r##R(const T *w, const float *x, int64_t ldx, int64_t K, float *out) {    \
        __m512 a[R][4];                                                                                 \
        for (int r = 0; r < R; r++)                                                                     \
            for (int c = 0; c < 4; c++) a[r][c] = _mm512_setzero_ps();                                  \
        int64_t k = 0;                                                                                  \
        for (; k + 64 <= K; k += 64)                                                                    \
            for (int c = 0; c < 4; c++) {                                                               \
                const __m512 wc = LOAD16(w + k + 16 * c);                                               \
                for (int r = 0; r < R; r++)                                                             \
                    a[r][c] = _mm512_fmadd_ps(wc, _mm512_loadu_ps(x + r * ldx + k + 16 * c), a[r][c]);  \
            }                                                                                           \
        for (; k + 16 <= K; k += 16) {                                                                  \
            const __m512 wc = LOAD16(w + k);                                                            \
            for (int r = 0; r < R; r++) a[r][0] = _mm512_fmadd_ps(wc, _mm512_loadu_ps(x + r * ldx + k), a[r][0]); \
        }                                                                                               \
        for (int r = 0; r < R; r++) {                                                                   \
            float tail = 0.0f;                                                                          \
            if (k < K) tail = hsum(_mm256_mul_ps(LOAD(w + k), _mm256_loadu_ps(x + r * ldx + k)));       \
            out[r] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a[r][0], a[r][1]),                \
                                                        _mm512_add_ps(a[r][2], a[r][3]))) + tail;       \
        }                                                                                               \
    }
#define KV_FEW(NAME, T, LOAD, LOAD16) KV_DEFINE_FEW16(NAME, T, LOAD, LOAD16, 1) KV_DEFINE_FEW16(NAME, T, LOAD, LOAD16, 2) \
    KV_DEFINE_FEW16(NAME, T, LOAD, LOAD16, 3) KV_DEFINE_FEW16(NAME, T, LOAD, LOAD16, 4)
KV_FEW(f32_few, float, _mm256_loadu_ps, _mm512_loadu_ps)
KV_FEW(i8_few, int8_t, widen_i8, widen_i8_16)
KV_FEW(bf16_few, uint16_t, widen_bf16, widen_bf16_16)
#else
#define KV_FEW(NAME, T, LOAD, LOAD16) KV_DEFINE_FEW8(NAME, T, LOAD, 1) KV_DEFINE_FEW8(NAME, T, LOAD, 2) \
    KV_DEFINE_FEW8(NAME, T, LOAD, 3) KV_DEFINE_FEW8(NAME, T, LOAD, 4)
KV_FEW(f32_few, float, _mm256_loadu_ps, _mm256_loadu_ps)
KV_FEW(i8_few, int8_t, widen_i8, widen_i8)
KV_FEW(bf16_few, uint16_t, widen_bf16, widen_bf16)
#endif

/* out[r] = x[r, :] . w_n for R <= 4 rows (KV_DEFINE_FEW*), R <= 6 for int4 in the avx512 build. */
KV_ALWAYS_INLINE void few_rows(const kv_matrix *m, int64_t n, const float *x, int64_t ldx, int R, float *out) {
    const int64_t K = m->K, groups = m->group ? K / m->group : 0;
    float sb[groups + 1], tb[groups + 1];   /* float16 scales and shifts widened (kv_groups) */
    const float *sc = m->fmt == KV_INT4 || m->fmt == KV_INT8G ? kv_groups(m, m->scale, n, 0, groups, sb) : NULL;
    const float *sh = m->fmt == KV_INT4 || m->fmt == KV_INT8G ? kv_groups(m, m->shift, n, 0, groups, tb) : NULL;
#define KV_FEW_CALL(RC)                                                                                   \
    switch (m->fmt) {                                                                                     \
    case KV_FP32: f32_few_r##RC((const float *)m->w + n * K, x, ldx, K, out); break;                      \
    case KV_INT8: i8_few_r##RC((const int8_t *)m->w + n * K, x, ldx, K, out); break;                      \
    case KV_BF16: bf16_few_r##RC((const uint16_t *)m->w + n * K, x, ldx, K, out); break;                  \
    case KV_INT8G: i8g_few_r##RC(kv_i8g_row(m, n), kv_hb_row(m, n), sc, sh, m->group, x, ldx, K, out); break; \
    default: i4_few_r##RC((const uint8_t *)m->w + n * (K / 2), sc, sh, m->group, x, ldx, K, out);         \
    }
#ifdef __AVX512F__
    if (R == 6 || R == 5) {   /* int4 only (KV_FEW_I4_CHUNK) */
        const uint8_t *w = (const uint8_t *)m->w + n * (K / 2);
        if (R == 6) i4_few_r6(w, sc, sh, m->group, x, ldx, K, out);
        else i4_few_r5(w, sc, sh, m->group, x, ldx, K, out);
        return;
    }
#endif
    if (R == 4) { KV_FEW_CALL(4) }
    else if (R == 3) { KV_FEW_CALL(3) }
    else if (R == 2) { KV_FEW_CALL(2) }
    else { KV_FEW_CALL(1) }
#undef KV_FEW_CALL
}

/* Weight row n of m widened to float32 into buf (K floats); fp32 rows are returned in place. The
 * values are the one-row helpers' (int8 unscaled, int4 dequantized with the same FMA). */
KV_ALWAYS_INLINE const float *widen_row(const kv_matrix *m, int64_t n, float *buf) {
    const int64_t K = m->K;
    if (m->fmt == KV_FP32) return (const float *)m->w + n * K;
    const int64_t groups = m->group ? K / m->group : 0;
    float sb[groups + 1], tb[groups + 1];
    if (m->fmt == KV_INT4) {
        const uint8_t *w = (const uint8_t *)m->w + n * (K / 2);
        const int64_t G = m->group;
        const float *s = kv_groups(m, m->scale, n, 0, groups, sb), *t = kv_groups(m, m->shift, n, 0, groups, tb);
        for (int64_t k = 0; k < K; k += 32) {
            __m256 wv[4];
            widen_i4(w + k / 2, _mm256_set1_ps(s[gidx(k, G)]), _mm256_set1_ps(t[gidx(k, G)]), wv);
            for (int c = 0; c < 4; c++) _mm256_storeu_ps(buf + k + 8 * c, wv[c]);
        }
        return buf;
    }
    int64_t k = 0;
    if (m->fmt == KV_INT8) {
        const int8_t *w = (const int8_t *)m->w + n * K;
        for (; k + 8 <= K; k += 8) _mm256_storeu_ps(buf + k, widen_i8(w + k));
    } else if (m->fmt == KV_INT8G) {
        const int8_t *w = kv_i8g_row(m, n);
        const uint8_t *hb = kv_hb_row(m, n);
        const float *s = kv_groups(m, m->scale, n, 0, groups, sb), *t = kv_groups(m, m->shift, n, 0, groups, tb);
        const int64_t G = m->group;
        if (hb && t) for (; k + 8 <= K; k += 8) _mm256_storeu_ps(buf + k, dq_i8g_8(w, hb, k, s, t, gidx(k, G), 1, 1));
        else if (hb) for (; k + 8 <= K; k += 8) _mm256_storeu_ps(buf + k, dq_i8g_8(w, hb, k, s, t, gidx(k, G), 0, 1));
        else if (t) for (; k + 8 <= K; k += 8) _mm256_storeu_ps(buf + k, dq_i8g_8(w, hb, k, s, t, gidx(k, G), 1, 0));
        else for (; k + 8 <= K; k += 8) _mm256_storeu_ps(buf + k, dq_i8g_8(w, hb, k, s, t, gidx(k, G), 0, 0));
    } else {
        const uint16_t *w = (const uint16_t *)m->w + n * K;
        for (; k + 8 <= K; k += 8) _mm256_storeu_ps(buf + k, widen_bf16(w + k));
    }
    return buf;
}

/* A row's finished output: the int8 scale, then the bias (one expression for every path). */
static inline float finish_dot(const kv_matrix *m, int64_t n, float dot) {
    const float scaled = m->fmt == KV_INT8 ? dot * m->scale[n] : dot;
    return m->bias ? scaled + m->bias[n] : scaled;
}

/* y[m * ldy + (n - n0)] = x[m, :] . dequant(w)[n, :] + bias[n] for m < M, n0 <= n < n1. The
 * weights are read from memory once, in order, row after row. Short quantized rows (a few hundred
 * bytes) are prefetched ahead in software: without it one core streamed int8 weights at about
 * half the rate (EPYC, docs/performance.md). With several rows of x, each weight row is widened
 * once and summed against all of them in the one-row order (above). */
static inline void kv_matrix_rows(const kv_matrix *m, const float *x, int64_t ldx, int64_t M, int64_t n0,
                                  int64_t n1, float *y, int64_t ldy) {
    const int64_t K = m->K, G = m->group, groups = m->fmt == KV_INT4 ? K / G : 0;
    int64_t n = n0;
    prefetch_rows(m, n0, n1 - n0 < 8 ? n1 - n0 : 8);
    if (M == 1) {
        /* One weight row at a time, so a thread's weights are one front-to-back stream. The
         * quantized rows (a few hundred bytes) are prefetched ~4 KiB ahead (int8 and bf16 inside i8_m1 / bf16_m1;
         * int4 row by row, its weights only: the hardware prefetcher follows the small scale and
         * shift streams); fp32 rows are long enough for the hardware prefetcher, which software
         * prefetch only disturbed. */
        if (m->fmt == KV_FP32) {
            const float *w = (const float *)m->w;
            for (; n < n1; n++) y[n - n0] = finish_dot(m, n, f32_m1(x, K, w + n * K));
        } else if (m->fmt == KV_INT8) {
            const int8_t *w = (const int8_t *)m->w;
            for (; n < n1; n++) y[n - n0] = finish_dot(m, n, i8_m1(x, K, w + n * K));
        } else if (m->fmt == KV_BF16) {
            const uint16_t *w = (const uint16_t *)m->w;
            for (; n < n1; n++) y[n - n0] = finish_dot(m, n, bf16_m1(x, K, w + n * K));
        } else if (m->fmt == KV_INT8G) {
            float sb[K / G], tb[K / G];
            for (; n < n1; n++)
                y[n - n0] = finish_dot(m, n, i8g_m1(x, K, kv_i8g_row(m, n), kv_hb_row(m, n),
                                                    kv_groups(m, m->scale, n, 0, K / G, sb),
                                                    kv_groups(m, m->shift, n, 0, K / G, tb), G));
        } else {
            const uint8_t *w = (const uint8_t *)m->w;
            const int64_t half = K / 2, ahead = 4096 / half + 1;
            float sb[groups], tb[groups];
            for (; n < n1; n++) {
                prefetch_span(w + (n + ahead) * half, half);
                y[n - n0] = finish_dot(m, n, i4_m1(x, K, w + n * half, kv_groups(m, m->scale, n, 0, groups, sb),
                                                   kv_groups(m, m->shift, n, 0, groups, tb), G));
            }
        }
        return;
    }
    if (M <= KV_FEW_ROWS) {   /* widened in registers, four rows at a time (int4 on avx512: six) */
        const int64_t chunk = m->fmt == KV_INT4 ? KV_FEW_I4_CHUNK : 4;
        float few[6];
        for (; n < n1; n++) {
            if (n + 8 < n1) prefetch_rows(m, n + 8, 1);
            for (int64_t m0 = 0; m0 < M; m0 += chunk) {
                const int R = (int)(M - m0 < chunk ? M - m0 : chunk);
                few_rows(m, n, x + m0 * ldx, ldx, R, few);
                for (int r = 0; r < R; r++) y[(m0 + r) * ldy + n - n0] = finish_dot(m, n, few[r]);
            }
        }
        return;
    }
    const int wide = m->fmt != KV_INT4;   /* the one-row helpers' width (avx512 build): int4's is 8 */
    float buf[KV_TILE_W * K];
    float out[KV_TILE_W * KV_TILE_R];
    const float *wf[KV_TILE_W];
    for (; n < n1; n += KV_TILE_W) {
        const int nw = (int)(n1 - n < KV_TILE_W ? n1 - n : KV_TILE_W);
        if (n + 8 < n1) prefetch_rows(m, n + 8, nw);
        for (int j = 0; j < nw; j++) wf[j] = widen_row(m, n + j, buf + j * K);
        for (int64_t m0 = 0; m0 < M; m0 += KV_TILE_R) {
            const int R = (int)(M - m0 < KV_TILE_R ? M - m0 : KV_TILE_R);
            canon_tile(wide, nw, R, wf, x + m0 * ldx, ldx, K, out);
            for (int j = 0; j < nw; j++)
                for (int r = 0; r < R; r++) y[(m0 + r) * ldy + n + j - n0] = finish_dot(m, n + j, out[j * R + r]);
        }
    }
}

#endif
