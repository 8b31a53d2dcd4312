/* kvfleet CPU kernels: weight-only linear layers (int8, int4, bf16) for x86-64 AVX2 + FMA.
 *
 * Contract (kernels/cpu_woq.py builds this file with the system C compiler, loads it with
 * ctypes and checks every argument before a call; nothing here validates):
 *
 *   y[m, n] = sum_k x[m, k] * dequant(w)[n, k] + bias[n]      (bias may be NULL)
 *
 *   x:    [M, K] float32, row-major, rows `ldx` floats apart
 *   y:    [M, N] float32, row-major, contiguous
 *   int8: w [N, K] int8, scale [N] float32 (symmetric, per channel)
 *   int8g: w [N, K] int8, scale [N, K / G] float32, shift [N, K / G] float32 or NULL (groups of G, a
 *          multiple of 16, along K; K a multiple of 32): GGUF Q8_0, Q6_K and Q5_K tensors; scale and
 *          shift may be float16 (scale_f16), w the 5-bit form (hbits: GGUF Q5_0 as stored; cpu_gemv_m1.h)
 *   int4 and int8g with their scales in any form (kv_woq_scaled_linear; kv_matrix.scale_f16: float16 and GGUF
 *          K-quants' factored ones)
 *   int4: w [N, K/2] uint8 packed, scale and shift [N, K / G] float32 (shift = -zero_point * scale)
 *   bf16: w [N, K] bfloat16 (as uint16), no scale
 *   (the layouts and dequantization: cpu_gemv.h, whose helpers do the arithmetic)
 *
 * Output channels are split, four (one row of x) or twelve at a time, over the OpenMP threads (libgomp: the same runtime
 * torch's wheels bundle, so the process keeps one thread pool).
 */
#include "cpu_amx.h"
#include "cpu_gemv.h"

#include <stdlib.h>

/* Weights below which one thread does the whole layer: waking a sleeping OpenMP thread
 * (OMP_WAIT_POLICY=PASSIVE, the engine's default) costs tens of microseconds, more than a
 * small layer takes on one core. Set by kv_woq_set_parallel_min (cpu_woq.py). */
static int64_t PARALLEL_MIN_WEIGHTS = 1 << 16;

void kv_woq_set_parallel_min(int64_t weights) { PARALLEL_MIN_WEIGHTS = weights; }

static void woq_linear(const kv_matrix *m, const float *x, int64_t M, int64_t ldx, float *y) {
    /* four channels per block at one row; twelve with several rows (whole tiles: KV_TILE_W) */
    const int64_t per = M == 1 ? 4 : 12, blocks = (m->N + per - 1) / per;
    #pragma omp parallel for schedule(static) if (m->N * m->K >= PARALLEL_MIN_WEIGHTS)
    for (int64_t b = 0; b < blocks; b++) {
        int64_t n0 = per * b, n1 = n0 + per < m->N ? n0 + per : m->N;
        kv_matrix_rows(m, x, ldx, M, n0, n1, y + n0, m->N);
    }
}

void kv_woq_int8_linear(const float *x, int64_t M, int64_t K, int64_t ldx, const int8_t *w,
                        int64_t N, const float *scale, const float *bias, float *y) {
    kv_matrix m = {KV_INT8, N, K, w, scale, NULL, 0, bias};
    woq_linear(&m, x, M, ldx, y);
}

void kv_woq_int4_linear(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *w,
                        int64_t N, const float *scale, const float *shift, int64_t G,
                        const float *bias, float *y) {
    kv_matrix m = {KV_INT4, N, K, w, scale, shift, G, bias};
    woq_linear(&m, x, M, ldx, y);
}

/* scale_f16: scale and shift hold float16; hbits: NULL, or the 5-bit form's high bits (w the nibbles). */
void kv_woq_int8g_linear(const float *x, int64_t M, int64_t K, int64_t ldx, const int8_t *w, int64_t N,
                         const float *scale, const float *shift, int64_t G, const float *bias, float *y,
                         int64_t scale_f16, const uint8_t *hbits) {
    kv_matrix m = {KV_INT8G, N, K, w, scale, shift, G, bias};
    m.scale_f16 = scale_f16;
    m.hbits = hbits;
    woq_linear(&m, x, M, ldx, y);
}

/* Either quantized format (fmt KV_INT4 or KV_INT8G) with its scales in any form (kv_matrix.scale_f16: 0
 * float32, 1 float16, 2 factored: scale / shift int8 factors of scale_d / shift_d, float16 per super_group
 * weights; GGUF K-quants as stored). */
void kv_woq_scaled_linear(const float *x, int64_t M, int64_t K, int64_t ldx, int64_t fmt, const void *w, int64_t N,
                          const void *scale, const void *shift, int64_t G, const float *bias, float *y,
                          int64_t scale_f16, const uint16_t *scale_d, const uint16_t *shift_d, int64_t super_group,
                          const uint8_t *hbits) {
    kv_matrix m = {fmt, N, K, w, (const float *)scale, (const float *)shift, G, bias};
    m.scale_f16 = scale_f16;
    m.scale_d = scale_d;
    m.shift_d = shift_d;
    m.super_group = super_group;
    m.hbits = hbits;
    woq_linear(&m, x, M, ldx, y);
}

