/* kvfleet CPU kernels: the fused decoder's attention phase, for cpu_decoder.c (what comes right
 * before it, rotary and the cache writes, is cpu_kv_write.h). Per layer: write_kv, then
 * attention (passes of KV_ATTN_ROWS rows; tasks per group of a sequence's consecutive rows, KV
 * head and split), then merge_attention. Every row's sums are its own: the same blocks in the same order, its own split
 * (split_of, by its own length), whatever the step's other rows (batch-invariant).
 */
#ifndef KVFLEET_CPU_ATTENTION_H
#define KVFLEET_CPU_ATTENTION_H

#include "cpu_kv_write.h"

/* The first position row i attends to in the current layer: len - window with a sliding window
 * (transformers' sliding_window: key positions > query position - window), else 0. */
static inline int64_t row_from(const kv_step *s, int64_t i) {
    const int64_t len = s->seq_lens[i], w = s->L->window;
    return w > 0 && len > w ? len - w : 0;
}

/* Row i's cache blocks in the current layer: first .. blocks - 1 (blocks before the window's
 * first are never read: the KV cache manager may have freed them). Returns the split size's
 * split_of over blocks - first in *per and the split count. */
static inline int64_t split_of(int64_t blocks, int64_t *per);
static inline int64_t row_blocks(const kv_step *s, int64_t i, int64_t *first, int64_t *blocks, int64_t *per) {
    const int64_t bs = s->d->block_size;
    *blocks = (s->seq_lens[i] + bs - 1) / bs;
    *first = row_from(s, i) / bs;
    return split_of(*blocks - *first, per);
}

/* Scores of query q against four keys at element offsets k0..k3 of kc (D floats each), as one
 * vector: each dot in two FMA chains (elements e mod 16 < 8 and >= 8), then one tree of horizontal
 * adds for the four (a fixed order per key, wherever the key sits in its group of four). With
 * AVX-512 the two chains are the halves of one 16-wide accumulator: the same arithmetic, bit for
 * bit, in half the instructions. */
static inline __attribute__((always_inline)) __m128 dot4(const float *q, const float *kc, int64_t k0, int64_t k1,
                                                         int64_t k2, int64_t k3, int64_t D) {
    __m256 a0 = _mm256_setzero_ps(), b0 = a0, a1 = a0, b1 = a0, a2 = a0, b2 = a0, a3 = a0, b3 = a0;
    int64_t e = 0;
#ifdef __AVX512F__
    __m512 c0 = _mm512_setzero_ps(), c1 = c0, c2 = c0, c3 = c0;
    for (; e + 16 <= D; e += 16) {
        const __m512 qv = _mm512_loadu_ps(q + e);
        c0 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(kc + k0 + e), c0);
        c1 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(kc + k1 + e), c1);
        c2 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(kc + k2 + e), c2);
        c3 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(kc + k3 + e), c3);
    }
    a0 = _mm512_castps512_ps256(c0), b0 = _mm512_extractf32x8_ps(c0, 1);
    a1 = _mm512_castps512_ps256(c1), b1 = _mm512_extractf32x8_ps(c1, 1);
    a2 = _mm512_castps512_ps256(c2), b2 = _mm512_extractf32x8_ps(c2, 1);
    a3 = _mm512_castps512_ps256(c3), b3 = _mm512_extractf32x8_ps(c3, 1);
#else
    for (; e + 16 <= D; e += 16) {
        const __m256 q0 = _mm256_loadu_ps(q + e), q1 = _mm256_loadu_ps(q + e + 8);
        a0 = _mm256_fmadd_ps(q0, _mm256_loadu_ps(kc + k0 + e), a0);
        b0 = _mm256_fmadd_ps(q1, _mm256_loadu_ps(kc + k0 + e + 8), b0);
        a1 = _mm256_fmadd_ps(q0, _mm256_loadu_ps(kc + k1 + e), a1);
        b1 = _mm256_fmadd_ps(q1, _mm256_loadu_ps(kc + k1 + e + 8), b1);
        a2 = _mm256_fmadd_ps(q0, _mm256_loadu_ps(kc + k2 + e), a2);
        b2 = _mm256_fmadd_ps(q1, _mm256_loadu_ps(kc + k2 + e + 8), b2);
        a3 = _mm256_fmadd_ps(q0, _mm256_loadu_ps(kc + k3 + e), a3);
        b3 = _mm256_fmadd_ps(q1, _mm256_loadu_ps(kc + k3 + e + 8), b3);
    }
