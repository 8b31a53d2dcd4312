/* kvfleet CPU kernels: the weight formats and the one-row dot products of the weight-only quantized
 * linear layers (cpu_woq.c) and of the fused decoder (cpu_decoder.c), x86-64 AVX2 + FMA (16 wide
 * in the avx512 builds). The several-row kernels built on them are cpu_gemv.h (which includes
 * this file; include that one).
 *
 * Every helper computes raw sums (no scale, no bias) of rows of x (float32, rows `ldx` floats
 * apart, K inputs) against weight rows in one of these formats:
 *
 *   fp32: w [N, K] float32, row-major
 *   bf16: w [N, K] bf16 (uint16), row-major, widened exactly
 *   int8: w [N, K] int8 row-major; dequant(w)[n, k] = w[n, k] * scale[n]  (the caller scales)
 *   int8g: w [N, K] int8, scale [N, K/G] float32, shift [N, K/G] float32 or NULL (G a multiple of
 *         16; K of 32): dequant(w)[n, k] = w[n, k] * scale[n, k / G] (+ shift[n, k / G]), a multiply
 *         and then an add, each rounded in float32 before the sum -- the very arithmetic of gguf's
 *         dequantization, so GGUF Q8_0 (G 32), Q6_K (G 16) and Q5_K (G 32 with shift) tensors keep
 *         their weights bit for bit
 *   int8g5: int8g's 5-bit form (kv_matrix.hbits set; GGUF Q5_0 as stored): per row, w [K/2] uint8 the
 *         low four bits of q + 16 in int4's nibble layout (below), hbits [K/8] the fifth bits (bit k:
 *         weight k, LSB first): q = (nibble | bit << 4) - 16, then int8g's arithmetic
 *   int4: w [N, K/2] uint8; per row, block b of 32 weights (k = 32b .. 32b+31) is 16 bytes:
 *         byte j holds k = 32b + j in its low nibble and k = 32b + 16 + j in its high nibble;
 *         dequant(w)[n, k] = q * scale[n, k / G] + shift[n, k / G], q in 0..15, G the group size
 *         (a multiple of 32); the int4 helpers apply scale and shift themselves.
 *
 * int4's and int8g's scales and shifts may be stored as float16 (kv_matrix.scale_f16 1; GGUF's own
 * per-block d and m) or factored (scale_f16 2; GGUF K-quants' d * sc and -dmin * m as stored: scale and
 * shift hold int8 factors [N, K/G], scale_d and shift_d float16 [N, K/super_group]): each row's are
 * made float32 (exactly) before its sums (kv_groups), so the arithmetic, and every bit of the result,
 * is the float32 form's.
 *
 * K is a multiple of 32 (int4) or 8 (fp32, bf16, int8). A decode step is bound by reading weights:
 * each weight is loaded once. At one row (the _m1 helpers) each weight row is summed front to back
 * with four independent FMA chains, so a thread reads its weights as one sequential stream; reading
 * four rows at once (four streams a few hundred bytes apart) defeated the hardware prefetcher and
 * halved the rate (docs/performance.md, "One sequential stream per thread"). Built with
 * -ffp-contract=off (cpu_lib.py): the compiler fuses no multiply-add of its own, so equal code is
 * equal arithmetic.
 */
#ifndef KVFLEET_CPU_GEMV_M1_H
#define KVFLEET_CPU_GEMV_M1_H

#include <immintrin.h>
#include <stdint.h>
#include <stddef.h>

enum { KV_FP32 = 0, KV_INT8 = 1, KV_INT4 = 2, KV_BF16 = 3, KV_INT8G = 4 };

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

/* k / G for a group size G: a shift when G is a power of two (always, for GGUF's 32 and the usual
 * 64 / 128), so the inner loops pay no integer division per block. */
static inline __attribute__((always_inline)) int64_t gidx(int64_t k, int64_t G) {
    return (G & (G - 1)) == 0 ? k >> __builtin_ctzll((unsigned long long)G) : k / G;
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
/* r[0..15] (16 x 16 dwords) transposed in place: r[i][j] <- r[j][i]. */
static inline void kv_transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int h = 0; h < 16; h += 8)
        for (int i = 0; i < 4; i++) {
            t[h + i] = _mm512_shuffle_i32x4(r[h + i], r[h + i + 4], 0x88);
            t[h + i + 4] = _mm512_shuffle_i32x4(r[h + i], r[h + i + 4], 0xdd);
        }
    for (int i = 0; i < 8; i++) {
        r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
    }
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

/* One row of x against int4 row w (K/2 packed bytes), s / t its K/G scales and shifts: 8 wide in
 * every build (a 16-wide form, two 8-wide unpackings joined, made one stream 9 % slower on a Xeon
 * with AMX). */
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

