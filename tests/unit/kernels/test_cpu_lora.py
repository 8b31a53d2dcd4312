"""kernels/cpu_lora.h through kvfleet.kernels.cpu_decoder: LoRA deltas inside the fused step.

A row with an adapter slot equals (float64 reference) the same layer with the slot's adapter merged
into the weights, every projection adapted (q, k, v as parts of qkv, o, gate and up as parts of
gate_up, down); a row without one equals the base model bit for bit; a row's bits do not depend on
the step's other rows (adapter or base) for each matmul kind this CPU has; bad tables and slots are
ValueErrors."""

from __future__ import annotations

import pytest
import torch

from kvfleet.kernels import cpu_woq

pytestmark = pytest.mark.skipif(not cpu_woq.available(), reason="AVX2/FMA kernels unavailable here")

from kvfleet.kernels.cpu_decoder import FusedDecoder, LoRATable, matmul_available  # noqa: E402

from .test_cpu_decoder import FF, KVH, QH, D, H, _inputs, _model, _reference, _separate_rows  # noqa: E402

SLOTS, R = 3, 8
MATMULS = ["float32",
           pytest.param("amx", marks=pytest.mark.skipif(not matmul_available("amx"), reason="no AMX here")),
           pytest.param("avx512_bf16", marks=pytest.mark.skipif(not matmul_available("avx512_bf16"),
                                                                reason="no AVX512-BF16 here"))]
PARTS = {"q": (H, 0, QH * D), "k": (H, QH * D, KVH * D), "v": (H, (QH + KVH) * D, KVH * D), "o": (QH * D, 0, H),
         "gate": (H, 0, FF), "up": (H, FF, FF), "down": (FF, 0, H)}


def _tables(layers: int, seed: int = 5, rank: dict[int, int] | None = None):
    """Random slot tables for every part of every layer (slot s's adapter of rank ``rank[s]`` <= R,
    zero-padded above it, as lora_layers stores them) and, per layer and slot, the merged deltas
    ``B A`` (float64) by matrix."""
    gen = torch.Generator().manual_seed(seed)
    rank = rank or {s: R for s in range(SLOTS)}
    tables, merged = [], []
    for _ in range(layers):
        layer, deltas = {}, {s: {} for s in range(SLOTS)}
        for part, (k, n0, n) in PARTS.items():
            a, b = torch.zeros(SLOTS, R, k), torch.zeros(SLOTS, R, n)
            for s, r in rank.items():
                a[s, :r] = torch.randn(r, k, generator=gen) / k ** 0.5
                b[s, :r] = torch.randn(r, n, generator=gen) * 0.3
                matrix = {"q": "qkv", "k": "qkv", "v": "qkv", "gate": "gu", "up": "gu"}.get(part, part)
                deltas[s].setdefault(matrix, []).append((n0, (b[s].double().T @ a[s].double())))
            layer[part] = LoRATable(a.contiguous(), b.contiguous(), n0)
        tables.append(layer)
        merged.append(deltas)
    return tables, merged


def _merge(ref, merged, slot):
    """The float64 reference weights with ``slot``'s adapter added (None: the base)."""
    if slot is None:
        return ref
    out = []
    for (n1, n2, wqkv, bqkv, wo, wgu, wd), deltas in zip(ref, merged):
        w = {"qkv": wqkv.clone(), "o": wo.clone(), "gu": wgu.clone(), "down": wd.clone()}
        for matrix, parts in deltas[slot].items():
            for n0, delta in parts:
                w[matrix][n0:n0 + delta.shape[0]] += delta
        out.append((n1, n2, w["qkv"], bqkv, w["o"], w["gu"], w["down"]))
    return out


def _with_lora(fmt="fp32", seed=0, rank=None):
    weights, ref, head_ref = _model(fmt, seed=seed, vocab=304)   # 304: a multiple of 16 (AMX tiles)
    tables, merged = _tables(len(weights.layers), rank=rank)
    for layer, t in zip(weights.layers, tables):
        layer.lora = t
    return weights, ref, head_ref, merged


def _restore(weights, snapshot):
    for layer, (kc, vc) in zip(weights.layers, snapshot):
        layer.k_cache.copy_(kc)
        layer.v_cache.copy_(vc)


def test_rows_with_adapters_match_the_merged_float64_reference():
    """Rows of slots 0, 2, none and 1 (slot 1 of rank 3 in rank-8 slots): each matches the float64
    reference with its adapter merged into the weights; the base row matches the base reference."""
    weights, ref, head_ref, merged = _with_lora(rank={0: R, 1: 3, 2: R})
    M = 4
    x, cos, sin, slots, tables, lens = _separate_rows(M, seed=7)
    lora_slots = torch.tensor([0, 2, -1, 1])
    snapshot = [(layer.k_cache.clone(), layer.v_cache.clone()) for layer in weights.layers]
    fused = FusedDecoder(weights, threads=2)
    hidden, logits = fused.step(x.clone(), cos, sin, slots, tables, lens, lora_slots=lora_slots)
    for i, s in enumerate(lora_slots.tolist()):
        _restore(weights, snapshot)
        _, want = _reference(weights, _merge(ref, merged, None if s < 0 else s), head_ref, x[i:i + 1], cos[i:i + 1],
                             sin[i:i + 1], slots[i:i + 1], tables[i:i + 1], lens[i:i + 1])
        torch.testing.assert_close(logits[i].double(), want[0], rtol=1e-4, atol=1e-3)
    # and the adapters change the logits (the deltas are not lost)
    _restore(weights, snapshot)
    _, base = _reference(weights, ref, head_ref, x[:1], cos[:1], sin[:1], slots[:1], tables[:1], lens[:1])
    assert (logits[0].double() - base[0]).abs().max() > 0.05


