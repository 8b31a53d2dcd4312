/* kvfleet CPU kernels: one engine step of a dense decoder in one call, x86-64 AVX2 + FMA. The layer
 * is data (kv_layer, kv_decoder in cpu_decoder.h; runtime/worker/recipes.py fills it per family).
 *
 * Contract (kernels/cpu_decoder.py builds the kv_decoder description once from the model's
 * tensors, checks every shape, and calls kv_decode once per step; nothing here validates):
 *
 *   M rows, 1 <= M <= KV_MAX_ROWS: each row is one token, a one-token decode at its position (a
 *                        decode step's sequences; a speculative step's last token and drafts; a
 *                        prefill chunk's prompt tokens: row j of a sequence attends up to its own
 *                        position, over keys this step writes, since every row's key and value
 *                        is written before any row's attention)
 *   x [M, H] float32     in: the M rows' token embeddings; out: the residual stream after the
 *                        last layer (overwritten)
 *   out [M, H] float32   the final RMSNorm of x (the LM head's input)
 *   logits [L, V]        the LM head on the rows logits_indices [L] of out (all M rows when
 *                        logits_indices is NULL), when the decoder has a head (else NULL)
 *   cos, sin [R, M, rd]  each row's rotary embedding in each of R tables (a layer uses table
 *                        kv_layer.rope; transformers' rotary module output, attention scaling
 *                        included), rd = kv_decoder.rotary_dim: the first rd elements of each
 *                        head rotate, in halves or in interleaved pairs (kv_decoder.rotary_interleaved)
 *   slots [M] int64      cache slot of each row's new key/value (block * block_size + offset;
 *                        -1: not written)
 *   block_tables [M, W] int32 (rows `bt_stride` apart), seq_lens [M] int32: row i attends over
 *                        positions 0 .. len - 1 of its block table (len - window .. len - 1 in a
 *                        layer with a sliding window; earlier blocks are not read)
 *   caches               per layer [num_blocks, block_size, KVH, D] keys and values, float32 or
 *                        bf16 (d->cache_dtype): a bf16 cache stores each key and value rounded to
 *                        nearest even (torch's .to(torch.bfloat16)) and attention widens them to
 *                        float32 in registers (a shift); all arithmetic stays float32
 *
 * Per layer (attention_phase, then mlp_phase; a NULL norm is none): h = attn_in(x);
 * q|k|v = h Wqkv^T (+ bias); q_norm / k_norm per head or over the projection; rotary on q and k;
 * k, v written at the slot; attention of each query head over its KV head's cached positions in
 * the layer's window (grouped-query attention, online softmax, Milakov & Gimelshein 2018);
 * x += attn_out(attn Wo^T) * residual_scale; h = mlp_in(x);
 * x += mlp_out((act(h Wg^T) * h Wu^T) Wd^T) * residual_scale, act SiLU or GELU-tanh. The weights are
 * kv_matrix (cpu_gemv.h: fp32, bf16, int8, int4, grouped int8); gate_up holds the I gate rows,
 * then the I up rows. A matrix with an input permutation (kv_matrix.perm; not the head's nor the
 * experts') runs on its input rows gathered by it (cpu_perm.h), once per phase, after the LoRA
 * shrink of that input (adapters keep the natural order). A layer with experts (kv_layer.moe) runs
 * cpu_moe.h's moe_phase in place of that MLP (router, top-k, each expert's rows as one group; SiLU), between the same norms.
 * LoRA (cpu_lora.h): a row whose adapter slot (d->lora_slots) is >= 0 gets each adapted
 * projection's delta (q, k, v, o, gate, up, down; the layer's kv_lora) added to that projection's
 * output before anything reads it; float32, the row's own arithmetic (batch-invariant).
 * Tensor parallelism (cpu_tp.h): with d->all_reduce the description is one rank's shard, and o's
 * and down's outputs, partial sums, are summed over the ranks (tp_sum) before the residual add.
 *
 * Threads: cpu_pool.h (the pool, its phases and the step's scratch). Sizes and the step's state:
 * cpu_step.h. Attention, rotary and the cache writes: cpu_attention.h.
 *
 * Large steps (prefill chunks): each linear-layer task still owns a run of output channels and
 * goes through the rows KV_ROW_BLOCK at a time, its weights staying in cache from one block to the
 * next; attention runs KV_ATTN_ROWS rows a pass. No
 * blocking changes a row's arithmetic: every row is summed in the one-row order (cpu_gemv.h), so a
 * row's result is bitwise independent of the step's other rows (batch-invariant).
 */
