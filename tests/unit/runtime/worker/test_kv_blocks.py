"""Whole KV blocks out of and into the paged cache as bytes (peer KV pull, issue 29)."""

from __future__ import annotations

import pytest
import torch

from kvfleet.runtime.kv_transfer.wire import FrameReader, TransferError, encode_frame
from kvfleet.runtime.worker.kv_blocks import block_layout, read_blocks, write_blocks


def caches(num_layers=3, num_blocks=6, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks, 4, 2, 8)  # blocks, block_size, kv heads, head size
    return [(torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype))
            for _ in range(num_layers)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocks_round_trip_in_place_and_touch_nothing_else(dtype):
    src, dst = caches(dtype=dtype, seed=1), caches(dtype=dtype, seed=2)
    before = [(k.clone(), v.clone()) for k, v in dst]
    ptrs = [(k.data_ptr(), v.data_ptr()) for k, v in dst]
    payloads = read_blocks(src, [4, 1])
    assert [len(p) for p in payloads] == [3 * 2 * 4 * 2 * 8 * src[0][0].element_size()] * 2
    write_blocks(dst, [0, 5], payloads)
    for (sk, sv), (dk, dv), (bk, bv) in zip(src, dst, before):
        assert torch.equal(dk[0], sk[4]) and torch.equal(dv[5], sv[1])
        assert torch.equal(dk[1:5], bk[1:5]) and torch.equal(dv[1:5], bv[1:5])
    assert [(k.data_ptr(), v.data_ptr()) for k, v in dst] == ptrs  # the same tensors (the fused paths hold them)


def test_payload_layout_is_layers_then_k_v():
    src = caches(num_layers=2, dtype=torch.float32)
    (payload,) = read_blocks(src, [3])
    flat = torch.frombuffer(bytearray(payload), dtype=torch.float32).reshape(2, 2, 4, 2, 8)
    assert torch.equal(flat[1, 0], src[1][0][3]) and torch.equal(flat[0, 1], src[0][1][3])


def test_a_wrong_payload_length_is_refused():
    dst = caches()
    with pytest.raises(ValueError, match="payloads"):
        write_blocks(dst, [0], [b"\0" * 10])
    assert read_blocks(dst, []) == [] and write_blocks(dst, [], []) is None


def test_a_bf16_cache_beside_float32_activations_frames_as_bf16_and_a_float32_peer_refuses_it():
    """``kv_cache_dtype bfloat16`` on a float32 model: the frames name the cache's dtype (not the
    activations'), round-trip into another bf16 cache, and a replica with a float32 cache refuses them."""
    from types import SimpleNamespace

    geometry = dict(num_layers=3, num_kv_heads=2, head_size=8, block_size=4)
    bf16_runner = SimpleNamespace(dtype=torch.float32, kv_cache_dtype=torch.bfloat16, **geometry)
    f32_runner = SimpleNamespace(dtype=torch.float32, kv_cache_dtype=torch.float32, **geometry)
    layout = block_layout(bf16_runner, "m", None)
    assert (layout.dtype, layout.elem_size) == ("bfloat16", 2)
    src, dst = caches(dtype=torch.bfloat16, seed=1), caches(dtype=torch.bfloat16, seed=2)
    (payload,) = read_blocks(src, [3])
    frame = encode_frame(layout, b"\x01" * 16, payload)
    reader = FrameReader(layout, [b"\x01" * 16])
    reader.feed(frame)
    write_blocks(dst, [0], [reader.blocks[0][1]])
    assert all(torch.equal(dk[0], sk[3]) and torch.equal(dv[0], sv[3]) for (sk, sv), (dk, dv) in zip(src, dst))
    with pytest.raises(TransferError, match="dtype 'bfloat16' differs from this replica's 'float32'") as err:
        FrameReader(block_layout(f32_runner, "m", None)).feed(frame)
    assert err.value.reason == "layout"
