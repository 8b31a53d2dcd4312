"""The KV event publisher (kvfleet.runtime.engine.kv_event_publisher) on a real ZMQ socket:
a block pool's events arrive at a SUB socket (a reader of the fleet: the default publisher is
CURVE-authenticated, tests/unit/runtime/kv_events/test_auth.py) as vLLM-encoded batches (three
frames, seq 1, 2, ...), and the snapshot at ``seq`` plus the later batches replays to the pool's hashes.
Also ``--kv-events-config`` parsing (kvfleet.runtime.kv_events.config)."""

from __future__ import annotations

import msgspec
import pytest
import zmq

from kvfleet.runtime.config import EngineConfig
from kvfleet.runtime.core.kv_cache_manager import KVCacheManager
from kvfleet.runtime.core.request import Request
from kvfleet.runtime.engine.kv_event_publisher import KVEventPublisher
from kvfleet.runtime.kv_events import wire
from kvfleet.runtime.kv_events.auth import events_keys, secure_reader
from kvfleet.runtime.kv_events.config import KVEventsConfig
from kvfleet.runtime.kv_transfer.fleet_auth import load_fleet_keys
from kvfleet.runtime.sampling_params import SamplingParams


def run(m: KVCacheManager, rid: str, prompt: list[int]) -> None:
    r = Request(rid, prompt, SamplingParams(max_tokens=1), eos_token_id=0)
    hits, n = m.get_computed_blocks(r)
    assert m.allocate_slots(r, r.num_tokens - n, hits) is not None
    r.num_computed_tokens = r.num_tokens
    m.free(r)


def apply(index: set[bytes], batch: wire.KVEventBatch) -> None:
    for e in batch.events:
        if isinstance(e, wire.BlockStored):
            index.update(e.block_hashes)
        elif isinstance(e, wire.BlockRemoved):
            index.difference_update(e.block_hashes)
        else:
            index.clear()


def test_batches_on_the_socket_replay_to_the_pool_and_snapshot():
    pub = KVEventPublisher(KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://127.0.0.1:0", topic="kv"), 4)
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.setsockopt(zmq.RCVTIMEO, 5000)
    secure_reader(sub, events_keys(load_fleet_keys()))  # the suite's fleet secret (tests/conftest.py)
    sub.connect(pub.bound_endpoint)
    m = KVCacheManager(num_blocks=6, block_size=4, enable_kv_cache_events=True)
    try:
        # a PUB socket drops messages until the subscription arrived (ZMQ's slow joiner):
        # publish probes until one is received
        for _ in range(100):
            pub.publish([])  # nothing sent for an empty step
            m.reset_prefix_cache()
            run(m, "warm", [9, 9, 9, 9, 1])
            pub.publish(m.take_events())
            if sub.poll(50):
                break
        first_seq, first = wire.parse_frames(sub.recv_multipart())
        snap = pub.snapshot()
        index = set(snap.block_hashes)
        assert snap.seq >= first_seq and snap.block_size == 4
        m.reset_prefix_cache()
        pub.publish(m.take_events())
        for i, prompt in enumerate([list(range(1, 14)), list(range(1, 10)), list(range(40, 61))]):
            run(m, f"r{i}", prompt)
            pub.publish(m.take_events())
        seqs = []
        while len(seqs) < pub.seq - snap.seq:
            seq, batch = wire.parse_frames(sub.recv_multipart())
            if seq > snap.seq:
                seqs.append(seq)
                apply(index, batch)
        assert seqs == list(range(snap.seq + 1, pub.seq + 1))  # no gap, in order
        assert index == set(m.cached_block_hashes()) == set(pub.snapshot().block_hashes)
        assert isinstance(first.events[-1], wire.BlockStored) and first.events[-1].block_size == 4
    finally:
        sub.close(0)
        pub.close()


def test_payload_is_vllm_msgpack_array_encoding():
    batch = wire.KVEventBatch(1.5, [wire.BlockStored([b"\x01" * 16], None, [1, 2], 2, None, "cpu"),
                                    wire.BlockRemoved([b"\x01" * 16]), wire.AllBlocksCleared()])
    raw = msgspec.msgpack.decode(wire.encode_batch(batch))
    assert raw == [1.5, [["BlockStored", [b"\x01" * 16], None, [1, 2], 2, None, "cpu"],
                         ["BlockRemoved", [b"\x01" * 16], None], ["AllBlocksCleared"]], None]
    assert wire.decode_batch(wire.encode_batch(batch)) == batch


def test_kv_events_config_parses_vllm_json_and_refuses_bad_input():
    cfg = EngineConfig(kv_events_config='{"enable_kv_cache_events": true, "publisher": "null", "topic": "t"}')
    assert cfg.kv_events_config.enable_kv_cache_events and cfg.kv_events_config.publisher == "null"
    assert EngineConfig(kv_events_config="").kv_events_config is None
    for bad in ("{", "[1]", '{"publisher": "kafka"}', '{"endpoints": "x"}'):
        with pytest.raises(ValueError):
            EngineConfig(kv_events_config=bad)


def test_without_token_ids_a_stored_block_carries_its_hashes_only():
    """``include_token_ids: false`` (``kvfleet serve``'s default events, issue 42): no prompt tokens
    leave the replica, the hashes a router indexes do."""
    from kvfleet.runtime.core import kv_events as ev
    from kvfleet.runtime.engine.kv_event_publisher import to_wire

    stored = ev.BlockStored([b"\x01" * 16], None, [5, 6], 2, None, "cpu")
    assert to_wire(stored).token_ids == [5, 6]
    bare = to_wire(stored, token_ids=False)
    assert bare.token_ids == [] and bare.block_hashes == [b"\x01" * 16] and bare.block_size == 2
    assert to_wire(ev.AllBlocksCleared(), token_ids=False) == wire.AllBlocksCleared()