#define _GNU_SOURCE
#include "cpu_attention.h"
#include "cpu_lora.h"
#include "cpu_perm.h"
#include "cpu_step.h"

#include <stdlib.h>

/* ------------------------------------------------------------------ the decoder */

/* Tasks for N output channels: about four per thread, each a multiple of KV_CHUNK channels, so
 * that each thread streams long runs of weights (the prefetcher's and DRAM's best case) while a
 * late thread's share can still be taken over. Sets s->span. */
static int64_t spans(kv_step *s, int64_t N) {
    int64_t parts = 4 * (P.helpers + 1), span = (N + parts - 1) / parts;
    s->span = span = (span + KV_CHUNK - 1) / KV_CHUNK * KV_CHUNK;
    return (N + span - 1) / span;
}

/* Rows [m0, m1) of x rounded to bf16 into s->xb, if the step's matmuls run in bf16: in the AMX
 * tiles' order, or row after row for the dot-product kernels. */
static inline void pack_rows(const kv_step *s, const float *x, int64_t K, int64_t m0, int64_t m1) {
#if KV_HAVE_AMX
    if (s->matmul == KV_MATMUL_AMX)
        for (int64_t m = m0; m < m1; m += 16) kv_amx_pack_tile(x, K, s->M, K, s->xb, m);
#endif
#if KV_HAVE_DPBF16
    if (s->matmul == KV_MATMUL_DPBF16) kv_dp_pack_rows(x, K, K, m0, m1, s->xb);
#endif
    (void)s; (void)x; (void)K; (void)m0; (void)m1;
}

static void task_norm(const void *ctx, int64_t t) {
    const kv_prep *p = ctx;
    const kv_step *s = p->s;
    const int64_t H = s->d->hidden, m0 = t * KV_PREP_ROWS, m1 = min64(m0 + KV_PREP_ROWS, s->M);
    for (int64_t m = m0; m < m1; m++) rmsnorm(s->x + m * H, p->w, H, (float)s->d->eps, p->out + m * H);
    if (p->K) pack_rows(s, p->out, H, m0, m1);
}

/* out = rmsnorm(x, w) for the step's rows; with `pack`, packed for the next phase's bf16 matmuls. */
static void norm_rows(const kv_step *s, const float *w, float *out, int pack) {
    const kv_prep p = {.s = s, .w = w, .out = out, .K = pack ? s->d->hidden : 0};
    kv_parallel(task_norm, &p, prep_tasks(s));
}

static void task_pack(const void *ctx, int64_t t) {
    const kv_prep *p = ctx;
    pack_rows(p->s, p->x, p->K, t * KV_PREP_ROWS, min64((t + 1) * KV_PREP_ROWS, p->s->M));
}

/* bf16 matmuls (s->xb): the next phase's input rows x [M, K], packed once into s->xb for every task. */
static void pack_input(const kv_step *s, const float *x, int64_t K) {
    if (!s->xb) return;
    const kv_prep p = {.s = s, .x = x, .K = K};
    kv_parallel(task_pack, &p, prep_tasks(s));
}

static void task_permute(const void *ctx, int64_t t) {
    const kv_prep *p = ctx;
    const int64_t m0 = t * KV_PREP_ROWS, m1 = min64(m0 + KV_PREP_ROWS, p->s->M);
    kv_permute_rows(p->out, p->K, m0, m1, p->perm);
    pack_rows(p->s, p->out, p->K, m0, m1);
}

/* The next matrix's input rows x [M, K]: gathered in place by its input permutation, if it has one
 * (cpu_perm.h), then packed for bf16 matmuls (pack_input). */
static void input_rows(const kv_step *s, float *x, int64_t K, const int32_t *perm) {
    if (!perm) {
        pack_input(s, x, K);
        return;
    }
    const kv_prep p = {.s = s, .out = x, .K = K, .perm = perm};
    kv_parallel(task_permute, &p, prep_tasks(s));
}

