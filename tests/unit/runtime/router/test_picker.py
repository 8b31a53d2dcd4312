"""The router's picker (kvfleet.runtime.router.picker), pure: the hash ring, CHWBL prefix affinity
with its capacity ceiling and spills, least load, round robin (the proxy itself: tests/e2e/test_router.py)."""

from __future__ import annotations

import collections

import pytest

from kvfleet.runtime.router.picker import FALLBACK, HIT, SPILL, Candidate, HashRing, Picker, capacity, hash64
from kvfleet.runtime.router.settings import parse_args

KEYS = [f"http://10.0.0.{i}:8000" for i in range(1, 5)]


def test_ring_walk_visits_each_endpoint_once_owner_first():
    ring = HashRing(50)
    ring.update(KEYS)
    for point in (0, 2**63, 2**64 - 1, 12345):
        walked = list(ring.walk(point))
        assert sorted(walked) == sorted(KEYS)


def test_ring_moves_only_the_removed_endpoints_keys():
    # consistent hashing: removing one endpoint remaps only the keys it owned
    full, less = Picker(), Picker()
    cands = [Candidate(k) for k in KEYS]
    before = {i: full.pick(cands, f"prefix-{i}").key for i in range(400)}
    after = {i: less.pick(cands[:-1], f"prefix-{i}", ring_keys=KEYS[:-1]).key for i in range(400)}
    moved = [i for i in before if before[i] != after[i]]
    assert all(before[i] == KEYS[-1] for i in moved)
    assert 40 < len(moved) < 170  # about a quarter of 400


def test_ring_spreads_prefixes_over_endpoints():
    p = Picker(virtual_nodes=100)
    cands = [Candidate(k) for k in KEYS]
    counts = collections.Counter(p.pick(cands, f"system prompt {i}").key for i in range(2000))
    assert min(counts.values()) > 2000 / 4 * 0.6


def test_same_prefix_same_replica_is_a_hit():
    p = Picker()
    cands = [Candidate(k) for k in KEYS]
    first = p.pick(cands, "abc")
    assert first.decision == HIT
    assert all(p.pick(cands, "abc") == first for _ in range(5))


def test_capacity_is_the_papers_ceiling():
    assert capacity(0, 3, 1.25) == 1
    assert capacity(2, 3, 1.25) == 2  # ceil(1.25 * 3 / 3)
    assert capacity(11, 4, 1.25) == 4  # ceil(1.25 * 12 / 4) = ceil(3.75)


def test_hot_prefix_spills_to_the_next_endpoint_on_the_ring():
    p = Picker(load_factor=1.25)
    idle = [Candidate(k) for k in KEYS]
    home = p.pick(idle, "hot").key
    order = list(p.ring.walk(hash64("hot")))
    assert order[0] == home
    # the home replica has 4 in flight, the others 0: bound ceil(1.25 * 5 / 4) = 2
    loaded = [Candidate(k, in_flight=4 if k == home else 0) for k in KEYS]
    d = p.pick(loaded, "hot")
    assert d == type(d)(order[1], SPILL)


def test_unavailable_home_spills_and_comes_back():
    p = Picker()
    cands = [Candidate(k) for k in KEYS]
    home = p.pick(cands, "k").key
    others = [c for c in cands if c.key != home]
    d = p.pick(others, "k", ring_keys=KEYS)
    assert d.key != home and d.decision == SPILL
    assert p.pick(cands, "k", ring_keys=KEYS).key == home


def test_least_load_uses_own_in_flight_plus_foreign_then_kv_usage():
    p = Picker("least-load")
    cands = [Candidate(KEYS[0], in_flight=1), Candidate(KEYS[1], foreign=3), Candidate(KEYS[2], in_flight=1,
             kv_cache_usage=0.1), Candidate(KEYS[3], in_flight=1, kv_cache_usage=0.5)]
    assert Candidate("x", in_flight=2, foreign=1).load == 3
    assert p.pick(cands, "ignored") == type(p.pick(cands, None))(KEYS[0], FALLBACK)
    # no prefix key under prefix-hash: least load, a fallback
    assert Picker().pick(cands, None).key == KEYS[0]


def test_round_robin_cycles():
    p = Picker("round-robin")
    cands = [Candidate(k) for k in KEYS[:3]]
    assert [p.pick(cands, "x").key for _ in range(6)] == KEYS[:3] * 2
    with pytest.raises(ValueError):
        Picker("random")


def test_min_capacity_keeps_a_lightly_loaded_owner_from_spilling():
    """Three prefixes in flight on their owner and none elsewhere: the paper's bound
    (ceil(1.25 x 4 / 3) = 2) spills the fourth request; a floor of 4 keeps it on the owner."""
    ring_owner = Picker().pick([Candidate(k) for k in KEYS], "hot prefix").key
    loaded = [Candidate(k, in_flight=3 if k == ring_owner else 0) for k in KEYS]
    assert Picker(min_capacity=1).pick(loaded, "hot prefix").decision == SPILL
    kept = Picker(min_capacity=4).pick(loaded, "hot prefix")
    assert (kept.key, kept.decision) == (ring_owner, HIT)
    assert capacity(3, 3, 1.25, min_capacity=4) == 4 and capacity(30, 3, 1.25, min_capacity=4) == 13
    assert parse_args(["--endpoints", "http://a:1"], environ={}).min_capacity == 4