/* Grouped int8 weights dequantized (the format's arithmetic above): 16 (avx512) or 8 from k (a multiple
 * of 16 / 8) of row w, group g. SH (a constant after inlining) says whether there is a shift, Q5 whether
 * the row is in the 5-bit form (w the nibbles, hb the high bits; int8g5 above): four instantiations of
 * every loop. Both forms give the same int32 q, so the same float32 weights and sums. */
#define KV_ALWAYS_INLINE static inline __attribute__((always_inline))
static inline unsigned kv_load_u16(const uint8_t *p) { uint16_t v; __builtin_memcpy(&v, p, 2); return v; }
#ifdef __AVX512F__
KV_ALWAYS_INLINE __m512i ld_q_16(const int8_t *w, const uint8_t *hb, int64_t k, int Q5) {
    if (!Q5) return _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(w + k)));
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)((const uint8_t *)w + ((k >> 5) << 4))));
    const __m512i lo = (k & 16) ? _mm512_srli_epi32(b, 4) : _mm512_and_si512(b, _mm512_set1_epi32(15));
    /* (nib | bit << 4) - 16: 16 off where the bit is clear */
    return _mm512_mask_sub_epi32(lo, (__mmask16)~kv_load_u16(hb + (k >> 3)), lo, _mm512_set1_epi32(16));
}
KV_ALWAYS_INLINE __m512 dq_i8g_16(const int8_t *w, const uint8_t *hb, int64_t k, const float *s, const float *t,
                                  int64_t g, int SH, int Q5) {
    const __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(ld_q_16(w, hb, k, Q5)), _mm512_set1_ps(s[g]));
    return SH ? _mm512_add_ps(v, _mm512_set1_ps(t[g])) : v;
}
#endif
KV_ALWAYS_INLINE __m256i ld_q_8(const int8_t *w, const uint8_t *hb, int64_t k, int Q5) {
    if (!Q5) return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(w + k)));
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)((const uint8_t *)w + ((k >> 5) << 4) + (k & 8))));
    const __m256i lo = (k & 16) ? _mm256_srli_epi32(b, 4) : _mm256_and_si256(b, _mm256_set1_epi32(15));
    const __m256i sel = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    const __m256i on = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(hb[k >> 3]), sel), sel);
    return _mm256_sub_epi32(lo, _mm256_andnot_si256(on, _mm256_set1_epi32(16)));
}
KV_ALWAYS_INLINE __m256 dq_i8g_8(const int8_t *w, const uint8_t *hb, int64_t k, const float *s, const float *t,
                                 int64_t g, int SH, int Q5) {
    const __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(ld_q_8(w, hb, k, Q5)), _mm256_set1_ps(s[g]));
    return SH ? _mm256_add_ps(v, _mm256_set1_ps(t[g])) : v;
}

/* One row of x against grouped int8 row w (scales s[K/G], shifts t[K/G] or NULL; hb: the 5-bit form's
 * high bits, else NULL): each weight dequantized in float32, then summed in the order of KV_DEFINE_M1
 * (16 wide in the avx512 build). */