/* Rows per block of a task's loop over the step's rows: a bf16 call widens its weights once for
 * its rows, so it takes more of them (its blocks start at multiples of 16, as the tiles do). */
static inline int64_t row_block(const kv_step *s) { return s->xb ? KV_BF16_ROW_BLOCK : KV_ROW_BLOCK; }

/* The kernels matrix w runs in step s (KV_MATMUL_*): its own kind (kv_matrix.kind, fixed when the
 * decoder is built, so the same for every row count) where it names one, else the step's; a step
 * on float32 kernels (a build or thread without the bf16 ones) runs every matrix there. */
static inline int64_t kind_of(const kv_step *s, const kv_matrix *w) {
    return w->kind == 0 || s->matmul == KV_MATMUL_F32 ? s->matmul : w->kind - 1;
}

/* y[m * ldy + n - n0] = x[m0 + m] . w[n] for m < rows, n0 <= n < n1 (kind_of): on AMX tiles or as bf16 dot
 * products from s->xb (pack_input of x; m0 a multiple of 16: either layout puts row m0's data at
 * m0 K), else kvfleet's float32 kernels (one-row order). */
static inline void rows_of(const kv_step *s, const kv_matrix *w, const float *x, int64_t m0, int64_t rows,
                           int64_t n0, int64_t n1, float *y, int64_t ldy) {
    const int64_t kind = kind_of(s, w);
#if KV_HAVE_AMX
    if (kind == KV_MATMUL_AMX && kv_amx_rows(w, s->xb + m0 * w->K, rows, n0, n1, y, ldy) == 0) return;
#endif
#if KV_HAVE_DPBF16
    if (kind == KV_MATMUL_DPBF16 && kv_dp_rows(w, s->xb + m0 * w->K, rows, n0, n1, y, ldy) == 0) return;
#endif
    (void)kind;
    kv_matrix_rows(w, x + m0 * w->K, w->K, rows, n0, n1, y, ldy);   /* (-1 above: no buffer memory) */
}

/* y[m * ldy + n - n0] for the M rows of x [M, w->K] and n0 <= n < n1, row_block rows at a time: up
 * to that (decode) one call, so the task's weights are one stream; with more rows (a prefill
 * chunk) the task's weights stay in cache from one row block to the next, and each block of rows
 * is read once per task. Each row is summed alike whatever the blocking (rows_of): it changes no bit. */
static void matrix_rows(const kv_step *s, const kv_matrix *w, const float *x, int64_t M, int64_t n0, int64_t n1,
                        float *y, int64_t ldy) {
    for (int64_t m0 = 0; m0 < M; m0 += row_block(s))
        rows_of(s, w, x, m0, min64(row_block(s), M - m0), n0, n1, y + m0 * ldy, ldy);
}

static void task_qkv(const void *ctx, int64_t t) {
    const kv_step *s = ctx;
    const int64_t N = qkv_width(s->d), n0 = t * s->span;
    matrix_rows(s, &s->L->qkv, s->h, s->M, n0, min64(n0 + s->span, N), s->qkv + n0, N);
    lora_expand(s, KV_LORA_QKV, KV_LORA_O, 0, s->M, n0, min64(n0 + s->span, N), s->qkv + n0, N);
}

/* The task's columns n of a W^T (W = o or down), row block after row block (matrix_rows),
 * KV_CHUNK channels at a time: x[:, n] += y * residual_scale, or with an output norm (`normed`)
 * y into h[:, n], which add_normed then normalizes and adds. */