#endif
    if (e < D) {
        const __m256 q0 = _mm256_loadu_ps(q + e);
        a0 = _mm256_fmadd_ps(q0, _mm256_loadu_ps(kc + k0 + e), a0);
        a1 = _mm256_fmadd_ps(q0, _mm256_loadu_ps(kc + k1 + e), a1);
        a2 = _mm256_fmadd_ps(q0, _mm256_loadu_ps(kc + k2 + e), a2);
        a3 = _mm256_fmadd_ps(q0, _mm256_loadu_ps(kc + k3 + e), a3);
    }
    const __m256 t01 = _mm256_hadd_ps(_mm256_add_ps(a0, b0), _mm256_add_ps(a1, b1));
    const __m256 t23 = _mm256_hadd_ps(_mm256_add_ps(a2, b2), _mm256_add_ps(a3, b3));
    const __m256 t = _mm256_hadd_ps(t01, t23);   /* lane l of each half: key l's partial sum */
    return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

/* acc[0 .. D) += sum_p w[p] * vc[p * stride + e] over the n positions of one block, each element
 * its own chain over p (so the vector width changes no bit: 16 wide with AVX-512, else 8). Called
 * with D = 64 and 128 as constants, so the accumulators stay in registers for the whole block
 * (instead of a load and a store per position and 8 values). */
static inline __attribute__((always_inline)) void accumulate_values(float *acc, const float *w, const float *vc,
                                                                    int64_t stride, int64_t n, int64_t D) {
    int64_t e0 = 0;
#ifdef __AVX512F__
    for (; e0 + 64 <= D; e0 += 64) {
        __m512 a[4];
        for (int64_t e = 0; e < 4; e++) a[e] = _mm512_loadu_ps(acc + e0 + 16 * e);
        for (int64_t p = 0; p < n; p++) {
            const __m512 wp = _mm512_set1_ps(w[p]);
            const float *vp = vc + p * stride + e0;
            for (int64_t e = 0; e < 4; e++) a[e] = _mm512_fmadd_ps(wp, _mm512_loadu_ps(vp + 16 * e), a[e]);
        }
        for (int64_t e = 0; e < 4; e++) _mm512_storeu_ps(acc + e0 + 16 * e, a[e]);
    }
#endif
    for (; e0 < D; e0 += 64) {
        const int64_t width = D - e0 < 64 ? D - e0 : 64;
        __m256 a[8];
        for (int64_t e = 0; e < width / 8; e++) a[e] = _mm256_loadu_ps(acc + e0 + 8 * e);
        for (int64_t p = 0; p < n; p++) {
            const __m256 wp = _mm256_set1_ps(w[p]);
            const float *vp = vc + p * stride + e0;
            for (int64_t e = 0; e < width / 8; e++) a[e] = _mm256_fmadd_ps(wp, _mm256_loadu_ps(vp + 8 * e), a[e]);
        }
        for (int64_t e = 0; e < width / 8; e++) _mm256_storeu_ps(acc + e0 + 8 * e, a[e]);
    }
}

/* How a sequence of `blocks` cache blocks is split: `*per` blocks per split (at least
 * KV_SPLIT_BLOCKS, more for long sequences so that there are at most KV_MAX_SPLITS); returns the
 * number of splits. It depends on the sequence's length only, never on the step's other rows or
 * the thread count: a row's attention sums in the same order in any batch (batch-invariant). */
static inline int64_t split_of(int64_t blocks, int64_t *per) {
    int64_t p = (blocks + KV_MAX_SPLITS - 1) / KV_MAX_SPLITS;
    p = p < KV_SPLIT_BLOCKS ? KV_SPLIT_BLOCKS : p;
    *per = p;
    return blocks ? (blocks + p - 1) / p : 1;
}

/* Row i's partials for KV head g's first query head in split `part` (head j at + j * S * (D + 2):
 * the running maximum, the sum of exp(score - maximum), the D exp-weighted value sums); with
 * `first`, every head's are started (-inf, 0, zeros). */
