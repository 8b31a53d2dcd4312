/* kvfleet CPU kernels: what the fused decoder does to a layer's new queries, keys and values
 * right before attention (cpu_attention.h includes this file): the q/k norms, rotary, and the new
 * keys and values into the paged cache in its dtype (float32, or bf16 rounded to nearest even as
 * torch rounds). write_kv runs as tasks of KV_PREP_ROWS rows; each row's work is its own.
 */
#ifndef KVFLEET_CPU_KV_WRITE_H
#define KVFLEET_CPU_KV_WRITE_H

#include "cpu_step.h"

/* transformers' apply_rotary_pos_emb on the first R elements of a head (the rest pass through):
 * x * cos + rotate_half(x) * sin. Half style: rotate_half(x) = [-x2, x1] over the halves;
 * interleaved (GLM-4): pairs (2i, 2i + 1) turn by cos[i], sin[i], the first half of the rotary
 * module's output repeated twice. */
static void rope(float *x, const float *c, const float *s, int64_t R, int64_t interleaved) {
    const int64_t h = R / 2;
    if (interleaved) {
        for (int64_t i = 0; i < h; i++) {
            float a = x[2 * i], b = x[2 * i + 1];
            x[2 * i] = a * c[i] - b * s[i];
            x[2 * i + 1] = b * c[i] + a * s[i];
        }
        return;
    }
    for (int64_t i = 0; i < h; i++) {
        float a = x[i], b = x[i + h];
        x[i] = a * c[i] - b * s[i];
        x[i + h] = b * c[i + h] + a * s[i + h];
    }
}

/* f rounded to bf16, nearest even (torch's round_to_nearest_even: NaN -> 0x7fc0). */
static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if (f != f) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* D floats into the cache c (d's cache dtype) at element offset at. */
static void store_kv(const kv_decoder *d, void *c, int64_t at, const float *x, int64_t D) {
    if (d->cache_dtype == KV_CACHE_BF16)
        for (int64_t e = 0; e < D; e++) ((uint16_t *)c)[at + e] = to_bf16(x[e]);
    else
        memcpy((float *)c + at, x, D * sizeof(float));
}

/* Bytes per cache element. */
static inline int64_t kv_elem(const kv_decoder *d) { return d->cache_dtype == KV_CACHE_BF16 ? 2 : 4; }

/* Before the attention phase, KV_PREP_ROWS rows a task: rotary on each row's new queries and keys,
 * and its keys and values into the cache (so that every attention task reads a complete cache). */
static void task_write_kv(const void *ctx, int64_t t) {
    const kv_step *s = ctx;
    const kv_decoder *d = s->d;
    const int64_t QH = d->num_heads, KVH = d->num_kv_heads, D = d->head_size, R = d->rotary_dim;
    const int64_t il = d->rotary_interleaved;
    const float eps = (float)d->eps;
    for (int64_t i = t * KV_PREP_ROWS; i < min64((t + 1) * KV_PREP_ROWS, s->M); i++) {
        float *row = s->qkv + i * qkv_width(d);
        const float *c = s->cos + (s->L->rope * s->M + i) * R, *sn = s->sin + (s->L->rope * s->M + i) * R;
        if (d->qk_norm == KV_QK_PROJ) {   /* over the whole projection (OLMo 2) */
            rmsnorm(row, s->L->q_norm, QH * D, eps, row);
            rmsnorm(row + QH * D, s->L->k_norm, KVH * D, eps, row + QH * D);
        } else if (d->qk_norm == KV_QK_HEAD) {   /* per head (Qwen3, Gemma 3) */
            for (int64_t h = 0; h < QH; h++) rmsnorm(row + h * D, s->L->q_norm, D, eps, row + h * D);
            for (int64_t g = 0; g < KVH; g++) rmsnorm(row + (QH + g) * D, s->L->k_norm, D, eps, row + (QH + g) * D);
        }
        for (int64_t h = 0; h < QH; h++) rope(row + h * D, c, sn, R, il);
        for (int64_t g = 0; g < KVH; g++) {
            float *k = row + (QH + g) * D, *v = row + (QH + KVH + g) * D;
            rope(k, c, sn, R, il);
            if (s->slots[i] >= 0) {
                store_kv(d, s->L->k_cache, (s->slots[i] * KVH + g) * D, k, D);
                store_kv(d, s->L->v_cache, (s->slots[i] * KVH + g) * D, v, D);
            }
        }
    }
}

static void write_kv(const kv_step *s) { kv_parallel(task_write_kv, s, prep_tasks(s)); }

#endif
