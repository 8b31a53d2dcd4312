/* kvfleet CPU kernels: the dot-product building blocks of the weight-only quantized linear
 * layers (cpu_woq.c) and of the fused decoder (cpu_decoder.c), x86-64 AVX2 + FMA.
 *
 * Every helper computes raw sums (no scale, no bias) of rows of x (float32, rows `ldx` floats
 * apart, K inputs) against weight rows in one of three formats:
 *
 *   fp32: w [N, K] float32, row-major
 *   int8: w [N, K] int8 row-major; dequant(w)[n, k] = w[n, k] * scale[n]  (the caller scales)
 *   int4: w [N, K/2] uint8; per row, block b of 32 weights (k = 32b .. 32b+31) is 16 bytes:
 *         byte j holds k = 32b + j in its low nibble and k = 32b + 16 + j in its high nibble;
 *         dequant(w)[n, k] = q * scale[n, k / G] + shift[n, k / G], q in 0..15, G the group size
 *         (a multiple of 32); the int4 helpers apply scale and shift themselves.
 *
 * K is a multiple of 32 (int4) or 8 (fp32, bf16, int8). A decode step is bound by reading weights:
 * each weight is loaded once, widened to float32 in registers and used for up to 4 rows of x.
 * At one row (the _m1 helpers) each weight row is summed front to back with four independent
 * FMA chains, so a thread reads its weights as one sequential stream; reading four rows at once
 * (four streams a few hundred bytes apart) defeated the hardware prefetcher and halved the rate
 * (docs/performance.md, "One sequential stream per thread").
 */
#ifndef KVFLEET_CPU_GEMV_H
#define KVFLEET_CPU_GEMV_H

#include <immintrin.h>
#include <stdint.h>
#include <stddef.h>

enum { KV_FP32 = 0, KV_INT8 = 1, KV_INT4 = 2, KV_BF16 = 3 };

static inline float hsum(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

static inline __m256 widen_i8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

/* 8 bf16 weights widened to float32: exact (bf16 is the high half of a float32). */
static inline __m256 widen_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* 32 int4 weights (16 bytes) widened to four float vectors, dequantized: q * s + t (out[i] holds
 * k = 8i .. 8i + 7). The 16 bytes are broadcast to both 128-bit lanes and one in-lane byte
 * shuffle puts byte j in dword j (lane 0: bytes 0-3, lane 1: bytes 4-7; then 8-15), so each byte's
 * low nibble (k = j) and high nibble (k = 16 + j) come out with an and and a shift. Two shuffles
 * per 32 weights: the per-8-weight byte-to-dword widening (vpmovzxbd) kept the shuffle port
 * busy and held one core to ~7 G weights/s (EPYC, docs/performance.md). */
static inline void widen_i4(const uint8_t *p, __m256 s, __m256 t, __m256 out[4]) {
    const __m256i bytes = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)p));
    const __m256i lo_idx = _mm256_setr_epi8(0, -1, -1, -1, 1, -1, -1, -1, 2, -1, -1, -1, 3, -1, -1, -1,
                                            4, -1, -1, -1, 5, -1, -1, -1, 6, -1, -1, -1, 7, -1, -1, -1);
    const __m256i hi_idx = _mm256_setr_epi8(8, -1, -1, -1, 9, -1, -1, -1, 10, -1, -1, -1, 11, -1, -1, -1,
                                            12, -1, -1, -1, 13, -1, -1, -1, 14, -1, -1, -1, 15, -1, -1, -1);
    const __m256i mask = _mm256_set1_epi32(0x0F);
    __m256i a = _mm256_shuffle_epi8(bytes, lo_idx), b = _mm256_shuffle_epi8(bytes, hi_idx);
    out[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(a, mask)), s, t);
    out[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(b, mask)), s, t);
    out[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(a, 4)), s, t);
    out[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4)), s, t);
}

/* R <= 4 rows of x against one weight row: out[r] = sum_k x[r, k] * w[k]. One body for fp32 and
 * int8 weights; LOAD turns 8 weights at p into a float vector. */