static float *start_partials(const kv_step *s, int64_t i, int64_t g, int64_t part, int first) {
    const kv_decoder *d = s->d;
    const int64_t QH = d->num_heads, D = d->head_size, G = QH / d->num_kv_heads, S = KV_MAX_SPLITS;
    float *out = s->partial + (((i - s->a0) * QH + g * G) * S + part) * (D + 2);
    if (first)
        for (int64_t j = 0; j < G; j++) {
            float *o = out + j * S * (D + 2);
            o[0] = -INFINITY;
            o[1] = 0.0f;
            memset(o + 2, 0, D * sizeof(float));
        }
    return out;
}

/* One head's partials o (start_partials) before a block whose largest score is bmax: what was
 * summed under a smaller maximum is rescaled to bmax (online softmax). */
static inline void rescale_partial(float *o, float bmax, int64_t D) {
    if (bmax <= o[0]) return;
    const float corr = expf(o[0] - bmax);
    o[1] *= corr;
    for (int64_t e = 0; e < D; e += 8)
        _mm256_storeu_ps(o + 2 + e, _mm256_mul_ps(_mm256_loadu_ps(o + 2 + e), _mm256_set1_ps(corr)));
    o[0] = bmax;
}

/* accumulate_values with D = 64 and 128 as constants (the accumulators in registers). */
static inline void add_values(float *acc, const float *w, const float *vc, int64_t stride, int64_t n, int64_t D) {
    if (D == 64) accumulate_values(acc, w, vc, stride, n, 64);
    else if (D == 128) accumulate_values(acc, w, vc, stride, n, 128);
    else accumulate_values(acc, w, vc, stride, n, D);
}

/* Partial attention of row i, KV head g, over one cache block (position b * bs on) of split `part`
 * (of the row's split_of): for each of the group's query heads, the running maximum, the sum of
 * exp(score - maximum) and the exp-weighted sum of values (online softmax: Milakov & Gimelshein
 * 2018, "Online normalizer calculation for softmax"), stored in s->partial for merge_attention.
 * `first` starts the split's sums; blocks are added one call at a time, in order. kb, vb: the
 * block's keys and values of KV head g as float32, position p at kb + p * stride (the cache
 * itself, or a bf16 block widened once for all the rows that read it: task_attention). The same
 * code for every row, alone or in a group: a row's sums do not depend on the rest of the step. */
static void attend_block(const kv_step *s, int64_t i, int64_t g, int64_t part, int64_t b, int first,
                         const float *kb, const float *vb, int64_t stride, float *sc) {
    const kv_decoder *d = s->d;
    const int64_t QH = d->num_heads, KVH = d->num_kv_heads, D = d->head_size, bs = d->block_size;
    const int64_t G = QH / KVH, S = KV_MAX_SPLITS;
    const int64_t len = s->seq_lens[i];
    const float *q0 = s->qkv + i * qkv_width(d) + g * G * D;
    const float scale = (float)d->scale;
    float *out = start_partials(s, i, g, part, first);
    const int64_t n = len - b * bs < bs ? len - b * bs : bs, n8 = (n + 7) / 8 * 8;
    const int64_t from = row_from(s, i) - b * bs;   /* positions before it: outside the window */
    for (int64_t j = 0; j < G; j++) {
        const float *q = q0 + j * D;
        float *o = out + j * S * (D + 2), *acc = o + 2;
        for (int64_t p = 0; p < n; p += 4) {   /* past n: the last key again (never used) */
            const int64_t p1 = p + 1 < n ? p + 1 : p, p2 = p + 2 < n ? p + 2 : p, p3 = p + 3 < n ? p + 3 : p;
            _mm_storeu_ps(sc + p, _mm_mul_ps(dot4(q, kb, p * stride, p1 * stride, p2 * stride, p3 * stride, D),
                                             _mm_set1_ps(scale)));
        }
        for (int64_t p = n; p < n8; p++) sc[p] = -INFINITY;   /* the 8-wide tail: no score */
        for (int64_t p = 0; p < from; p++) sc[p] = -INFINITY;
        __m256 mx = _mm256_loadu_ps(sc);
        for (int64_t p = 8; p < n8; p += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(sc + p));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        rescale_partial(o, _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4))), D);
        const __m256 vmx = _mm256_set1_ps(o[0]);
        __m256 sum = _mm256_setzero_ps();
        for (int64_t p = 0; p < n8; p += 8) {   /* exp(-inf) = 0 past n */
            const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sc + p), vmx));
            _mm256_storeu_ps(sc + p, e);
            sum = _mm256_add_ps(sum, e);
        }
        o[1] += hsum(sum);
        add_values(acc, sc, vb, stride, n, D);
    }
}