void kv_woq_bf16_linear(const float *x, int64_t M, int64_t K, int64_t ldx, const uint16_t *w,
                        int64_t N, const float *bias, float *y) {
    kv_matrix m = {KV_BF16, N, K, w, NULL, NULL, 0, bias};
    woq_linear(&m, x, M, ldx, y);
}

/* dequant(w) [N, K] of an int4 weight, row by row with the kernels' own widening (widen_row):
 * into out32 (float32), or, when out32 is NULL, rounded to bf16 into out16. */
static inline __m256i bf16_round(__m256 v) {   /* nearest even, finite values; integer ops only */
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    return _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
}

static void int4_dequant(const uint8_t *w, int64_t N, int64_t K, const float *scale, const float *shift, int64_t G,
                         float *out32, uint16_t *out16) {
    const kv_matrix m = {KV_INT4, N, K, w, scale, shift, G, NULL};
    #pragma omp parallel for schedule(static) if (N * K >= PARALLEL_MIN_WEIGHTS)
    for (int64_t n = 0; n < N; n++) {
        if (out32) {
            widen_row(&m, n, out32 + n * K);
            continue;
        }
        float row[K];
        widen_row(&m, n, row);
        for (int64_t k = 0; k < K; k += 16) {   /* K is a multiple of 32 */
            /* packus interleaves 128-bit lanes; the permute puts the 16 values back in order */
            const __m256i h = _mm256_packus_epi32(bf16_round(_mm256_loadu_ps(row + k)),
                                                  bf16_round(_mm256_loadu_ps(row + k + 8)));
            _mm256_storeu_si256((__m256i *)(out16 + n * K + k), _mm256_permute4x64_epi64(h, 0xD8));
        }
    }
}

/* out [N, K] float32 = dequant(w): the int4 weight as floats, for steps of many rows, where
 * torch's matmul on the dequantized weight is compute-bound and beats re-widening per row. */
void kv_woq_int4_dequant(const uint8_t *w, int64_t N, int64_t K, const float *scale, const float *shift,
                         int64_t G, float *out) {
    int4_dequant(w, N, K, scale, shift, G, out, NULL);
}

/* out [N, K] bf16 (as uint16) = dequant(w) rounded to nearest even: the int4 weight for a native
 * bf16 matmul (prefill on CPUs with AVX512-BF16 or AMX), half the bytes of the float32 one. */
void kv_woq_int4_dequant_bf16(const uint8_t *w, int64_t N, int64_t K, const float *scale, const float *shift,
                              int64_t G, uint16_t *out) {
    int4_dequant(w, N, K, scale, shift, G, NULL, out);
}

/* 1 when this build has the AMX kernels (cpu_amx.h) and the process may use the tiles. */
int64_t kv_amx_available(void) {
#if KV_HAVE_AMX
    return kv_amx_ready();
#else
    return 0;
#endif
}

/* 1 when this build has the bf16 dot-product kernels (cpu_dpbf16.h: AVX512-BF16). */
int64_t kv_dpbf16_available(void) { return KV_HAVE_DPBF16; }

/* y [M, N] = the kernels' output for x [M, K] (rows ldx apart) and m: `matmul` 0 the float32 ones'
 * (cpu_gemv.h), 1 the AMX tiles' (cpu_amx.h; N a multiple of 16), 2 the bf16 dot products'
 * (cpu_dpbf16.h); K a multiple of 32 (1, 2). Returns 0, or -1 without those kernels here, or memory.
 * The tests' entry to a kv_matrix in any form (the fused decoder calls the kernels directly). */
int64_t kv_bf16_linear(const kv_matrix *m, const float *x, int64_t M, int64_t ldx, float *y, int64_t matmul) {
    if (matmul == 0) {
        woq_linear(m, x, M, ldx, y);
        return 0;
    }
    if (m->K % 32 || (matmul == 1 && (!KV_HAVE_AMX || m->N % 16)) || (matmul == 2 && !KV_HAVE_DPBF16)
        || (matmul != 1 && matmul != 2))
        return -1;
#if KV_HAVE_DPBF16
#if KV_HAVE_AMX
    if (matmul == 1 && !kv_amx_ready()) return -1;
#endif
    const int64_t size = matmul == 1 ? (M + 15) / 16 * 16 * m->K : M * m->K;
    uint16_t *xb = aligned_alloc(64, (size_t)((size * 2 + 63) / 64 * 64));
    if (!xb) return -1;
#if KV_HAVE_AMX
    if (matmul == 1) kv_amx_pack_x(x, ldx, M, m->K, xb);
#endif
    if (matmul == 2) kv_dp_pack_rows(x, ldx, m->K, 0, M, xb);
    const int64_t blocks = (m->N + 95) / 96;   /* 96 channels a call: the tiles' groups of 48 and 32 (cpu_amx.h) */
    int failed = 0;
    #pragma omp parallel for schedule(static) reduction(|: failed)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t n0 = b * 96, n1 = n0 + 96 < m->N ? n0 + 96 : m->N;
#if KV_HAVE_AMX
        if (matmul == 1) failed |= kv_amx_rows(m, xb, M, n0, n1, y + n0, m->N) != 0;
#endif
        if (matmul == 2) failed |= kv_dp_rows(m, xb, M, n0, n1, y + n0, m->N) != 0;
    }
    free(xb);
    return failed ? -1 : 0;
#else
    (void)x; (void)ldx; (void)y;
    return -1;
#endif
}
