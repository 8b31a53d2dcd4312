"""kvfleet.kernels.cpu_decoder: the fused C decode step against a float64 torch reference of the
same Llama layer (RMSNorm, q|k|v, rotary, paged grouped-query attention, o, SiLU MLP, LM head),
for fp32, bf16, int8 and int4 weights, one and several rows, scattered block tables and partial blocks,
float32 and bf16 KV caches; and batch invariance: a row's bits do not depend on the step's other
rows, prefill-sized steps (hundreds of rows of several sequences) included; the LM head on the
asked rows only; the AMX tile kernels where the CPU has them."""

from __future__ import annotations

import ctypes

import pytest
import torch

from kvfleet.kernels import cpu_woq

pytestmark = pytest.mark.skipif(not cpu_woq.available(), reason="AVX2/FMA kernels unavailable here")

from kvfleet.kernels.cpu_decoder import (  # noqa: E402
    MAX_ROWS,
    DecoderWeights,
    FusedDecoder,
    Layer,
    Linear,
    matmul_available,
)

AMX = pytest.mark.skipif(not matmul_available("amx"), reason="no AMX-BF16 here (or the amx build is not loaded)")
DPBF16 = pytest.mark.skipif(not matmul_available("avx512_bf16"),
                            reason="no AVX512-BF16 here (or the loaded build lacks it)")
BF16_MATMULS = [pytest.param("amx", marks=AMX), pytest.param("avx512_bf16", marks=DPBF16)]

H, QH, KVH, D, FF, V, BS, BLOCKS = 128, 6, 2, 64, 320, 300, 16, 40


def _linear(fmt: str, n: int, k: int, gen: torch.Generator, bias: bool = False) -> tuple[Linear, torch.Tensor]:
    """A random layer in ``fmt`` and its dequantized float64 weight ``[n, k]``."""
    w = torch.randn(n, k, generator=gen) * 0.2
    b = torch.randn(n, generator=gen) * 0.1 if bias else None
    if fmt == "fp32":
        return Linear("fp32", w.contiguous(), bias=b), w.double()
    if fmt == "bf16":
        wb = w.to(torch.bfloat16).contiguous()
        return Linear("bf16", wb, bias=b), wb.double()
    if fmt == "int8":
        scale = w.abs().amax(1) / 127
        q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        return Linear("int8", q, scale.contiguous(), bias=b), q.double() * scale.double()[:, None]
    G = 32
    if fmt == "int8g":  # Q8_0's layout: a scale per 32 weights
        scale = (w.view(n, k // G, G).abs().amax(-1) / 127).contiguous()
        q = torch.round(w / scale.repeat_interleave(G, 1)).clamp(-127, 127).to(torch.int8)
        return Linear("int8g", q, scale, group=G, bias=b), q.double() * scale.double().repeat_interleave(G, 1)
    if fmt in ("int8g16", "int8g32s"):  # Q6_K's layout (G 16, q in -32..31), Q5_K's (G 32, q in 0..31, a shift)
        G = 16 if fmt == "int8g16" else 32
        g = w.view(n, k // G, G)
        if G == 16:  # symmetric, 6 bits
            scale, shift = (g.abs().amax(-1) / 31).contiguous(), None
            q = torch.round(g / scale[..., None]).clamp(-32, 31)
        else:  # asymmetric, 5 bits: w = q * scale + min
            lo = g.amin(-1)
            scale, shift = ((g.amax(-1) - lo) / 31).contiguous(), lo.contiguous()
            q = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 31)
        q = q.view(n, k).to(torch.int8)
        deq = q.float() * scale.repeat_interleave(G, 1)  # the format's float32 arithmetic
        deq = deq if shift is None else deq + shift.repeat_interleave(G, 1)
        return Linear("int8g", q, scale.contiguous(), shift, G, b), deq.double()
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    scale = torch.rand(n, k // G, generator=gen) * 0.05
    shift = -8 * scale
    deq = q.double() * scale.double().repeat_interleave(G, 1) + shift.double().repeat_interleave(G, 1)
    return Linear("int4", cpu_woq.pack_int4(q), scale.contiguous(), shift.contiguous(), G, b), deq


def _model(fmt: str, layers: int = 2, seed: int = 0, bias: bool = False, cache: torch.dtype = torch.float32,
           vocab: int = V):
    gen = torch.Generator().manual_seed(seed)
    built, ref = [], []
    for _ in range(layers):
        qkv, qkv_ref = _linear(fmt, (QH + 2 * KVH) * D, H, gen, bias)
        o, o_ref = _linear(fmt, H, QH * D, gen)
        gu, gu_ref = _linear(fmt, 2 * FF, H, gen)
        down, down_ref = _linear(fmt, H, FF, gen)
        n1, n2 = 1 + 0.1 * torch.randn(H, generator=gen), 1 + 0.1 * torch.randn(H, generator=gen)
        kc, vc = torch.randn(BLOCKS, BS, KVH, D, generator=gen), torch.randn(BLOCKS, BS, KVH, D, generator=gen)
        kc, vc = kc.to(cache), vc.to(cache)
        built.append(Layer(n1, n2, qkv, o, gu, down, kc, vc))
        ref.append((n1, n2, qkv_ref, None if qkv.bias is None else qkv.bias.double(), o_ref, gu_ref, down_ref))
    head, head_ref = _linear(fmt, vocab, H, gen)
    final = 1 + 0.1 * torch.randn(H, generator=gen)
    weights = DecoderWeights(QH, KVH, D, 1e-5, D ** -0.5, built, final, head)
    return weights, ref, head_ref


def _rope(x, cos, sin):
    h = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., h:], x[..., :h]], -1) * sin


