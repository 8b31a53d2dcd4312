"""The Triton kernels against the torch reference, under the Triton interpreter
(``TRITON_INTERPRET=1``) on CPU, or compiled when the tests run on a CUDA machine.

The interpreter flag must be set before triton is first imported in the process;
tests/conftest.py sets it for the session on machines without CUDA (torch._dynamo imports
triton during model loading), and the ``tri`` fixture (``kvfleet.kernels.testing.
triton_kernels``) sets it too and re-imports the kernel modules, so this module also runs
on its own. Tolerances per dtype: ``kvfleet.kernels.testing.TOLERANCES``.

Kept small (2-8 heads, sequences up to ~100 tokens) so that the whole module takes well
under a minute of interpreter time.
"""

from __future__ import annotations

import pytest
import torch

from kvfleet.kernels import paged_attention_torch, reshape_and_cache_torch
from kvfleet.kernels.testing import (
    TOLERANCES,
    make_paged_batch,
    naive_attention,
    poison_before_window,
    record_calls,
    triton_kernels,
)

ON_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if ON_CUDA else "cpu"
GQA = [(2, 2), (3, 1), (8, 1)]  # (num_heads, num_kv_heads): ratios 1, 3, 8


@pytest.fixture(scope="module")
def tri():
    """The Triton implementations, interpreted on CPU."""
    try:
        with triton_kernels(interpret=not ON_CUDA) as (cache_mod, attn_mod):
            yield cache_mod.reshape_and_cache_triton, attn_mod.paged_attention_triton, attn_mod
    except RuntimeError as e:
        if "imported in this process" not in str(e):
            raise
        pytest.fail(str(e), pytrace=False)


def seq_mix(bs: int) -> list[tuple[int, int]]:
    """(seq_len, q_len): decode at 1, a block, a block plus one, ragged; a whole prompt of a
    block plus one; a chunk after a cached prefix; a prompt of exactly one block."""
    return [(1, 1), (bs, 1), (bs + 1, 1), (2 * bs + 5, 1), (bs + 1, bs + 1), (2 * bs + 3, bs - 1), (bs, bs)]