#define KV_DEFINE_ROWS(NAME, T, LOAD)                                                                   \
    static inline void NAME(const float *x, int64_t ldx, int64_t K, const T *wn, int R, float out[4]) { \
        __m256 a0[4], a1[4];                                                                            \
        for (int r = 0; r < 4; r++) { a0[r] = _mm256_setzero_ps(); a1[r] = _mm256_setzero_ps(); }       \
        int64_t k = 0;                                                                                  \
        for (; k + 16 <= K; k += 16) {                                                                  \
            __m256 w0 = LOAD(wn + k), w1 = LOAD(wn + k + 8);                                            \
            for (int r = 0; r < R; r++) {                                                               \
                a0[r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + r * ldx + k), a0[r]);                   \
                a1[r] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + r * ldx + k + 8), a1[r]);               \
            }                                                                                           \
        }                                                                                               \
        for (; k + 8 <= K; k += 8) {                                                                    \
            __m256 w0 = LOAD(wn + k);                                                                   \
            for (int r = 0; r < R; r++) a0[r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + r * ldx + k), a0[r]); \
        }                                                                                               \
        for (int r = 0; r < R; r++) out[r] = hsum(_mm256_add_ps(a0[r], a1[r]));                         \
    }

KV_DEFINE_ROWS(f32_rows, float, _mm256_loadu_ps)
KV_DEFINE_ROWS(i8_rows, int8_t, widen_i8)
KV_DEFINE_ROWS(bf16_rows, uint16_t, widen_bf16)

/* Four rows of x against two weight rows w0, w1 (fp32 or int8): out[j][r] = x[r, :] . w_j. Each x
 * vector loaded serves two weight rows (eight accumulators), where the one-row form loads an x
 * vector per multiply-add and was bound by loads. */
#define KV_DEFINE_TILE(NAME, T, LOAD)                                                                   \
    static inline void NAME(const float *x, int64_t ldx, int64_t K, const T *w0, const T *w1,           \
                            float out[2][4]) {                                                          \
        __m256 a[2][4];                                                                                 \
        for (int r = 0; r < 4; r++) { a[0][r] = _mm256_setzero_ps(); a[1][r] = _mm256_setzero_ps(); }   \
        for (int64_t k = 0; k < K; k += 8) {                                                            \
            if (((k * (int64_t)sizeof(T)) & 63) == 0) {   /* each row's stream, a line at a time */     \
                _mm_prefetch((const char *)(w0 + k) + 4096, _MM_HINT_T0);                               \
                _mm_prefetch((const char *)(w1 + k) + 4096, _MM_HINT_T0);                               \
            }                                                                                           \
            __m256 v0 = LOAD(w0 + k), v1 = LOAD(w1 + k);                                                \
            for (int r = 0; r < 4; r++) {                                                               \
                __m256 xr = _mm256_loadu_ps(x + r * ldx + k);                                           \
                a[0][r] = _mm256_fmadd_ps(v0, xr, a[0][r]);                                             \
                a[1][r] = _mm256_fmadd_ps(v1, xr, a[1][r]);                                             \
            }                                                                                           \
        }                                                                                               \
        for (int r = 0; r < 4; r++) { out[0][r] = hsum(a[0][r]); out[1][r] = hsum(a[1][r]); }           \
    }

KV_DEFINE_TILE(f32_tile, float, _mm256_loadu_ps)
KV_DEFINE_TILE(i8_tile, int8_t, widen_i8)
KV_DEFINE_TILE(bf16_tile, uint16_t, widen_bf16)

/* int4 row n: wn its packed bytes, sn / tn its K/G scales and shifts. */
static inline void i4_rows(const float *x, int64_t ldx, int64_t K, const uint8_t *wn, const float *sn,
                           const float *tn, int64_t G, int R, float out[4]) {
    __m256 a0[4], a1[4];
    for (int r = 0; r < 4; r++) { a0[r] = _mm256_setzero_ps(); a1[r] = _mm256_setzero_ps(); }
    for (int64_t k = 0; k < K; k += 32) {
        __m256 wv[4];
        widen_i4(wn + k / 2, _mm256_set1_ps(sn[k / G]), _mm256_set1_ps(tn[k / G]), wv);
        for (int r = 0; r < R; r++) {
            const float *xr = x + r * ldx + k;
            a0[r] = _mm256_fmadd_ps(wv[0], _mm256_loadu_ps(xr), a0[r]);
            a1[r] = _mm256_fmadd_ps(wv[1], _mm256_loadu_ps(xr + 8), a1[r]);
            a0[r] = _mm256_fmadd_ps(wv[2], _mm256_loadu_ps(xr + 16), a0[r]);
            a1[r] = _mm256_fmadd_ps(wv[3], _mm256_loadu_ps(xr + 24), a1[r]);
        }
    }
    for (int r = 0; r < R; r++) out[r] = hsum(_mm256_add_ps(a0[r], a1[r]));
}

