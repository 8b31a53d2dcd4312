/* kvfleet CPU kernels: the AMX tiles' linear layer (cpu_amx.h) for a few rows (M <= KV_AMX_FEW, one
 * stream's decode, a short speculative step) as AVX512-BF16 dot products that give the tiles' bits.
 * Compiled into the `amx` build variant only (cpu_amx.h includes it and calls it). A tile product at one row uses 1/16 of
 * the tile unit and waits on tile loads; here each weight is widened, transposed and used once.
 *
 * Contract: exactly kv_amx_rows' output (cpu_amx.h: y[m * ldy + n - n0] = finish_dot(the tile sum))
 * for m < M <= KV_AMX_FEW, n0 <= n < n1 (n1 - n0 a multiple of 16, K of 32), xb from
 * kv_amx_pack_x of the M rows -- the same bits, so the `amx` matmul kind stays batch-invariant
 * whichever kernel a step's row count picks (tests/unit/kernels/test_cpu_lib.py checks it bitwise,
 * with denormals and K up to 8192, in every weight format).
 *
 * What the tiles compute, measured on a Xeon with AMX (random bf16 operands, 10^4 cases per
 * exponent range, 2^-70 .. 2^70, no mismatch below overflow): TDPBF16PS adds to each fp32
 * accumulator c, per instruction (one 32-wide block of K, pairs k = 2i, 2i + 1, i < 16),
 *     c = c + (E + O),  E = (((0 + p0) + p2) + ... + p30),  O = (((0 + p1) + p3) + ... + p31),
 * every add rounded to fp32 to nearest even, denormal inputs and results flushed to zero (p_k the
 * exact product of two bf16). Neither a sequential sum over k (vdpbf16ps's own order) nor an exact
 * sum per instruction gives these bits. VDPBF16PS adds one pair per lane, p_{2i+1} then p_{2i}, with
 * the same rounding and flushing; fed x with its odd (even) element zeroed, a lane adds exactly one
 * product (the other is a signed zero, which leaves a sum that is not -0 unchanged, and none of E,
 * O is ever -0), so two chains per output give E and O, and `c + (E + O)` is two vaddps under
 * MXCSR's FTZ and DAZ (set for the call, restored after).
 *
 * Layout: 16 output channels per vector lane group. Per pass, up to KV_FEW_G lane groups (16 G
 * channels) have their weights widened KV_FEW_KC blocks of K at a time (kv_bf16_blocks, the AMX
 * narrow path's order: 16 channel rows x 32 bf16 per block) and each 16 x 16-dword block transposed
 * in place (kv_transpose16), so vector r of a block holds pair r of its 16 channels. Then for each
 * block and pair, every (group, row) chain takes one vdpbf16ps with the row's pair broadcast.
 */
#ifndef KVFLEET_CPU_AMX_FEW_H
#define KVFLEET_CPU_AMX_FEW_H

#include "cpu_dpbf16.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)

enum { KV_AMX_FEW = 4, KV_FEW_G = 4, KV_FEW_KC = 4 };

/* Row t's pairs of the packed rows xb (kv_amx_pack_x, M <= 16: one token tile), each as a dword
 * with its odd (xe) or even (xo) bf16 zeroed: xe[t * KB * 16 + kb * 16 + r]. */
static inline void amx_few_split_x(const uint16_t *xb, int M, int64_t KB, uint32_t *xe, uint32_t *xo) {
    const uint32_t *d = (const uint32_t *)xb;
    for (int64_t i = 0; i < KB * 16; i++)       /* i = kb * 16 + r: the tile row of pair r */
        for (int t = 0; t < M; t++) {
            const uint32_t v = d[i * 16 + t];
            xe[t * KB * 16 + i] = v & 0xFFFFu;
            xo[t * KB * 16 + i] = v & 0xFFFF0000u;
        }
}

/* One 32-wide block of K: acc[g][t] += (E + O) for G lane groups (transposed blocks at wt, 512
 * uint16 apart) and M rows (pairs at xe/xo + t * xs). */
