"""The torch reference kernels (the CPU production path and the oracle of the Triton
kernels) against a naive dense causal attention, plus their contract: slot -1, shuffled
blocks, GQA, errors, backend dispatch."""

from __future__ import annotations

import pytest
import torch

from kvfleet.kernels import (
    BACKEND_ENV,
    paged_attention,
    paged_attention_torch,
    reshape_and_cache,
    reshape_and_cache_torch,
    select_backend,
)
from kvfleet.kernels.testing import TOLERANCES, make_paged_batch, naive_attention, poison_before_window

# (num_heads, num_kv_heads): GQA ratios 1, 3, 8
GQA = [(2, 2), (3, 1), (8, 1)]


def seq_mix(bs: int) -> list[tuple[int, int]]:
    """(seq_len, q_len) pairs: decode at lengths 1, a block, a block plus one and a ragged
    one; a whole-prompt prefill; a chunk after a cached prefix; a single-token prompt."""
    return [(1, 1), (bs, 1), (bs + 1, 1), (3 * bs + 5, 1), (bs + 1, bs + 1), (2 * bs + 3, bs - 1), (1, 1),
            (bs, bs)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_size", [64, 96, 128])
@pytest.mark.parametrize("heads", GQA)
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_reference_matches_naive(block_size, heads, head_size, dtype):
    h, kvh = heads
    b = make_paged_batch(seq_mix(block_size), num_heads=h, num_kv_heads=kvh, head_size=head_size,
                         block_size=block_size, dtype=dtype, seed=block_size + h + head_size)
    out = paged_attention_torch(*b.attn_args)
    assert out.dtype == dtype and out.shape == b.query.shape
    ref = naive_attention(b)
    atol, rtol = TOLERANCES[dtype]
    # The reference computes in fp32 from the dtype's inputs; only the final rounding and
    # fp32 summation order differ from fp64.
    torch.testing.assert_close(out.double(), ref, atol=atol, rtol=rtol)


# Windows: 1 (only itself), shorter than a block, a block plus some, longer than every sequence.
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("window", [1, 5, 19, 1000])
@pytest.mark.parametrize("heads", [(2, 2), (6, 2)])
@pytest.mark.parametrize("block_size", [4, 16])
def test_reference_sliding_window_and_softcap_match_naive(block_size, heads, window, softcap, dtype):
    h, kvh = heads
    seqs = seq_mix(block_size) + [(90, 30), (77, 1), (40, 2)]
    b = make_paged_batch(seqs, num_heads=h, num_kv_heads=kvh, head_size=32, block_size=block_size, dtype=dtype,
                         seed=window + block_size)
    out = paged_attention_torch(*b.attn_args, sliding_window=window, softcap=softcap)
    ref = naive_attention(b, sliding_window=window, softcap=softcap)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out.double(), ref, atol=atol, rtol=rtol)
    if window < 77:
        # The window changes the result (the oracle's window is not a no-op here).
        assert not torch.allclose(ref, naive_attention(b, softcap=softcap), atol=1e-3)
    if window >= 90:
        torch.testing.assert_close(out, paged_attention_torch(*b.attn_args, softcap=softcap))


def test_reference_sliding_window_skips_blocks_before_the_window():
    # Blocks wholly before every query's window hold NaN: reading them (even masked) would
    # give NaN, so a finite, exact result shows they are not read.
    b = make_paged_batch([(200, 1), (150, 1), (120, 40), (64, 1), (33, 20)], num_heads=4, num_kv_heads=2,
                         head_size=32, block_size=8)
    assert poison_before_window(b, 24, align=8) > 30
    out = paged_attention_torch(*b.attn_args, sliding_window=24)
    torch.testing.assert_close(out.double(), naive_attention(b, sliding_window=24), atol=1e-5, rtol=1e-5)