/* One row of x against one weight row (fp32, bf16 or int8, LOAD as above): four accumulators over k,
 * so the row is read front to back and consecutive rows make one sequential stream. */
#ifdef __AVX512F__
/* The same with 16-wide loads and FMAs (the avx512 variants): half the instructions per weight,
 * so one core keeps up with a faster memory stream. K's last 8 (K = 8 mod 16) run 8 wide. */
static inline __m512 widen_i8_16(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
static inline __m512 widen_bf16_16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
#define KV_DEFINE_M1(NAME, T, LOAD, LOAD16, PF)                                                         \
    static inline float NAME(const float *x, int64_t K, const T *w) {                                   \
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;                                     \
        int64_t k = 0;                                                                                  \
        for (; k + 64 <= K; k += 64) {                                                                  \
            if (PF) _mm_prefetch((const char *)(w + k) + PF, _MM_HINT_T0);                              \
            if (PF && sizeof(T) > 1) _mm_prefetch((const char *)(w + k) + PF + 64, _MM_HINT_T0);        \
            a0 = _mm512_fmadd_ps(LOAD16(w + k), _mm512_loadu_ps(x + k), a0);                            \
            a1 = _mm512_fmadd_ps(LOAD16(w + k + 16), _mm512_loadu_ps(x + k + 16), a1);                  \
            a2 = _mm512_fmadd_ps(LOAD16(w + k + 32), _mm512_loadu_ps(x + k + 32), a2);                  \
            a3 = _mm512_fmadd_ps(LOAD16(w + k + 48), _mm512_loadu_ps(x + k + 48), a3);                  \
        }                                                                                               \
        for (; k + 16 <= K; k += 16) a0 = _mm512_fmadd_ps(LOAD16(w + k), _mm512_loadu_ps(x + k), a0);  \
        float tail = 0.0f;                                                                              \
        if (k < K) tail = hsum(_mm256_mul_ps(LOAD(w + k), _mm256_loadu_ps(x + k)));                     \
        return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3))) + tail; \
    }
#else
#define KV_DEFINE_M1(NAME, T, LOAD, LOAD16, PF)                                                         \
    static inline float NAME(const float *x, int64_t K, const T *w) {                                   \
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;                                     \
        int64_t k = 0;                                                                                  \
        for (; k + 32 <= K; k += 32) {                                                                  \
            if (PF) _mm_prefetch((const char *)(w + k) + PF, _MM_HINT_T0);                              \
            a0 = _mm256_fmadd_ps(LOAD(w + k), _mm256_loadu_ps(x + k), a0);                              \
            a1 = _mm256_fmadd_ps(LOAD(w + k + 8), _mm256_loadu_ps(x + k + 8), a1);                      \
            a2 = _mm256_fmadd_ps(LOAD(w + k + 16), _mm256_loadu_ps(x + k + 16), a2);                    \
            a3 = _mm256_fmadd_ps(LOAD(w + k + 24), _mm256_loadu_ps(x + k + 24), a3);                    \
        }                                                                                               \
        for (; k + 8 <= K; k += 8) a0 = _mm256_fmadd_ps(LOAD(w + k), _mm256_loadu_ps(x + k), a0);      \
        return hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));                       \
    }
#endif

KV_DEFINE_M1(f32_m1, float, _mm256_loadu_ps, _mm512_loadu_ps, 0)
KV_DEFINE_M1(i8_m1, int8_t, widen_i8, widen_i8_16, 4096)
KV_DEFINE_M1(bf16_m1, uint16_t, widen_bf16, widen_bf16_16, 4096)