#ifdef __AVX512F__
KV_ALWAYS_INLINE float i8g_m1_body(const float *x, int64_t K, const int8_t *w, const uint8_t *hb, const float *s,
                                   const float *t, int64_t G, int SH, int Q5) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int64_t k = 0;
    for (; k + 64 <= K; k += 64) {
        _mm_prefetch((const char *)w + (Q5 ? k / 2 : k) + 4096, _MM_HINT_T0);
        a0 = _mm512_fmadd_ps(dq_i8g_16(w, hb, k, s, t, gidx(k, G), SH, Q5), _mm512_loadu_ps(x + k), a0);
        a1 = _mm512_fmadd_ps(dq_i8g_16(w, hb, k + 16, s, t, gidx(k + 16, G), SH, Q5), _mm512_loadu_ps(x + k + 16), a1);
        a2 = _mm512_fmadd_ps(dq_i8g_16(w, hb, k + 32, s, t, gidx(k + 32, G), SH, Q5), _mm512_loadu_ps(x + k + 32), a2);
        a3 = _mm512_fmadd_ps(dq_i8g_16(w, hb, k + 48, s, t, gidx(k + 48, G), SH, Q5), _mm512_loadu_ps(x + k + 48), a3);
    }
    for (; k + 16 <= K; k += 16)
        a0 = _mm512_fmadd_ps(dq_i8g_16(w, hb, k, s, t, gidx(k, G), SH, Q5), _mm512_loadu_ps(x + k), a0);
    return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
}
#else
KV_ALWAYS_INLINE float i8g_m1_body(const float *x, int64_t K, const int8_t *w, const uint8_t *hb, const float *s,
                                   const float *t, int64_t G, int SH, int Q5) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t k = 0; k + 32 <= K; k += 32) {
        _mm_prefetch((const char *)w + (Q5 ? k / 2 : k) + 4096, _MM_HINT_T0);
        if (G % 32 == 0) {   /* one group for the block: its scale (and shift) looked up once */
            const int64_t g = gidx(k, G);
            a0 = _mm256_fmadd_ps(dq_i8g_8(w, hb, k, s, t, g, SH, Q5), _mm256_loadu_ps(x + k), a0);
            a1 = _mm256_fmadd_ps(dq_i8g_8(w, hb, k + 8, s, t, g, SH, Q5), _mm256_loadu_ps(x + k + 8), a1);
            a2 = _mm256_fmadd_ps(dq_i8g_8(w, hb, k + 16, s, t, g, SH, Q5), _mm256_loadu_ps(x + k + 16), a2);
            a3 = _mm256_fmadd_ps(dq_i8g_8(w, hb, k + 24, s, t, g, SH, Q5), _mm256_loadu_ps(x + k + 24), a3);
        } else {
            a0 = _mm256_fmadd_ps(dq_i8g_8(w, hb, k, s, t, gidx(k, G), SH, Q5), _mm256_loadu_ps(x + k), a0);
            a1 = _mm256_fmadd_ps(dq_i8g_8(w, hb, k + 8, s, t, gidx(k + 8, G), SH, Q5), _mm256_loadu_ps(x + k + 8), a1);
            a2 = _mm256_fmadd_ps(dq_i8g_8(w, hb, k + 16, s, t, gidx(k + 16, G), SH, Q5), _mm256_loadu_ps(x + k + 16), a2);
            a3 = _mm256_fmadd_ps(dq_i8g_8(w, hb, k + 24, s, t, gidx(k + 24, G), SH, Q5), _mm256_loadu_ps(x + k + 24), a3);
        }
    }
    return hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
}
#endif
static inline float i8g_m1(const float *x, int64_t K, const int8_t *w, const uint8_t *hb, const float *s, const float *t,
                           int64_t G) {
    if (hb) return t ? i8g_m1_body(x, K, w, hb, s, t, G, 1, 1) : i8g_m1_body(x, K, w, hb, s, t, G, 0, 1);
    return t ? i8g_m1_body(x, K, w, hb, s, t, G, 1, 0) : i8g_m1_body(x, K, w, hb, s, t, G, 0, 0);
}

/* A linear layer's weights in one of the formats above. */
typedef struct {
    int64_t fmt;            /* KV_FP32, KV_INT8, KV_INT4, KV_BF16 or KV_INT8G */
    int64_t N, K;
    const void *w;          /* float [N, K] / int8 [N, K] / uint8 [N, K/2] / uint16 (bf16) [N, K] */
    const float *scale;     /* int8: [N]; int4, int8g: [N, K/G]; fp32, bf16: NULL */
    const float *shift;     /* int4: [N, K/G]; int8g: [N, K/G] or NULL; else NULL */
    int64_t group;          /* int4 / int8g group size G */
    const float *bias;      /* [N] or NULL */
    const int32_t *perm;    /* [K] or NULL: the input permutation (act-order GPTQ): the fused decoder
                             * runs the matrix on x[m, perm[k]] (cpu_perm.h); the kernels here ignore it */
    int64_t kind;           /* the fused decoder's kernels for this matrix: 0 the step's (kv_decoder.matmul),
                             * else 1 + a KV_MATMUL_* code (runtime/worker/cpu_plan.py chooses it once per
                             * matrix, never per row count: batch invariance); other callers ignore it */
    int64_t scale_f16;      /* int4, int8g: 1 when scale and shift hold float16 (uint16 bits; kv_groups widens
                             * them, exactly), 2 int8 factors of scale_d / shift_d (below), 0 float32 */
    const uint8_t *hbits;   /* int8g: NULL, or the 5-bit form (int8g5): w then holds the low nibbles [N, K/2]
                             * in int4's layout and hbits [N, K/8] the fifth bits (bit k of the row: weight k) */
    const uint16_t *scale_d;   /* scale_f16 == 2 (factored): float16 [N, K/super_group], the multipliers of
                                * scale's int8 factors (GGUF K-quants' d per 256 weights) */
    const uint16_t *shift_d;   /* scale_f16 == 2: float16 [N, K/super_group] of shift's factors (dmin negated),
                                * NULL when shift is */
    int64_t super_group;       /* scale_f16 == 2: weights per scale_d / shift_d entry (a multiple of group) */
} kv_matrix;

/* Groups g0 .. g1 - 1 of row n of p (m's scale or shift, or NULL) as float32, at r[g0 .. g1 - 1] of the
 * pointer r returned: p's own row when it holds float32, else into buf (g1 - g0 floats): widened from
 * float16 (exact), or, factored (scale_f16 2), float32(d) * float32(factor) with d the float16 of the
 * group's super-block (scale_d for p == m->scale, else shift_d) -- one float32 product of an 11-bit
 * and an 8-bit integer significand, exact, so the very value the float32 form stores. NULL for NULL. */
