/* kvfleet CPU kernels: a layer's mixture of experts in the fused decoder step (kv_layer.moe, the
 * kv_moe struct of cpu_decoder.h). Included by cpu_decoder.c after its matmul helpers (rows_of,
 * pack_rows, row_block, timed), whose contracts it keeps; cpu_decoder.c runs moe_phase in place of
 * the dense MLP (gate_up + SiLU, down) of a layer whose `moe` is set.
 *
 * Contract, for the step's M rows h [M, H] (the MLP's input, mlp_in_norm's output: s->h) and the
 * residual x (the experts' activation is SiLU; kernels/cpu_decoder.py refuses another):
 *
 *   route    logits = h R^T (R = moe->router [E, H], always float32 kernels, one-row order), then
 *            moe_route per row: k experts and their weights (below: the one definition).
 *   experts  for each expert e, the rows routed to it are gathered into one group (rows in step
 *            order; each group starts at a multiple of 16 rows, as the AMX tiles and the packed
 *            bf16 input want) and run as one matmul over the group: act = silu(g W_gu[e][:I]^T) *
 *            (g W_gu[e][I:]^T), y = act W_down[e]^T -- each expert's weights are read once per
 *            step (per pass of KV_MOE_GATHERED / k rows: 2048 with top-2, a whole default prefill
 *            chunk), in whatever format and matmul kind the dense layers use
 *            (rows_of: float32, AMX tiles, AVX512-BF16 dot products). Tasks are (expert, channel
 *            span) pairs over the experts that have rows.
 *   combine  x[m] += sum over m's k experts in ascending expert id of (w * y): a product then a
 *            sum, accumulated from zero and added to x once -- transformers' order (zeros, then
 *            index_add_ of y * w expert by expert in ascending id, then the residual add); times
 *            residual_scale, or through mlp_out_norm, as the dense MLP's output (add_rows).
 *
 * Batch invariance: a row's logits, routing, each of its expert outputs (rows_of sums every row
 * in the one-row order whatever the group's other rows, cpu_gemv.h / cpu_amx.h / cpu_dpbf16.h) and
 * its combine depend on that row alone, so its bits are the same alone and in any batch.
 *
 * Routing (moe_route: the one place; kernels/cpu_decoder.py MoeLayer documents the same):
 *   KV_MOE_SOFTMAX       p = softmax(logits) over all E (float32: max subtracted, expf, summed in
 *                        expert order, divided); the k largest p (ties: the lower expert id) in
 *                        descending order; with norm_topk_prob each divided by their sum (summed in
 *                        that order). Qwen3-MoE (norm_topk_prob as configured), Mixtral (always:
 *                        softmax over all then renormalised top-k equals the softmax over the top-k
 *                        logits, and is what transformers computes).
 *   KV_MOE_TOPK_SOFTMAX  the k largest logits, then the softmax over those k (GPT-OSS's order;
 *                        the router's bias, if any, is kv_matrix.bias).
 *   DeepSeek-V3's sigmoid scores with a selection bias and group-limited top-k would be a third
 *   kind here; the grouping and combine below do not depend on how the weights were chosen.
 */
#ifndef KVFLEET_CPU_MOE_H
#define KVFLEET_CPU_MOE_H

#define KV_MOE_GATHERED 4096  /* (row, expert) pairs per pass of the experts: KV_MOE_GATHERED / k step rows */
#define KV_MOE_MAX_K 16     /* most experts per token */

/* One row's routing (see the contract): logits [E] -> ids [k] in ascending expert id, weights [k]
 * in the same order. */