/* One row of x against int4 row w (K/2 packed bytes), s / t its K/G scales and shifts. */
static inline float i4_m1(const float *x, int64_t K, const uint8_t *w, const float *s, const float *t, int64_t G) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t g0 = 0; g0 < K; g0 += G, s++, t++) {
        __m256 sv = _mm256_set1_ps(*s), tv = _mm256_set1_ps(*t);
        for (int64_t k = g0; k < g0 + G; k += 32) {
            __m256 wv[4];
            widen_i4(w + k / 2, sv, tv, wv);
            a0 = _mm256_fmadd_ps(wv[0], _mm256_loadu_ps(x + k), a0);
            a1 = _mm256_fmadd_ps(wv[1], _mm256_loadu_ps(x + k + 8), a1);
            a2 = _mm256_fmadd_ps(wv[2], _mm256_loadu_ps(x + k + 16), a2);
            a3 = _mm256_fmadd_ps(wv[3], _mm256_loadu_ps(x + k + 24), a3);
        }
    }
    return hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
}

/* A linear layer's weights in one of the formats above. */
typedef struct {
    int64_t fmt;            /* KV_FP32, KV_INT8, KV_INT4 or KV_BF16 */
    int64_t N, K;
    const void *w;          /* float [N, K] / int8 [N, K] / uint8 [N, K/2] / uint16 (bf16) [N, K] */
    const float *scale;     /* int8: [N]; int4: [N, K/G]; fp32: NULL */
    const float *shift;     /* int4: [N, K/G]; else NULL */
    int64_t group;          /* int4 group size G */
    const float *bias;      /* [N] or NULL */
} kv_matrix;

/* Software prefetch of `bytes` from p, one cache line at a time (addresses past the end of the
 * weights are harmless: a prefetch never faults). */
static inline void prefetch_span(const void *p, int64_t bytes) {
    for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch((const char *)p + b, _MM_HINT_T0);
}

/* Prefetch rows n .. n + count - 1 of m (weights, and int4 scales and shifts). */
static inline void prefetch_rows(const kv_matrix *m, int64_t n, int64_t count) {
    const int64_t K = m->K;
    const int64_t row = m->fmt == KV_FP32 ? 4 * K : m->fmt == KV_BF16 ? 2 * K : m->fmt == KV_INT8 ? K : K / 2;
    prefetch_span((const char *)m->w + n * row, count * row);
    if (m->fmt == KV_INT4) {
        prefetch_span(m->scale + n * (K / m->group), count * (K / m->group) * 4);
        prefetch_span(m->shift + n * (K / m->group), count * (K / m->group) * 4);
    }
}

/* y[m * ldy + (n - n0)] = x[m, :] . dequant(w)[n, :] + bias[n] for m < M, n0 <= n < n1. The
 * weights are read from memory once, in order, row after row. Short quantized rows (a few hundred
 * bytes) are prefetched ahead in software: without it one core streamed int8 weights at about
 * half the rate (EPYC, docs/performance.md). With several rows of x, each weight row is used for
 * up to four of them at a time (from L1 after the first). */