KV_ALWAYS_INLINE const float *kv_groups(const kv_matrix *m, const float *p, int64_t n, int64_t g0, int64_t g1,
                                       float *buf) {
    if (!p) return NULL;
    const int64_t groups = gidx(m->K, m->group);   /* (shifts, not divisions: this runs per row and chunk) */
    if (!m->scale_f16) return p + n * groups;
    if (m->scale_f16 == 2) {
        const int64_t per = gidx(m->super_group, m->group);
        const int8_t *f = (const int8_t *)(const void *)p + n * groups;
        const uint16_t *d = (p == m->scale ? m->scale_d : m->shift_d) + n * gidx(m->K, m->super_group);
        int64_t g = g0;
#ifdef __AVX512F__
        const int64_t supers = gidx(m->K, m->super_group);
        if ((per & (per - 1)) == 0 && supers <= 16) {   /* the row's d widened once, 16 groups at a time */
            const int ps = __builtin_ctzll((unsigned long long)per);
            const __m512 dall = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16((__mmask16)((1u << supers) - 1), d));
            const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
            for (; g + 16 <= g1; g += 16) {
                const __m512i u = _mm512_srli_epi32(_mm512_add_epi32(_mm512_set1_epi32((int)g), lane), ps);
                _mm512_storeu_ps(buf + g - g0, _mm512_mul_ps(_mm512_permutexvar_ps(u, dall),
                                 _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(f + g))))));
            }
        }
#endif
        if ((per & 7) == 0 && (per & (per - 1)) == 0) {   /* 8 groups at a time within one super-block */
            const int ps = __builtin_ctzll((unsigned long long)per);
            for (; g < g1 && (g & 7); g++) buf[g - g0] = _cvtsh_ss(d[g >> ps]) * (float)f[g];
            for (; g + 8 <= g1; g += 8)
                _mm256_storeu_ps(buf + g - g0, _mm256_mul_ps(_mm256_set1_ps(_cvtsh_ss(d[g >> ps])),
                                 _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(f + g))))));
        }
        for (; g < g1; g++) buf[g - g0] = _cvtsh_ss(d[gidx(g, per)]) * (float)f[g];
        return buf - g0;
    }
    const uint16_t *h = (const uint16_t *)(const void *)p + n * groups;
    int64_t g = g0;
    for (; g + 8 <= g1; g += 8) _mm256_storeu_ps(buf + g - g0, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + g))));
    for (; g < g1; g++) buf[g - g0] = _cvtsh_ss(h[g]);
    return buf - g0;
}

/* Row n of an int8g matrix: its int8 weights (or, in the 5-bit form, its nibbles) and its high bits (NULL). */
static inline const int8_t *kv_i8g_row(const kv_matrix *m, int64_t n) {
    return (const int8_t *)m->w + n * (m->hbits ? m->K / 2 : m->K);
}
static inline const uint8_t *kv_hb_row(const kv_matrix *m, int64_t n) {
    return m->hbits ? m->hbits + n * (m->K / 8) : NULL;
}

/* Software prefetch of `bytes` from p, one cache line at a time (addresses past the end of the
 * weights are harmless: a prefetch never faults). */
static inline void prefetch_span(const void *p, int64_t bytes) {
    for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch((const char *)p + b, _MM_HINT_T0);
}

/* Prefetch rows n .. n + count - 1 of m (weights, high bits, and group scales and shifts). */
static inline void prefetch_rows(const kv_matrix *m, int64_t n, int64_t count) {
    const int64_t K = m->K;
    const int64_t row = m->fmt == KV_FP32 ? 4 * K : m->fmt == KV_BF16 ? 2 * K : m->fmt == KV_INT8 ? K
                        : m->fmt == KV_INT8G && !m->hbits ? K : K / 2;
    prefetch_span((const char *)m->w + n * row, count * row);
    if (m->fmt == KV_INT8G && m->hbits) prefetch_span(m->hbits + n * (K / 8), count * (K / 8));
    if (m->fmt == KV_INT8G || m->fmt == KV_INT4) {
        const int64_t groups = K / m->group, bytes = m->scale_f16 == 2 ? 1 : m->scale_f16 ? 2 : 4;
        prefetch_span((const char *)m->scale + n * groups * bytes, count * groups * bytes);
        if (m->shift) prefetch_span((const char *)m->shift + n * groups * bytes, count * groups * bytes);
        if (m->scale_f16 == 2) {
            const int64_t supers = K / m->super_group;
            prefetch_span(m->scale_d + n * supers, count * supers * 2);
            if (m->shift_d) prefetch_span(m->shift_d + n * supers, count * supers * 2);
        }
    }
}

#endif
