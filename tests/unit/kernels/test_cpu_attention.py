"""kernels/cpu_attention*.h (the fused decoder's attention) per matmul kind, with a bf16 KV cache:
every kind (``float32``, and ``avx512_bf16`` / ``amx`` on builds with AVX512-BF16) attends in
float32: keys and values widened from the bf16 cache, q, scores, softmax and sums float32 -- the
float64 reference's result within float32 rounding. Attention is isolated here by running every
matrix on the float32 kernels (``Linear.matmul``) under each kind's decoder. (Scores as bf16 dot
products with q rounded to bf16 were tried in the fifth round and not kept: docs/performance.md.)
Batch invariance with the bf16 kinds' matmuls: a row alone, in a batch, and one sequence's
consecutive rows (a group: the block's keys transposed once for all of them) give the same bits;
positions past a row's length never reach its sums (NaN there changes nothing). Run with
``KVFLEET_CPU_ISA=avx2`` / ``avx512`` for the builds without AVX512-BF16 (the bf16 kinds are then
unavailable and skipped)."""

from __future__ import annotations

import pytest
import torch

from kvfleet.kernels import cpu_woq

pytestmark = pytest.mark.skipif(not cpu_woq.available(), reason="AVX2/FMA kernels unavailable here")

from kvfleet.kernels.cpu_decoder import FusedDecoder, matmul_available  # noqa: E402
from unit.kernels import test_cpu_decoder as dec  # noqa: E402  (the model, inputs and float64 reference)

BF16_KINDS = [pytest.param(k, marks=pytest.mark.skipif(not matmul_available(k), reason=f"no {k} kernels here"))
              for k in ("avx512_bf16", "amx")]


