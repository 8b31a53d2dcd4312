/* kvfleet CPU kernels: weight-only quantized linear layers (int8, int4) for x86-64 AVX2 + FMA.
 *
 * Contract (kernels/cpu_woq.py builds this file with the system C compiler, loads it with
 * ctypes and checks every argument before a call; nothing here validates):
 *
 *   y[m, n] = sum_k x[m, k] * dequant(w)[n, k] + bias[n]      (bias may be NULL)
 *
 *   x:    [M, K] float32, row-major, rows `ldx` floats apart
 *   y:    [M, N] float32, row-major, contiguous
 *   int8: w [N, K] int8 row-major; dequant(w)[n, k] = w[n, k] * scale[n]  (symmetric, per channel)
 *   int4: w [N, K/2] uint8; per row, block b of 32 weights (k = 32b .. 32b+31) is 16 bytes:
 *         byte j holds k = 32b + j in its low nibble and k = 32b + 16 + j in its high nibble;
 *         dequant(w)[n, k] = q * scale[n, k / G] + shift[n, k / G], q in 0..15, G the group size
 *         (a multiple of 32), scale and shift [N, K / G] float32 (shift = -zero_point * scale).
 *   K is a multiple of 32 (int4) or 8 (int8).
 *
 * Decode steps (M = a few rows) are bound by reading the weights: each weight is loaded once,
 * widened to float32 in registers and used for up to 4 rows of x at a time (the rows of x stay
 * in L1). Output channels are split over the OpenMP threads (libgomp: the same runtime torch's
 * wheels bundle, so the process keeps one thread pool).
 */
#include <immintrin.h>
#include <stdint.h>
#include <stddef.h>

/* Weights below which one thread does the whole layer: waking a sleeping OpenMP thread
 * (OMP_WAIT_POLICY=PASSIVE, the engine's default) costs tens of microseconds, more than a
 * small layer takes on one core. Set by kv_woq_set_parallel_min (cpu_woq.py). */
static int64_t PARALLEL_MIN_WEIGHTS = 1 << 16;

void kv_woq_set_parallel_min(int64_t weights) { PARALLEL_MIN_WEIGHTS = weights; }

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

/* Rows m0 .. m0+R-1 (R <= 4) of output channel n, int8 weights. */
static inline void int8_rows(const float *x, int64_t ldx, int64_t K, const int8_t *wn, float s,
                             float b, float *y, int64_t N, int64_t n, int64_t m0, int R) {
    __m256 a0[4], a1[4];
    for (int r = 0; r < 4; r++) { a0[r] = _mm256_setzero_ps(); a1[r] = _mm256_setzero_ps(); }
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        __m256 w0 = widen_i8(wn + k), w1 = widen_i8(wn + k + 8);
        for (int r = 0; r < R; r++) {
            const float *xr = x + (m0 + r) * ldx + k;
            a0[r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xr), a0[r]);
            a1[r] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xr + 8), a1[r]);
        }
    }
    for (; k + 8 <= K; k += 8) {
        __m256 w0 = widen_i8(wn + k);
        for (int r = 0; r < R; r++)
            a0[r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + (m0 + r) * ldx + k), a0[r]);
    }
    for (int r = 0; r < R; r++)
        y[(m0 + r) * N + n] = hsum(_mm256_add_ps(a0[r], a1[r])) * s + b;
}

/* One row of x against output channels n .. n+3: eight independent FMA chains (a single row
 * against a single channel has two, and the FMA latency, not memory, would set the pace). */
