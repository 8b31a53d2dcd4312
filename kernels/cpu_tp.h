/* kvfleet CPU kernels: tensor parallelism inside the fused step (included by cpu_decoder.c, after
 * its helpers add_normed and timed).
 *
 * Contract. Under tensor parallelism each rank's kv_decoder describes its own shard, as
 * transformers' tensor-parallel plan splits the model (runtime/worker/cpu_decode_tp.py checks the
 * plan): q|k|v and gate|up hold the rank's output rows (its query and KV heads, its MLP channels;
 * num_heads, num_kv_heads and intermediate are the rank's), o and down the matching input columns,
 * the KV caches the rank's KV heads. o's and down's products are then the rank's partial sums of
 * the sublayer's output. With kv_decoder.all_reduce set, each of those two matrices writes its
 * partial output into the step's h (never straight into the residual), and tp_sum calls
 * all_reduce(h, M * H): it must sum h over the ranks in place (every rank calls it at the same
 * points, M the same on every rank) and return 0, or nonzero on failure. Then x += h *
 * residual_scale (or, with the layer's output norm, add_normed's x += rmsnorm(h) * residual_scale,
 * at its call site). A bias of o or down is the caller's to add once (on one rank's matrix only).
 * all_reduce NULL: one rank, nothing changes. The callback runs on the thread that called
 * kv_decode, between two phases (the pool's helpers idle).
 *
 * A failed all_reduce marks the step failed (tp_failed): kv_decode stops after the layer and
 * returns -2, the ranks being out of step; the caller raises. The time spent in all_reduce is
 * the profile's PROF_TP.
 */
#ifndef KVFLEET_CPU_TP_H
#define KVFLEET_CPU_TP_H

static int TP_FAILED;   /* the current step's all_reduce failed (P.lock held) */

static inline int tp_on(const kv_step *s) { return s->d->all_reduce != NULL; }

static void task_add_h(const void *ctx, int64_t t) {
    const kv_prep *p = ctx;
    const kv_step *s = p->s;
    const int64_t H = s->d->hidden, m0 = t * KV_PREP_ROWS, m1 = min64(m0 + KV_PREP_ROWS, s->M);
    const float rs = (float)s->d->residual_scale;
    for (int64_t m = m0; m < m1; m++) {
        const float *h = s->h + m * H;
        float *x = s->x + m * H;
        for (int64_t k = 0; k < H; k++) x[k] += rs == 1.0f ? h[k] : h[k] * rs;
    }
}

/* After o's or down's tasks wrote this rank's partial output into h (tp_on): h summed over the
 * ranks, then, unless the sublayer has an output norm (`normed`: its call site adds it), x += h *
 * residual_scale. `phase`: the profile phase the matrix's time goes to. No-op with one rank. */
static void tp_sum(kv_step *s, int normed, int phase, int64_t *t) {
    if (!tp_on(s) || TP_FAILED) return;
    timed(phase, t);
    if (s->d->all_reduce(s->h, s->M * s->d->hidden) != 0) {
        TP_FAILED = 1;
        return;
    }
    timed(PROF_TP, t);
    if (!normed) {
        const kv_prep p = {.s = s};
        kv_parallel(task_add_h, &p, prep_tasks(s));
    }
}

#endif
