/* kvfleet CPU kernels: the state of one fused decoder step (kv_step) and what every phase of it
 * shares: the step's sizes, exp8, qkv_width, the row tasks' size. Included by cpu_decoder.c and
 * cpu_attention.h.
 */
#ifndef KVFLEET_CPU_STEP_H
#define KVFLEET_CPU_STEP_H

#include "cpu_decoder.h"
#include "cpu_pool.h"

#include <math.h>
#include <string.h>

#define KV_MAX_ROWS 8192    /* rows one step takes (cpu_decoder.py MAX_ROWS) */
#define KV_ROW_BLOCK 64     /* rows per kv_matrix_rows call in a large step */
#define KV_BF16_ROW_BLOCK 256  /* rows per AMX / bf16 dot-product call: each widens its weights to bf16 once */
#define KV_ATTN_ROWS 256    /* rows per attention pass (the size of s->partial) */
#define KV_MAX_SPLITS 8     /* attention splits per sequence */
#define KV_SPLIT_BLOCKS 8   /* fewest cache blocks per split (split_of) */
#define KV_CHUNK 32         /* output channels per inner block (the tasks' stack buffers) */

/* exp(x) for the lanes of a vector (V, its intrinsics' prefix P, its round-to-nearest ROUND and
 * integer-to-float bit cast CAST): range reduction by ln 2 and Cephes' degree-6 polynomial for expf
 * (relative error ~2e-7 over the clamped range -87.3 .. 88.3); the same arithmetic lane for lane at
 * every width (exp8 here, exp16 in cpu_attention.h). */
#define KV_DEFINE_EXP(NAME, V, P, ROUND, CAST)                                                                \
    static inline V NAME(V x) {                                                                               \
        x = P##_min_ps(P##_max_ps(x, P##_set1_ps(-87.3f)), P##_set1_ps(88.3f));                               \
        V n = ROUND(P##_mul_ps(x, P##_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);  \
        x = P##_fnmadd_ps(n, P##_set1_ps(0.693359375f), x);                                                   \
        x = P##_fnmadd_ps(n, P##_set1_ps(-2.12194440e-4f), x);                                                \
        V y = P##_set1_ps(1.9875691500e-4f);                                                                  \
        y = P##_fmadd_ps(y, x, P##_set1_ps(1.3981999507e-3f));                                                \
        y = P##_fmadd_ps(y, x, P##_set1_ps(8.3334519073e-3f));                                                \
        y = P##_fmadd_ps(y, x, P##_set1_ps(4.1665795894e-2f));                                                \
        y = P##_fmadd_ps(y, x, P##_set1_ps(1.6666665459e-1f));                                                \
        y = P##_fmadd_ps(y, x, P##_set1_ps(5.0000001201e-1f));                                                \
        y = P##_fmadd_ps(y, P##_mul_ps(x, x), P##_add_ps(x, P##_set1_ps(1.0f)));                              \
        return P##_mul_ps(y, CAST(P##_slli_epi32(P##_add_epi32(P##_cvtps_epi32(n), P##_set1_epi32(127)), 23))); \
    }
KV_DEFINE_EXP(exp8, __m256, _mm256, _mm256_round_ps, _mm256_castsi256_ps)

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
    uint16_t *xb;           /* bf16 matmuls: the current phase's input rows in bf16 (pack_input), else NULL */
    int64_t matmul;         /* the kernels this step runs (KV_MATMUL_*; what the build and the CPU allow) */
    int64_t *tasks;         /* the attention pass's tasks: (lead index * KVH + KV head) * KV_MAX_SPLITS + split */
} kv_step;

static inline int64_t qkv_width(const kv_decoder *d) { return (d->num_heads + 2 * d->num_kv_heads) * d->head_size; }

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* out = w * (x * rsqrt(mean(x^2) + eps)) over H floats (out may be x); w NULL: out = x. */
static void rmsnorm(const float *x, const float *w, int64_t H, float eps, float *out) {
    if (!w) {
        if (out != x) memcpy(out, x, H * sizeof(float));
        return;
    }
    __m256 acc = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= H; k += 8) { __m256 v = _mm256_loadu_ps(x + k); acc = _mm256_fmadd_ps(v, v, acc); }
    float ss = hsum(acc);
    for (; k < H; k++) ss += x[k] * x[k];
    float r = 1.0f / sqrtf(ss / (float)H + eps);
    for (k = 0; k < H; k++) out[k] = w[k] * (x[k] * r);
}

/* Row-wise work of a phase (RMSNorm, the bf16 packing, rotary and the cache writes, attention's
 * merge) runs as tasks of KV_PREP_ROWS rows: serial it took ~10 % of a prefill step. A decode
 * step's rows are one task. */
enum { KV_PREP_ROWS = 16 };   /* a multiple of an AMX tile's 16 rows */
typedef struct { const kv_step *s; const float *w, *x; float *out; int64_t K, rows; const int32_t *perm; } kv_prep;

static inline int64_t prep_tasks(const kv_step *s) { return (s->M + KV_PREP_ROWS - 1) / KV_PREP_ROWS; }

#endif