static void add_rows(const kv_step *s, const kv_matrix *w, const float *a, int64_t t, int normed, int lora) {
    const int64_t H = s->d->hidden, end = min64((t + 1) * s->span, H);
    const float rs = (float)s->d->residual_scale;
    float tmp[KV_BF16_ROW_BLOCK * KV_CHUNK];
    for (int64_t m0 = 0; m0 < s->M; m0 += row_block(s)) {
        const int64_t rows = min64(row_block(s), s->M - m0);
        for (int64_t n0 = t * s->span; n0 < end; n0 += KV_CHUNK) {
            const int64_t n1 = min64(n0 + KV_CHUNK, end);
            rows_of(s, w, a, m0, rows, n0, n1, tmp, KV_CHUNK);
            lora_expand(s, lora, lora + 1, m0, rows, n0, n1, tmp, KV_CHUNK);   /* W's adapter deltas (part `lora`) */
            for (int64_t m = 0; m < rows; m++)
                for (int64_t n = n0; n < n1; n++) {
                    const float y = tmp[m * KV_CHUNK + n - n0];
                    if (normed) s->h[(m0 + m) * H + n] = y;
                    else s->x[(m0 + m) * H + n] += rs == 1.0f ? y : y * rs;
                }
        }
    }
}

static void task_o(const void *ctx, int64_t t) {
    const kv_step *s = ctx;
    add_rows(s, &s->L->o, s->attn, t, s->L->attn_out_norm || s->d->all_reduce, KV_LORA_O);   /* (tp: into h, cpu_tp.h) */
}

static void task_down(const void *ctx, int64_t t) {
    const kv_step *s = ctx;
    add_rows(s, &s->L->down, s->act, t, s->L->mlp_out_norm || s->d->all_reduce, KV_LORA_DOWN);
}

static void task_add_normed(const void *ctx, int64_t t) {
    const kv_prep *p = ctx;
    const kv_step *s = p->s;
    const int64_t H = s->d->hidden, m0 = t * KV_PREP_ROWS, m1 = min64(m0 + KV_PREP_ROWS, s->M);
    const float rs = (float)s->d->residual_scale;
    for (int64_t m = m0; m < m1; m++) {
        float *h = s->h + m * H, *x = s->x + m * H;
        rmsnorm(h, p->w, H, (float)s->d->eps, h);
        for (int64_t k = 0; k < H; k++) x[k] += rs == 1.0f ? h[k] : h[k] * rs;
    }
}

/* A sublayer's output norm (Gemma 3's, GLM-4's, OLMo 2's post norms): x += rmsnorm(h, w) * residual_scale. */
static void add_normed(const kv_step *s, const float *w) {
    const kv_prep p = {.s = s, .w = w};
    kv_parallel(task_add_normed, &p, prep_tasks(s));
}

/* gelu_pytorch_tanh(a) = a / 2 (1 + tanh(sqrt(2 / pi) (a + 0.044715 a^3))), tanh(y) = 1 - 2 / (exp(2y) + 1). */
static inline __m256 gelu_tanh8(__m256 a) {
    const __m256 one = _mm256_set1_ps(1.0f);
    __m256 y = _mm256_mul_ps(_mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.044715f), a), a), a);
    y = _mm256_mul_ps(_mm256_set1_ps(0.7978845608f), _mm256_add_ps(a, y));
    const __m256 e = exp8(_mm256_add_ps(y, y));
    const __m256 th = _mm256_sub_ps(one, _mm256_div_ps(_mm256_set1_ps(2.0f), _mm256_add_ps(e, one)));
    return _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), a), _mm256_add_ps(one, th));
}

static inline float gelu_tanh1(float a) {
    const float y = 0.7978845608f * (a + 0.044715f * a * a * a);
    return 0.5f * a * (1.0f + (1.0f - 2.0f / (expf(y + y) + 1.0f)));
}

/* act[m, j] = act(h Wg^T) * (h Wu^T) (d->act: SiLU or GELU-tanh) for rows m0 .. m0 + rows - 1
 * (at most row_block) and channels j0 .. j1 - 1 (at most KV_CHUNK). */
