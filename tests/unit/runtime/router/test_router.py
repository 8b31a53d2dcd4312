"""The router's pure parts: CHWBL picking, prefix keys, the hold queue, ejection back-off,
EndpointSlice parsing, settings (no servers; the proxy itself: tests/e2e/test_router.py)."""

from __future__ import annotations

import asyncio
import collections

import pytest

from kvfleet.runtime.router.endpoints import EndpointPool
from kvfleet.runtime.router.endpointslices import slice_urls
from kvfleet.runtime.router.hold import PendingQueue, PendingTimeout, QueueFull
from kvfleet.runtime.router.picker import FALLBACK, HIT, SPILL, Candidate, HashRing, Picker, capacity, hash64
from kvfleet.runtime.router.prefix_key import prefix_key
from kvfleet.runtime.router.probe import parse_load
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


def test_prefix_key_chat_completions_and_token_ids():
    sys_prompt = "You are a helpful assistant. " * 20
    a = prefix_key("/v1/chat/completions", {"model": "m", "messages": [
        {"role": "system", "content": sys_prompt}, {"role": "user", "content": "one"}]})
    b = prefix_key("/v1/chat/completions", {"model": "m", "messages": [
        {"role": "system", "content": [{"type": "text", "text": sys_prompt}]}, {"role": "user", "content": "two"}]})
    assert a == b and len(a) == len("m\0") + 256
    c = prefix_key("/v1/chat/completions", {"model": "other", "messages": [{"role": "system", "content": sys_prompt}]})
    assert c != a  # another model, another cache
    assert prefix_key("/v1/completions", {"model": "m", "prompt": "hello"}) == "m\0hello"
    assert prefix_key("/v1/completions", {"prompt": ["first", "second"]}) == "\0first"
    assert prefix_key("/v1/completions", {"prompt": list(range(100))}, prefix_chars=16) == "\x000,1,2,3"
    for body in (None, [], {"prompt": ""}, {"messages": "x"}, {}):
        assert prefix_key("/v1/chat/completions", body) is None
    assert prefix_key("/v1/models", {"model": "m"}) is None


def test_hold_queue_fifo_bound_and_timeout():
    async def main():
        q = PendingQueue(max_pending=2, pending_timeout=0.3)
        up = False
        order = []

        async def one(i):
            await q.hold(lambda: up)
            order.append(i)

        tasks = [asyncio.create_task(one(i)) for i in range(2)]
        await asyncio.sleep(0.01)
        assert len(q) == 2
        with pytest.raises(QueueFull):
            await q.hold(lambda: up)
        up = True
        q.notify()
        await asyncio.gather(*tasks)
        assert order == [0, 1] and len(q) == 0
        up = False
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(PendingTimeout):
            await q.hold(lambda: up)
        assert 0.25 < asyncio.get_running_loop().time() - t0 < 1.0
        # woken while nothing is available after all: it keeps waiting at the head
        late = asyncio.create_task(q.hold(lambda: up))
        await asyncio.sleep(0.01)
        q.notify()
        await asyncio.sleep(0.01)
        assert not late.done() and len(q) == 1
        up = True
        q.notify()
        await late

    asyncio.run(main())


def test_ejection_backs_off_exponentially_and_resets():
    now = [100.0]
    pool = EndpointPool(eject_base=1.0, eject_max=5.0, clock=lambda: now[0])
    woken = []
    pool.on_available(lambda: woken.append(1))
    pool.set_urls(KEYS[:2])
    assert pool.available() == []
    pool.set_probe(KEYS[0], True, waiting=2, kv_cache_usage=0.5)
    assert [e.url for e in pool.available()] == [KEYS[0]] and woken == [1]
    ep = pool.get(KEYS[0])
    # foreign load: the replica's own count minus this router's share when it was scraped
    ep.in_flight = 1
    pool.set_probe(KEYS[0], True, waiting=1, running=2)
    assert ep.foreign == 2 and ep.candidate().load == 3
    ep.in_flight = 0  # our request finished since: not counted twice
    assert ep.candidate().load == 2
    assert [pool.eject(ep) for _ in range(4)] == [1.0, 2.0, 4.0, 5.0]
    assert pool.available() == []
    now[0] += 5.0
    pool.end_ejections()
    assert [e.url for e in pool.available()] == [KEYS[0]] and woken == [1, 1]
    pool.succeeded(ep)
    assert pool.eject(ep) == 1.0
    pool.set_urls(KEYS[1:])
    assert pool.urls() == KEYS[1:]


def test_slice_urls_ready_addresses_only():
    slices = [
        {"metadata": {"labels": {"kubernetes.io/service-name": "svc"}}, "addressType": "IPv4",
         "ports": [{"name": "http", "port": 8000}],
         "endpoints": [{"addresses": ["10.0.0.1"], "conditions": {"ready": True}},
                       {"addresses": ["10.0.0.2"], "conditions": {"ready": False, "terminating": True}},
                       {"addresses": ["10.0.0.3"]}]},  # unset: ready
        {"metadata": {"labels": {"kubernetes.io/service-name": "svc"}}, "addressType": "IPv6",
         "ports": [{"name": "http", "port": 8000}], "endpoints": [{"addresses": ["fd00::5"]}]},
        {"metadata": {"labels": {"kubernetes.io/service-name": "other"}}, "ports": [{"name": "http", "port": 1}],
         "endpoints": [{"addresses": ["10.9.9.9"]}]},
        {"metadata": {"labels": {"kubernetes.io/service-name": "svc"}}, "ports": [{"name": "grpc", "port": 9}],
         "endpoints": [{"addresses": ["10.0.0.4"]}]},
    ]
    assert slice_urls(slices, "http", "svc") == ["http://10.0.0.1:8000", "http://10.0.0.3:8000", "http://[fd00::5]:8000"]
    assert slice_urls(slices, "8000", "svc") == slice_urls(slices, "http", "svc")


def test_parse_load_reads_kvfleet_and_vllm_names():
    text = ('# TYPE kvfleet:num_requests_waiting gauge\nkvfleet:num_requests_waiting{model_name="m"} 3.0\n'
            '# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name="m"} 2.0\n'
            '# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{model_name="m"} 9.0\n'
            '# TYPE kvfleet:kv_cache_usage_perc gauge\nkvfleet:kv_cache_usage_perc{model_name="m"} 0.25\n')
    assert parse_load(text) == {"waiting": 3.0, "running": 2.0, "kv_cache_usage": 0.25}


def test_settings_need_one_endpoint_source():
    s = parse_args(["--endpoints", "http://a:1, http://b:2/", "--routing-algorithm", "least-load"], environ={})
    assert s.endpoints == ["http://a:1", "http://b:2/"] and s.routing_algorithm == "least-load"
    assert parse_args([], environ={"KVFLEET_ROUTER_KUBE_SERVICE": "svc"}).kube_service == "svc"
    for argv in ([], ["--endpoints", "http://a:1", "--kube-service", "s"], ["--endpoints", "x", "--max-pending", "-1"]):
        with pytest.raises(SystemExit):
            parse_args(argv, environ={})


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
