"""The router's KV event subscriber (kvfleet.runtime.router.kv_subscriber) against real publishers
on ZMQ sockets: with the fleet secret it follows a replica's default (CURVE) publisher into the
index; a plaintext publisher and one keyed by another secret deliver nothing to the index, and
each refusal is passed on with its reason (the router counts them:
``kvfleet:router_kv_events_refused_total``)."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from kvfleet.runtime.core import kv_events as ev
from kvfleet.runtime.engine.kv_event_publisher import KVEventPublisher
from kvfleet.runtime.kv_events.auth import events_keys
from kvfleet.runtime.kv_events.config import KVEventsConfig
from kvfleet.runtime.kv_transfer.fleet_auth import FleetKeys
from kvfleet.runtime.router.kv_index import KVIndex
from kvfleet.runtime.router.kv_subscriber import KVSubscriber

SECRET = "the router test's fleet secret, 32 bytes"
URL = "http://127.0.0.1:1"


def _publisher(monkeypatch, secret: str | None) -> KVEventPublisher:
    """A replica's publisher: the fleet's (``secret`` = SECRET), another fleet's, or plaintext (None)."""
    monkeypatch.setenv("KVFLEET_FLEET_SECRET", secret or SECRET)
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://127.0.0.1:0",
                            auth="fleet" if secret else "none")
    return KVEventPublisher(config, 4)


async def _follow(pub: KVEventPublisher, seconds: float, refusal: bool = False) -> tuple[KVIndex, list[str]]:
    """Follow ``pub`` as the router does (its snapshot over HTTP, then its socket) while it
    publishes a new block every 50 ms; the index and the refusals once three batches were applied
    after the snapshot, or (``refusal``) once a refusal was passed on and 60 batches (3 s) were
    published, or after ``seconds`` (conditions, not a time: a loaded machine runs it late)."""
    refused: list[str] = []

    def snapshot(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=pub.snapshot_json())

    index = KVIndex()
    async with httpx.AsyncClient(transport=httpx.MockTransport(snapshot)) as client:
        sub = KVSubscriber(index, client, retry_s=0.2, keys=events_keys(FleetKeys(SECRET.encode())),
                           on_refused=lambda url, reason: refused.append(reason))
        sub.join_s = 0.2
        runner = asyncio.create_task(sub.run(lambda: [URL], interval=0.1))
        deadline = time.monotonic() + seconds
        n, first_seq = 0, None
        while time.monotonic() < deadline:
            n += 1
            pub.publish([ev.BlockStored([n.to_bytes(16, "big")], None, [], 4)])
            await asyncio.sleep(0.05)
            rep = index.replicas.get(URL)
            if rep is not None and not rep.stale:
                first_seq = rep.seq if first_seq is None else first_seq
                if rep.seq >= first_seq + 3 and not refusal:
                    break  # three batches applied after the snapshot: followed
            if refusal and refused and n >= 60:
                break
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)
    return index, refused


def test_the_fleet_publisher_is_followed(monkeypatch):
    pub = _publisher(monkeypatch, SECRET)
    try:
        index, refused = asyncio.run(_follow(pub, 20))
    finally:
        pub.close()
    rep = index.replicas[URL]
    assert not rep.stale and rep.seq == len(rep.hashes) >= 4 and refused == []


@pytest.mark.parametrize("secret", [None, "a forged publisher's own secret"], ids=["plaintext", "other_key"])
def test_a_publisher_without_the_fleet_key_delivers_nothing_and_is_counted(monkeypatch, secret):
    pub = _publisher(monkeypatch, secret)
    try:
        index, refused = asyncio.run(_follow(pub, 20, refusal=True))
        published = pub.seq
    finally:
        pub.close()
    rep = index.replicas[URL]
    # The index holds what the snapshot said when it was read (HTTP), no batch of the socket.
    assert rep.seq < published and len(rep.hashes) == rep.seq
    assert refused and set(refused) == {"not_fleet"}


def test_without_fleet_keys_nothing_is_followed():
    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(lambda r: httpx.Response(500))) as client:
            sub = KVSubscriber(KVIndex(), client, keys=None)
            await asyncio.wait_for(sub._follow(URL), 1)  # returns at once: no snapshot read, no socket
            sub.ctx.destroy(linger=0)
    asyncio.run(go())