static void act_rows(const kv_step *s, int64_t m0, int64_t rows, int64_t j0, int64_t j1) {
    const int64_t I = s->d->intermediate, gelu = s->d->act == KV_ACT_GELU_TANH;
    float g[KV_BF16_ROW_BLOCK * KV_CHUNK], u[KV_BF16_ROW_BLOCK * KV_CHUNK];
    rows_of(s, &s->L->gate_up, s->h, m0, rows, j0, j1, g, KV_CHUNK);
    rows_of(s, &s->L->gate_up, s->h, m0, rows, I + j0, I + j1, u, KV_CHUNK);
    lora_expand(s, KV_LORA_GATE_UP, KV_LORA_DOWN, m0, rows, j0, j1, g, KV_CHUNK);
    lora_expand(s, KV_LORA_GATE_UP, KV_LORA_DOWN, m0, rows, I + j0, I + j1, u, KV_CHUNK);
    float *act = s->act + m0 * I;
    for (int64_t m = 0; m < rows; m++) {
        int64_t j = j0;
        for (; j + 8 <= j1; j += 8) {   /* silu(a) * u = a / (1 + exp(-a)) * u */
            const __m256 a = _mm256_loadu_ps(g + m * KV_CHUNK + j - j0), up = _mm256_loadu_ps(u + m * KV_CHUNK + j - j0);
            __m256 f;
            if (gelu) {
                f = gelu_tanh8(a);
            } else {
                const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), a));
                f = _mm256_div_ps(a, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
            }
            _mm256_storeu_ps(act + m * I + j, _mm256_mul_ps(f, up));
        }
        for (; j < j1; j++) {
            const float a = g[m * KV_CHUNK + j - j0];
            act[m * I + j] = (gelu ? gelu_tanh1(a) : a / (1.0f + expf(-a))) * u[m * KV_CHUNK + j - j0];
        }
    }
}

static void task_mlp(const void *ctx, int64_t t) {
    const kv_step *s = ctx;
    const int64_t I = s->d->intermediate, end = min64((t + 1) * s->span, I);
    for (int64_t m0 = 0; m0 < s->M; m0 += row_block(s))   /* the task's weights stay in cache across row blocks */
        for (int64_t j0 = t * s->span; j0 < end; j0 += KV_CHUNK)
            act_rows(s, m0, min64(row_block(s), s->M - m0), j0, min64(j0 + KV_CHUNK, end));
}

static void task_head(const void *ctx, int64_t t) {
    const kv_step *s = ctx;
    const kv_matrix *w = s->d->head;
    const int64_t n0 = t * s->span;
    matrix_rows(s, w, s->h, s->M, n0, min64(n0 + s->span, w->N), s->logits + n0, w->N);
}

/* Nanoseconds spent per phase since the last kv_decode_profile call, and the steps:
 * [norms, qkv, attention, o, mlp (gate_up + SiLU), down, head, tp (the all-reduces, cpu_tp.h), steps].
 * The clock (kv_decode_profile_clock): wall time, or the calling thread's CPU time -- with no helper
 * threads (a pool of one) that is the whole step's work, and on a shared machine it leaves out the
 * time other processes took the core. */
enum { PROF_NORM, PROF_QKV, PROF_ATTN, PROF_O, PROF_MLP, PROF_DOWN, PROF_HEAD, PROF_TP, PROF_STEPS, PROF_N };
static int64_t PROF[PROF_N];
static clockid_t PROF_CLOCK = CLOCK_MONOTONIC;

/* 1: the phases in the calling thread's CPU time, 0: in wall time (the default). */
void kv_decode_profile_clock(int64_t thread_cpu) {
    pthread_mutex_lock(&P.lock);
    PROF_CLOCK = thread_cpu ? CLOCK_THREAD_CPUTIME_ID : CLOCK_MONOTONIC;
    pthread_mutex_unlock(&P.lock);
}