static void moe_route(const kv_moe *moe, const float *logits, int64_t *ids, float *weights) {
    const int64_t E = moe->num_experts, k = moe->top_k;
    float p[E > 0 ? E : 1], top[KV_MOE_MAX_K];
    int64_t pick[KV_MOE_MAX_K];
    float mx = logits[0];
    for (int64_t e = 1; e < E; e++) mx = logits[e] > mx ? logits[e] : mx;
    if (moe->scoring == KV_MOE_SOFTMAX) {
        float sum = 0.0f;
        for (int64_t e = 0; e < E; e++) sum += p[e] = expf(logits[e] - mx);
        for (int64_t e = 0; e < E; e++) p[e] = p[e] / sum;
    } else {
        for (int64_t e = 0; e < E; e++) p[e] = logits[e];
    }
    for (int64_t j = 0; j < k; j++) {   /* the k largest, descending; ties: the lower id */
        int64_t best = -1;
        for (int64_t e = 0; e < E; e++) {
            int taken = 0;
            for (int64_t i = 0; i < j; i++) taken |= pick[i] == e;
            if (!taken && (best < 0 || p[e] > p[best])) best = e;
        }
        pick[j] = best;
        top[j] = p[best];
    }
    if (moe->scoring == KV_MOE_TOPK_SOFTMAX) {
        const float first = top[0];   /* the largest */
        float sum = 0.0f;
        for (int64_t j = 0; j < k; j++) sum += top[j] = expf(top[j] - first);
        for (int64_t j = 0; j < k; j++) top[j] = top[j] / sum;
    } else if (moe->norm_topk_prob) {
        float sum = 0.0f;
        for (int64_t j = 0; j < k; j++) sum += top[j];
        for (int64_t j = 0; j < k; j++) top[j] = top[j] / sum;
    }
    for (int64_t j = 0; j < k; j++) {   /* ascending expert id: the combine's fixed order */
        int64_t at = 0;
        for (int64_t i = 0; i < k; i++) at += pick[i] < pick[j];
        ids[at] = pick[j];
        weights[at] = top[j];
    }
}

/* The experts' scratch (grown by moe_reserve under P.lock, like the step's). */
static struct {
    float *f;
    int64_t floats;
    int64_t *i;
    int64_t ints;
} MOE;

/* Step rows per pass of a layer's experts. */
static inline int64_t moe_pass_rows(const kv_moe *m) { return KV_MOE_GATHERED / m->top_k; }

/* Bounds of one pass, over the kv_moe layers of d, for steps of M rows: R step rows, E experts, k
 * per row, I width, G gathered rows (each group padded to 16), tasks. */
typedef struct { int64_t R, E, k, I, G, tasks; } kv_moe_sizes;

static kv_moe_sizes moe_sizes(const kv_decoder *d, int64_t M) {
    kv_moe_sizes z = {0};
    for (int64_t l = 0; l < d->num_layers; l++) {
        const kv_moe *m = d->layers[l].moe;
        if (!m) continue;
        const int64_t R = min64(M, moe_pass_rows(m)), G = R * m->top_k + 15 * min64(R * m->top_k, m->num_experts);
        z.R = R > z.R ? R : z.R;
        z.G = G > z.G ? G : z.G;
        z.E = m->num_experts > z.E ? m->num_experts : z.E;
        z.k = m->top_k > z.k ? m->top_k : z.k;
        z.I = m->intermediate > z.I ? m->intermediate : z.I;
    }
    z.tasks = 2 * (4 * (KV_MAX_THREADS + 1) + z.E);   /* moe_tasks: at most parts + experts */
    return z;
}

/* Grow the scratch for steps of M rows (P.lock held). Returns 0, or -1 when out of memory. */
static int moe_reserve(const kv_decoder *d, int64_t M, int bf16) {
    const kv_moe_sizes z = moe_sizes(d, M);
    if (!z.E) return 0;
    const int64_t wide = z.I > d->hidden ? z.I : d->hidden;
    const int64_t floats = z.R * z.E + z.R * z.k + z.G * (2 * d->hidden + z.I) + (bf16 ? (z.G * wide + 1) / 2 : 0);
    const int64_t ints = 2 * z.R * z.k + z.G + 2 * z.E + 1 + z.tasks;
    if (kv_grow((void **)&MOE.f, &MOE.floats, floats, sizeof(float))) return -1;
    return kv_grow((void **)&MOE.i, &MOE.ints, ints, sizeof(int64_t));
}