#include "cpu_attention16.h"   /* the AVX-512 scores (attend_block16), over the helpers above */

/* A cache block's bf16 keys or values (position p at c + p * stride) widened to float32 into
 * out [bs, D] (exact: a bf16 is the high half of a float32). */
static inline void widen_block(const uint16_t *c, int64_t stride, int64_t bs, int64_t D, float *out) {
    for (int64_t p = 0; p < bs; p++) {
        int64_t e = 0;
#ifdef __AVX512F__
        for (; e + 16 <= D; e += 16) _mm512_storeu_ps(out + p * D + e, widen_bf16_16(c + p * stride + e));
#endif
        for (; e < D; e += 8) _mm256_storeu_ps(out + p * D + e, widen_bf16(c + p * stride + e));
    }
}

/* Cache block `block`'s keys and values of KV head g prefetched into L2 (task_attention: the
 * split's first KV_AHEAD blocks when the task starts, then KV_AHEAD blocks ahead of the one
 * attended; the next block then into L1). The prefetches to L1 alone, one block ahead, left the
 * first block of every task and the stream's latency uncovered: from memory, one thread, the
 * 48-row step's attention 65 -> 55 ms (docs/performance.md, issue 40). Always inlined: as a call
 * it gained nothing (a call clobbers every vector register of task_attention's loop). */
enum { KV_AHEAD = 8 };
static inline __attribute__((always_inline)) void prefetch_block_l2(const char *kc, const char *vc, int64_t block,
                                                                    const kv_decoder *d, int64_t g) {
    const int64_t KVH = d->num_kv_heads, D = d->head_size, es = kv_elem(d), stride = KVH * D;
    const int64_t at = (block * d->block_size * KVH + g) * D;
    for (int64_t p = 0; p < d->block_size; p++)
        for (int64_t o = 0; o < D * es; o += 64) {
            _mm_prefetch(kc + (at + p * stride) * es + o, _MM_HINT_T1);
            _mm_prefetch(vc + (at + p * stride) * es + o, _MM_HINT_T1);
        }
}

/* Task t = (group lead i, KV head g, split part), from s->tasks[t] = (lead index KVH + g) S + part
 * (attention() lists only the splits some row of the group has). Splitting a sequence's positions (Flash-Decoding's
 * split-K) gives the threads work when one sequence has few KV heads; a task reads each key and
 * value once for all the query heads that share it. Rows of one sequence at consecutive positions
 * (a speculative step's last token and drafts: s->group) are done by their first row's tasks,
 * block by block for all of them, so each block is read from memory once for the group; every
 * row still sums exactly as it would alone (the same blocks in the same order, its own split and
 * length). */