def _rows(M: int, seed: int, longest: int = 12 * dec.BS):
    """M sequences on disjoint block tables (BLOCKS // M blocks each) at lengths up to ``longest``
    (over 8 blocks: two splits), odd lengths and partial last blocks among them."""
    gen = torch.Generator().manual_seed(seed)
    per = dec.BLOCKS // M
    lens = torch.randint(1, min(longest, per * dec.BS) + 1, (M,), generator=gen, dtype=torch.int32)
    lens[0] = min(longest, per * dec.BS) - 3
    tables = torch.randperm(dec.BLOCKS, generator=gen)[: M * per].view(M, per).to(torch.int32).contiguous()
    slots = torch.tensor([int(tables[i, (n - 1) // dec.BS]) * dec.BS + (n - 1) % dec.BS for i, n in enumerate(lens.tolist())])
    pos = (lens - 1).double()[:, None]
    freqs = 1.0 / (10000 ** (torch.arange(0, dec.D, 2).double() / dec.D))
    angles = torch.cat([pos * freqs, pos * freqs], -1)
    x = torch.randn(M, dec.H, generator=gen)
    return x, angles.cos().float(), angles.sin().float(), slots, tables, lens


def _float32_matrices(weights):
    """Every layer's matrices on the float32 kernels; the LM head (after the hidden state the
    tests compare) stays on the decoder's, which keeps the decoder's kind."""
    for layer in weights.layers:
        for m in (layer.qkv, layer.o, layer.gate_up, layer.down):
            m.matmul = "float32"


def _against_reference(weights, ref, head_ref, args, fused, round_q: bool) -> float:
    """The largest difference of the step's hidden state from the float64 reference's (with
    ``round_q``, the reference's q rounded to bf16 after rotary)."""
    caches = [(layer.k_cache.clone(), layer.v_cache.clone()) for layer in weights.layers]
    hidden, _ = fused.step(args[0].clone(), *args[1:])
    written = [(layer.k_cache.clone(), layer.v_cache.clone()) for layer in weights.layers]
    for layer, (kc, vc) in zip(weights.layers, caches):
        layer.k_cache.copy_(kc)
        layer.v_cache.copy_(vc)
    with pytest.MonkeyPatch.context() as mp:
        if round_q:   # q is the one [.., QH, D] tensor the reference rotates
            rope = dec._rope
            mp.setattr(dec, "_rope", lambda x, c, s: rope(x, c, s).to(torch.bfloat16).double()
                       if x.shape[-2] == dec.QH else rope(x, c, s))
        want, _ = dec._reference(weights, ref, head_ref, *args, written)
    for layer, (kc, vc) in zip(weights.layers, caches):
        layer.k_cache.copy_(kc)
        layer.v_cache.copy_(vc)
    return (hidden.double() - want).abs().max().item()


@pytest.mark.parametrize("kind", ["float32", *BF16_KINDS])
def test_attention_is_float32_with_every_matmul_kind(kind):
    """Every layer's matrices on the float32 kernels: whatever the decoder's kind, the step matches
    the float64 reference within float32 rounding, and a reference with q rounded to bf16 (what a
    bf16 scoring would do) is measurably further away."""
    weights, ref, head_ref = dec._model("fp32", layers=1, cache=torch.bfloat16, vocab=304)
    _float32_matrices(weights)
    args = _rows(4, seed=2)
    fused = FusedDecoder(weights, threads=2, matmul=kind)
    assert fused.matmul == kind
    exact = _against_reference(weights, ref, head_ref, args, fused, round_q=False)
    rounded = _against_reference(weights, ref, head_ref, args, fused, round_q=True)
    assert exact <= 1e-4 and rounded > 10 * exact, (exact, rounded)


@pytest.mark.parametrize("kind", BF16_KINDS)
def test_bf16_attention_rows_give_the_same_bits_in_any_batch(kind):
    """bf16 matmuls with a bf16 cache: each row of a 4-row step (two splits in the longest) equals
    the row stepped alone; one sequence's 5 consecutive rows across a block boundary (a group)
    equal one-row steps."""
    weights, _, _ = dec._model("int8", layers=2, cache=torch.bfloat16, vocab=304)
    snapshot = [(layer.k_cache.clone(), layer.v_cache.clone()) for layer in weights.layers]
    fused = FusedDecoder(weights, threads=2, matmul=kind)
    assert fused.matmul == kind

    def step(x, cos, sin, slots, tables, lens, restore=True):
        for layer, (kc, vc) in zip(weights.layers, snapshot if restore else ()):
            layer.k_cache.copy_(kc)
            layer.v_cache.copy_(vc)
        return fused.step(x.clone(), cos, sin, slots, tables.contiguous(), lens)[1]

    args = _rows(4, seed=3)
    together = step(*args)
    for i in range(4):
        assert torch.equal(step(*[t[i:i + 1] for t in args])[0], together[i]), f"row {i} differs in the batch"

    R, start = 5, 9 * dec.BS - 2   # a group: one table, lengths one apart, two splits at the end
    table = torch.randperm(dec.BLOCKS, generator=torch.Generator().manual_seed(8))[:10].to(torch.int32)
    pos = torch.arange(start, start + R)
    slots = torch.tensor([int(table[p // dec.BS]) * dec.BS + p % dec.BS for p in pos.tolist()])
    freqs = 1.0 / (10000 ** (torch.arange(0, dec.D, 2).double() / dec.D))
    angles = torch.cat([pos.double()[:, None] * freqs] * 2, -1)
    x = torch.randn(R, dec.H, generator=torch.Generator().manual_seed(9))
    group = (x, angles.cos().float(), angles.sin().float(), slots, table.repeat(R, 1), (pos + 1).to(torch.int32))
    together = step(*group)
    # then one row at a time, each over the keys the rows before it wrote
    assert torch.equal(step(*[t[:1] for t in group])[0], together[0]), "row 0 differs"
    for j in range(1, R):
        assert torch.equal(step(*[t[j:j + 1] for t in group], restore=False)[0], together[j]), f"row {j} differs"


@pytest.mark.parametrize("kind", ["float32", *BF16_KINDS])
def test_positions_past_a_rows_length_never_reach_it(kind):
    """NaN keys and values in the cache past every row's length (the last blocks' unwritten
    slots, the lanes the 16-wide scores mask) leave each row's logits as they were."""
    weights, _, _ = dec._model("int8", layers=1, cache=torch.bfloat16, vocab=304)
    args = _rows(4, seed=4)
    lens, tables = args[5], args[4]
    snapshot = [(layer.k_cache.clone(), layer.v_cache.clone()) for layer in weights.layers]
    fused = FusedDecoder(weights, threads=2, matmul=kind)
    clean = fused.step(args[0].clone(), *args[1:])[1]
    for layer, (kc, vc) in zip(weights.layers, snapshot):
        for cache, saved in ((layer.k_cache, kc), (layer.v_cache, vc)):
            cache.copy_(saved)
            for i, n in enumerate(lens.tolist()):
                last = int(tables[i, (n - 1) // dec.BS])
                cache[last, (n - 1) % dec.BS + 1:] = float("nan")
    dirty = fused.step(args[0].clone(), *args[1:])[1]
    assert torch.equal(dirty, clean)
