/* kvfleet CPU kernels: LoRA adapters' deltas inside the fused decoder step (cpu_decoder.c).
 *
 * Contract. A layer's adapted projections are kv_lora parts (cpu_decoder.h): per projection the
 * adapters' slots a [slots, R, K] and b [slots, R, n] (B^T with the scaling folded in, as
 * runtime/worker/lora_layers.py stores them), adding to output columns n0 .. n0 + n - 1 of the
 * layer's matrix (q, k and v are three parts of qkv, gate and up two of gate_up). A step's rows
 * carry their slot in d->lora_slots (-1: none; NULL: no row has one). For each row m with slot s
 * and each part of a matrix W:
 *
 *     y[m, n0 + j] += sum_r u[m, r] * b[s, r, j],   u[m, r] = x[m] . a[s, r]   (r < R)
 *
 * where x is W's input row and y W's output row before anything else uses it (the activation,
 * rotary, the residual add, the output norm). Rows without an adapter are untouched and cost
 * nothing; a step without adapter rows costs a NULL test per phase.
 *
 * Two halves, so that neither needs a [M, N] buffer: lora_shrink (a phase of its own before W's
 * tasks: (row, part, 4 ranks) each) computes every adapted part's u[m] = x[m] a[s]^T into the
 * step's small scratch; lora_expand (called inside W's tasks on the block of rows and output
 * columns the task just computed) adds u[m] b[s] to those columns.
 *
 * Batch invariance: u[m] is f32_m1's one-row dot product (the fixed order of cpu_gemv_m1.h), and
 * each output column sums r = 0 .. R - 1 with one fused multiply-add each, the same in vector
 * lanes and in the scalar tail: a row's delta is the same bits whatever the step's other rows,
 * its row block and the task's columns. All float32, whatever the matmul kind of the base weights.
 *
 * State (LORA below): the step's adapter rows, set by lora_begin under P.lock like the pool's scratch.
 */
#ifndef KVFLEET_CPU_LORA_H
#define KVFLEET_CPU_LORA_H

#include "cpu_step.h"

static struct {
    int64_t n;          /* rows of the step with an adapter */
    int64_t *row;       /* [2 M]: row m's index among them (or -1), then the adapter rows in order */
    const int64_t *rows;  /* row + M: the adapter rows */
    float *u;           /* [n, KV_LORA_PARTS, R]: each adapted part's shrink */
    int64_t have_row, have_u;
} LORA;

/* The step's adapter rows from d->lora_slots (P.lock held). Returns 0, or -1 when out of memory. */
static int lora_begin(const kv_decoder *d, int64_t M) {
    LORA.n = 0;
    if (!d->lora_slots || d->lora_rank <= 0) return 0;
    if (kv_grow((void **)&LORA.row, &LORA.have_row, 2 * M, sizeof(int64_t))) return -1;
    int64_t n = 0, *rows = LORA.row + M;
    for (int64_t m = 0; m < M; m++) {
        LORA.row[m] = d->lora_slots[m] >= 0 ? n : -1;
        if (d->lora_slots[m] >= 0) rows[n++] = m;
    }
    if (n && kv_grow((void **)&LORA.u, &LORA.have_u, n * KV_LORA_PARTS * d->lora_rank, sizeof(float))) return -1;
    LORA.n = n;
    LORA.rows = rows;
    return 0;
}

/* Whether layer L has an adapted part among p0 .. p1 - 1 and the step has adapter rows. */
static inline int lora_any(const kv_layer *L, int p0, int p1) {
    if (!LORA.n || !L->lora) return 0;
    for (int p = p0; p < p1; p++)
        if (L->lora->part[p].a) return 1;
    return 0;
}

/* Shrink tasks: (adapter row, part, KV_LORA_RANKS ranks), so that one decode row's few hundred dot
 * products still spread over the threads. */
enum { KV_LORA_RANKS = 4 };
typedef struct { const kv_step *s; const float *x; int64_t K, chunks; int p0, p1; } kv_lora_shrink;

static void task_lora_shrink(const void *ctx, int64_t t) {
    const kv_lora_shrink *c = ctx;
    const int64_t R = c->s->d->lora_rank, K = c->K, per_row = (c->p1 - c->p0) * c->chunks;
    const int64_t i = t / per_row, p = c->p0 + t % per_row / c->chunks, r0 = t % c->chunks * KV_LORA_RANKS;
    const kv_lora_part *part = &c->s->L->lora->part[p];
    if (!part->a) return;
    const int64_t m = LORA.rows[i], slot = c->s->d->lora_slots[m];
    const float *x = c->x + m * K, *a = part->a + slot * R * K;
    float *u = LORA.u + (i * KV_LORA_PARTS + p) * R;
    for (int64_t r = r0; r < min64(r0 + KV_LORA_RANKS, R); r++) u[r] = f32_m1(x, K, a + r * K);
}

/* u of parts p0 .. p1 - 1 of the current layer for every adapter row, from their input rows x [M, K]. */
static void lora_shrink(const kv_step *s, const float *x, int64_t K, int p0, int p1) {
    if (!lora_any(s->L, p0, p1)) return;
    const int64_t chunks = (s->d->lora_rank + KV_LORA_RANKS - 1) / KV_LORA_RANKS;
    const kv_lora_shrink c = {.s = s, .x = x, .K = K, .chunks = chunks, .p0 = p0, .p1 = p1};
    kv_parallel(task_lora_shrink, &c, LORA.n * (p1 - p0) * chunks);
}

/* y[j] += sum_r u[r] b[r * ldb + j] for j < n, r = 0 .. R - 1 in order, one FMA each. */
static inline void lora_expand_row(const float *u, int64_t R, const float *b, int64_t ldb, int64_t n, float *y) {
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        __m256 acc = _mm256_setzero_ps();
        for (int64_t r = 0; r < R; r++) acc = _mm256_fmadd_ps(_mm256_set1_ps(u[r]), _mm256_loadu_ps(b + r * ldb + j), acc);
        _mm256_storeu_ps(y + j, _mm256_add_ps(_mm256_loadu_ps(y + j), acc));
    }
    for (; j < n; j++) {
        float acc = 0.0f;
        for (int64_t r = 0; r < R; r++) acc = fmaf(u[r], b[r * ldb + j], acc);
        y[j] += acc;
    }
}

/* The deltas of parts p0 .. p1 - 1 (lora_shrink's u) in the block a task computed: rows m0 ..
 * m0 + rows - 1 and matrix columns c0 .. c1 - 1, stored at y[(m - m0) * ldy + c - c0]. */
static void lora_expand(const kv_step *s, int p0, int p1, int64_t m0, int64_t rows, int64_t c0, int64_t c1,
                        float *y, int64_t ldy) {
    if (!lora_any(s->L, p0, p1)) return;
    const int64_t R = s->d->lora_rank;
    for (int64_t m = m0; m < m0 + rows; m++) {
        const int64_t i = LORA.row[m];
        if (i < 0) continue;
        const int64_t slot = s->d->lora_slots[m];
        for (int p = p0; p < p1; p++) {
            const kv_lora_part *part = &s->L->lora->part[p];
            const int64_t lo = c0 > part->n0 ? c0 : part->n0, hi = min64(c1, part->n0 + part->n);
            if (!part->a || lo >= hi) continue;
            lora_expand_row(LORA.u + (i * KV_LORA_PARTS + p) * R, R, part->b + slot * R * part->n + (lo - part->n0),
                            part->n, hi - lo, y + (m - m0) * ldy + (lo - c0));
        }
    }
}

#endif