static inline int64_t prof_ns(void) {
    struct timespec t;
    clock_gettime(PROF_CLOCK, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

void kv_decode_profile(int64_t *out) {
    pthread_mutex_lock(&P.lock);
    memcpy(out, PROF, sizeof PROF);
    memset(PROF, 0, sizeof PROF);
    pthread_mutex_unlock(&P.lock);
}

static inline void timed(int which, int64_t *t) {
    int64_t now = prof_ns();
    PROF[which] += now - *t;
    *t = now;
}

#include "cpu_moe.h"   /* a layer's experts (moe_phase), over the helpers above */
#include "cpu_tp.h"    /* tensor parallelism: the ranks' partial o and down outputs summed (tp_sum) */

/* Scratch for a step of M rows, grown as needed (P.lock held): floats (with bf16 matmuls, the
 * packed input after them), and (2 + KVH KV_MAX_SPLITS) M int64: the groups, their leads and
 * attention's tasks. Returns 0, or -1 when out of memory. */
static int grow_scratch(const kv_decoder *d, int64_t M, int bf16) {
    const int64_t QD = d->num_heads * d->head_size, pass = min64(M, KV_ATTN_ROWS), I = d->intermediate;
    const int64_t widest = I > d->hidden ? (I > QD ? I : QD) : (d->hidden > QD ? d->hidden : QD);
    const int64_t need = M * (d->hidden + qkv_width(d) + QD + d->intermediate)
                         + pass * d->num_heads * KV_MAX_SPLITS * (d->head_size + 2)
                         + (bf16 ? ((M + 15) / 16 * 16 * widest + 1) / 2 : 0);   /* the packed bf16 input */
    if (kv_grow((void **)&P.scratch, &P.scratch_floats, need, sizeof(float))) return -1;
    const int64_t per_row = 2 + d->num_kv_heads * KV_MAX_SPLITS;   /* group, leads, attention's tasks */
    return kv_grow((void **)&P.group, &P.group_ints, per_row * M, sizeof(int64_t));
}

/* The attention sublayer of layer s->L: x += o(attention(rotary(qk_norm(q|k|v(attn_in(x))))))
 * (through attn_out and residual_scale where the layer has them). */
static void attention_phase(kv_step *s, int64_t num_leads, int64_t *t) {
    const kv_decoder *d = s->d;
    norm_rows(s, s->L->attn_in_norm, s->h, !s->L->qkv.perm);
    timed(PROF_NORM, t);
    lora_shrink(s, s->h, d->hidden, KV_LORA_QKV, KV_LORA_O);
    if (s->L->qkv.perm) input_rows(s, s->h, d->hidden, s->L->qkv.perm);   /* (after: adapters read x in order) */
    kv_parallel(task_qkv, s, spans(s, qkv_width(d)));
    timed(PROF_QKV, t);
    write_kv(s);
    attention(s, num_leads);
    timed(PROF_ATTN, t);
    lora_shrink(s, s->attn, d->num_heads * d->head_size, KV_LORA_O, KV_LORA_GATE_UP);
    input_rows(s, s->attn, d->num_heads * d->head_size, s->L->o.perm);
    kv_parallel(task_o, s, spans(s, d->hidden));
    tp_sum(s, s->L->attn_out_norm != NULL, PROF_O, t);
    if (s->L->attn_out_norm) add_normed(s, s->L->attn_out_norm);
    timed(PROF_O, t);
}

/* The MLP sublayer of layer s->L: x += down(act(gate(h)) * up(h)), h = mlp_in(x) (through
 * mlp_out and residual_scale where the layer has them). */
static void mlp_phase(kv_step *s, int64_t *t) {
    const kv_decoder *d = s->d;
    const int32_t *perm = s->L->moe ? NULL : s->L->gate_up.perm;   /* (experts: none, cpu_decoder.py) */
    norm_rows(s, s->L->mlp_in_norm, s->h, !perm);
    timed(PROF_NORM, t);
    if (s->L->moe) {
        moe_phase(s, t);   /* its output into x, or into h for mlp_out_norm, as task_down's */
    } else {
        lora_shrink(s, s->h, d->hidden, KV_LORA_GATE_UP, KV_LORA_DOWN);
        if (perm) input_rows(s, s->h, d->hidden, perm);
        kv_parallel(task_mlp, s, spans(s, d->intermediate));
        timed(PROF_MLP, t);
        lora_shrink(s, s->act, d->intermediate, KV_LORA_DOWN, KV_LORA_PARTS);
        input_rows(s, s->act, d->intermediate, s->L->down.perm);
        kv_parallel(task_down, s, spans(s, d->hidden));
        tp_sum(s, s->L->mlp_out_norm != NULL, PROF_DOWN, t);
    }
    if (s->L->mlp_out_norm) add_normed(s, s->L->mlp_out_norm);
    timed(PROF_DOWN, t);
}

/* The LM head on the rows `logits_indices` of out (all M rows when NULL): logits [L, V]. The rows
 * are gathered into the scratch first (h is free by then). */
static void lm_head(kv_step *s, const float *out, const int64_t *logits_indices, int64_t L) {
    const int64_t H = s->d->hidden;
    if (logits_indices) {
        for (int64_t r = 0; r < L; r++) memcpy(s->h + r * H, out + logits_indices[r] * H, H * sizeof(float));
    } else {
        s->h = (float *)out;
    }
    s->M = L;
    if (kind_of(s, s->d->head) != KV_MATMUL_F32) pack_input(s, s->h, H);
    kv_parallel(task_head, s, spans(s, s->d->head->N));
}

/* The kernels d asks for, where this build and the process have them (else float32). */
static int64_t step_matmul(const kv_decoder *d) {
#if KV_HAVE_AMX
    if (d->matmul == KV_MATMUL_AMX && kv_amx_ready()) return KV_MATMUL_AMX;
#endif
#if KV_HAVE_DPBF16
    if (d->matmul == KV_MATMUL_DPBF16) return KV_MATMUL_DPBF16;
#endif
    return KV_MATMUL_F32;
}

/* One step over 1 <= M <= KV_MAX_ROWS rows (see the contract at the top). logits_indices [L]:
 * the rows whose logits are computed, in order (NULL: all M; L is then ignored). Returns 0, -1
 * when M or L is out of range or scratch memory could not be allocated, -2 when a tensor-parallel
 * all-reduce failed (cpu_tp.h). */
int64_t kv_decode(const kv_decoder *d, int64_t M, float *x, const float *cos, const float *sin,
                  const int64_t *slots, const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens,
                  float *out, float *logits, const int64_t *logits_indices, int64_t L) {
    if (M < 1 || M > KV_MAX_ROWS || (logits_indices && (L < 0 || L > M))) return -1;
    const int64_t H = d->hidden, QD = d->num_heads * d->head_size, I = d->intermediate;
    const int64_t matmul = step_matmul(d);
    pthread_mutex_lock(&P.lock);
    if (grow_scratch(d, M, matmul != KV_MATMUL_F32) || moe_reserve(d, M, matmul != KV_MATMUL_F32)
        || lora_begin(d, M)) {
        pthread_mutex_unlock(&P.lock);
        return -1;
    }
    kv_step s = {.d = d, .M = M, .x = x, .h = P.scratch, .cos = cos, .sin = sin, .slots = slots,
                 .block_tables = block_tables, .seq_lens = seq_lens, .bt_stride = bt_stride, .logits = logits,
                 .group = P.group, .leads = P.group + M, .splits = KV_MAX_SPLITS, .matmul = matmul};
    const int64_t num_leads = group_rows(&s, P.group, P.group + M);
    s.tasks = P.group + 2 * M;
    s.qkv = s.h + M * H;
    s.attn = s.qkv + M * qkv_width(d);
    s.act = s.attn + M * QD;
    s.partial = s.act + M * I;
    s.xb = matmul != KV_MATMUL_F32 ? (uint16_t *)(s.partial + min64(M, KV_ATTN_ROWS) * d->num_heads * KV_MAX_SPLITS * (d->head_size + 2))
               : NULL;
    int64_t t = prof_ns();
    TP_FAILED = 0;
    for (int64_t l = 0; l < d->num_layers && !TP_FAILED; l++) {
        s.L = &d->layers[l];
        attention_phase(&s, num_leads, &t);
        mlp_phase(&s, &t);
    }
    if (TP_FAILED) {   /* an all-reduce failed: the ranks are out of step (cpu_tp.h) */
        pthread_mutex_unlock(&P.lock);
        return -2;
    }
    norm_rows(&s, d->final_norm, out, 0);   /* the LM head packs the rows it takes (lm_head) */
    timed(PROF_NORM, &t);
    if (d->head && logits && (logits_indices == NULL || L > 0)) {
        lm_head(&s, out, logits_indices, logits_indices ? L : M);
        timed(PROF_HEAD, &t);
    }
    PROF[PROF_STEPS]++;
    pthread_mutex_unlock(&P.lock);
    return 0;
}

/* The struct sizes kernels/cpu_lib.py checks its ctypes mirrors against (cpu_decoder.h). */
int64_t kv_abi_sizes(int64_t *out, int64_t n) { return kv_abi_sizes_of(out, n); }
