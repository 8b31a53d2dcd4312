/* kvfleet CPU kernels: the fused decoder's description (cpu_decoder.c's input), the structs that
 * kernels/cpu_lib.py mirrors with ctypes (kv_matrix in cpu_gemv.h; kv_moe, kv_layer and kv_decoder here).
 * Their sizes are exported by kv_abi_sizes and compared with the mirrors when the library loads:
 * change a struct here and its mirror in cpu_lib.py together. */
#ifndef KVFLEET_CPU_DECODER_H
#define KVFLEET_CPU_DECODER_H

#include "cpu_amx.h"
#include "cpu_gemv.h"

/* kv_moe.scoring: how the router's logits become the top-k experts' weights (cpu_moe.h, moe_route). */
enum { KV_MOE_SOFTMAX = 0, KV_MOE_TOPK_SOFTMAX = 1 };

/* A layer's mixture of experts (kv_layer.moe; cpu_moe.h runs it in place of the dense MLP). */
typedef struct {
    int64_t num_experts, top_k, intermediate;   /* E, k (<= 16), each expert's MLP width I */
    int64_t norm_topk_prob;                     /* KV_MOE_SOFTMAX: renormalise the top-k weights */
    int64_t scoring;                            /* KV_MOE_SOFTMAX or KV_MOE_TOPK_SOFTMAX */
    kv_matrix router;                           /* [E, H] float32 (bias allowed); float32 kernels always */
    const kv_matrix *gate_up;                   /* [E]: [2 I, H] each, gate rows then up rows */
    const kv_matrix *down;                      /* [E]: [H, I] each */
} kv_moe;

/* A LoRA adapter table of one projection (kv_lora; cpu_lora.h adds its deltas): the adapters'
 * slots as runtime/worker/lora_layers.py holds them, a [slots, R, K] and b [slots, R, n] (B
 * transposed, the adapter's scaling folded in, ranks below R = kv_decoder.lora_rank zero-padded),
 * float32; they add to the output columns n0 .. n0 + n - 1 of the layer's matrix. a NULL: none. */
typedef struct {
    const float *a, *b;
    int64_t n0, n;
} kv_lora_part;

/* kv_lora.part indices: q, k, v (parts of qkv; a stored qkv is one part), o, gate, up (of gate_up), down. */
enum { KV_LORA_QKV = 0, KV_LORA_O = 3, KV_LORA_GATE_UP = 4, KV_LORA_DOWN = 6, KV_LORA_PARTS = 7 };
typedef struct {
    kv_lora_part part[KV_LORA_PARTS];
} kv_lora;

/* One decoder layer (runtime/worker/recipes.py describes the families that fill it). The four
 * RMSNorm positions, each [H] or NULL (none): attn_in before q|k|v (NULL: the residual itself is
 * the input), attn_out on o's output before it is added to the residual, mlp_in and mlp_out alike
 * around the MLP. Llama: attn_in + mlp_in; Gemma 3 and GLM-4: all four; OLMo 2: attn_out + mlp_out. */
typedef struct {
    const float *attn_in_norm, *attn_out_norm, *mlp_in_norm, *mlp_out_norm;
    const float *q_norm, *k_norm;          /* kv_decoder.qk_norm: [D] (per head) or [QH D] / [KVH D]; else NULL */
    kv_matrix qkv;                         /* [(QH + 2 KVH) D, H]: q rows, then k, then v */
    kv_matrix o;                           /* [H, QH D] */
    kv_matrix gate_up;                     /* [2 I, H]: gate rows, then up rows */
    kv_matrix down;                        /* [H, I] */
    void *k_cache, *v_cache;               /* [num_blocks, block_size, KVH, D], kv_decoder.cache_dtype */
    int64_t window;                        /* sliding window in positions: a row attends to len - window .. len - 1; 0: all */
    int64_t rope;                          /* which cos/sin table (kv_decode's cos [R, M, rotary_dim]) */
    const kv_moe *moe;                     /* NULL: the dense MLP (gate_up, down); else the experts (those unused) */
    const kv_lora *lora;                   /* the LoRA adapters' tables of this layer, or NULL (none) */
} kv_layer;

/* kv_decoder.qk_norm: RMSNorm of the new queries and keys before rotary: none, per head (weights
 * [D], Qwen3, Gemma 3) or over the whole projection (weights [QH D] and [KVH D], OLMo 2). */
enum { KV_QK_NONE = 0, KV_QK_HEAD = 1, KV_QK_PROJ = 2 };
/* kv_decoder.act: the gated MLP's activation, act(gate) * up: SiLU, or tanh-approximated GELU. */
enum { KV_ACT_SILU = 0, KV_ACT_GELU_TANH = 1 };

/* kv_decoder.cache_dtype: the KV caches' element type (activations are float32 either way). */
enum { KV_CACHE_F32 = 0, KV_CACHE_BF16 = 1 };

/* kv_decoder.matmul: the kernels of the linear layers: float32 (cpu_gemv.h), bf16 on AMX tiles
 * (cpu_amx.h; the `amx` build), bf16 dot products (cpu_dpbf16.h; the avx512_bf16 and amx builds).
 * A build without the asked kernels runs float32. A matrix may name its own (kv_matrix.kind = 1 +
 * a code: float32, or the decoder's own kind; kernels/cpu_decoder.py checks it), for every step. */
enum { KV_MATMUL_F32 = 0, KV_MATMUL_AMX = 1, KV_MATMUL_DPBF16 = 2 };

typedef struct {
    int64_t num_layers, hidden, num_heads, num_kv_heads, head_size, intermediate, block_size;
    double eps, scale;                     /* RMSNorm epsilon; softmax scale */
    const kv_layer *layers;
    const float *final_norm;               /* [H] */
    const kv_matrix *head;                 /* LM head [V, H], or NULL */
    int64_t cache_dtype;                   /* KV_CACHE_F32 or KV_CACHE_BF16 (round to nearest even) */
    int64_t matmul;                        /* KV_MATMUL_F32, KV_MATMUL_AMX or KV_MATMUL_DPBF16 */
    int64_t qk_norm;                       /* KV_QK_* */
    int64_t act;                           /* KV_ACT_* */
    int64_t rotary_dim;                    /* the first rotary_dim elements of each head rotate (even, <= D) */
    int64_t rotary_interleaved;            /* 0: pairs (i, i + rotary_dim / 2); 1: pairs (2i, 2i + 1) (GLM-4) */
    double residual_scale;                 /* each sublayer's output times this before the residual add (Granite) */
    int64_t lora_rank;                     /* R, the width of the layers' LoRA slots (kv_lora_part) */
    const int64_t *lora_slots;             /* set per step: [M] each row's adapter slot (-1: none); NULL: no row has one */
    int64_t (*all_reduce)(float *buf, int64_t n);   /* tensor parallelism (cpu_tp.h): sums buf over the ranks; NULL: one rank */
} kv_decoder;


/* sizeof() of kv_matrix, kv_layer, kv_decoder, kv_moe and kv_lora into out[0 .. n - 1]; returns how many there are. */
static inline int64_t kv_abi_sizes_of(int64_t *out, int64_t n) {
    const int64_t sizes[] = {(int64_t)sizeof(kv_matrix), (int64_t)sizeof(kv_layer), (int64_t)sizeof(kv_decoder),
                             (int64_t)sizeof(kv_moe), (int64_t)sizeof(kv_lora)};
    for (int64_t i = 0; i < n && i < 5; i++) out[i] = sizes[i];
    return 5;
}

#endif
