"""kernels/cpu_perm.h through kvfleet.kernels.cpu_decoder: a matrix's input permutation
(``Linear.perm``, act-order GPTQ). An int4 model whose four matrices per layer hold their input
features in a random order (each its own: q|k|v, o, gate|up, down), stepped with their
permutations, equals the same dequantized weights in the natural order as float32 matrices: to
float32 rounding on the float32 kernels, to bf16's on AVX512-BF16 and AMX; without the
permutations it does not; with LoRA adapters on every projection (their shrink reads the input
before the gather) alike. A row's bits are the same alone and in a batch with every matmul kind.
Permutations that are not, and ones where the step takes none (LM head, experts), are refused."""

from __future__ import annotations

import pytest
import torch

from kvfleet.kernels import cpu_woq

pytestmark = pytest.mark.skipif(not cpu_woq.available(), reason="AVX2/FMA kernels unavailable here")

from kvfleet.kernels.cpu_decoder import (  # noqa: E402
    DecoderWeights,
    FusedDecoder,
    Layer,
    Linear,
    LoRATable,
    MoeLayer,
    matmul_available,
)

H, QH, KVH, D, FF, V, BS, BLOCKS, G = 128, 4, 2, 32, 192, 96, 16, 48, 32
MATMULS = ["float32"] + [pytest.param(k, marks=pytest.mark.skipif(not matmul_available(k), reason=f"no {k} here"))
                         for k in ("avx512_bf16", "amx")]