def _reference(weights, ref, head_ref, x, cos, sin, slots, tables, lens, written=None):
    """float64: the decoder layer as transformers' Llama computes it, over the paged caches
    (which it updates like the kernel does). ``written``: the caches after the kernel's step; each
    new key and value must be within one rounding of the reference's own, and the reference then
    attends over the kernel's (a bf16 cache: a 1e-7 difference in a key can round it one bf16 step
    the other way)."""
    def norm(v, w):
        return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + weights.eps) * w.double()

    x = x.double()
    cos, sin = cos.double(), sin.double()
    for index, (layer, (n1, n2, wqkv, bqkv, wo, wgu, wd)) in enumerate(zip(weights.layers, ref)):
        h = norm(x, n1)
        qkv = h @ wqkv.T + (0 if bqkv is None else bqkv)
        q = qkv[:, : QH * D].view(-1, QH, D)
        k = qkv[:, QH * D : (QH + KVH) * D].view(-1, KVH, D)
        v = qkv[:, (QH + KVH) * D :].view(-1, KVH, D)
        q, k = _rope(q, cos[:, None], sin[:, None]), _rope(k, cos[:, None], sin[:, None])
        for i, slot in enumerate(slots.tolist()):
            if slot < 0:
                continue
            for name, new in (("k_cache", k[i]), ("v_cache", v[i])):
                cache = getattr(layer, name).view(-1, KVH, D)
                cache[slot] = new.float().to(cache.dtype)
                if written is not None:
                    kernel = written[index][name == "v_cache"].view(-1, KVH, D)[slot]
                    ulp = 2.0 ** -7 if cache.dtype == torch.bfloat16 else 1e-4
                    torch.testing.assert_close(kernel.double(), new, rtol=ulp, atol=1e-4)
                    cache[slot] = kernel
        out = []
        for i, n in enumerate(lens.tolist()):
            pos = torch.arange(n)
            flat = tables[i, pos // BS].long() * BS + pos % BS
            keys = layer.k_cache.view(-1, KVH, D)[flat].double()  # [n, KVH, D]
            vals = layer.v_cache.view(-1, KVH, D)[flat].double()
            keys, vals = keys.repeat_interleave(QH // KVH, 1), vals.repeat_interleave(QH // KVH, 1)
            p = torch.softmax(torch.einsum("hd,nhd->hn", q[i], keys) * weights.scale, -1)
            out.append(torch.einsum("hn,nhd->hd", p, vals).reshape(-1))
        x = x + torch.stack(out) @ wo.T
        gu = norm(x, n2) @ wgu.T
        x = x + (torch.nn.functional.silu(gu[:, :FF]) * gu[:, FF:]) @ wd.T
    hidden = norm(x, weights.final_norm)
    return hidden, hidden @ head_ref.T


def _inputs(M: int, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 7 * BS, (M,), generator=gen, dtype=torch.int32)
    width = int((lens.max() + BS - 1) // BS) + 1
    tables = torch.stack([torch.randperm(BLOCKS, generator=gen)[:width] for _ in range(M)]).to(torch.int32)
    # each row's new token sits at position len - 1 of its own block table (distinct slots)
    slots = torch.tensor([int(tables[i, (n - 1) // BS]) * BS + (n - 1) % BS for i, n in enumerate(lens.tolist())])
    pos = (lens - 1).double()[:, None]
    freqs = 1.0 / (10000 ** (torch.arange(0, D, 2).double() / D))
    angles = torch.cat([pos * freqs, pos * freqs], -1)
    return (torch.randn(M, H, generator=gen), angles.cos().float(), angles.sin().float(), slots, tables, lens)


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "int8", "int4", "int8g", "int8g16", "int8g32s"])
@pytest.mark.parametrize("M", [1, 3, 9])
def test_step_matches_the_float64_reference(fmt, M):
    weights, ref, head_ref = _model(fmt, bias=(fmt in ("fp32", "bf16")))
    x, cos, sin, slots, tables, lens = _inputs(M)
    # Rows of one step belong to distinct sequences: distinct slots.
    assert len(set(slots.tolist())) == M
    caches = [(layer.k_cache.clone(), layer.v_cache.clone()) for layer in weights.layers]
    fused = FusedDecoder(weights, threads=2)
    hidden, logits = fused.step(x.clone(), cos, sin, slots, tables, lens)
    for layer, (kc, vc) in zip(weights.layers, caches):  # the reference starts from the same caches
        layer.k_cache.copy_(kc)
        layer.v_cache.copy_(vc)
    expect_hidden, expect_logits = _reference(weights, ref, head_ref, x, cos, sin, slots, tables, lens)
    torch.testing.assert_close(hidden.double(), expect_hidden, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits.double(), expect_logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("fmt", "head_size"), [("fp32", 64), ("int8", 64), ("fp32", 32), ("fp32", 80), ("fp32", 128)])
@pytest.mark.parametrize("M", [1, 9])
def test_a_bf16_cache_matches_the_float64_reference(fmt, head_size, M, monkeypatch):
    """A bf16 KV cache: the reference attends in float64 over the same bf16 keys and values (the
    new ones rounded by torch), so only the kernel's float32 arithmetic differs. Head sizes: the
    AVX-512 values-as-stored accumulation's widths (64 and 128 whole, 32 and 80 partly)."""
    import sys

    monkeypatch.setattr(sys.modules[__name__], "D", head_size)
    weights, ref, head_ref = _model(fmt, cache=torch.bfloat16)
    x, cos, sin, slots, tables, lens = _inputs(M)
    caches = [(layer.k_cache.clone(), layer.v_cache.clone()) for layer in weights.layers]
    fused = FusedDecoder(weights, threads=2)
    assert fused.cache_dtype == torch.bfloat16
    hidden, logits = fused.step(x.clone(), cos, sin, slots, tables, lens)
    written = [(layer.k_cache.clone(), layer.v_cache.clone()) for layer in weights.layers]
    for layer, (kc, vc) in zip(weights.layers, caches):
        layer.k_cache.copy_(kc)
        layer.v_cache.copy_(vc)
    expect_hidden, expect_logits = _reference(weights, ref, head_ref, x, cos, sin, slots, tables, lens, written)
    torch.testing.assert_close(hidden.double(), expect_hidden, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits.double(), expect_logits, rtol=1e-4, atol=1e-4)


def test_a_bf16_cache_holds_keys_rounded_as_torch_rounds():
    """Layer 0's new keys and values (computed before any attention, so the same in both runs):
    the bf16 cache holds bitwise ``.to(torch.bfloat16)`` of what the float32 cache holds."""
    w32, _, _ = _model("fp32", layers=1)
    w16, _, _ = _model("fp32", layers=1, cache=torch.bfloat16)
    x, cos, sin, slots, tables, lens = _inputs(9)
    FusedDecoder(w32, threads=2).step(x.clone(), cos, sin, slots, tables, lens)
    FusedDecoder(w16, threads=2).step(x.clone(), cos, sin, slots, tables, lens)
    for name in ("k_cache", "v_cache"):
        got = getattr(w16.layers[0], name).view(-1, KVH, D)[slots]
        want = getattr(w32.layers[0], name).view(-1, KVH, D)[slots].to(torch.bfloat16)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), name


def test_mixed_cache_dtypes_are_refused():
    weights, _, _ = _model("fp32", layers=2)
    weights.layers[1].v_cache = weights.layers[1].v_cache.to(torch.bfloat16)
    with pytest.raises(ValueError, match="layer 1 v_cache"):
        FusedDecoder(weights)
    weights.layers[0].k_cache = weights.layers[0].k_cache.half()
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        FusedDecoder(weights)


@pytest.mark.parametrize(("head_size", "block_size"), [(32, 16), (128, 16), (40, 16), (64, 8), (64, 32)])
def test_other_head_and_block_sizes_match_the_reference(head_size, block_size, monkeypatch):
    """The attention accumulators are specialised for D = 64 and 128; 32 takes the generic
    width, 40 (not a multiple of 16) the avx2 build's scores on every build; blocks of 8 and 32
    positions are a part of and two of the AVX-512 scores' 16. The module's geometry constants are
    read at call time, so the test resizes them."""
    import sys

    monkeypatch.setattr(sys.modules[__name__], "D", head_size)
    monkeypatch.setattr(sys.modules[__name__], "BS", block_size)
    weights, ref, head_ref = _model("fp32")
    x, cos, sin, slots, tables, lens = _inputs(3)
    caches = [(layer.k_cache.clone(), layer.v_cache.clone()) for layer in weights.layers]
    hidden, logits = FusedDecoder(weights, threads=2).step(x.clone(), cos, sin, slots, tables, lens)
    for layer, (kc, vc) in zip(weights.layers, caches):
        layer.k_cache.copy_(kc)
        layer.v_cache.copy_(vc)
    expect_hidden, expect_logits = _reference(weights, ref, head_ref, x, cos, sin, slots, tables, lens)
    torch.testing.assert_close(hidden.double(), expect_hidden, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits.double(), expect_logits, rtol=1e-4, atol=1e-4)


def test_the_step_writes_each_rows_key_and_value_at_its_slot():
    weights, _, _ = _model("fp32", layers=1)
    x, cos, sin, slots, tables, lens = _inputs(2)
    slots[1] = -1  # not written
    before = weights.layers[0].k_cache.clone()
    FusedDecoder(weights, threads=1).step(x.clone(), cos, sin, slots, tables, lens)
    changed = (weights.layers[0].k_cache != before).any(-1).any(-1).view(-1).nonzero().view(-1).tolist()
    assert changed == [int(slots[0])]


def test_threads_do_not_change_the_result():
    weights, _, _ = _model("int8")
    x, cos, sin, slots, tables, lens = _inputs(5)
    snapshot = [(layer.k_cache.clone(), layer.v_cache.clone()) for layer in weights.layers]
    results = []
    for threads in (1, 2):
        for layer, (kc, vc) in zip(weights.layers, snapshot):
            layer.k_cache.copy_(kc)
            layer.v_cache.copy_(vc)
        results.append(FusedDecoder(weights, threads=threads).step(x.clone(), cos, sin, slots, tables, lens))
    torch.testing.assert_close(results[0][1], results[1][1], rtol=0, atol=0)


def test_bad_arguments_are_value_errors():
    weights, _, _ = _model("fp32", layers=1)
    fused = FusedDecoder(weights)
    x, cos, sin, slots, tables, lens = _inputs(2)
    with pytest.raises(ValueError, match=f"1..{MAX_ROWS} rows"):
        fused.step(torch.zeros(MAX_ROWS + 1, H), cos, sin, slots, tables, lens)
    # the C bound is the same (it returns before reading an argument)
    assert fused._lib.kv_decode(ctypes.addressof(fused._struct), MAX_ROWS + 1, *[None] * 5, 0, *[None] * 4, 0) == -1
    with pytest.raises(ValueError, match="logits_indices"):
        fused.step(x, cos, sin, slots, tables, lens, torch.tensor([2]))
    with pytest.raises(ValueError, match="slots"):
        fused.step(x, cos, sin, slots.int(), tables, lens)
    with pytest.raises(ValueError, match="block_tables"):
        fused.step(x, cos, sin, slots, tables.long(), lens)
    bad = Linear("int8", torch.zeros(8, H, dtype=torch.int8), torch.ones(7))
    with pytest.raises(ValueError, match="scale"):
        bad.check("layer", 8, H)
    weights.layers[0].o = Linear("fp32", torch.zeros(H + 1, QH * D))
    with pytest.raises(ValueError, match="layer 0 o"):
        FusedDecoder(weights)


@pytest.mark.parametrize("fmt,cache", [("fp32", torch.float32), ("bf16", torch.float32), ("int8", torch.float32),
                                       ("int4", torch.float32), ("int8g", torch.float32), ("int8g32s", torch.float32),
                                       ("int8g16", torch.float32), ("fp32", torch.bfloat16),
                                       ("int8", torch.bfloat16)])
def test_a_row_gives_the_same_bits_in_any_batch(fmt, cache):
    """Batch invariance: each row of a 5-row step equals the same row stepped alone, bit for bit
    (the linear layers sum every row in the one-row order; attention splits a sequence by its own
    length, not by the step's row count), with either KV cache dtype."""
    weights, _, _ = _model(fmt, cache=cache)
    M = 5
    x, cos, sin, _, _, lens = _inputs(M, seed=3)
    # disjoint block tables (here the rows are separate sequences: no row reads another's new key)
    tables = torch.randperm(BLOCKS, generator=torch.Generator().manual_seed(4))[: M * 8].view(M, 8).to(torch.int32)
    slots = torch.tensor([int(tables[i, (n - 1) // BS]) * BS + (n - 1) % BS for i, n in enumerate(lens.tolist())])
    snapshot = [(layer.k_cache.clone(), layer.v_cache.clone()) for layer in weights.layers]
    fused = FusedDecoder(weights, threads=2)
    _, together = fused.step(x.clone(), cos, sin, slots, tables, lens)
    for i in range(M):
        for layer, (kc, vc) in zip(weights.layers, snapshot):
            layer.k_cache.copy_(kc)
            layer.v_cache.copy_(vc)
        _, alone = fused.step(x[i:i + 1].clone(), cos[i:i + 1], sin[i:i + 1], slots[i:i + 1], tables[i:i + 1],
                              lens[i:i + 1])
        assert torch.equal(alone[0], together[i]), f"row {i} (len {int(lens[i])}) differs in the batch"


@pytest.mark.parametrize("fmt", ["fp32", "int4"])
def test_a_sequences_rows_in_one_step_equal_one_row_steps(fmt):
    """Speculative verification: one sequence's tokens at consecutive positions as the rows of one
    step (each attending up to its own position, over keys the step itself writes; the rows attend
    as a group) give the bits of stepping them one at a time."""
    weights, _, _ = _model(fmt)
    R, start = 5, 3 * BS - 2   # the rows cross a block boundary
    gen = torch.Generator().manual_seed(7)
    table = torch.randperm(BLOCKS, generator=gen)[:8].to(torch.int32)
    pos = torch.arange(start, start + R)
    lens = (pos + 1).to(torch.int32)
    slots = torch.tensor([int(table[p // BS]) * BS + p % BS for p in pos.tolist()])
    freqs = 1.0 / (10000 ** (torch.arange(0, D, 2).double() / D))
    angles = torch.cat([pos.double()[:, None] * freqs, pos.double()[:, None] * freqs], -1)
    x, cos, sin = torch.randn(R, H, generator=gen), angles.cos().float(), angles.sin().float()
    snapshot = [(layer.k_cache.clone(), layer.v_cache.clone()) for layer in weights.layers]
    fused = FusedDecoder(weights, threads=2)
    _, together = fused.step(x.clone(), cos, sin, slots, table.repeat(R, 1).contiguous(), lens)
    for layer, (kc, vc) in zip(weights.layers, snapshot):
        layer.k_cache.copy_(kc)
        layer.v_cache.copy_(vc)
    for j in range(R):
        _, alone = fused.step(x[j:j + 1].clone(), cos[j:j + 1], sin[j:j + 1], slots[j:j + 1], table[None].clone(),
                              lens[j:j + 1])
        assert torch.equal(alone[0], together[j]), f"row {j} (position {int(pos[j])}) differs"


def _separate_rows(M: int, seed: int):
    """M rows of distinct sequences with disjoint block tables (no row reads another's new key)."""
    x, cos, sin, _, _, lens = _inputs(M, seed=seed)
    tables = torch.randperm(BLOCKS, generator=torch.Generator().manual_seed(seed + 1))[: M * 2].view(M, 2)
    lens = lens.clamp(max=2 * BS)
    slots = torch.tensor([int(tables[i, (n - 1) // BS]) * BS + (n - 1) % BS for i, n in enumerate(lens.tolist())])
    return x, cos, sin, slots, tables.to(torch.int32).contiguous(), lens


@pytest.mark.parametrize("matmul", BF16_MATMULS)
@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4", "int8g", "int8g16"])
@pytest.mark.parametrize("M", [1, 20])
def test_bf16_matmul_step_matches_the_float64_reference(fmt, M, matmul):
    """On AMX tiles or AVX512-BF16 dot products (activations and dequantized weights rounded to
    bf16, float32 sums): one row and 20 (on tiles the narrow and wide paths), within bf16's
    rounding of the float64 reference."""
    weights, ref, head_ref = _model(fmt, vocab=304)
    x, cos, sin, slots, tables, lens = _separate_rows(M, seed=11)
    caches = [(layer.k_cache.clone(), layer.v_cache.clone()) for layer in weights.layers]
    fused = FusedDecoder(weights, threads=2, matmul=matmul)
    assert fused.matmul == matmul
    hidden, logits = fused.step(x.clone(), cos, sin, slots, tables, lens)
    for layer, (kc, vc) in zip(weights.layers, caches):
        layer.k_cache.copy_(kc)
        layer.v_cache.copy_(vc)
    expect_hidden, expect_logits = _reference(weights, ref, head_ref, x, cos, sin, slots, tables, lens)
    for got, want in ((hidden, expect_hidden), (logits, expect_logits)):  # bf16: 8 significant bits
        assert (got.double() - want).abs().max() <= 2e-2 * want.abs().max()


@pytest.mark.parametrize("matmul", BF16_MATMULS)
@pytest.mark.parametrize("fmt", ["int4", "int8g", "int8g16", "int8g32s"])
def test_bf16_matmul_rows_give_the_same_bits_in_any_batch(fmt, matmul):
    """Batch invariance of the bf16 matmuls: each row of a 20-row step (on tiles the wide path)
    equals the row stepped alone (the narrow path) and in a 5-row step, bit for bit."""
    weights, _, _ = _model(fmt, vocab=304)
    x, cos, sin, slots, tables, lens = _separate_rows(20, seed=5)
    snapshot = [(layer.k_cache.clone(), layer.v_cache.clone()) for layer in weights.layers]
    fused = FusedDecoder(weights, threads=2, matmul=matmul)
    assert fused.matmul == matmul

    def step(rows):
        for layer, (kc, vc) in zip(weights.layers, snapshot):
            layer.k_cache.copy_(kc)
            layer.v_cache.copy_(vc)
        return fused.step(x[rows].clone(), cos[rows], sin[rows], slots[rows], tables[rows].contiguous(), lens[rows])[1]

    together = step(slice(0, 20))
    five = step(slice(7, 12))
    assert torch.equal(five, together[7:12])
    for i in (0, 9, 19):
        assert torch.equal(step(slice(i, i + 1))[0], together[i]), f"row {i} differs in the batch"


@pytest.mark.parametrize("matmul", BF16_MATMULS)
def test_matrices_on_their_own_kernels_keep_every_rows_bits_in_any_batch(matmul):
    """Per-matrix kernels (``Linear.matmul``, cpu_plan.matrix_matmul): the head and one layer's o and
    gate|up on the float32 kernels in a bf16 decoder. A row alone equals the same row among 16 and
    among 40, bit for bit; the head's logits are the float32 kernels' own (cpu_woq's int8g linear on
    the step's hidden state, bitwise), and differ from an all-bf16 decoder's."""
    weights, _, _ = _model("int8g", vocab=304)
    all_bf16 = FusedDecoder(weights, threads=2, matmul=matmul)
    for m in (weights.head, weights.layers[1].o, weights.layers[1].gate_up):
        m.matmul = "float32"
    fused = FusedDecoder(weights, threads=2, matmul=matmul)
    assert (fused.matmul, fused.head_matmul, all_bf16.head_matmul) == (matmul, "float32", matmul)
    M = 40   # one block per row, BLOCKS of them: no row reads another's new key
    x, cos, sin, _, _, lens = _inputs(M, seed=21)
    lens = lens.clamp(max=BS)
    tables = torch.randperm(BLOCKS, generator=torch.Generator().manual_seed(22))[:M].view(M, 1).to(torch.int32)
    slots = tables[:, 0].long() * BS + (lens.long() - 1)
    snapshot = [(layer.k_cache.clone(), layer.v_cache.clone()) for layer in weights.layers]

    def step(decoder, rows):
        for layer, (kc, vc) in zip(weights.layers, snapshot):
            layer.k_cache.copy_(kc)
            layer.v_cache.copy_(vc)
        return decoder.step(x[rows].clone(), cos[rows], sin[rows], slots[rows], tables[rows].contiguous(), lens[rows])

    hidden, together = step(fused, slice(0, M))
    sixteen = step(fused, slice(12, 28))[1]
    assert torch.equal(sixteen, together[12:28])
    for i in (0, 13, 27, 39):
        assert torch.equal(step(fused, slice(i, i + 1))[1][0], together[i]), f"row {i} differs in the batch"
    head = weights.head
    want = cpu_woq.int8g_linear_unchecked(hidden, head.w, head.scale, head.shift, head.group, None)
    assert torch.equal(together, want)
    assert not torch.equal(step(all_bf16, slice(0, M))[1], together)
    weights.head.matmul = "fp16"
    with pytest.raises(ValueError, match="own matmul"):
        FusedDecoder(weights, threads=2, matmul=matmul)


def _prefill_rows(seqs: list[tuple[int, int]], gen: torch.Generator):
    """Rows of prompt chunks: sequence ``i`` has tokens at positions ``start .. start + n - 1``
    (``seqs[i] = (start, n)``; the positions before ``start`` are in the cache already), its own
    blocks; the rows of a sequence are consecutive, as the engine packs a chunk."""
    width = max(s + n for s, n in seqs) // BS + 1
    blocks = torch.randperm(BLOCKS, generator=gen)[: width * len(seqs)].view(len(seqs), width).to(torch.int32)
    pos = torch.cat([torch.arange(s, s + n) for s, n in seqs])
    tables = torch.cat([blocks[i].repeat(n, 1) for i, (_, n) in enumerate(seqs)]).contiguous()
    slots = torch.tensor([int(tables[r, p // BS]) * BS + p % BS for r, p in enumerate(pos.tolist())])
    freqs = 1.0 / (10000 ** (torch.arange(0, D, 2).double() / D))
    angles = torch.cat([pos.double()[:, None] * freqs, pos.double()[:, None] * freqs], -1)
    x = torch.randn(pos.numel(), H, generator=gen)
    return x, angles.cos().float(), angles.sin().float(), slots, tables, (pos + 1).to(torch.int32)


@pytest.mark.parametrize("fmt", ["fp32", "int4", pytest.param("int4-amx", marks=AMX),
                                 pytest.param("int4-avx512_bf16", marks=DPBF16)])
def test_a_prefill_sized_step_equals_one_row_steps(fmt):
    """Three prompt chunks in one step, 300 rows (more than a row block of the linear layers, 64
    (bf16 matmuls: 256), and an attention pass, 256; one chunk after a cached prefix): every row's
    hidden state and logits are bitwise those of stepping its tokens one at a time, in order."""
    fmt, _, matmul = fmt.partition("-")
    weights, _, _ = _model(fmt, vocab=304)
    gen = torch.Generator().manual_seed(11)
    x, cos, sin, slots, tables, lens = _prefill_rows([(0, 110), (37, 100), (5, 90)], gen)
    snapshot = [(layer.k_cache.clone(), layer.v_cache.clone()) for layer in weights.layers]
    fused = FusedDecoder(weights, threads=2, matmul=matmul or "float32")
    assert fused.matmul == (matmul or "float32")
    hidden, together = fused.step(x.clone(), cos, sin, slots, tables, lens)
    for layer, (kc, vc) in zip(weights.layers, snapshot):
        layer.k_cache.copy_(kc)
        layer.v_cache.copy_(vc)
    for j in range(x.shape[0]):
        h, alone = fused.step(x[j:j + 1].clone(), cos[j:j + 1], sin[j:j + 1], slots[j:j + 1],
                              tables[j:j + 1].clone(), lens[j:j + 1])
        assert torch.equal(h[0], hidden[j]) and torch.equal(alone[0], together[j]), f"row {j} differs"


def test_logits_indices_select_the_rows_of_the_head():
    weights, _, _ = _model("fp32", layers=1)
    gen = torch.Generator().manual_seed(12)
    args = _prefill_rows([(0, 70), (3, 9)], gen)
    snapshot = [(layer.k_cache.clone(), layer.v_cache.clone()) for layer in weights.layers]
    fused = FusedDecoder(weights, threads=2)
    results = []
    for rows in (None, torch.tensor([78, 0, 69, 5]), torch.tensor([], dtype=torch.int64)):
        for layer, (kc, vc) in zip(weights.layers, snapshot):
            layer.k_cache.copy_(kc)
            layer.v_cache.copy_(vc)
        results.append(fused.step(args[0].clone(), *args[1:], logits_indices=rows))
    (hidden, every), (hidden2, some), (_, none) = results
    assert torch.equal(hidden, hidden2)
    assert every.shape == (79, V) and torch.equal(some, every[[78, 0, 69, 5]])
    assert none.shape == (0, V)
