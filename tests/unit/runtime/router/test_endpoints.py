"""The endpoint pool (kvfleet.runtime.router.endpoints): ejection backs off exponentially and resets."""

from __future__ import annotations

from kvfleet.runtime.router.endpoints import EndpointPool

KEYS = [f"http://10.0.0.{i}:8000" for i in range(1, 5)]


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
