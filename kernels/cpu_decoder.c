/* kvfleet CPU kernels: one engine step of a Llama-family decoder in one call, x86-64 AVX2 + FMA.
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
 *   cos, sin [M, D]      each row's rotary embedding (transformers' rotary module output:
 *                        rotate-half convention, attention scaling included), D = head size
 *   slots [M] int64      cache slot of each row's new key/value (block * block_size + offset;
 *                        -1: not written)
 *   block_tables [M, W] int32 (rows `bt_stride` apart), seq_lens [M] int32: row i attends over
 *                        positions 0 .. len - 1 of its block table
 *   caches               per layer [num_blocks, block_size, KVH, D] keys and values, float32 or
 *                        bf16 (d->cache_dtype): a bf16 cache stores each key and value rounded to
 *                        nearest even (torch's .to(torch.bfloat16)) and attention widens them to
 *                        float32 in registers (a shift); all arithmetic stays float32
 *
 * Per layer: h = rmsnorm(x); q|k|v = h Wqkv^T; rotary on q and k; k, v written at the slot;
 * attention of each query head over its KV head's cached positions (grouped-query attention,
 * online softmax, Milakov & Gimelshein 2018); x += attn Wo^T; h = rmsnorm(x);
 * x += (silu(h Wg^T) * h Wu^T) Wd^T. The weights are kv_matrix (cpu_gemv.h: fp32, int8, int4);
 * gate_up holds the I gate rows, then the I up rows.
 *
 * Threads: a pool of its own (pthreads), not OpenMP. Each parallel phase is a set of tasks
 * (a run of output channels, or one split of one sequence's KV head) that the calling thread and the helpers claim
 * with one atomic counter, so the caller never waits for a helper that is asleep or
 * descheduled: it does the tasks itself, and waits only for a task a helper has claimed. A
 * helper spins `spin_us` after its last task (a decode step's phases come microseconds apart),
 * then sleeps on a futex; the caller wakes it when it publishes a phase. A forked child has no
 * helpers and runs every task on its calling thread.
 *
 * Large steps (prefill chunks): each linear-layer task still owns a run of output channels and
 * goes through the rows KV_ROW_BLOCK at a time, its weights staying in cache from one block to the
 * next; attention runs KV_ATTN_ROWS rows a pass. No
 * blocking changes a row's arithmetic: every row is summed in the one-row order (cpu_gemv.h), so a
 * row's result is bitwise independent of the step's other rows (batch-invariant).
 */
#define _GNU_SOURCE
#include "cpu_decoder.h"

#include <limits.h>
#include <linux/futex.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define KV_MAX_THREADS 64
#define KV_MAX_ROWS 8192    /* rows one step takes (cpu_decoder.py MAX_ROWS) */
#define KV_ROW_BLOCK 64     /* rows per kv_matrix_rows call in a large step */
#define KV_AMX_ROW_BLOCK 256   /* rows per AMX call: each call widens its weights to bf16 once */
#define KV_ATTN_ROWS 256    /* rows per attention pass (the size of s->partial) */
#define KV_MAX_SPLITS 8     /* attention splits per sequence */
#define KV_SPLIT_BLOCKS 8   /* fewest cache blocks per split (split_of) */
#define KV_CHUNK 32         /* output channels per inner block (the tasks' stack buffers) */

/* ------------------------------------------------------------------ thread pool */

typedef void (*kv_task_fn)(const void *ctx, int64_t task);
typedef struct { kv_task_fn fn; const void *ctx; int64_t total; } kv_phase;