#define KV_DEFINE_FEW_BLOCK(G, M)                                                                        \
    static inline void amx_few_block_g##G##_m##M(const uint16_t *wt, const uint32_t *xe, const uint32_t *xo, \
                                                 int64_t xs, __m512 acc[KV_FEW_G][KV_AMX_FEW]) {         \
        __m512 e[G][M], o[G][M];                                                                         \
        for (int g = 0; g < G; g++)                                                                      \
            for (int t = 0; t < M; t++) e[g][t] = o[g][t] = _mm512_setzero_ps();                         \
        for (int r = 0; r < 16; r++) {                                                                   \
            __m512bh w[G];                                                                               \
            for (int g = 0; g < G; g++) w[g] = (__m512bh)_mm512_load_si512(wt + g * KV_FEW_KC * 512 + 32 * r); \
            for (int t = 0; t < M; t++) {                                                                \
                const __m512bh be = (__m512bh)_mm512_set1_epi32((int)xe[t * xs + r]);                    \
                const __m512bh bo = (__m512bh)_mm512_set1_epi32((int)xo[t * xs + r]);                    \
                for (int g = 0; g < G; g++) {                                                            \
                    e[g][t] = _mm512_dpbf16_ps(e[g][t], w[g], be);                                       \
                    o[g][t] = _mm512_dpbf16_ps(o[g][t], w[g], bo);                                       \
                }                                                                                        \
            }                                                                                            \
        }                                                                                                \
        for (int g = 0; g < G; g++)                                                                      \
            for (int t = 0; t < M; t++) acc[g][t] = _mm512_add_ps(acc[g][t], _mm512_add_ps(e[g][t], o[g][t])); \
    }
KV_DEFINE_FEW_BLOCK(4, 1) KV_DEFINE_FEW_BLOCK(4, 2) KV_DEFINE_FEW_BLOCK(2, 3) KV_DEFINE_FEW_BLOCK(2, 4)
KV_DEFINE_FEW_BLOCK(1, 1) KV_DEFINE_FEW_BLOCK(1, 2) KV_DEFINE_FEW_BLOCK(1, 3) KV_DEFINE_FEW_BLOCK(1, 4)
KV_DEFINE_FEW_BLOCK(3, 1) KV_DEFINE_FEW_BLOCK(3, 2) KV_DEFINE_FEW_BLOCK(2, 1) KV_DEFINE_FEW_BLOCK(2, 2)

/* Lane groups per block call for M rows: as many chains as the registers hold (2 G M accumulators). */
static inline int amx_few_groups(int M) { return M <= 2 ? 4 : 2; }

static inline void amx_few_block(int G, int M, const uint16_t *wt, const uint32_t *xe, const uint32_t *xo, int64_t xs,
                                 __m512 acc[KV_FEW_G][KV_AMX_FEW]) {
#define KV_FEW_CASE(GG)                                                                  \
    switch (M) {                                                                         \
    case 1: amx_few_block_g##GG##_m1(wt, xe, xo, xs, acc); return;                       \
    case 2: amx_few_block_g##GG##_m2(wt, xe, xo, xs, acc); return;                       \
    default: break;                                                                      \
    }
    if (G == 4) { KV_FEW_CASE(4) }
    if (G == 3) { KV_FEW_CASE(3) }
    if (G == 2) {
        KV_FEW_CASE(2)
        if (M == 3) { amx_few_block_g2_m3(wt, xe, xo, xs, acc); return; }
        amx_few_block_g2_m4(wt, xe, xo, xs, acc);
        return;
    }
    switch (M) {
    case 1: amx_few_block_g1_m1(wt, xe, xo, xs, acc); return;
    case 2: amx_few_block_g1_m2(wt, xe, xo, xs, acc); return;
    case 3: amx_few_block_g1_m3(wt, xe, xo, xs, acc); return;
    default: amx_few_block_g1_m4(wt, xe, xo, xs, acc); return;
    }
#undef KV_FEW_CASE
}