def test_reference_sliding_window_decode_chunks():
    # Decode sequences of very different lengths in several gather chunks, with a window
    # that makes long and short ones read similar block counts.
    lens = [1, 2, 15, 16, 17, 33, 100, 257, 600, 31, 64, 65, 5, 700]
    b = make_paged_batch([(L, 1) for L in lens], num_heads=4, num_kv_heads=2, head_size=64, block_size=16)
    import kvfleet.kernels.attention_plan as plan_mod

    old = plan_mod._DECODE_CHUNK_BYTES
    try:
        plan_mod._DECODE_CHUNK_BYTES = 32 * 1024
        plan = plan_mod.plan_paged_attention_torch(b.block_tables, b.seq_lens, b.query_start_loc, b.key_cache,
                                                   sliding_window=40)
        assert len(plan.chunks) > 1, "one gather chunk: the test does not cover chunking"
        out = paged_attention_torch(*b.attn_args, sliding_window=40, softcap=30.0, plan=plan)
    finally:
        plan_mod._DECODE_CHUNK_BYTES = old
    torch.testing.assert_close(out.double(), naive_attention(b, sliding_window=40, softcap=30.0),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kwargs,match", [
    (dict(sliding_window=0), "sliding_window"),
    (dict(sliding_window=-3), "sliding_window"),
    (dict(sliding_window=2.5), "sliding_window"),
    (dict(sliding_window=True), "sliding_window"),
    (dict(softcap=0.0), "softcap"),
    (dict(softcap=-1.0), "softcap"),
    (dict(softcap=float("inf")), "softcap"),
])
def test_attention_options_are_validated(kwargs, match):
    b = make_paged_batch([(5, 1), (9, 3)], block_size=8)
    with pytest.raises(ValueError, match=match):
        paged_attention_torch(*b.attn_args, **kwargs)
    with pytest.raises(ValueError, match=match):
        paged_attention(*b.attn_args, **kwargs)


