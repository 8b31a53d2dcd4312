/* kvfleet CPU kernels: the fused decoder's attention scores 16 positions at a time (AVX-512 builds,
 * head size a multiple of 16): transpose_keys, scores16, add_values_heads and attend_block16, which
 * task_attention runs. Included by cpu_attention.h where its helpers (start_partials,
 * rescale_partial, row_from, add_values' arithmetic) are defined; nothing else includes it.
 */
#ifndef KVFLEET_CPU_ATTENTION16_H
#define KVFLEET_CPU_ATTENTION16_H

#ifdef __AVX512F__
/* ---- AVX-512, head size a multiple of 16: scores 16 positions at a time ----
 * The keys of a block are transposed once per task (transpose_keys), so one vector holds an
 * element of 16 positions' keys: a query head's 16 scores are 64 FMAs (D = 64) with no horizontal
 * sums, and the heads that share a KV head read each key vector once. Each score is its own dot
 * (four chains over the elements e mod 4, then (c0 + c1) + (c2 + c3)), so a row's scores do not
 * depend on the step's other rows; the bits differ from the avx2 build's (dot4), as its kernels do. */

/* exp8's arithmetic, 16 lanes (cpu_step.h's KV_DEFINE_EXP). */
KV_DEFINE_EXP(exp16, __m512, _mm512, _mm512_roundscale_ps, _mm512_castsi512_ps)

/* kT[(c D + e) 16 + l] = element e of the key at position 16 c + l (keys + p * stride: float32,
 * or bf16 widened here when `bf16`), for the block's bs positions; positions past bs in the last
 * group of 16 are zero. */
static void transpose_keys(const void *keys, int bf16, int64_t stride, int64_t bs, int64_t D, float *kT) {
    for (int64_t c = 0; 16 * c < bs; c++)
        for (int64_t e0 = 0; e0 < D; e0 += 16) {
            __m512i r[16];
            for (int64_t l = 0; l < 16; l++) {
                const int64_t at = (16 * c + l) * stride + e0;
                r[l] = 16 * c + l >= bs ? _mm512_setzero_si512()
                       : bf16 ? _mm512_castps_si512(widen_bf16_16((const uint16_t *)keys + at))
                              : _mm512_castps_si512(_mm512_loadu_ps((const float *)keys + at));
            }
            kv_transpose16(r);
            for (int64_t l = 0; l < 16; l++) _mm512_storeu_si512(kT + ((c * D + e0 + l) * 16), r[l]);
        }
}

/* sc[j] lane l = (q_j . key l) * scale for H (<= 4) query heads q_j = q + j D and the 16 keys of
 * kT (one group of transpose_keys). */
static inline __attribute__((always_inline)) void scores16(const float *q, const float *kT, int64_t D, int H,
                                                           float scale, __m512 *sc) {
    __m512 a[4][4];
    for (int j = 0; j < H; j++)
        for (int c = 0; c < 4; c++) a[j][c] = _mm512_setzero_ps();
    for (int64_t e = 0; e < D; e += 4)
        for (int c = 0; c < 4; c++) {
            const __m512 kv = _mm512_loadu_ps(kT + (e + c) * 16);
            for (int j = 0; j < H; j++) a[j][c] = _mm512_fmadd_ps(_mm512_set1_ps(q[j * D + e + c]), kv, a[j][c]);
        }
    for (int j = 0; j < H; j++)
        sc[j] = _mm512_mul_ps(_mm512_add_ps(_mm512_add_ps(a[j][0], a[j][1]), _mm512_add_ps(a[j][2], a[j][3])),
                              _mm512_set1_ps(scale));
}

/* add_values for h (<= 4) query heads at once: acc[j][0 .. D) += sum_p w[16 j + p] * v_p[e] over
 * the n positions, v_p = vals + p * stride, float32 or (`bf16`) widened in registers: each value
 * is read and widened once for the h heads, and each element is its own chain over p, as in
 * add_values (the same bits). D a multiple of 16. */