static void task_attention(const void *ctx, int64_t t) {
    const kv_step *s = ctx;
    const int64_t KVH = s->d->num_kv_heads, S = KV_MAX_SPLITS, bs = s->d->block_size;
    const int64_t i = s->leads[s->tasks[t] / (KVH * S)], g = s->tasks[t] / S % KVH, part = s->tasks[t] % S;
    const int64_t rows = s->group[i];
    int64_t b0 = -1, b1 = 0;
    for (int64_t r = i; r < i + rows; r++) {
        int64_t first, blocks, per;
        if (part >= row_blocks(s, r, &first, &blocks, &per)) continue;
        const int64_t lo = first + part * per, hi = lo + per < blocks ? lo + per : blocks;
        b0 = b0 < 0 || lo < b0 ? lo : b0;
        b1 = hi > b1 ? hi : b1;
    }
    if (b0 < 0) return;
    const kv_decoder *d = s->d;
    const int64_t D = d->head_size, stride = KVH * D, es = kv_elem(d);
    const char *kc = s->L->k_cache, *vc = s->L->v_cache;
    const int32_t *bt = s->block_tables + i * s->bt_stride;
    const int bf16 = d->cache_dtype == KV_CACHE_BF16;
#ifdef __AVX512F__
    const int t16 = D % 16 == 0;   /* the transposed-key scores (attend_block16) */
    float kT[t16 ? (bs + 15) / 16 * 16 * D : 1], w16[64];
#else
    const int t16 = 0;
#endif
    float sc[bs + 8], kw[bf16 && !t16 ? bs * D : 1], vw[bf16 ? bs * D : 1];
    for (int64_t b = b0; b < b0 + KV_AHEAD && b < b1; b++) prefetch_block_l2(kc, vc, bt[b], d, g);
    for (int64_t b = b0; b < b1; b++) {
        if (b + KV_AHEAD < b1) prefetch_block_l2(kc, vc, bt[b + KV_AHEAD], d, g);
        if (b + 1 < b1) {   /* the next block's keys and values: cache blocks sit anywhere in memory,
                             * and waiting on each line's miss made attention latency-bound */
            const int64_t next = ((int64_t)bt[b + 1] * bs * KVH + g) * D;
            for (int64_t p = 0; p < bs; p++) {
                prefetch_span(kc + (next + p * stride) * es, D * es);
                prefetch_span(vc + (next + p * stride) * es, D * es);
            }
        }
        const int64_t base = ((int64_t)bt[b] * bs * KVH + g) * D;   /* position b * bs, KV head g */
        const float *kb = (const float *)kc + base, *vb = (const float *)vc + base;
        const void *keys = kb;   /* what transpose_keys reads: the cache's keys (float32 or bf16) */
        int64_t kstride = stride, vstride = stride;
        const int direct = t16 && rows == 1;   /* one row (decode): its values read as stored, bf16
                                                 * widened in registers (attend_block16) */
        if (bf16) {   /* widened once for every row of the group and every query head (exact) */
            const uint16_t *k16 = (const uint16_t *)kc + base, *v16 = (const uint16_t *)vc + base;
            if (!direct) {
                widen_block(v16, stride, bs, D, vw);
                vb = vw, vstride = D;
            }
            if (t16) {
                keys = k16;   /* widened as they are transposed */
            } else {
                widen_block(k16, stride, bs, D, kw);
                kb = kw, kstride = D;
            }
        }
#ifdef __AVX512F__
        int transposed = 0;   /* kT holds this block's keys (transposed once, for the first row that reads it) */
#endif
        for (int64_t r = i; r < i + rows; r++) {
            int64_t first, blocks, per;
            if (part >= row_blocks(s, r, &first, &blocks, &per)) continue;
            const int64_t lo = first + part * per, hi = lo + per < blocks ? lo + per : blocks;
            if (b < lo || b >= hi) continue;
#ifdef __AVX512F__
            if (t16) {
                if (!transposed) transpose_keys(keys, bf16, kstride, bs, D, kT);
                transposed = 1;
                attend_block16(s, r, g, part, b, b == lo, kT,
                               direct && bf16 ? (const void *)((const uint16_t *)vc + base) : (const void *)vb,
                               direct && bf16, vstride, w16);
                continue;
            }
#endif
            (void)keys, (void)vstride;   /* (the AVX-512 scores' only: here kstride == vstride) */
            attend_block(s, r, g, part, b, b == lo, kb, vb, kstride, sc);
        }
    }
}

/* s->group: row i leads a group of the rows i, i + 1, ... of one sequence at consecutive
 * positions (the same block table, seq_lens one apart, the same split size), at most
 * KV_GROUP_ROWS, never across an attention pass (KV_ATTN_ROWS); group[i] = its row count, 0 for
 * the rows it leads. leads: the leading rows in order; returns their count. */