def _permuted(n: int, k: int, gen: torch.Generator) -> tuple[Linear, torch.Tensor]:
    """An int4 layer over its inputs in a random order (``perm``) and its dequantized float32 weight
    in the natural order: ``x @ natural.T == x[:, perm] @ dequant(sorted).T``."""
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    scale = (torch.rand(n, k // G, generator=gen) * 0.03 + 0.005).contiguous()
    shift = (-8 * scale).contiguous()
    deq = q.float() * scale.repeat_interleave(G, 1) + shift.repeat_interleave(G, 1)
    perm = torch.randperm(k, generator=gen).to(torch.int32)
    natural = torch.empty_like(deq)
    natural[:, perm.long()] = deq
    return Linear("int4", cpu_woq.pack_int4(q), scale, shift, G, perm=perm), natural.contiguous()


def _models(seed: int = 0, layers: int = 2) -> tuple[DecoderWeights, DecoderWeights]:
    """The permuted int4 model and its float32 twin (same norms, head, caches' contents)."""
    gen = torch.Generator().manual_seed(seed)
    permuted, natural = [], []
    for _ in range(layers):
        mats = [_permuted(n, k, gen) for n, k in (((QH + 2 * KVH) * D, H), (H, QH * D), (2 * FF, H), (H, FF))]
        n1, n2 = 1 + 0.1 * torch.randn(H, generator=gen), 1 + 0.1 * torch.randn(H, generator=gen)
        kc, vc = torch.randn(BLOCKS, BS, KVH, D, generator=gen), torch.randn(BLOCKS, BS, KVH, D, generator=gen)
        permuted.append(Layer(n1, n2, *(m for m, _ in mats), kc, vc))
        natural.append(Layer(n1, n2, *(Linear("fp32", w) for _, w in mats), kc.clone(), vc.clone()))
    head = Linear("fp32", torch.randn(V, H, generator=gen) * 0.2)
    final = 1 + 0.1 * torch.randn(H, generator=gen)
    return (DecoderWeights(QH, KVH, D, 1e-5, D ** -0.5, permuted, final, head),
            DecoderWeights(QH, KVH, D, 1e-5, D ** -0.5, natural, final, head))


def _inputs(M: int, seed: int = 1):
    """M rows of distinct sequences, disjoint block tables."""
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 2 * BS, (M,), generator=gen, dtype=torch.int32)
    tables = torch.randperm(BLOCKS, generator=gen)[: 2 * M].view(M, 2).to(torch.int32).contiguous()
    slots = torch.tensor([int(tables[i, (n - 1) // BS]) * BS + (n - 1) % BS for i, n in enumerate(lens.tolist())])
    freqs = 1.0 / (10000 ** (torch.arange(0, D, 2).double() / D))
    angles = (lens - 1).double()[:, None] * freqs
    angles = torch.cat([angles, angles], -1)
    return torch.randn(M, H, generator=gen), angles.cos().float(), angles.sin().float(), slots, tables, lens


def _step(weights: DecoderWeights, matmul: str, rows, inputs, lora_slots=None) -> torch.Tensor:
    """Logits of ``inputs[rows]`` from fresh copies of the caches (so steps do not see each other)."""
    saved = [(layer.k_cache.clone(), layer.v_cache.clone()) for layer in weights.layers]
    fused = FusedDecoder(weights, threads=2, matmul=matmul)
    assert fused.matmul == matmul
    x, cos, sin, slots, tables, lens = inputs
    _, logits = fused.step(x[rows].clone(), cos[rows].contiguous(), sin[rows].contiguous(), slots[rows].contiguous(),
                           tables[rows].contiguous(), lens[rows].contiguous(), lora_slots=lora_slots)
    for layer, (kc, vc) in zip(weights.layers, saved):
        layer.k_cache.copy_(kc)
        layer.v_cache.copy_(vc)
    return logits


@pytest.mark.parametrize("matmul", MATMULS)
def test_permuted_int4_equals_its_dequantized_float32_model(matmul):
    permuted, natural = _models()
    inputs = _inputs(9)
    want = _step(natural, "float32", slice(0, 9), inputs).double()
    got = _step(permuted, matmul, slice(0, 9), inputs).double()
    err = (got - want).abs().max() / want.abs().max()
    # float32: sums in another order; bf16 matmuls: activations and weights rounded to 8 bits
    assert err <= (1e-4 if matmul == "float32" else 2e-2), f"{matmul}: relative error {float(err):.2e}"
    for layer in permuted.layers:   # the same weights without their permutations: far off
        for m in (layer.qkv, layer.o, layer.gate_up, layer.down):
            m.perm = None
    off = _step(permuted, matmul, slice(0, 9), inputs).double()
    assert (off - want).abs().max() / want.abs().max() > 0.1


@pytest.mark.parametrize("matmul", MATMULS)
def test_lora_adapters_on_permuted_matrices(matmul):
    permuted, natural = _models(seed=4)
    gen = torch.Generator().manual_seed(6)
    parts = {"q": (H, 0, QH * D), "k": (H, QH * D, KVH * D), "v": (H, (QH + KVH) * D, KVH * D), "o": (QH * D, 0, H),
             "gate": (H, 0, FF), "up": (H, FF, FF), "down": (FF, 0, H)}
    for p, n in zip(permuted.layers, natural.layers):   # 2 slots of rank 4, the same tables on both models
        p.lora = n.lora = {part: LoRATable(torch.randn(2, 4, k, generator=gen) / k ** 0.5,
                                           torch.randn(2, 4, cols, generator=gen) * 0.3, n0)
                           for part, (k, n0, cols) in parts.items()}
    inputs = _inputs(6, seed=7)
    slots = torch.tensor([0, -1, 1, 0, 1, -1])
    want = _step(natural, "float32", slice(0, 6), inputs, slots).double()
    assert (want - _step(natural, "float32", slice(0, 6), inputs).double()).abs().max() > 0.1 * want.abs().max()
    got = _step(permuted, matmul, slice(0, 6), inputs, slots).double()
    err = (got - want).abs().max() / want.abs().max()
    assert err <= (1e-4 if matmul == "float32" else 2e-2), f"{matmul}: relative error {float(err):.2e}"


@pytest.mark.parametrize("matmul", MATMULS)
def test_a_permuted_row_gives_the_same_bits_in_any_batch(matmul):
    permuted, _ = _models(seed=2)
    inputs = _inputs(20, seed=3)
    together = _step(permuted, matmul, slice(0, 20), inputs)
    assert torch.equal(_step(permuted, matmul, slice(7, 12), inputs), together[7:12])
    for i in (0, 19):
        assert torch.equal(_step(permuted, matmul, slice(i, i + 1), inputs)[0], together[i]), f"row {i}"


def test_bad_permutations_are_refused():
    permuted, _ = _models(layers=1)
    layer = permuted.layers[0]
    good = layer.o.perm
    for bad in (torch.zeros(QH * D, dtype=torch.int32), good[:-1].contiguous(), good.long()):
        layer.o.perm = bad
        with pytest.raises(ValueError, match="perm"):
            FusedDecoder(permuted, threads=2)
    layer.o.perm = good
    permuted.head.perm = torch.arange(H, dtype=torch.int32)
    with pytest.raises(ValueError, match="LM head takes no input permutation"):
        FusedDecoder(permuted, threads=2)
    permuted.head.perm = None
    router = Linear("fp32", torch.randn(2, H))
    moe = MoeLayer(router, [layer.gate_up, layer.gate_up], [layer.down, layer.down], top_k=1)
    layer.gate_up, layer.down, layer.moe = None, None, moe
    with pytest.raises(ValueError, match="experts' step takes no input permutation"):
        FusedDecoder(permuted, threads=2)