@pytest.mark.parametrize("matmul", MATMULS)
def test_a_row_gives_the_same_bits_alone_and_in_a_mixed_batch(matmul):
    """Batch invariance with adapters, per matmul kind: each row of a 20-row step (on AMX tiles the
    wide path; slots 0, -1, 1, 2, -1, 0, ...) equals the row stepped alone (the narrow path) and in a
    5-row step, and a base row equals the same row on the decoder without LoRA tables."""
    weights, _, _, _ = _with_lora("fp32")
    M = 20
    x, cos, sin, slots, tables, lens = _separate_rows(M, seed=3)
    lora_slots = torch.tensor([0, -1, 1, 2, -1] * 4)
    snapshot = [(layer.k_cache.clone(), layer.v_cache.clone()) for layer in weights.layers]
    fused = FusedDecoder(weights, threads=2, matmul=matmul)
    assert fused.matmul == matmul

    def step(decoder, rows, lora=True):
        _restore(weights, snapshot)
        return decoder.step(x[rows].clone(), cos[rows], sin[rows], slots[rows], tables[rows].contiguous(), lens[rows],
                            lora_slots=lora_slots[rows] if lora else None)[1]

    together = step(fused, slice(0, M))
    assert torch.equal(step(fused, slice(7, 12)), together[7:12])
    for i in (0, 1, 2, 3, 19):
        assert torch.equal(step(fused, slice(i, i + 1))[0], together[i]), f"row {i} differs in the batch"
    for layer in weights.layers:
        layer.lora = None
    base = step(FusedDecoder(weights, threads=2, matmul=matmul), slice(0, M), lora=False)
    is_base = lora_slots < 0
    assert torch.equal(base[is_base], together[is_base]), "a base row differs from the decoder without LoRA"
    assert all(not torch.equal(base[i], together[i]) for i in (~is_base).nonzero().flatten().tolist())


@pytest.mark.parametrize("matmul", MATMULS[1:])
def test_bf16_matmuls_add_float32_deltas(matmul):
    """With bf16 matmuls (base weights and activations rounded to bf16, the deltas float32): the
    adapter rows are within bf16's rounding of the merged float64 reference."""
    weights, ref, head_ref, merged = _with_lora("fp32")
    x, cos, sin, slots, tables, lens = _separate_rows(2, seed=7)
    snapshot = [(layer.k_cache.clone(), layer.v_cache.clone()) for layer in weights.layers]
    _, logits = FusedDecoder(weights, threads=2, matmul=matmul).step(x.clone(), cos, sin, slots, tables, lens,
                                                                       lora_slots=torch.tensor([1, 2]))
    for i, s in enumerate((1, 2)):
        _restore(weights, snapshot)
        _, want = _reference(weights, _merge(ref, merged, s), head_ref, x[i:i + 1], cos[i:i + 1], sin[i:i + 1],
                             slots[i:i + 1], tables[i:i + 1], lens[i:i + 1])
        assert (logits[i].double() - want[0]).abs().max() <= 2e-2 * want.abs().max()


def test_a_slot_written_between_steps_is_read_in_place():
    """The tables are read at each step: zeroing slot 0's B makes its row the base model's bits."""
    weights, _, _, _ = _with_lora("fp32")
    x, cos, sin, slots, tables, lens = _inputs(1, seed=9)
    snapshot = [(layer.k_cache.clone(), layer.v_cache.clone()) for layer in weights.layers]
    fused = FusedDecoder(weights, threads=2)
    _, base = fused.step(x.clone(), cos, sin, slots, tables, lens)
    _restore(weights, snapshot)
    _, adapted = fused.step(x.clone(), cos, sin, slots, tables, lens, lora_slots=torch.tensor([0]))
    assert not torch.equal(base, adapted)
    for layer in weights.layers:
        for table in layer.lora.values():
            table.b[0].zero_()
    _restore(weights, snapshot)
    _, cleared = fused.step(x.clone(), cos, sin, slots, tables, lens, lora_slots=torch.tensor([0]))
    assert torch.equal(base, cleared)


def test_bad_tables_and_slots_are_value_errors():
    weights, _, _, _ = _with_lora("fp32")
    x, cos, sin, slots, tables, lens = _inputs(2, seed=1)
    fused = FusedDecoder(weights, threads=1)
    assert (fused.lora_slots, fused.lora_rank) == (SLOTS, R)
    for bad, match in ((torch.tensor([0, SLOTS]), "slots 0.."), (torch.tensor([-2, 0]), "slots 0.."),
                       (torch.tensor([0, 1], dtype=torch.int32), "int64"), (torch.tensor([0]), r"\(2,\)")):
        with pytest.raises(ValueError, match=match):
            fused.step(x.clone(), cos, sin, slots, tables, lens, lora_slots=bad)
    layer = weights.layers[0]
    good = layer.lora["q"]
    for table, match in ((LoRATable(good.a, good.b, n0=QH * D), "do not fit"),
                         (LoRATable(good.a[:, :4].contiguous(), good.b), "do not fit"),
                         (LoRATable(good.a.double(), good.b), "float32")):
        layer.lora["q"] = table
        with pytest.raises(ValueError, match=match):
            FusedDecoder(weights, threads=1)
    layer.lora = {"qk": good}
    with pytest.raises(ValueError, match="not one of"):
        FusedDecoder(weights, threads=1)
    for layer in weights.layers:
        layer.lora = None
    with pytest.raises(ValueError, match="no LoRA tables"):
        FusedDecoder(weights, threads=1).step(x.clone(), cos, sin, slots, tables, lens, lora_slots=torch.tensor([0, 0]))