enum { KV_GROUP_ROWS = 32 };   /* a prefill chunk's rows: each block widened (and its keys transposed) once per 32 */
static int64_t group_rows(const kv_step *s, int64_t *group, int64_t *leads) {
    const int64_t bs = s->d->block_size;
    int64_t lead = 0, n = 1;
    group[0] = 1;
    leads[0] = 0;
    for (int64_t i = 1; i < s->M; i++) {
        const int64_t blocks = (s->seq_lens[i] + bs - 1) / bs;
        int64_t per_i, per_l;
        split_of(blocks, &per_i);
        split_of((s->seq_lens[lead] + bs - 1) / bs, &per_l);
        if (i % KV_ATTN_ROWS && s->seq_lens[i] == s->seq_lens[i - 1] + 1 && group[lead] < KV_GROUP_ROWS
            && per_i == per_l
            && !memcmp(s->block_tables + i * s->bt_stride, s->block_tables + lead * s->bt_stride,
                       blocks * sizeof(int32_t))) {
            group[lead]++;
            group[i] = 0;
        } else {
            lead = leads[n++] = i;
            group[i] = 1;
        }
    }
    return n;
}

/* Task t of merge_attention: each query head's output from its splits' partials (rescaled to the
 * largest maximum), for KV_PREP_ROWS rows of the attention pass (serial, it took ~15 % of a
 * prefill step's attention). */
static void task_merge(const void *ctx, int64_t t) {
    const kv_prep *pr = ctx;
    const kv_step *s = pr->s;
    const int64_t QH = s->d->num_heads, D = s->d->head_size;
    const int64_t r1 = min64((t + 1) * KV_PREP_ROWS, pr->rows) * QH;
    for (int64_t r = t * KV_PREP_ROWS * QH; r < r1; r++) {
        const int64_t stride = KV_MAX_SPLITS * (D + 2);
        int64_t first, blocks, per;
        const int64_t S = row_blocks(s, s->a0 + r / QH, &first, &blocks, &per);
        const float *p = s->partial + r * stride;
        float mx = -INFINITY, sum = 0.0f, *out = s->attn + (s->a0 * QH + r) * D;
        for (int64_t k = 0; k < S; k++) mx = p[k * (D + 2)] > mx ? p[k * (D + 2)] : mx;
        memset(out, 0, D * sizeof(float));
        for (int64_t k = 0; k < S; k++) {
            const float *o = p + k * (D + 2);
            if (o[1] == 0.0f) continue;   /* an empty split */
            float w = expf(o[0] - mx);
            sum += o[1] * w;
            for (int64_t e = 0; e < D; e++) out[e] += o[2 + e] * w;
        }
        float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
        for (int64_t e = 0; e < D; e++) out[e] *= inv;
    }
}

/* The attention outputs of the `rows` rows of the attention pass from their splits' partials. */
static void merge_attention(const kv_step *s, int64_t rows) {
    const kv_prep p = {.s = s, .rows = rows};
    kv_parallel(task_merge, &p, (rows + KV_PREP_ROWS - 1) / KV_PREP_ROWS);
}

/* Attention of every row, KV_ATTN_ROWS rows at a time (s->partial holds one pass): the tasks of
 * the groups led in the pass (one per lead, KV head and split that some row of its group has: no
 * empty tasks to claim, ~60 % of the slots of a 48-row decode step), then their merge. */
static void attention(kv_step *s, int64_t num_leads) {
    const int64_t KVH = s->d->num_kv_heads, S = KV_MAX_SPLITS, *all = s->leads;
    int64_t l0 = 0;
    for (s->a0 = 0; s->a0 < s->M; s->a0 += KV_ATTN_ROWS) {
        const int64_t a1 = min64(s->a0 + KV_ATTN_ROWS, s->M);
        int64_t l1 = l0, n = 0;
        while (l1 < num_leads && all[l1] < a1) l1++;
        s->leads = all + l0;
        for (int64_t l = 0; l < l1 - l0; l++) {
            int64_t splits = 0;
            for (int64_t r = s->leads[l]; r < s->leads[l] + s->group[s->leads[l]]; r++) {
                int64_t first, blocks, per;
                const int64_t k = row_blocks(s, r, &first, &blocks, &per);
                splits = k > splits ? k : splits;
            }
            for (int64_t g = 0; g < KVH; g++)
                for (int64_t part = 0; part < splits; part++) s->tasks[n++] = (l * KVH + g) * S + part;
        }
        kv_parallel(task_attention, s, n);
        merge_attention(s, a1 - s->a0);
        l0 = l1;
    }
    s->leads = all;
    s->a0 = 0;
}

#endif