static struct {
    int helpers;
    _Atomic uint64_t counter;   /* phase sequence << 32 | next unclaimed task */
    _Atomic int64_t done;       /* tasks of the current phase finished */
    kv_phase phase[2];          /* by sequence parity */
    _Atomic uint32_t wake;      /* futex word */
    _Atomic int sleepers;
    int64_t spin_ns;
    pthread_mutex_t lock;       /* one kv_decode at a time (the pool and scratch are global) */
    float *scratch;
    int64_t scratch_floats;
    int64_t *group;             /* [2 M]: kv_step's group and leads */
    int64_t group_rows;
} P = {.lock = PTHREAD_MUTEX_INITIALIZER, .spin_ns = 200000};

static inline int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static inline uint32_t seq_of(uint64_t c) { return (uint32_t)(c >> 32); }

/* Claim and run tasks of phase `seq` until none is left or the phase has moved on. The phase's
 * description is read before the claim; a successful claim proves it was still current (it is
 * rewritten only after all its tasks are done), so a stale read is never acted on. */
static void run_tasks(uint32_t seq) {
    const kv_phase *ph = &P.phase[seq & 1];
    kv_task_fn fn = __atomic_load_n(&ph->fn, __ATOMIC_RELAXED);
    const void *ctx = __atomic_load_n(&ph->ctx, __ATOMIC_RELAXED);
    int64_t total = __atomic_load_n(&ph->total, __ATOMIC_RELAXED);
    uint64_t c = atomic_load(&P.counter);
    for (;;) {
        if (seq_of(c) != seq || (int64_t)(uint32_t)c >= total) return;
        if (atomic_compare_exchange_weak(&P.counter, &c, c + 1)) {
            fn(ctx, (int64_t)(uint32_t)c);
            atomic_fetch_add(&P.done, 1);
            c = atomic_load(&P.counter);
        }
    }
}

static void *helper_main(void *arg) {
    (void)arg;
    uint32_t seen = seq_of(atomic_load(&P.counter));
    for (;;) {
        uint32_t seq = seq_of(atomic_load(&P.counter));
        if (seq != seen) {
            seen = seq;
            run_tasks(seq);
            continue;
        }
        int64_t t0 = now_ns();
        unsigned spins = 0;
        while (seq_of(atomic_load(&P.counter)) == seen) {
            _mm_pause();
            if ((++spins & 63) == 0 && now_ns() - t0 > P.spin_ns) {
                uint32_t w = atomic_load(&P.wake);
                atomic_fetch_add(&P.sleepers, 1);
                if (seq_of(atomic_load(&P.counter)) == seen)
                    syscall(SYS_futex, &P.wake, FUTEX_WAIT_PRIVATE, w, NULL, NULL, 0);
                atomic_fetch_sub(&P.sleepers, 1);
                t0 = now_ns();
            }
        }
    }
    return NULL;
}

/* Start helpers up to `threads` - 1 (never fewer than already run); spin_us as described above.
 * Returns the number of helpers running. */
int64_t kv_pool_start(int64_t threads, int64_t spin_us) {
    pthread_mutex_lock(&P.lock);
    P.spin_ns = spin_us * 1000;
    while (P.helpers < threads - 1 && P.helpers < KV_MAX_THREADS - 1) {
        pthread_t t;
        if (pthread_create(&t, NULL, helper_main, NULL) != 0) break;
        pthread_detach(t);
        P.helpers++;
    }
    int64_t n = P.helpers;
    pthread_mutex_unlock(&P.lock);
    return n;
}