def assert_close(out, ref, dtype):
    atol, rtol = TOLERANCES[dtype]
    assert out.dtype == ref.dtype == dtype
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float().cpu(), ref.float().cpu(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("head_size", [64, 128])
@pytest.mark.parametrize("heads", GQA)
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_paged_attention_grid(tri, block_size, heads, head_size, dtype):
    _, attn, _ = tri
    h, kvh = heads
    b = make_paged_batch(seq_mix(block_size), num_heads=h, num_kv_heads=kvh, head_size=head_size,
                         block_size=block_size, dtype=dtype, device=DEVICE, seed=block_size * 7 + h)
    ref = paged_attention_torch(*b.attn_args)
    out = attn(*b.attn_args, num_splits=1)
    assert_close(out, ref, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads", [(3, 1), (8, 2)])
@pytest.mark.parametrize("num_splits", [2, 5])
def test_split_k_decode_matches(tri, heads, dtype, num_splits):
    # Flash-decoding: the context split across programs and reduced. Lengths chosen so
    # some splits of the short sequences are empty (m = -inf-like, l = 0 partials).
    _, attn, _ = tri
    h, kvh = heads
    b = make_paged_batch([(1, 1), (16, 1), (17, 1), (100, 1), (70, 3)], num_heads=h, num_kv_heads=kvh,
                         head_size=64, block_size=16, dtype=dtype, device=DEVICE, seed=num_splits)
    ref = paged_attention_torch(*b.attn_args)
    out = attn(*b.attn_args, num_splits=num_splits, block_n=16, max_seq_len=b.max_seq_len)
    assert_close(out, ref, dtype)


# (block_size, heads, window, softcap, dtype, num_splits): windows of 1 key, shorter than a
# tile, spanning tiles and blocks, longer than the context; soft-capping; split contexts.
SLIDING_CASES = [
    (8, (4, 2), 1, None, torch.float32, 1),
    (8, (3, 1), 5, None, torch.float16, 1),
    (16, (2, 2), 21, 5.0, torch.float32, 1),
    (4, (8, 1), 13, None, torch.float32, 3),
    (16, (4, 2), 40, 30.0, torch.float16, 2),
    (8, (2, 1), 500, 5.0, torch.float32, 1),
]


@pytest.mark.parametrize("block_size,heads,window,softcap,dtype,num_splits", SLIDING_CASES)
def test_sliding_window_and_softcap_match_reference(tri, block_size, heads, window, softcap, dtype, num_splits):
    _, attn, _ = tri
    h, kvh = heads
    seqs = seq_mix(block_size) + [(90, 20), (100, 1)]
    b = make_paged_batch(seqs, num_heads=h, num_kv_heads=kvh, head_size=32, block_size=block_size, dtype=dtype,
                         device=DEVICE, seed=window)
    ref = paged_attention_torch(*b.attn_args, sliding_window=window, softcap=softcap)
    out = attn(*b.attn_args, sliding_window=window, softcap=softcap, num_splits=num_splits, block_n=16,
               max_seq_len=b.max_seq_len)
    assert_close(out, ref, dtype)
    if dtype == torch.float32:
        torch.testing.assert_close(out.double().cpu(), naive_attention(b, sliding_window=window, softcap=softcap),
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_splits", [1, 2])
def test_sliding_window_skips_tiles_before_the_window(tri, num_splits):
    # NaN in every block wholly before the first query row's window (16-key tiles, 16-token
    # blocks): loading any of them, even masked, would make the output NaN.
    _, attn, _ = tri
    b = make_paged_batch([(160, 1), (130, 40), (70, 2), (20, 20)], num_heads=4, num_kv_heads=2, head_size=32,
                         block_size=16, device=DEVICE)
    assert poison_before_window(b, 24, align=16) >= 10
    out = attn(*b.attn_args, sliding_window=24, num_splits=num_splits, block_n=16, max_seq_len=b.max_seq_len)
    assert_close(out, paged_attention_torch(*b.attn_args, sliding_window=24), torch.float32)


def test_sliding_window_sizes_splits_for_the_window(tri):
    _, _, mod = tri
    dev = torch.device("cuda") if ON_CUDA else torch.device("cpu")
    full = mod.launch_config(1, 1, 8, 1, 128, max_query_len=1, max_seq_len=32768, device=dev, num_sms=132)
    windowed = mod.launch_config(1, 1, 8, 1, 128, max_query_len=1, max_seq_len=32768, device=dev, num_sms=132,
                                 sliding_window=256)
    assert full.num_splits > windowed.num_splits == 1
    with pytest.raises(ValueError, match="sliding_window"):
        b = make_paged_batch([(9, 1)], block_size=8, device=DEVICE)
        mod.paged_attention_triton(*b.attn_args, sliding_window=0)


def test_int64_metadata(tri):
    _, attn, _ = tri
    b = make_paged_batch([(20, 1), (37, 5)], num_heads=4, num_kv_heads=2, block_size=8, device=DEVICE)
    q, kc, vc, bt, sl, qsl, scale = b.attn_args
    out = attn(q, kc, vc, bt.long(), sl.long(), qsl.long(), scale)
    assert_close(out, paged_attention_torch(*b.attn_args), torch.float32)


def test_wrong_max_query_len_hint_still_exact(tri):
    # Decode-sized query tiles (16 rows) on a batch with 20-token chunks: more query
    # blocks per sequence, same result.
    _, attn, _ = tri
    b = make_paged_batch([(30, 20), (9, 1), (41, 17)], num_heads=6, num_kv_heads=2, block_size=8, device=DEVICE)
    out = attn(*b.attn_args, max_query_len=1, num_splits=1)
    assert_close(out, paged_attention_torch(*b.attn_args), torch.float32)


def test_low_max_seq_len_hint_still_exact(tri):
    # The last split takes every remaining tile: a wrong hint costs balance, not keys.
    _, attn, _ = tri
    b = make_paged_batch([(100, 1), (37, 2)], num_heads=2, num_kv_heads=1, block_size=8, device=DEVICE)
    out = attn(*b.attn_args, num_splits=3, block_n=16, max_seq_len=20)
    assert_close(out, paged_attention_torch(*b.attn_args), torch.float32)


def test_launch_config_choices(tri):
    _, _, mod = tri
    dev = torch.device("cuda") if ON_CUDA else torch.device("cpu")
    # Decode, GQA 4: 16-row tiles hold 4 query tokens; one long sequence gets split.
    cfg = mod.launch_config(1, 1, 4, 1, 128, max_query_len=1, max_seq_len=32768, device=dev)
    assert (cfg.block_m, cfg.block_q, cfg.head_pad) == (16, 4, 128)
    assert cfg.num_splits > 1 and cfg.num_q_programs == 1
    # Prefill: 64-row tiles, no split when there are many query blocks.
    cfg = mod.launch_config(4096, 1, 32, 8, 128, max_query_len=4096, max_seq_len=4096, device=dev)
    assert (cfg.block_m, cfg.block_q, cfg.num_splits) == (64, 16, 1)
    # Head size 96 pads to 128; GQA 32 (more heads than 16 rows) widens the tile.
    cfg = mod.launch_config(2, 2, 32, 1, 96, max_query_len=1, max_seq_len=10, device=dev)
    assert (cfg.head_pad, cfg.block_m, cfg.block_q) == (128, 32, 1)
    with pytest.raises(ValueError, match="block_n"):
        mod.launch_config(2, 2, 4, 1, 64, max_query_len=1, max_seq_len=10, device=dev, block_n=24)


def test_default_launch_config(tri):
    # No tuning arguments: the wrapper picks query tile, tile size and splits itself.
    _, attn, mod = tri
    b = make_paged_batch([(40, 1), (90, 1)], num_heads=6, num_kv_heads=2, block_size=16, device=DEVICE)
    n = mod.choose_num_splits(2 * 2, 90, 64, torch.device(DEVICE))
    assert n >= 1
    assert_close(attn(*b.attn_args), paged_attention_torch(*b.attn_args), torch.float32)
    # Prefill-sized batch (64-row query tiles).
    b = make_paged_batch([(70, 70), (50, 20)], num_heads=4, num_kv_heads=1, block_size=8, device=DEVICE)
    assert_close(attn(*b.attn_args), paged_attention_torch(*b.attn_args), torch.float32)


def test_bfloat16_and_head_size_96(tri):
    _, attn, _ = tri
    b = make_paged_batch(seq_mix(16), num_heads=6, num_kv_heads=2, head_size=96, block_size=16,
                         dtype=torch.bfloat16, device=DEVICE)
    assert_close(attn(*b.attn_args, num_splits=1), paged_attention_torch(*b.attn_args), torch.bfloat16)
    b = make_paged_batch([(33, 1), (20, 1)], num_heads=4, num_kv_heads=4, head_size=96, block_size=8,
                         dtype=torch.float32, device=DEVICE)
    assert_close(attn(*b.attn_args, num_splits=2, block_n=16), paged_attention_torch(*b.attn_args), torch.float32)


def test_shuffled_blocks_same_output(tri):
    _, attn, _ = tri
    seqs = seq_mix(8)
    a = make_paged_batch(seqs, num_heads=3, num_kv_heads=1, block_size=8, shuffle=False, seed=11, device=DEVICE)
    b = make_paged_batch(seqs, num_heads=3, num_kv_heads=1, block_size=8, shuffle=True, seed=11, device=DEVICE)
    assert not torch.equal(a.block_tables, b.block_tables)
    oa = attn(*a.attn_args, num_splits=1)
    ob = attn(*b.attn_args, num_splits=1)
    # Same tiles in the same order: the physical placement changes only addresses.
    assert torch.equal(oa, ob)
    oa2 = attn(*a.attn_args, num_splits=3, block_n=16, max_seq_len=a.max_seq_len)
    ob2 = attn(*b.attn_args, num_splits=3, block_n=16, max_seq_len=b.max_seq_len)
    assert torch.equal(oa2, ob2)


def test_zero_query_sequence_and_out_argument(tri):
    _, attn, _ = tri
    b = make_paged_batch([(5, 1), (20, 0), (9, 3), (12, 0)], num_heads=4, num_kv_heads=2, block_size=8,
                         device=DEVICE)
    # Non-contiguous query (as the engine passes it) and an explicit out buffer.
    q = b.query.transpose(0, 1).contiguous().transpose(0, 1)
    out = torch.full_like(b.query, float("nan"))
    res = attn(q, *b.attn_args[1:], out=out, num_splits=1)
    assert res is out
    assert_close(out, paged_attention_torch(*b.attn_args), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(8, 2, 64), (16, 3, 128), (32, 1, 96)])
def test_reshape_and_cache_matches_and_skips(tri, shape, dtype):
    store, _, _ = tri
    block_size, kvh, d = shape
    b = make_paged_batch([(block_size + 1, block_size + 1), (3, 2), (1, 1)], num_heads=kvh, num_kv_heads=kvh,
                         head_size=d, block_size=block_size, dtype=dtype, device=DEVICE)
    slots = b.slot_mapping.clone()
    slots[1] = -1
    slots[-2] = -1
    kc, vc = b.key_cache.clone(), b.value_cache.clone()
    kc_ref, vc_ref = b.key_cache.clone(), b.value_cache.clone()
    # Perturb the new K/V so that writing them changes the cache.
    k_new = b.new_keys + 1
    v_new = b.new_values - 1
    store(k_new, v_new, kc, vc, slots)
    reshape_and_cache_torch(k_new, v_new, kc_ref, vc_ref, slots)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)
    # Slots of the skipped tokens still hold their old contents.
    flat = kc.view(-1, kvh, d)
    for t in (1, len(slots) - 2):
        assert torch.equal(flat[b.slot_mapping[t]], b.key_cache.view(-1, kvh, d)[b.slot_mapping[t]])
    assert not torch.equal(kc, b.key_cache)


def test_reshape_and_cache_strided_input_and_cast(tri):
    store, _, _ = tri
    kc = torch.zeros(4, 8, 2, 16, dtype=torch.float16, device=DEVICE)
    vc = torch.zeros_like(kc)
    kv = torch.randn(2, 3, 2, 16, device=DEVICE)  # fp32 input, a strided view per K and V
    slots = torch.tensor([0, 9, 31], dtype=torch.int32, device=DEVICE)
    store(kv[0], kv[1], kc, vc, slots)
    assert torch.equal(kc.view(-1, 2, 16)[slots.long()], kv[0].half())
    assert torch.equal(vc.view(-1, 2, 16)[slots.long()], kv[1].half())
    assert kc.view(-1, 2, 16).abs().sum(dim=(1, 2)).count_nonzero() == 3


def test_dispatch_env_forces_triton(tri, monkeypatch):
    from kvfleet.kernels import BACKEND_ENV, paged_attention

    b = make_paged_batch([(9, 1), (5, 5)], num_heads=2, num_kv_heads=1, block_size=8, device=DEVICE)
    monkeypatch.setenv(BACKEND_ENV, "triton")
    _, _, mod = tri
    calls = record_calls(monkeypatch, mod, "paged_attention_triton")
    out = paged_attention(*b.attn_args)
    assert len(calls) == 1
    assert_close(out, paged_attention_torch(*b.attn_args), torch.float32)
