"""The router's KV block index (kvfleet.runtime.router.kv_index) and the precise-prefix-cache
picker (kvfleet.runtime.router.picker): a replica's index is its snapshot plus later batches, a
seq gap makes it stale until the next snapshot, the prompt hash chain matches the engine's
block pool, and the picker prefers the replica with the longest cached prefix within CHWBL's
bound, falling back to the char-prefix ring without events."""

from __future__ import annotations

from kvfleet.runtime.core.kv_cache_manager import KVCacheManager
from kvfleet.runtime.core.request import Request
from kvfleet.runtime.engine.kv_event_publisher import KVEventPublisher, to_wire
from kvfleet.runtime.kv_events import wire
from kvfleet.runtime.kv_events.config import KVEventsConfig
from kvfleet.runtime.kv_events.hashing import prompt_block_hashes
from kvfleet.runtime.router.kv_index import KVIndex
from kvfleet.runtime.router.picker import HIT, SPILL, Candidate, Picker
from kvfleet.runtime.sampling_params import SamplingParams


def run(m: KVCacheManager, rid: str, prompt: list[int]) -> None:
    r = Request(rid, prompt, SamplingParams(max_tokens=1), eos_token_id=0)
    hits, n = m.get_computed_blocks(r)
    assert m.allocate_slots(r, r.num_tokens - n, hits) is not None
    r.num_computed_tokens = r.num_tokens
    m.free(r)


def snapshot_dict(pub: KVEventPublisher) -> dict:
    snap = pub.snapshot()
    return {"seq": snap.seq, "block_size": snap.block_size, "block_hashes": [h.hex() for h in snap.block_hashes]}


def test_index_follows_an_engine_pool_and_matches_the_router_hash_chain():
    m = KVCacheManager(num_blocks=32, block_size=4, enable_kv_cache_events=True)
    pub = KVEventPublisher(KVEventsConfig(enable_kv_cache_events=True, publisher="null"), 4)
    index = KVIndex()
    system = list(range(100, 117))  # 17 tokens: 4 full blocks
    run(m, "a", system + [1, 2])
    pub.publish(m.take_events())
    index.load_snapshot("http://r1", snapshot_dict(pub))  # a late router starts from the snapshot
    run(m, "b", list(range(300, 309)))
    events = m.take_events()
    pub.publish(events)
    assert index.apply("http://r1", pub.seq, wire.KVEventBatch(0.0, [to_wire(e) for e in events]))
    hashes = prompt_block_hashes(system + [5, 6, 7], 4)
    assert index.matched_blocks("http://r1", hashes) == 4
    assert index.matched_blocks("http://r1", prompt_block_hashes(list(range(300, 312)), 4)) == 2
    assert index.matched_blocks("http://r2", hashes) == 0 and index.block_size() == 4


def test_a_seq_gap_makes_the_replica_stale_until_a_snapshot():
    index = KVIndex()
    h = [bytes([i]) * 16 for i in range(4)]
    index.load_snapshot("u", {"seq": 3, "block_size": 4, "block_hashes": [h[0].hex()]})
    assert index.apply("u", 2, wire.KVEventBatch(0.0, [wire.BlockRemoved([h[0]])]))  # old: ignored
    assert index.apply("u", 4, wire.KVEventBatch(0.0, [wire.BlockStored([h[1]], h[0], [1] * 4, 4)]))
    assert index.matched_blocks("u", h) == 2
    assert not index.apply("u", 6, wire.KVEventBatch(0.0, [wire.BlockStored([h[2]], h[1], [1] * 4, 4)]))
    assert index.matched_blocks("u", h) == 0 and not index.has_events(["u"])
    assert index.block_counts() == {"u": -1}  # the router's gauge: stale
    index.load_snapshot("u", {"seq": 5, "block_size": 4, "block_hashes": [x.hex() for x in h[:2]]})
    assert index.matched_blocks("u", h) == 3  # the batch held while stale (seq 6) applied after it
    assert index.block_counts() == {"u": 3}


def test_the_router_exports_its_index_per_replica():
    from kvfleet.runtime.router.endpoints import EndpointPool
    from kvfleet.runtime.router.metrics import RouterMetrics

    index = KVIndex()
    index.load_snapshot("http://a", {"seq": 1, "block_size": 4, "block_hashes": [(bytes([i]) * 16).hex() for i in range(2)]})
    index.load_snapshot("http://b", {"seq": 1, "block_size": 4, "block_hashes": []})
    m = RouterMetrics()
    text = m.exposition(EndpointPool(), 0, 0, index.block_counts()).decode()
    assert 'kvfleet:router_kv_index_blocks{endpoint="http://a"} 2.0' in text
    assert 'kvfleet:router_kv_index_blocks{endpoint="http://b"} 0.0' in text
    index.forget("http://a")  # a replica gone leaves the gauge
    text = m.exposition(EndpointPool(), 0, 0, index.block_counts()).decode()
    assert "http://a" not in text and 'endpoint="http://b"' in text


def test_precise_picker_prefers_the_longest_cached_prefix_within_the_bound():
    p = Picker("precise-prefix-cache", load_factor=1.25)
    cands = [Candidate("a", in_flight=1), Candidate("b", in_flight=1), Candidate("c", in_flight=1)]
    assert p.pick(cands, "k", cached_blocks={"a": 2, "b": 9, "c": 0}).key == "b"
    assert p.pick(cands, "k", cached_blocks={"a": 2, "b": 9, "c": 0}).decision == HIT
    # b is over CHWBL's bound: the next-longest prefix among those within it, a spill
    busy = [Candidate("a", in_flight=1), Candidate("b", in_flight=8), Candidate("c", in_flight=1)]
    d = p.pick(busy, "k", cached_blocks={"a": 2, "b": 9, "c": 0})
    assert (d.key, d.decision) == ("a", SPILL)


def test_precise_picker_without_cached_blocks_is_the_char_prefix_ring():
    cands = [Candidate(k) for k in "abcd"]
    chwbl = Picker("prefix-hash")
    precise = Picker("precise-prefix-cache")
    for key in ("x", "y", "z", "w"):
        assert precise.pick(cands, key, cached_blocks=None) == chwbl.pick(cands, key)
        assert precise.pick(cands, key, cached_blocks={"a": 0}) == chwbl.pick(cands, key)