static inline __attribute__((always_inline)) void add_values_heads(float *const *acc, const float *w,
                                                                   const void *vals, int bf16, int64_t stride,
                                                                   int64_t n, int64_t D, int h) {
    for (int64_t e0 = 0; e0 < D; e0 += 64) {
        const int width = (int)(D - e0 < 64 ? (D - e0) / 16 : 4);
        __m512 a[4][4];
        for (int j = 0; j < h; j++)
            for (int c = 0; c < width; c++) a[j][c] = _mm512_loadu_ps(acc[j] + e0 + 16 * c);
        for (int64_t p = 0; p < n; p++) {
            __m512 v[4];
            for (int c = 0; c < width; c++)
                v[c] = bf16 ? widen_bf16_16((const uint16_t *)vals + p * stride + e0 + 16 * c)
                            : _mm512_loadu_ps((const float *)vals + p * stride + e0 + 16 * c);
            for (int j = 0; j < h; j++) {
                const __m512 wp = _mm512_set1_ps(w[16 * j + p]);
                for (int c = 0; c < width; c++) a[j][c] = _mm512_fmadd_ps(wp, v[c], a[j][c]);
            }
        }
        for (int j = 0; j < h; j++)
            for (int c = 0; c < width; c++) _mm512_storeu_ps(acc[j] + e0 + 16 * c, a[j][c]);
    }
}

/* add_values_heads with D = 64 and h as constants where they are (the accumulators in registers). */
static inline void add_values_h(float *const *acc, const float *w, const void *vals, int bf16, int64_t stride,
                                int64_t n, int64_t D, int h) {
    if (D == 64 && h == 3) add_values_heads(acc, w, vals, bf16, stride, n, 64, 3);
    else if (D == 64 && h == 4) add_values_heads(acc, w, vals, bf16, stride, n, 64, 4);
    else if (D == 64 && h == 1) add_values_heads(acc, w, vals, bf16, stride, n, 64, 1);
    else if (D == 64 && h == 2) add_values_heads(acc, w, vals, bf16, stride, n, 64, 2);
    else add_values_heads(acc, w, vals, bf16, stride, n, D, h);
}

/* attend_block with the keys transposed (kT: transpose_keys of the block) and the values at vals +
 * p * stride (float32, or bf16 as stored with `vbf16`: widened in registers); w: 64 floats of
 * scratch. The same partials as attend_block's, summed differently. */
static void attend_block16(const kv_step *s, int64_t i, int64_t g, int64_t part, int64_t b, int first,
                           const float *kT, const void *vals, int vbf16, int64_t stride, float *w) {
    const kv_decoder *d = s->d;
    const int64_t QH = d->num_heads, KVH = d->num_kv_heads, D = d->head_size, bs = d->block_size;
    const int64_t G = QH / KVH, S = KV_MAX_SPLITS;
    const int64_t len = s->seq_lens[i];
    const float *q0 = s->qkv + i * qkv_width(d) + g * G * D;
    float *out = start_partials(s, i, g, part, first);
    const int64_t n = len - b * bs < bs ? len - b * bs : bs;
    const int64_t from = row_from(s, i) - b * bs;   /* positions before it: outside the window */
    for (int64_t c = (from > 0 ? from : 0) / 16; 16 * c < n; c++) {
        const int64_t m = n - 16 * c < 16 ? n - 16 * c : 16, skip = from - 16 * c > 0 ? from - 16 * c : 0;
        const __mmask16 valid = (__mmask16)(((1u << m) - 1u) & ~((1u << skip) - 1u));
        for (int64_t j0 = 0; j0 < G; j0 += 4) {
            __m512 sc[4];
            const int h = (int)(G - j0 < 4 ? G - j0 : 4);
            const float *q = q0 + j0 * D, *kc = kT + c * D * 16;
            switch (h) {   /* a constant H: the accumulators stay in registers */
            case 4: scores16(q, kc, D, 4, (float)d->scale, sc); break;
            case 3: scores16(q, kc, D, 3, (float)d->scale, sc); break;
            case 2: scores16(q, kc, D, 2, (float)d->scale, sc); break;
            default: scores16(q, kc, D, 1, (float)d->scale, sc); break;
            }
            float *acc[4];
            for (int j = 0; j < h; j++) {   /* each head's weights, its sums rescaled first */
                float *o = out + (j0 + j) * S * (D + 2);
                rescale_partial(o, _mm512_mask_reduce_max_ps(valid, sc[j]), D);
                const __m512 p = _mm512_maskz_mov_ps(valid, exp16(_mm512_sub_ps(sc[j], _mm512_set1_ps(o[0]))));
                o[1] += _mm512_reduce_add_ps(p);
                _mm512_storeu_ps(w + 16 * j, p);
                acc[j] = o + 2;
            }
            const int64_t at = 16 * c * stride;   /* then the h heads' values in one pass */
            add_values_h(acc, w, vbf16 ? (const void *)((const uint16_t *)vals + at) : (const void *)((const float *)vals + at),
                         vbf16, stride, m, D, h);
        }
    }
}
#endif

#endif