static inline void int8_m1_n4(const float *x, int64_t K, const int8_t *w, const float *scale,
                              const float *bias, float *y, int64_t n) {
    __m256 a[4][2];
    for (int j = 0; j < 4; j++) { a[j][0] = _mm256_setzero_ps(); a[j][1] = _mm256_setzero_ps(); }
    const int8_t *w0 = w + n * K;
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        __m256 x0 = _mm256_loadu_ps(x + k), x1 = _mm256_loadu_ps(x + k + 8);
        for (int j = 0; j < 4; j++) {
            a[j][0] = _mm256_fmadd_ps(widen_i8(w0 + j * K + k), x0, a[j][0]);
            a[j][1] = _mm256_fmadd_ps(widen_i8(w0 + j * K + k + 8), x1, a[j][1]);
        }
    }
    for (; k + 8 <= K; k += 8) {
        __m256 x0 = _mm256_loadu_ps(x + k);
        for (int j = 0; j < 4; j++) a[j][0] = _mm256_fmadd_ps(widen_i8(w0 + j * K + k), x0, a[j][0]);
    }
    for (int j = 0; j < 4; j++)
        y[n + j] = hsum(_mm256_add_ps(a[j][0], a[j][1])) * scale[n + j] + (bias ? bias[n + j] : 0.0f);
}

void kv_woq_int8_linear(const float *x, int64_t M, int64_t K, int64_t ldx, const int8_t *w,
                        int64_t N, const float *scale, const float *bias, float *y) {
    if (M == 1) {
        int64_t blocks = N / 4;
        #pragma omp parallel for schedule(static) if (N * K >= PARALLEL_MIN_WEIGHTS)
        for (int64_t b = 0; b < blocks; b++) int8_m1_n4(x, K, w, scale, bias, y, 4 * b);
        for (int64_t n = 4 * blocks; n < N; n++)
            int8_rows(x, ldx, K, w + n * K, scale[n], bias ? bias[n] : 0.0f, y, N, n, 0, 1);
        return;
    }
    #pragma omp parallel for schedule(static) if (N * K >= PARALLEL_MIN_WEIGHTS)
    for (int64_t n = 0; n < N; n++) {
        const int8_t *wn = w + n * K;
        float b = bias ? bias[n] : 0.0f;
        for (int64_t m0 = 0; m0 < M; m0 += 4) {
            int R = (int)(M - m0 < 4 ? M - m0 : 4);
            int8_rows(x, ldx, K, wn, scale[n], b, y, N, n, m0, R);
        }
    }
}

/* 32 int4 weights (16 bytes) widened to four float vectors, dequantized: q * s + t. */
static inline void widen_i4(const uint8_t *p, __m256 s, __m256 t, __m256 out[4]) {
    __m128i bytes = _mm_loadu_si128((const __m128i *)p);
    __m128i mask = _mm_set1_epi8(0x0F);
    __m128i lo = _mm_and_si128(bytes, mask);                       /* k = j      (j = 0..15) */
    __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);    /* k = 16 + j */
    out[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), s, t);
    out[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), s, t);
    out[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), s, t);
    out[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), s, t);
}

static inline void int4_rows(const float *x, int64_t ldx, int64_t K, const uint8_t *wn, const float *sn,
                             const float *tn, int64_t G, float b, float *y, int64_t N, int64_t n,
                             int64_t m0, int R) {
    __m256 a0[4], a1[4];
    for (int r = 0; r < 4; r++) { a0[r] = _mm256_setzero_ps(); a1[r] = _mm256_setzero_ps(); }
    for (int64_t k = 0; k < K; k += 32) {
        int64_t g = k / G;
        __m256 wv[4];
        widen_i4(wn + k / 2, _mm256_set1_ps(sn[g]), _mm256_set1_ps(tn[g]), wv);
        for (int r = 0; r < R; r++) {
            const float *xr = x + (m0 + r) * ldx + k;
            a0[r] = _mm256_fmadd_ps(wv[0], _mm256_loadu_ps(xr), a0[r]);
            a1[r] = _mm256_fmadd_ps(wv[1], _mm256_loadu_ps(xr + 8), a1[r]);
            a0[r] = _mm256_fmadd_ps(wv[2], _mm256_loadu_ps(xr + 16), a0[r]);
            a1[r] = _mm256_fmadd_ps(wv[3], _mm256_loadu_ps(xr + 24), a1[r]);
        }
    }
    for (int r = 0; r < R; r++)
        y[(m0 + r) * N + n] = hsum(_mm256_add_ps(a0[r], a1[r])) + b;
}

