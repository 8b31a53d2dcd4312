/* kvfleet CPU kernels: a matrix's input permutation (kv_matrix.perm; act-order GPTQ checkpoints,
 * whose int4 weights hold the input features sorted by quantization group).
 *
 * Contract: kv_permute_rows(x, K, m0, m1, perm) replaces each row m0 <= m < m1 of x [*, K] (rows K
 * floats apart) by its gather x'[m, k] = x[m, perm[k]] (perm [K] int32, a permutation of 0 .. K-1:
 * kernels/cpu_decoder.py checks it). A matrix W' over the sorted features then gives
 * x' W'^T = x W^T exactly: the gather moves floats, it rounds nothing, and each row is gathered on
 * its own (batch-invariant). The fused decoder (cpu_decoder.c, input_rows) gathers a phase's input
 * once, before its bf16 packing, so every matmul kind (float32, AVX512-BF16, AMX) reads the
 * permuted rows. Stack: K floats (a row's copy).
 */
#ifndef KVFLEET_CPU_PERM_H
#define KVFLEET_CPU_PERM_H

#include <stdint.h>
#include <string.h>

static inline void kv_permute_rows(float *x, int64_t K, int64_t m0, int64_t m1, const int32_t *perm) {
    float row[K];
    for (int64_t m = m0; m < m1; m++) {
        float *r = x + m * K;
        memcpy(row, r, K * sizeof(float));
        for (int64_t k = 0; k < K; k++) r[k] = row[perm[k]];
    }
}

#endif