static void kv_parallel(kv_task_fn fn, const void *ctx, int64_t total) {
    if (P.helpers == 0 || total <= 1) {
        for (int64_t i = 0; i < total; i++) fn(ctx, i);
        return;
    }
    uint32_t seq = seq_of(atomic_load(&P.counter)) + 1;
    kv_phase *ph = &P.phase[seq & 1];
    __atomic_store_n(&ph->fn, fn, __ATOMIC_RELAXED);
    __atomic_store_n(&ph->ctx, ctx, __ATOMIC_RELAXED);
    __atomic_store_n(&ph->total, total, __ATOMIC_RELAXED);
    atomic_store(&P.done, 0);
    atomic_store(&P.counter, (uint64_t)seq << 32);
    if (atomic_load(&P.sleepers) > 0) {
        atomic_fetch_add(&P.wake, 1);
        syscall(SYS_futex, &P.wake, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
    }
    run_tasks(seq);
    while (atomic_load(&P.done) < total) _mm_pause();
}

/* exp(x) for 8 floats: range reduction by ln 2 and Cephes' degree-6 polynomial for expf
 * (relative error ~2e-7 over the clamped range -87.3 .. 88.3). */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

/* ------------------------------------------------------------------ the decoder */

typedef struct {
    const kv_decoder *d;
    const kv_layer *L;
    int64_t M;
    float *x, *h, *qkv, *attn, *act, *logits;
    float *partial;         /* [rows of the pass, QH, splits, 2 + D]: per split, max, sum and weighted values */
    int64_t splits;
    const float *cos, *sin;
    const int64_t *slots;
    const int32_t *block_tables, *seq_lens;
    int64_t bt_stride;
    int64_t span;           /* output channels per task in the current phase (see spans()) */
    const int64_t *group;   /* [M]: rows in the group row i leads (0: row i is in an earlier row's group) */
    const int64_t *leads;   /* the attention pass's group leads, in order (task_attention) */
    int64_t a0;             /* the attention pass's first row */
    uint16_t *xb;           /* AMX: the current phase's input rows in the tiles' order (pack_input), else NULL */
} kv_step;

static void rmsnorm(const float *x, const float *w, int64_t H, float eps, float *out) {
    __m256 acc = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= H; k += 8) { __m256 v = _mm256_loadu_ps(x + k); acc = _mm256_fmadd_ps(v, v, acc); }
    float ss = hsum(acc);
    for (; k < H; k++) ss += x[k] * x[k];
    float r = 1.0f / sqrtf(ss / (float)H + eps);
    for (k = 0; k < H; k++) out[k] = w[k] * (x[k] * r);
}

static inline int64_t qkv_width(const kv_decoder *d) { return (d->num_heads + 2 * d->num_kv_heads) * d->head_size; }

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* Tasks for N output channels: about four per thread, each a multiple of KV_CHUNK channels, so
 * that each thread streams long runs of weights (the prefetcher's and DRAM's best case) while a
 * late thread's share can still be taken over. Sets s->span. */
static int64_t spans(kv_step *s, int64_t N) {
    int64_t parts = 4 * (P.helpers + 1), span = (N + parts - 1) / parts;
    s->span = span = (span + KV_CHUNK - 1) / KV_CHUNK * KV_CHUNK;
    return (N + span - 1) / span;
}

/* Row-wise work of a phase (RMSNorm, the AMX packing, rotary and the cache writes) as tasks of
 * KV_PREP_ROWS rows: serial it took ~10 % of a prefill step. A decode step's rows are one task. */
enum { KV_PREP_ROWS = 16 };   /* a multiple of an AMX tile's 16 rows */
typedef struct { const kv_step *s; const float *w, *x; float *out; int64_t K; } kv_prep;

static inline int64_t prep_tasks(const kv_step *s) { return (s->M + KV_PREP_ROWS - 1) / KV_PREP_ROWS; }

/* Rows [m0, m1) of x packed into s->xb (AMX), if the step runs on tiles. */
static inline void pack_rows(const kv_step *s, const float *x, int64_t K, int64_t m0, int64_t m1) {
#if KV_HAVE_AMX
    if (s->xb)
        for (int64_t m = m0; m < m1; m += 16) kv_amx_pack_tile(x, K, s->M, K, s->xb, m);
#else
    (void)s; (void)x; (void)K; (void)m0; (void)m1;
#endif
}