def test_reference_decode_chunking_and_long_ragged():
    # Many decode sequences of very different lengths: several chunks, padding per chunk.
    lens = [1, 2, 15, 16, 17, 33, 100, 257, 600, 31, 64, 65, 5, 700]
    b = make_paged_batch([(L, 1) for L in lens], num_heads=4, num_kv_heads=2, head_size=64, block_size=16)
    import kvfleet.kernels.attention_plan as plan_mod

    old = plan_mod._DECODE_CHUNK_BYTES
    try:
        plan_mod._DECODE_CHUNK_BYTES = 64 * 1024  # force multi-sequence and single-sequence chunks
        out = paged_attention_torch(*b.attn_args)
    finally:
        plan_mod._DECODE_CHUNK_BYTES = old
    torch.testing.assert_close(out.double(), naive_attention(b), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(paged_attention_torch(*b.attn_args), out, atol=1e-6, rtol=1e-6)


def test_reference_shuffled_blocks_same_output():
    seqs = seq_mix(16)
    a = make_paged_batch(seqs, num_heads=6, num_kv_heads=2, shuffle=False, seed=3)
    b = make_paged_batch(seqs, num_heads=6, num_kv_heads=2, shuffle=True, seed=3)
    assert not torch.equal(a.block_tables, b.block_tables)
    torch.testing.assert_close(paged_attention_torch(*a.attn_args), paged_attention_torch(*b.attn_args),
                               atol=1e-6, rtol=1e-6)


def test_reference_noncontiguous_query_and_out():
    # The engine passes query[0].transpose(0, 1) from a [1, H, T, d] tensor.
    b = make_paged_batch(seq_mix(8), num_heads=6, num_kv_heads=3, block_size=8)
    q_t = b.query.transpose(0, 1).contiguous().transpose(0, 1)
    assert not q_t.is_contiguous()
    out = torch.full_like(b.query, float("nan"))
    res = paged_attention_torch(q_t, *b.attn_args[1:], out=out)
    assert res is out
    torch.testing.assert_close(out.double(), naive_attention(b), atol=1e-5, rtol=1e-5)


def test_reference_zero_query_tokens_sequence():
    # A sequence with no query tokens this step contributes no rows.
    b = make_paged_batch([(5, 1), (20, 0), (9, 3)], block_size=8)
    torch.testing.assert_close(paged_attention_torch(*b.attn_args).double(), naive_attention(b),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_reshape_and_cache_writes_slots_and_skips_minus_one(dtype):
    b = make_paged_batch([(5, 5), (20, 3), (9, 1)], block_size=8, dtype=dtype)
    kc = torch.zeros_like(b.key_cache)
    vc = torch.zeros_like(b.value_cache)
    slots = b.slot_mapping.clone()
    slots[2] = -1
    slots[5] = -1
    reshape_and_cache_torch(b.new_keys, b.new_values, kc, vc, slots)
    flat_k = kc.view(-1, *kc.shape[2:])
    flat_v = vc.view(-1, *vc.shape[2:])
    keep = slots >= 0
    assert torch.equal(flat_k[slots[keep]], b.new_keys[keep])
    assert torch.equal(flat_v[slots[keep]], b.new_values[keep])
    # Everything else, including the slots of the skipped tokens, is untouched (still 0).
    written = torch.zeros(flat_k.shape[0], dtype=torch.bool)
    written[slots[keep]] = True
    assert flat_k[~written].abs().sum() == 0 and flat_v[~written].abs().sum() == 0
    assert flat_k[b.slot_mapping[2]].abs().sum() == 0


def test_reshape_and_cache_casts_and_validates():
    kc = torch.zeros(4, 8, 2, 16, dtype=torch.float16)
    vc = torch.zeros_like(kc)
    k = torch.randn(3, 2, 16)
    reshape_and_cache_torch(k, k, kc, vc, torch.tensor([0, 9, 31]))
    assert torch.equal(kc.view(-1, 2, 16)[torch.tensor([0, 9, 31])], k.half())
    with pytest.raises(ValueError, match="num_tokens"):
        reshape_and_cache_torch(k[:2], k[:2], kc, vc, torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="value_cache shape"):
        reshape_and_cache_torch(k, k, kc, vc[:2], torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="contiguous"):
        nc = torch.zeros(4, 2, 8, 16, dtype=torch.float16).transpose(1, 2)
        reshape_and_cache_torch(k, k, nc, nc, torch.tensor([0, 1, 2]))


def test_paged_attention_validates_shapes():
    b = make_paged_batch([(5, 1), (9, 3)], num_heads=4, num_kv_heads=2, block_size=8)
    q, kc, vc, bt, sl, qsl, scale = b.attn_args
    with pytest.raises(ValueError, match="multiple"):
        paged_attention_torch(q[:, :3], kc, vc, bt, sl, qsl, scale)
    with pytest.raises(ValueError, match="head_size"):
        paged_attention_torch(q[..., :32], kc, vc, bt, sl, qsl, scale)
    with pytest.raises(ValueError, match="seq_lens"):
        paged_attention_torch(q, kc, vc, bt, sl[:1], qsl, scale)
    with pytest.raises(ValueError, match="query_start_loc"):
        paged_attention_torch(q, kc, vc, bt, sl, qsl[:2], scale)
    with pytest.raises(ValueError, match="shorter"):
        paged_attention_torch(q, kc, vc, bt, torch.tensor([5, 2], dtype=torch.int32), qsl, scale)


def test_default_scale_is_inverse_sqrt_head_size():
    b = make_paged_batch([(7, 3)], head_size=64)
    q, kc, vc, bt, sl, qsl, _ = b.attn_args
    torch.testing.assert_close(paged_attention_torch(q, kc, vc, bt, sl, qsl), paged_attention_torch(*b.attn_args))


def test_backend_selection(monkeypatch):
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    assert select_backend(torch.device("cpu")) == "torch"
    assert select_backend(torch.device("cuda", 0)) == "triton"
    monkeypatch.setenv(BACKEND_ENV, "torch")
    assert select_backend(torch.device("cuda", 0)) == "torch"
    monkeypatch.setenv(BACKEND_ENV, "TRITON")
    assert select_backend(torch.device("cpu")) == "triton"
    monkeypatch.setenv(BACKEND_ENV, "cuda")
    with pytest.raises(ValueError, match=BACKEND_ENV):
        select_backend(torch.device("cpu"))


def test_public_entry_points_use_torch_on_cpu(monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, "auto")
    b = make_paged_batch(seq_mix(8), num_heads=4, num_kv_heads=2, block_size=8)
    kc = torch.zeros_like(b.key_cache)
    vc = torch.zeros_like(b.value_cache)
    reshape_and_cache(b.new_keys, b.new_values, kc, vc, b.slot_mapping)
    assert torch.equal(kc.view(-1, 2, 64)[b.slot_mapping], b.new_keys)
    torch.testing.assert_close(paged_attention(*b.attn_args), paged_attention_torch(*b.attn_args))


@pytest.mark.parametrize("sliding_window,softcap", [(None, None), (24, None), (None, 20.0), (40, 30.0)])
def test_plan_shared_by_layers_is_bit_exact(sliding_window, softcap):
    # One plan per step, reused by every layer (each with its own cache contents), gives the
    # same bits as planning in every call, and matches the naive fp64 attention.
    from kvfleet.kernels.attention_plan import plan_paged_attention_torch

    seqs = seq_mix(16) + [(L, 1) for L in (300, 57, 130, 1, 64)] + [(200, 37)]
    layers = [make_paged_batch(seqs, num_heads=9, num_kv_heads=3, head_size=64, block_size=16, seed=seed)
              for seed in range(3)]
    # Every "layer" is attended with layer 0's block tables and lengths (the step's metadata).
    b0 = layers[0]
    plan = plan_paged_attention_torch(b0.block_tables, b0.seq_lens, b0.query_start_loc, b0.key_cache,
                                      sliding_window=sliding_window)
    outs = []
    for b in layers:
        q, kc, vc, _, _, _, scale = b.attn_args
        args = (q, kc, vc, b0.block_tables, b0.seq_lens, b0.query_start_loc, scale)
        outs.append(paged_attention_torch(*args, sliding_window=sliding_window, softcap=softcap, plan=plan))
        assert torch.equal(outs[-1], paged_attention_torch(*args, sliding_window=sliding_window, softcap=softcap))
    assert not torch.equal(outs[0], outs[1])  # the layers' caches differ, so must their outputs
    torch.testing.assert_close(outs[0].double(), naive_attention(b0, sliding_window=sliding_window, softcap=softcap),
                               atol=1e-5, rtol=1e-5)


def test_plan_for_another_batch_geometry_or_window_is_refused():
    from kvfleet.kernels.attention_plan import plan_paged_attention_torch

    b = make_paged_batch([(20, 1), (9, 3)], num_heads=4, num_kv_heads=2, block_size=8)
    plan = plan_paged_attention_torch(b.block_tables, b.seq_lens, b.query_start_loc, b.key_cache)
    with pytest.raises(ValueError, match="sliding_window"):
        paged_attention_torch(*b.attn_args, sliding_window=8, plan=plan)
    other = make_paged_batch([(20, 1), (9, 3)], num_heads=4, num_kv_heads=2, block_size=16)
    with pytest.raises(ValueError, match="plan made for"):
        paged_attention_torch(*other.attn_args, plan=plan)
    fewer = make_paged_batch([(20, 1)], num_heads=4, num_kv_heads=2, block_size=8)
    with pytest.raises(ValueError, match="plan made for"):
        paged_attention_torch(*fewer.attn_args, plan=plan)
    with pytest.raises(ValueError, match="sliding_window"):
        plan_paged_attention_torch(b.block_tables, b.seq_lens, b.query_start_loc, b.key_cache, sliding_window=0)


def test_decode_inside_then_outside_inference_mode():
    # The engine runs its steps under torch.inference_mode(); the decode path's reused gather
    # buffer must not leak an inference tensor into later calls outside that mode (torch
    # refuses in-place writes to inference tensors there), nor the other way round.
    b = make_paged_batch([(70, 1), (33, 1), (200, 1)], num_heads=4, num_kv_heads=2, head_size=64, block_size=16)
    expected = naive_attention(b)
    with torch.inference_mode():
        inside = paged_attention_torch(*b.attn_args)
    outside = paged_attention_torch(*b.attn_args)
    with torch.inference_mode():
        again = paged_attention_torch(*b.attn_args)
    for out in (inside, outside, again):
        torch.testing.assert_close(out.double(), expected, **dict(zip(("atol", "rtol"), TOLERANCES[torch.float32])))


@pytest.mark.parametrize("softcap", [None, 5.0])
def test_a_bf16_cache_beside_float32_queries(softcap):
    """``kv_cache_dtype bfloat16`` on the CPU: float32 queries over bf16 caches (prefill and decode
    rows) give exactly what they give over float32 caches holding the same bf16 values, in float32;
    writing float32 keys into a bf16 cache rounds them as ``.to(torch.bfloat16)`` does."""
    b = make_paged_batch(seq_mix(16), num_heads=6, num_kv_heads=2, head_size=64, block_size=16,
                         dtype=torch.float32, seed=5)
    k16, v16 = b.key_cache.to(torch.bfloat16), b.value_cache.to(torch.bfloat16)
    args = (b.query, k16, v16, *b.attn_args[3:])
    out = paged_attention_torch(*args, softcap=softcap)
    assert out.dtype == torch.float32
    want = paged_attention_torch(b.query, k16.float(), v16.float(), *b.attn_args[3:], softcap=softcap)
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
    key, value = torch.randn(3, 2, 64), torch.randn(3, 2, 64)
    reshape_and_cache_torch(key, value, k16, v16, torch.tensor([0, 17, 40]))
    assert torch.equal(k16.view(-1, 2, 64)[17].view(torch.int16), key[1].to(torch.bfloat16).view(torch.int16))
    assert torch.equal(v16.view(-1, 2, 64)[40], value[2].to(torch.bfloat16))