/* One pass of the experts over the step rows r0 .. r0 + rows - 1. */
typedef struct {
    kv_step g;              /* the step as the experts' matmuls see it: M = G gathered rows, xb ours */
    const kv_step *s;
    const kv_moe *moe;
    int64_t r0, rows, G, span;
    float *logits;          /* [rows, E] */
    float *wts;             /* [rows, k] each row's weights, ascending expert id */
    float *xg, *act, *y;    /* gathered [G, H] inputs, [G, I] activations, [G, H] expert outputs */
    int64_t *ids;           /* [rows, k] each row's experts, ascending */
    int64_t *at;            /* [rows, k] the gathered row of each (row, expert) */
    int64_t *src;           /* [G] the pass row a gathered row holds (padding rows: unset, never read) */
    int64_t *off;           /* [E + 1] expert e's group: gathered rows off[e] .. off[e + 1] - 1 (multiples of 16) */
    int64_t *end;           /* [E] the end of its routed rows (off[e] .. end[e] - 1; the rest is padding) */
    int64_t *task;          /* [tasks, 2]: (expert, first channel) */
} kv_moe_pass;

static void task_route(const void *ctx, int64_t t) {
    const kv_moe_pass *p = ctx;
    const int64_t H = p->s->d->hidden, E = p->moe->num_experts, k = p->moe->top_k;
    const int64_t m0 = t * KV_PREP_ROWS, m1 = min64(m0 + KV_PREP_ROWS, p->rows);
    kv_matrix_rows(&p->moe->router, p->s->h + (p->r0 + m0) * H, H, m1 - m0, 0, E, p->logits + m0 * E, E);
    for (int64_t m = m0; m < m1; m++) moe_route(p->moe, p->logits + m * E, p->ids + m * k, p->wts + m * k);
}

/* Rows [m0, m0 + 16) of x [G, K] (a 16-row block of one expert's group, whose routed rows end at
 * `end`), packed for bf16 matmuls. Padding rows are never read by any kernel (every call takes only
 * the routed rows: rows_of's `rows`, the tiles' token count), so they are neither copied nor
 * zeroed: the AMX tile of a block with padding takes zeros there, the dot-product layout nothing. */
static inline void moe_pack_block(const kv_moe_pass *p, const float *x, int64_t K, int64_t m0, int64_t end) {
    const int64_t m1 = min64(m0 + 16, end);
#if KV_HAVE_AMX
    if (p->g.matmul == KV_MATMUL_AMX) {
        kv_amx_pack_tile(x, K, m1, K, p->g.xb, m0);   /* rows m1 .. m0 + 15 as zeros */
        return;
    }
#endif
    pack_rows(&p->g, x, K, m0, m1);
}

/* The expert whose group holds gathered row m (groups are in expert order; off[E] = G). */
static inline int64_t moe_expert_of(const kv_moe_pass *p, int64_t m) {
    int64_t e = 0;
    while (p->off[e + 1] <= m) e++;
    return e;
}

/* Gathered rows [16 t, 16 t + 16): the routed rows' inputs copied and, for bf16 matmuls, packed. */
static void task_gather(const void *ctx, int64_t t) {
    const kv_moe_pass *p = ctx;
    const int64_t H = p->s->d->hidden, m0 = 16 * t, end = p->end[moe_expert_of(p, m0)];
    for (int64_t m = m0; m < min64(m0 + 16, end); m++)
        memcpy(p->xg + m * H, p->s->h + (p->r0 + p->src[m]) * H, H * sizeof(float));
    if (p->g.xb) moe_pack_block(p, p->xg, H, m0, end);
}

static void task_pack_act(const void *ctx, int64_t t) {
    const kv_moe_pass *p = ctx;
    moe_pack_block(p, p->act, p->moe->intermediate, 16 * t, p->end[moe_expert_of(p, 16 * t)]);
}

/* act[m, j] = silu(g . W_gu[j]) * (g . W_gu[I + j]) for gathered rows m0 .. m0 + rows - 1 (at
 * most row_block) and channels j0 .. j1 - 1 (at most KV_CHUNK); the arithmetic of silu_rows. */