static void task_norm(const void *ctx, int64_t t) {
    const kv_prep *p = ctx;
    const kv_step *s = p->s;
    const int64_t H = s->d->hidden, m0 = t * KV_PREP_ROWS, m1 = min64(m0 + KV_PREP_ROWS, s->M);
    for (int64_t m = m0; m < m1; m++) rmsnorm(s->x + m * H, p->w, H, (float)s->d->eps, p->out + m * H);
    pack_rows(s, p->out, H, m0, m1);
}

/* out = rmsnorm(x, w) for the step's rows, packed for the next phase's tiles (AMX). */
static void norm_rows(const kv_step *s, const float *w, float *out) {
    const kv_prep p = {.s = s, .w = w, .out = out};
    kv_parallel(task_norm, &p, prep_tasks(s));
}

static void task_pack(const void *ctx, int64_t t) {
    const kv_prep *p = ctx;
    pack_rows(p->s, p->x, p->K, t * KV_PREP_ROWS, min64((t + 1) * KV_PREP_ROWS, p->s->M));
}

/* AMX (d->amx, cpu_amx.h): the next phase's input rows x [M, K], packed once into s->xb for every task. */
static void pack_input(const kv_step *s, const float *x, int64_t K) {
    if (!s->xb) return;
    const kv_prep p = {.s = s, .x = x, .K = K};
    kv_parallel(task_pack, &p, prep_tasks(s));
}

/* Rows per block of a task's loop over the step's rows: an AMX call widens its weights once for
 * its rows, so it takes more of them (its blocks start at multiples of 16, as the tiles do). */
static inline int64_t row_block(const kv_step *s) { return s->xb ? KV_AMX_ROW_BLOCK : KV_ROW_BLOCK; }

/* y[m * ldy + n - n0] = x[m0 + m] . w[n] for m < rows, n0 <= n < n1: on AMX tiles from s->xb
 * (pack_input of x; m0 a multiple of 16), else kvfleet's float32 kernels (one-row order). */
static inline void rows_of(const kv_step *s, const kv_matrix *w, const float *x, int64_t m0, int64_t rows,
                           int64_t n0, int64_t n1, float *y, int64_t ldy) {
#if KV_HAVE_AMX
    if (s->xb && kv_amx_rows(w, s->xb + m0 / 16 * (w->K / 32) * 512, rows, n0, n1, y, ldy) == 0) return;
#endif
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
}

/* x[:, n0:n1] += a W^T (W = o or down): the task's columns of the residual stream, row block
 * after row block (matrix_rows), KV_CHUNK channels at a time. */
static void add_rows(const kv_step *s, const kv_matrix *w, const float *a, int64_t t) {
    const int64_t H = s->d->hidden, end = min64((t + 1) * s->span, H);
    float tmp[KV_AMX_ROW_BLOCK * KV_CHUNK];
    for (int64_t m0 = 0; m0 < s->M; m0 += row_block(s)) {
        const int64_t rows = min64(row_block(s), s->M - m0);
        for (int64_t n0 = t * s->span; n0 < end; n0 += KV_CHUNK) {
            const int64_t n1 = min64(n0 + KV_CHUNK, end);
            rows_of(s, w, a, m0, rows, n0, n1, tmp, KV_CHUNK);
            for (int64_t m = 0; m < rows; m++)
                for (int64_t n = n0; n < n1; n++) s->x[(m0 + m) * H + n] += tmp[m * KV_CHUNK + n - n0];
        }
    }
}

static void task_o(const void *ctx, int64_t t) {
    const kv_step *s = ctx;
    add_rows(s, &s->L->o, s->attn, t);
}

static void task_down(const void *ctx, int64_t t) {
    const kv_step *s = ctx;
    add_rows(s, &s->L->down, s->act, t);
}

/* act[m, j] = silu(h Wg^T) * (h Wu^T) for rows m0 .. m0 + rows - 1 (at most row_block) and
 * channels j0 .. j1 - 1 (at most KV_CHUNK). */