static inline void kv_matrix_rows(const kv_matrix *m, const float *x, int64_t ldx, int64_t M, int64_t n0,
                                  int64_t n1, float *y, int64_t ldy) {
    const int64_t K = m->K, G = m->group, groups = m->fmt == KV_INT4 ? K / G : 0;
    float out[4];
    int64_t n = n0;
    prefetch_rows(m, n0, n1 - n0 < 8 ? n1 - n0 : 8);
    if (M == 1) {
        /* One weight row at a time, so a thread's weights are one front-to-back stream. The
         * quantized rows (a few hundred bytes) are prefetched ~4 KiB ahead (int8 and bf16 inside i8_m1 / bf16_m1;
         * int4 row by row, its weights only: the hardware prefetcher follows the small scale and
         * shift streams); fp32 rows are long enough for the hardware prefetcher, which software
         * prefetch only disturbed. */
        const float *bias = m->bias;
        if (m->fmt == KV_FP32) {
            const float *w = (const float *)m->w;
            for (; n < n1; n++) y[n - n0] = f32_m1(x, K, w + n * K) + (bias ? bias[n] : 0.0f);
        } else if (m->fmt == KV_INT8) {
            const int8_t *w = (const int8_t *)m->w;
            for (; n < n1; n++) y[n - n0] = i8_m1(x, K, w + n * K) * m->scale[n] + (bias ? bias[n] : 0.0f);
        } else if (m->fmt == KV_BF16) {
            const uint16_t *w = (const uint16_t *)m->w;
            for (; n < n1; n++) y[n - n0] = bf16_m1(x, K, w + n * K) + (bias ? bias[n] : 0.0f);
        } else {
            const uint8_t *w = (const uint8_t *)m->w;
            const int64_t half = K / 2, ahead = 4096 / half + 1;
            for (; n < n1; n++) {
                prefetch_span(w + (n + ahead) * half, half);
                y[n - n0] = i4_m1(x, K, w + n * half, m->scale + n * groups, m->shift + n * groups, G)
                            + (bias ? bias[n] : 0.0f);
            }
        }
        return;
    }
    if (M >= 4 && m->fmt != KV_INT4) {   /* pairs of weight rows against groups of four x rows */
        float tile[2][4];
        for (; n + 2 <= n1; n += 2) {
            for (int64_t m0 = 0; m0 + 4 <= M; m0 += 4) {
                if (m->fmt == KV_FP32)
                    f32_tile(x + m0 * ldx, ldx, K, (const float *)m->w + n * K, (const float *)m->w + (n + 1) * K, tile);
                else if (m->fmt == KV_BF16)
                    bf16_tile(x + m0 * ldx, ldx, K, (const uint16_t *)m->w + n * K,
                              (const uint16_t *)m->w + (n + 1) * K, tile);
                else
                    i8_tile(x + m0 * ldx, ldx, K, (const int8_t *)m->w + n * K, (const int8_t *)m->w + (n + 1) * K,
                            tile);
                for (int j = 0; j < 2; j++) {
                    float sc = m->fmt == KV_INT8 ? m->scale[n + j] : 1.0f, b = m->bias ? m->bias[n + j] : 0.0f;
                    for (int r = 0; r < 4; r++) y[(m0 + r) * ldy + n + j - n0] = tile[j][r] * sc + b;
                }
            }
            if (M % 4) {   /* the last 1-3 rows of x, one weight row at a time */
                const int64_t m0 = M - M % 4;
                for (int64_t j = n; j < n + 2; j++) {
                    float b = m->bias ? m->bias[j] : 0.0f;
                    if (m->fmt == KV_FP32) f32_rows(x + m0 * ldx, ldx, K, (const float *)m->w + j * K, (int)(M % 4), out);
                    else if (m->fmt == KV_BF16)
                        bf16_rows(x + m0 * ldx, ldx, K, (const uint16_t *)m->w + j * K, (int)(M % 4), out);
                    else i8_rows(x + m0 * ldx, ldx, K, (const int8_t *)m->w + j * K, (int)(M % 4), out);
                    for (int r = 0; r < M % 4; r++)
                        y[(m0 + r) * ldy + j - n0] = (m->fmt == KV_INT8 ? out[r] * m->scale[j] : out[r]) + b;
                }
            }
        }
    }
    for (; n < n1; n++) {
        float b = m->bias ? m->bias[n] : 0.0f;
        if (n + 8 < n1) prefetch_rows(m, n + 8, 1);
        for (int64_t m0 = 0; m0 < M; m0 += 4) {
            int R = (int)(M - m0 < 4 ? M - m0 : 4);
            const float *xr = x + m0 * ldx;
            /* R as a constant (4, or the 1-3 left), so the accumulators stay in registers */
#define KV_ROWS_CALL(RC)                                                                                 \
    if (m->fmt == KV_FP32) f32_rows(xr, ldx, K, (const float *)m->w + n * K, RC, out);                   \
    else if (m->fmt == KV_BF16) bf16_rows(xr, ldx, K, (const uint16_t *)m->w + n * K, RC, out);          \
    else if (m->fmt == KV_INT8) i8_rows(xr, ldx, K, (const int8_t *)m->w + n * K, RC, out);              \
    else i4_rows(xr, ldx, K, (const uint8_t *)m->w + n * (K / 2), m->scale + n * groups, m->shift + n * groups, \
                 G, RC, out);
            if (R == 4) { KV_ROWS_CALL(4) }
            else if (R == 3) { KV_ROWS_CALL(3) }
            else if (R == 2) { KV_ROWS_CALL(2) }
            else { KV_ROWS_CALL(1) }
#undef KV_ROWS_CALL
            for (int r = 0; r < R; r++)
                y[(m0 + r) * ldy + n - n0] = (m->fmt == KV_INT8 ? out[r] * m->scale[n] : out[r]) + b;
        }
    }
}

#endif