static void moe_act_rows(const kv_moe_pass *p, const kv_matrix *w, int64_t m0, int64_t rows, int64_t j0, int64_t j1) {
    const int64_t I = p->moe->intermediate;
    float g[KV_BF16_ROW_BLOCK * KV_CHUNK], u[KV_BF16_ROW_BLOCK * KV_CHUNK];
    rows_of(&p->g, w, p->xg, m0, rows, j0, j1, g, KV_CHUNK);
    rows_of(&p->g, w, p->xg, m0, rows, I + j0, I + j1, u, KV_CHUNK);
    float *act = p->act + m0 * I;
    for (int64_t m = 0; m < rows; m++) {
        int64_t j = j0;
        for (; j + 8 <= j1; j += 8) {
            __m256 a = _mm256_loadu_ps(g + m * KV_CHUNK + j - j0);
            __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), a));
            _mm256_storeu_ps(act + m * I + j, _mm256_mul_ps(_mm256_div_ps(a, _mm256_add_ps(_mm256_set1_ps(1.0f), e)),
                                                            _mm256_loadu_ps(u + m * KV_CHUNK + j - j0)));
        }
        for (; j < j1; j++) {
            float a = g[m * KV_CHUNK + j - j0];
            act[m * I + j] = a / (1.0f + expf(-a)) * u[m * KV_CHUNK + j - j0];
        }
    }
}

static void task_expert_up(const void *ctx, int64_t t) {
    const kv_moe_pass *p = ctx;
    const int64_t e = p->task[2 * t], j0 = p->task[2 * t + 1], j1 = min64(j0 + p->span, p->moe->intermediate);
    const kv_matrix *w = &p->moe->gate_up[e];
    for (int64_t m0 = p->off[e]; m0 < p->end[e]; m0 += row_block(&p->g)) {
        const int64_t rows = min64(row_block(&p->g), p->end[e] - m0);
        for (int64_t j = j0; j < j1; j += KV_CHUNK) moe_act_rows(p, w, m0, rows, j, min64(j + KV_CHUNK, j1));
    }
}

static void task_expert_down(const void *ctx, int64_t t) {
    const kv_moe_pass *p = ctx;
    const int64_t H = p->s->d->hidden, e = p->task[2 * t], n0 = p->task[2 * t + 1], n1 = min64(n0 + p->span, H);
    for (int64_t m0 = p->off[e]; m0 < p->end[e]; m0 += row_block(&p->g))
        rows_of(&p->g, &p->moe->down[e], p->act, m0, min64(row_block(&p->g), p->end[e] - m0), n0, n1,
                p->y + m0 * H + n0, H);
}

/* The MoE output of row r0 + m, the sum of w * y over its experts in ascending expert id (see the
 * contract), where the dense MLP's down puts its output (add_rows): added to x (times
 * residual_scale), or, with an mlp_out_norm, into h for add_normed. */
static void task_combine(const void *ctx, int64_t t) {
    const kv_moe_pass *p = ctx;
    const kv_step *s = p->s;
    const int64_t H = s->d->hidden, k = p->moe->top_k, normed = s->L->mlp_out_norm != NULL;
    const int64_t m0 = t * KV_PREP_ROWS, m1 = min64(m0 + KV_PREP_ROWS, p->rows);
    const float rs = (float)s->d->residual_scale;
    for (int64_t m = m0; m < m1; m++) {
        float *x = (normed ? s->h : s->x) + (p->r0 + m) * H;
        int64_t h = 0;
        for (; h + 8 <= H; h += 8) {
            __m256 acc = _mm256_setzero_ps();
            for (int64_t j = 0; j < k; j++)
                acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_loadu_ps(p->y + p->at[m * k + j] * H + h),
                                                       _mm256_set1_ps(p->wts[m * k + j])));
            if (normed) _mm256_storeu_ps(x + h, acc);
            else _mm256_storeu_ps(x + h, _mm256_add_ps(_mm256_loadu_ps(x + h),
                                                       rs == 1.0f ? acc : _mm256_mul_ps(acc, _mm256_set1_ps(rs))));
        }
        for (; h < H; h++) {
            float acc = 0.0f;
            for (int64_t j = 0; j < k; j++) acc += p->y[p->at[m * k + j] * H + h] * p->wts[m * k + j];
            if (normed) x[h] = acc;
            else x[h] += rs == 1.0f ? acc : acc * rs;
        }
    }
}