static void silu_rows(const kv_step *s, int64_t m0, int64_t rows, int64_t j0, int64_t j1) {
    const int64_t I = s->d->intermediate, H = s->d->hidden;
    float g[KV_AMX_ROW_BLOCK * KV_CHUNK], u[KV_AMX_ROW_BLOCK * KV_CHUNK];
    rows_of(s, &s->L->gate_up, s->h, m0, rows, j0, j1, g, KV_CHUNK);
    rows_of(s, &s->L->gate_up, s->h, m0, rows, I + j0, I + j1, u, KV_CHUNK);
    float *act = s->act + m0 * I;
    for (int64_t m = 0; m < rows; m++) {
        int64_t j = j0;
        for (; j + 8 <= j1; j += 8) {   /* silu(a) * u = a / (1 + exp(-a)) * u */
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

static void task_mlp(const void *ctx, int64_t t) {
    const kv_step *s = ctx;
    const int64_t I = s->d->intermediate, end = min64((t + 1) * s->span, I);
    for (int64_t m0 = 0; m0 < s->M; m0 += row_block(s))   /* the task's weights stay in cache across row blocks */
        for (int64_t j0 = t * s->span; j0 < end; j0 += KV_CHUNK)
            silu_rows(s, m0, min64(row_block(s), s->M - m0), j0, min64(j0 + KV_CHUNK, end));
}

static void task_head(const void *ctx, int64_t t) {
    const kv_step *s = ctx;
    const kv_matrix *w = s->d->head;
    const int64_t n0 = t * s->span;
    matrix_rows(s, w, s->h, s->M, n0, min64(n0 + s->span, w->N), s->logits + n0, w->N);
}

/* transformers' apply_rotary_pos_emb: x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1]. */
static void rope(float *x, const float *c, const float *s, int64_t D) {
    const int64_t h = D / 2;
    for (int64_t i = 0; i < h; i++) {
        float a = x[i], b = x[i + h];
        x[i] = a * c[i] - b * s[i];
        x[i + h] = b * c[i + h] + a * s[i + h];
    }
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
    const int64_t QH = d->num_heads, KVH = d->num_kv_heads, D = d->head_size;
    for (int64_t i = t * KV_PREP_ROWS; i < min64((t + 1) * KV_PREP_ROWS, s->M); i++) {
        float *row = s->qkv + i * qkv_width(d);
        const float *c = s->cos + i * D, *sn = s->sin + i * D;
        for (int64_t h = 0; h < QH; h++) rope(row + h * D, c, sn, D);
        for (int64_t g = 0; g < KVH; g++) {
            float *k = row + (QH + g) * D, *v = row + (QH + KVH + g) * D;
            rope(k, c, sn, D);
            if (s->slots[i] >= 0) {
                store_kv(d, s->L->k_cache, (s->slots[i] * KVH + g) * D, k, D);
                store_kv(d, s->L->v_cache, (s->slots[i] * KVH + g) * D, v, D);
            }
        }
    }
}

static void write_kv(const kv_step *s) { kv_parallel(task_write_kv, s, prep_tasks(s)); }

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
    float *out = s->partial + (((i - s->a0) * QH + g * G) * S + part) * (D + 2);   /* head j at + j * S * (D + 2) */
    if (first)
        for (int64_t j = 0; j < G; j++) {
            float *o = out + j * S * (D + 2);
            o[0] = -INFINITY;
            o[1] = 0.0f;
            memset(o + 2, 0, D * sizeof(float));
        }
    const int64_t n = len - b * bs < bs ? len - b * bs : bs, n8 = (n + 7) / 8 * 8;
    for (int64_t j = 0; j < G; j++) {
        const float *q = q0 + j * D;
        float *o = out + j * S * (D + 2), *acc = o + 2;
        for (int64_t p = 0; p < n; p += 4) {   /* past n: the last key again (never used) */
            const int64_t p1 = p + 1 < n ? p + 1 : p, p2 = p + 2 < n ? p + 2 : p, p3 = p + 3 < n ? p + 3 : p;
            _mm_storeu_ps(sc + p, _mm_mul_ps(dot4(q, kb, p * stride, p1 * stride, p2 * stride, p3 * stride, D),
                                             _mm_set1_ps(scale)));
        }
        for (int64_t p = n; p < n8; p++) sc[p] = -INFINITY;   /* the 8-wide tail: no score */
        __m256 mx = _mm256_loadu_ps(sc);
        for (int64_t p = 8; p < n8; p += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(sc + p));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        const float bmax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
        if (bmax > o[0]) {   /* rescale what was summed under the old maximum */
            const float corr = expf(o[0] - bmax);
            o[1] *= corr;
            for (int64_t e = 0; e < D; e += 8) _mm256_storeu_ps(acc + e, _mm256_mul_ps(_mm256_loadu_ps(acc + e), _mm256_set1_ps(corr)));
            o[0] = bmax;
        }
        const __m256 vmx = _mm256_set1_ps(o[0]);
        __m256 sum = _mm256_setzero_ps();
        for (int64_t p = 0; p < n8; p += 8) {   /* exp(-inf) = 0 past n */
            const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sc + p), vmx));
            _mm256_storeu_ps(sc + p, e);
            sum = _mm256_add_ps(sum, e);
        }
        o[1] += hsum(sum);
        if (D == 64) accumulate_values(acc, sc, vb, stride, n, 64);
        else if (D == 128) accumulate_values(acc, sc, vb, stride, n, 128);
        else accumulate_values(acc, sc, vb, stride, n, D);
    }
}

