"""The router's peer hint (``--kv-peer-hint``, issue 29): the chosen replica is told which other
available replica caches a longer prefix of the prompt, signed with the fleet's key (issue 42), and
a client's own hint or signature never passes; without a fleet secret no hint is sent."""

from __future__ import annotations

import asyncio

import httpx

from kvfleet.runtime.kv_transfer.fleet_auth import FleetKeys
from kvfleet.runtime.router.endpoints import EndpointPool
from kvfleet.runtime.router.hold import PendingQueue
from kvfleet.runtime.router.kv_index import KVIndex
from kvfleet.runtime.router.metrics import RouterMetrics
from kvfleet.runtime.router.picker import Picker
from kvfleet.runtime.router.precise import _HASHES, PreciseForwarder
from kvfleet.runtime.router.proxy import KV_PEER_HEADER, KV_PEER_SIGNATURE_HEADER

H = [bytes([i]) * 16 for i in range(6)]
URLS = ["http://a:1", "http://b:1", "http://c:1"]
KEYS = FleetKeys(b"router-test-fleet-secret")


def forwarder(hint: bool = True, client=None, keys: FleetKeys | None = KEYS) -> PreciseForwarder:
    pool = EndpointPool()
    pool.set_urls(URLS)
    for u in URLS:
        pool.set_probe(u, True)
    index = KVIndex()
    index.load_snapshot(URLS[0], {"seq": 0, "block_size": 16, "block_hashes": [h.hex() for h in H[:5]]})
    index.load_snapshot(URLS[1], {"seq": 0, "block_size": 16, "block_hashes": [h.hex() for h in H[:2]]})
    index.load_snapshot(URLS[2], {"seq": 0, "block_size": 16, "block_hashes": []})
    return PreciseForwarder(pool, PendingQueue(8, 1.0), Picker("round-robin"), RouterMetrics(), client,
                            index=index, kv_peer_hint=hint, fleet_keys=keys)


def headers_for(fwd: PreciseForwarder, url: str, hashes) -> list:
    token = _HASHES.set(hashes)
    try:
        return fwd.upstream_headers(fwd.pool.get(url), [(b"authorization", b"Bearer k")])
    finally:
        _HASHES.reset(token)


def test_the_replica_holding_the_longest_prefix_is_named():
    fwd = forwarder()
    out = headers_for(fwd, URLS[2], H)
    assert out[:2] == [(b"authorization", b"Bearer k"), (KV_PEER_HEADER, URLS[0].encode())]
    assert out[2][0] == KV_PEER_SIGNATURE_HEADER and KEYS.check_hint(URLS[0], out[2][1].decode()) is None
    assert headers_for(fwd, URLS[1], H)[-2] == (KV_PEER_HEADER, URLS[0].encode())
    assert fwd.metrics.kv_peer_hints._value.get() == 2


def test_no_hint_when_the_chosen_replica_holds_as_much_or_the_hint_is_off():
    fwd = forwarder()
    assert headers_for(fwd, URLS[0], H) == [(b"authorization", b"Bearer k")]
    assert headers_for(fwd, URLS[2], [b"\xff" * 16]) == [(b"authorization", b"Bearer k")]  # nobody holds it
    assert headers_for(fwd, URLS[2], None) == [(b"authorization", b"Bearer k")]  # no hashes (e.g. a batch)
    assert headers_for(forwarder(hint=False), URLS[2], H) == [(b"authorization", b"Bearer k")]
    assert headers_for(forwarder(keys=None), URLS[2], H) == [(b"authorization", b"Bearer k")]  # nothing to sign with


def test_a_clients_own_hint_is_dropped():
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((request.headers.get("x-kvfleet-kv-peer"), request.headers.get("x-kvfleet-kv-peer-signature")))
        return httpx.Response(200, json={})

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            fwd = forwarder(hint=False, client=client)
            resp = await fwd.forward("GET", "/v1/models", b"", [(b"x-kvfleet-kv-peer", b"http://evil:1"),
                                                                 (b"x-kvfleet-kv-peer-signature", b"t=1,v1=00")], b"")
            await resp.upstream.aclose()  # the streamed answer is not read here

    asyncio.run(go())
    assert seen == [(None, None)]