/* One row of x against output channels n .. n+3 (eight FMA chains, as int8_m1_n4). */
static inline void int4_m1_n4(const float *x, int64_t K, const uint8_t *w, const float *scale,
                              const float *shift, int64_t G, const float *bias, float *y, int64_t n) {
    int64_t groups = K / G;
    __m256 a[4][2];
    for (int j = 0; j < 4; j++) { a[j][0] = _mm256_setzero_ps(); a[j][1] = _mm256_setzero_ps(); }
    for (int64_t k = 0; k < K; k += 32) {
        __m256 x0 = _mm256_loadu_ps(x + k), x1 = _mm256_loadu_ps(x + k + 8);
        __m256 x2 = _mm256_loadu_ps(x + k + 16), x3 = _mm256_loadu_ps(x + k + 24);
        int64_t g = k / G;
        for (int j = 0; j < 4; j++) {
            int64_t row = n + j;
            __m256 wv[4];
            widen_i4(w + row * (K / 2) + k / 2, _mm256_set1_ps(scale[row * groups + g]),
                     _mm256_set1_ps(shift[row * groups + g]), wv);
            a[j][0] = _mm256_fmadd_ps(wv[0], x0, a[j][0]);
            a[j][1] = _mm256_fmadd_ps(wv[1], x1, a[j][1]);
            a[j][0] = _mm256_fmadd_ps(wv[2], x2, a[j][0]);
            a[j][1] = _mm256_fmadd_ps(wv[3], x3, a[j][1]);
        }
    }
    for (int j = 0; j < 4; j++)
        y[n + j] = hsum(_mm256_add_ps(a[j][0], a[j][1])) + (bias ? bias[n + j] : 0.0f);
}

void kv_woq_int4_linear(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *w,
                        int64_t N, const float *scale, const float *shift, int64_t G,
                        const float *bias, float *y) {
    int64_t groups = K / G;
    if (M == 1) {
        int64_t blocks = N / 4;
        #pragma omp parallel for schedule(static) if (N * K >= PARALLEL_MIN_WEIGHTS)
        for (int64_t b = 0; b < blocks; b++) int4_m1_n4(x, K, w, scale, shift, G, bias, y, 4 * b);
        for (int64_t n = 4 * blocks; n < N; n++)
            int4_rows(x, ldx, K, w + n * (K / 2), scale + n * groups, shift + n * groups, G,
                      bias ? bias[n] : 0.0f, y, N, n, 0, 1);
        return;
    }
    #pragma omp parallel for schedule(static) if (N * K >= PARALLEL_MIN_WEIGHTS)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *wn = w + n * (K / 2);
        float b = bias ? bias[n] : 0.0f;
        for (int64_t m0 = 0; m0 < M; m0 += 4) {
            int R = (int)(M - m0 < 4 ? M - m0 : 4);
            int4_rows(x, ldx, K, wn, scale + n * groups, shift + n * groups, G, b, y, N, n, m0, R);
        }
    }
}

/* out [N, K] float32 = dequant(w): the int4 weight as floats, for steps of many rows, where
 * torch's matmul on the dequantized weight is compute-bound and beats re-widening per row. */
void kv_woq_int4_dequant(const uint8_t *w, int64_t N, int64_t K, const float *scale, const float *shift,
                         int64_t G, float *out) {
    int64_t groups = K / G;
    #pragma omp parallel for schedule(static) if (N * K >= PARALLEL_MIN_WEIGHTS)
    for (int64_t n = 0; n < N; n++) {
        for (int64_t k = 0; k < K; k += 32) {
            int64_t g = n * groups + k / G;
            __m256 wv[4];
            widen_i4(w + n * (K / 2) + k / 2, _mm256_set1_ps(scale[g]), _mm256_set1_ps(shift[g]), wv);
            float *o = out + n * K + k;
            _mm256_storeu_ps(o, wv[0]);
            _mm256_storeu_ps(o + 8, wv[1]);
            _mm256_storeu_ps(o + 16, wv[2]);
            _mm256_storeu_ps(o + 24, wv[3]);
        }
    }
}