/* Task t = (group lead i = s->leads[t / (KVH S)], KV head g, split part). Splitting a sequence's positions (Flash-Decoding's
 * split-K) gives the threads work when one sequence has few KV heads; a task reads each key and
 * value once for all the query heads that share it. Rows of one sequence at consecutive positions
 * (a speculative step's last token and drafts: s->group) are done by their first row's tasks,
 * block by block for all of them, so each block is read from memory once for the group; every
 * row still sums exactly as it would alone (the same blocks in the same order, its own split and
 * length). Tasks of rows led by another and past a row's last split return at once. */
static void task_attention(const void *ctx, int64_t t) {
    const kv_step *s = ctx;
    const int64_t KVH = s->d->num_kv_heads, S = KV_MAX_SPLITS, bs = s->d->block_size;
    const int64_t i = s->leads[t / (KVH * S)], g = t / S % KVH, part = t % S;
    const int64_t rows = s->group[i];
    int64_t b0 = -1, b1 = 0;
    for (int64_t r = i; r < i + rows; r++) {
        const int64_t blocks = (s->seq_lens[r] + bs - 1) / bs;
        int64_t per;
        if (part >= split_of(blocks, &per)) continue;
        const int64_t lo = part * per, hi = lo + per < blocks ? lo + per : blocks;
        b0 = b0 < 0 || lo < b0 ? lo : b0;
        b1 = hi > b1 ? hi : b1;
    }
    if (b0 < 0) return;
    const kv_decoder *d = s->d;
    const int64_t D = d->head_size, stride = KVH * D, es = kv_elem(d);
    const char *kc = s->L->k_cache, *vc = s->L->v_cache;
    const int32_t *bt = s->block_tables + i * s->bt_stride;
    const int bf16 = d->cache_dtype == KV_CACHE_BF16;
    float sc[bs + 8], kw[bf16 ? bs * D : 1], vw[bf16 ? bs * D : 1];
    for (int64_t b = b0; b < b1; b++) {
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
        int64_t kstride = stride;
        if (bf16) {   /* widened once for every row of the group and every query head (exact) */
            const uint16_t *k16 = (const uint16_t *)kc + base, *v16 = (const uint16_t *)vc + base;
            for (int64_t p = 0; p < bs; p++)
                for (int64_t e = 0; e < D; e += 8) {
                    _mm256_storeu_ps(kw + p * D + e, widen_bf16(k16 + p * stride + e));
                    _mm256_storeu_ps(vw + p * D + e, widen_bf16(v16 + p * stride + e));
                }
            kb = kw, vb = vw, kstride = D;
        }
        for (int64_t r = i; r < i + rows; r++) {
            const int64_t blocks = (s->seq_lens[r] + bs - 1) / bs;
            int64_t per;
            if (part >= split_of(blocks, &per)) continue;
            const int64_t lo = part * per, hi = lo + per < blocks ? lo + per : blocks;
            if (b >= lo && b < hi) attend_block(s, r, g, part, b, b == lo, kb, vb, kstride, sc);
        }
    }
}

