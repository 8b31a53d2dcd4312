"""KV cache events of the block pool (kvfleet.runtime.core.kv_events, block_pool,
kv_cache_manager), without a model: a stored block carries its hash chain, tokens and LoRA id;
evicting a block for reuse and ``reset_prefix_cache`` remove hashes; adapters never share a
hash; replaying the stream always yields the pool's current cached hashes (the snapshot)."""

from __future__ import annotations

import random

from kvfleet.runtime.core.block_pool import hash_block_tokens
from kvfleet.runtime.core.kv_cache_manager import KVCacheManager
from kvfleet.runtime.core.kv_events import BlockRemoved, BlockStored, replay
from kvfleet.runtime.core.request import Request
from kvfleet.runtime.sampling_params import SamplingParams


def req(rid: str, prompt: list[int], lora: int = 0) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=1), eos_token_id=0,
                   lora_name=f"l{lora}" if lora else None, lora_int_id=lora)


def run(m: KVCacheManager, r: Request) -> None:
    """Prefill ``r`` in one step (with its prefix-cache hits), then free it."""
    hits, n = m.get_computed_blocks(r)
    assert m.allocate_slots(r, r.num_tokens - n, hits) is not None
    r.num_computed_tokens = r.num_tokens
    m.free(r)


def test_stored_events_carry_the_hash_chain_tokens_and_block_size():
    m = KVCacheManager(num_blocks=16, block_size=4, enable_kv_cache_events=True)
    prompt = list(range(10, 21))  # 11 tokens: 2 full blocks
    run(m, req("a", prompt))
    events = m.take_events()
    h0 = hash_block_tokens(None, prompt[:4])
    h1 = hash_block_tokens(h0, prompt[4:8])
    assert events == [BlockStored([h0], None, prompt[:4], 4, None), BlockStored([h1], h0, prompt[4:8], 4, None)]
    assert m.take_events() == []  # drained
    run(m, req("b", prompt))  # full hit: nothing new enters the cache
    assert m.take_events() == []


def test_eviction_for_reuse_and_reset_emit_removed():
    m = KVCacheManager(num_blocks=4, block_size=4, enable_kv_cache_events=True)
    run(m, req("a", list(range(1, 10))))  # 2 cached blocks, 3 used
    stored = [e.block_hashes[0] for e in m.take_events()]
    run(m, req("b", list(range(50, 63))))  # 4 blocks: evicts both cached ones
    events = m.take_events()
    removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert sorted(removed) == sorted(stored)
    assert replay(events, set(stored)) == set(m.cached_block_hashes())
    before = m.cached_block_hashes()
    assert len(before) == 3 and m.reset_prefix_cache() == 3
    assert m.take_events() == [BlockRemoved(before)]
    assert m.cached_block_hashes() == []


def test_adapters_never_share_a_block_hash():
    m = KVCacheManager(num_blocks=32, block_size=4, enable_kv_cache_events=True)
    prompt = list(range(1, 13))
    for i, lora in enumerate([0, 1, 2]):
        run(m, req(f"r{i}", prompt, lora))
    stored = [e for e in m.take_events() if isinstance(e, BlockStored)]
    assert len(stored) == 3 * 3  # no cross-adapter hit: every adapter stored its own blocks
    assert len({e.block_hashes[0] for e in stored}) == 9
    assert [e.lora_id for e in stored] == [None] * 3 + [1] * 3 + [2] * 3


def test_events_off_records_nothing():
    m = KVCacheManager(num_blocks=8, block_size=4)
    run(m, req("a", list(range(1, 10))))
    assert m.take_events() == [] and m.block_pool.kv_event_queue is None


def test_replay_of_the_stream_equals_the_snapshot_under_churn():
    rng = random.Random(0)
    m = KVCacheManager(num_blocks=12, block_size=4, enable_kv_cache_events=True)
    prefixes = [[rng.randrange(1, 500) for _ in range(12)] for _ in range(4)]
    index: set[bytes] = set()
    for i in range(60):
        prompt = rng.choice(prefixes)[: rng.randrange(4, 13)] + [rng.randrange(1, 500) for _ in range(rng.randrange(0, 9))]
        run(m, req(f"r{i}", prompt, lora=rng.choice([0, 0, 1])))
        if i % 17 == 16:
            m.reset_prefix_cache()
        replay(m.take_events(), index)
        assert index == set(m.cached_block_hashes())