/* The (expert, channel span) tasks over N channels of every expert with rows; sets p->span
 * (a multiple of KV_CHUNK, about four tasks per thread over all the experts' channels). */
static int64_t moe_tasks(kv_moe_pass *p, int64_t N) {
    const int64_t E = p->moe->num_experts;
    int64_t used = 0, n = 0;
    for (int64_t e = 0; e < E; e++) used += p->end[e] > p->off[e];
    const int64_t parts = 4 * (P.helpers + 1);
    int64_t span = (used * N + parts - 1) / parts;
    p->span = span = (span + KV_CHUNK - 1) / KV_CHUNK * KV_CHUNK;
    for (int64_t e = 0; e < E; e++)
        if (p->end[e] > p->off[e])
            for (int64_t c = 0; c < N; c += span) {
                p->task[2 * n] = e;
                p->task[2 * n + 1] = c;
                n++;
            }
    return n;
}

/* The layer's experts for the step's rows (in place of the dense MLP; see the contract); times
 * routing and the gate_up phase as PROF_MLP, down and the combine as PROF_DOWN. */
static void moe_phase(kv_step *s, int64_t *t) {
    const kv_moe *moe = s->L->moe;
    const int64_t H = s->d->hidden, E = moe->num_experts, k = moe->top_k, I = moe->intermediate;
    const kv_moe_sizes z = moe_sizes(s->d, s->M);
    for (int64_t r0 = 0; r0 < s->M; r0 += moe_pass_rows(moe)) {
        kv_moe_pass p = {.s = s, .moe = moe, .r0 = r0, .rows = min64(moe_pass_rows(moe), s->M - r0)};
        p.logits = MOE.f;
        p.wts = p.logits + z.R * z.E;
        p.xg = p.wts + z.R * z.k;
        p.y = p.xg + z.G * H;
        p.act = p.y + z.G * H;
        p.ids = MOE.i;
        p.at = p.ids + z.R * z.k;
        p.src = p.at + z.R * z.k;
        p.off = p.src + z.G;
        p.end = p.off + z.E + 1;
        p.task = p.end + z.E;
        kv_parallel(task_route, &p, (p.rows + KV_PREP_ROWS - 1) / KV_PREP_ROWS);
        /* group the (row, expert) pairs by expert, rows in step order, each group padded to 16 rows */
        for (int64_t e = 0; e <= E; e++) p.off[e] = 0;
        for (int64_t i = 0; i < p.rows * k; i++) p.off[p.ids[i] + 1]++;
        for (int64_t e = 0; e < E; e++) p.off[e + 1] = p.off[e] + (p.off[e + 1] + 15) / 16 * 16;
        p.G = p.off[E];
        for (int64_t e = 0; e < E; e++) p.end[e] = p.off[e];
        for (int64_t m = 0; m < p.rows; m++)
            for (int64_t j = 0; j < k; j++) {
                const int64_t g = p.end[p.ids[m * k + j]]++;
                p.at[m * k + j] = g;
                p.src[g] = m;
            }
        p.g = *s;
        p.g.M = p.G;
        p.g.xb = s->xb ? (uint16_t *)(p.act + z.G * z.I) : NULL;
        kv_parallel(task_gather, &p, p.G / 16);
        kv_parallel(task_expert_up, &p, moe_tasks(&p, I));
        if (p.g.xb) kv_parallel(task_pack_act, &p, p.G / 16);
        timed(PROF_MLP, t);
        kv_parallel(task_expert_down, &p, moe_tasks(&p, H));
        kv_parallel(task_combine, &p, (p.rows + KV_PREP_ROWS - 1) / KV_PREP_ROWS);
        timed(PROF_DOWN, t);
    }
}

#endif