/* s->group: row i leads a group of the rows i, i + 1, ... of one sequence at consecutive
 * positions (the same block table, seq_lens one apart, the same split size), at most
 * KV_GROUP_ROWS, never across an attention pass (KV_ATTN_ROWS); group[i] = its row count, 0 for
 * the rows it leads. leads: the leading rows in order; returns their count. */
enum { KV_GROUP_ROWS = 8 };
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

/* Serial: each query head's output from its splits' partials (rescaled to the largest maximum),
 * for the `rows` rows of the attention pass. */
static void merge_attention(const kv_step *s, int64_t rows) {
    const int64_t QH = s->d->num_heads, D = s->d->head_size, bs = s->d->block_size;
    for (int64_t r = 0; r < rows * QH; r++) {
        const int64_t stride = KV_MAX_SPLITS * (D + 2);
        int64_t per;
        const int64_t S = split_of((s->seq_lens[s->a0 + r / QH] + bs - 1) / bs, &per);
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


/* Nanoseconds spent per phase since the last kv_decode_profile call, and the steps:
 * [norms, qkv, attention, o, mlp (gate_up + SiLU), down, head, steps]. */
enum { PROF_NORM, PROF_QKV, PROF_ATTN, PROF_O, PROF_MLP, PROF_DOWN, PROF_HEAD, PROF_STEPS, PROF_N };
static int64_t PROF[PROF_N];

void kv_decode_profile(int64_t *out) {
    pthread_mutex_lock(&P.lock);
    memcpy(out, PROF, sizeof PROF);
    memset(PROF, 0, sizeof PROF);
    pthread_mutex_unlock(&P.lock);
}

static inline void timed(int which, int64_t *t) {
    int64_t now = now_ns();
    PROF[which] += now - *t;
    *t = now;
}

/* Attention of every row, KV_ATTN_ROWS rows at a time (s->partial holds one pass): the groups
 * led in the pass, then their merge. */
static void attention(kv_step *s, int64_t num_leads) {
    const int64_t tasks_per_lead = s->d->num_kv_heads * KV_MAX_SPLITS;
    const int64_t *all = s->leads;
    int64_t l0 = 0;
    for (s->a0 = 0; s->a0 < s->M; s->a0 += KV_ATTN_ROWS) {
        const int64_t a1 = min64(s->a0 + KV_ATTN_ROWS, s->M);
        int64_t l1 = l0;
        while (l1 < num_leads && all[l1] < a1) l1++;
        s->leads = all + l0;
        kv_parallel(task_attention, s, (l1 - l0) * tasks_per_lead);
        merge_attention(s, a1 - s->a0);
        l0 = l1;
    }
    s->leads = all;
    s->a0 = 0;
}

/* Scratch for a step of M rows, grown as needed (P.lock held): floats (with AMX, the packed
 * input after them), and 2 M int64 for the groups. Returns 0, or -1 when out of memory. */
static int grow_scratch(const kv_decoder *d, int64_t M, int amx) {
    const int64_t QD = d->num_heads * d->head_size, pass = min64(M, KV_ATTN_ROWS), I = d->intermediate;
    const int64_t widest = I > d->hidden ? (I > QD ? I : QD) : (d->hidden > QD ? d->hidden : QD);
    const int64_t need = M * (d->hidden + qkv_width(d) + QD + d->intermediate)
                         + pass * d->num_heads * KV_MAX_SPLITS * (d->head_size + 2)
                         + (amx ? ((M + 15) / 16 * 16 * widest + 1) / 2 : 0);   /* the packed bf16 input */
    if (P.scratch_floats < need) {
        free(P.scratch);
        P.scratch = malloc(need * sizeof(float));
        P.scratch_floats = P.scratch ? need : 0;
        if (!P.scratch) return -1;
    }
    if (P.group_rows < M) {
        free(P.group);
        P.group = malloc(2 * M * sizeof(int64_t));
        P.group_rows = P.group ? M : 0;
        if (!P.group) return -1;
    }
    return 0;
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
    pack_input(s, s->h, H);
    kv_parallel(task_head, s, spans(s, s->d->head->N));
}

/* One step over 1 <= M <= KV_MAX_ROWS rows (see the contract at the top). logits_indices [L]:
 * the rows whose logits are computed, in order (NULL: all M; L is then ignored). Returns 0, or -1
 * when M or L is out of range or scratch memory could not be allocated. */
int64_t kv_decode(const kv_decoder *d, int64_t M, float *x, const float *cos, const float *sin,
                  const int64_t *slots, const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens,
                  float *out, float *logits, const int64_t *logits_indices, int64_t L) {
    if (M < 1 || M > KV_MAX_ROWS || (logits_indices && (L < 0 || L > M))) return -1;
    const int64_t H = d->hidden, QD = d->num_heads * d->head_size, I = d->intermediate;
#if KV_HAVE_AMX
    const int amx = d->amx && kv_amx_ready();
#else
    const int amx = 0;
#endif
    pthread_mutex_lock(&P.lock);
    if (grow_scratch(d, M, amx)) {
        pthread_mutex_unlock(&P.lock);
        return -1;
    }
    kv_step s = {.d = d, .M = M, .x = x, .h = P.scratch, .cos = cos, .sin = sin, .slots = slots,
                 .block_tables = block_tables, .seq_lens = seq_lens, .bt_stride = bt_stride, .logits = logits,
                 .group = P.group, .leads = P.group + M, .splits = KV_MAX_SPLITS};
    const int64_t num_leads = group_rows(&s, P.group, P.group + M);
    s.qkv = s.h + M * H;
    s.attn = s.qkv + M * qkv_width(d);
    s.act = s.attn + M * QD;
    s.partial = s.act + M * I;
    s.xb = amx ? (uint16_t *)(s.partial + min64(M, KV_ATTN_ROWS) * d->num_heads * KV_MAX_SPLITS * (d->head_size + 2))
               : NULL;
    int64_t t = now_ns();
    for (int64_t l = 0; l < d->num_layers; l++) {
        s.L = &d->layers[l];
        norm_rows(&s, s.L->input_norm, s.h);
        timed(PROF_NORM, &t);
        kv_parallel(task_qkv, &s, spans(&s, qkv_width(d)));
        timed(PROF_QKV, &t);
        write_kv(&s);
        attention(&s, num_leads);
        pack_input(&s, s.attn, QD);
        timed(PROF_ATTN, &t);
        kv_parallel(task_o, &s, spans(&s, H));
        timed(PROF_O, &t);
        norm_rows(&s, s.L->post_norm, s.h);
        timed(PROF_NORM, &t);
        kv_parallel(task_mlp, &s, spans(&s, I));
        pack_input(&s, s.act, I);
        timed(PROF_MLP, &t);
        kv_parallel(task_down, &s, spans(&s, H));
        timed(PROF_DOWN, &t);
    }
    norm_rows(&s, d->final_norm, out);
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