/* The contract at the top. Returns 0, or -1 when the per-thread buffer could not be allocated. */
static inline int kv_amx_rows_few(const kv_matrix *m, const uint16_t *xb, int M, int64_t n0, int64_t n1, float *y,
                                  int64_t ldy) {
    const int64_t K = m->K, KB = K / 32;
    /* [KV_FEW_G][KV_FEW_KC][16][32] widened weights, then xe and xo (M rows of K / 2 dwords each) */
    uint16_t *wt = kv_bf16_buffer(KV_FEW_G * KV_FEW_KC * 512 + 4 * (int64_t)M * K);
    if (!wt) return -1;
    uint32_t *xe = (uint32_t *)(wt + KV_FEW_G * KV_FEW_KC * 512), *xo = xe + M * KB * 16;
    amx_few_split_x(xb, M, KB, xe, xo);
    const int Gmax = amx_few_groups(M);
    const unsigned csr = _mm_getcsr();
    for (int64_t n = n0; n < n1; n += 16 * KV_FEW_G) {
        const int groups = (int)((n1 - n) / 16 < KV_FEW_G ? (n1 - n) / 16 : KV_FEW_G);
        __m512 acc[KV_FEW_G][KV_AMX_FEW];
        for (int g = 0; g < KV_FEW_G; g++)
            for (int t = 0; t < KV_AMX_FEW; t++) acc[g][t] = _mm512_setzero_ps();
        _mm_setcsr(csr | 0x8040);   /* FTZ | DAZ, as the tiles */
        for (int64_t kb0 = 0; kb0 < KB; kb0 += KV_FEW_KC) {
            const int64_t kb1 = kb0 + KV_FEW_KC < KB ? kb0 + KV_FEW_KC : KB;
            if (kb0 == 0) prefetch_rows(m, n + 16 * groups, 16 * groups);   /* the next pass's weights */
            for (int j = 0; j < 16 * groups; j++)
                kv_bf16_blocks(m, n + j, kb0, kb1, wt + ((j / 16) * KV_FEW_KC * 16 + j % 16) * 32, 512);
            for (int g = 0; g < groups; g++)
                for (int64_t kb = 0; kb < kb1 - kb0; kb++) {   /* channel rows -> pair rows */
                    uint16_t *blk = wt + (g * KV_FEW_KC + kb) * 512;
                    __m512i r[16];
                    for (int i = 0; i < 16; i++) r[i] = _mm512_load_si512(blk + 32 * i);
                    kv_transpose16(r);
                    for (int i = 0; i < 16; i++) _mm512_store_si512(blk + 32 * i, r[i]);
                }
            for (int64_t kb = kb0; kb < kb1; kb++)
                for (int g = 0; g < groups; g += Gmax) {
                    const int G = groups - g < Gmax ? groups - g : Gmax;
                    __m512 (*part)[KV_AMX_FEW] = acc + g;
                    amx_few_block(G, M, wt + (g * KV_FEW_KC + kb - kb0) * 512, xe + kb * 16, xo + kb * 16, KB * 16,
                                  part);
                }
        }
        _mm_setcsr(csr);
        for (int g = 0; g < groups; g++) {   /* amx_store's finish: the int8 scale, then the bias */
            const int64_t c0 = n + 16 * g;
            const __m512 scale = m->fmt == KV_INT8 ? _mm512_loadu_ps(m->scale + c0) : _mm512_set1_ps(1.0f);
            const __m512 bias = m->bias ? _mm512_loadu_ps(m->bias + c0) : _mm512_setzero_ps();
            for (int t = 0; t < M; t++) {
                __m512 v = acc[g][t];
                if (m->fmt == KV_INT8) v = _mm512_mul_ps(v, scale);
                if (m->bias) v = _mm512_add_ps(v, bias);
                _mm512_storeu_ps(y + t * ldy + c0 - n0, v);
            }
        }
    }
    return 0;
}

#endif

#endif
