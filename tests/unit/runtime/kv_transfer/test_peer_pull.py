"""The pulling side's HTTP client: peer URLs, HTTP failures and the concurrency bound (issue 29)."""

from __future__ import annotations

import asyncio
import hashlib

import httpx
import pytest

from kvfleet.runtime.kv_transfer.config import KVTransferConfig
from kvfleet.runtime.kv_transfer.fleet_auth import FLEET_AUTH_HEADER, FleetKeys, Sealer
from kvfleet.runtime.kv_transfer.peer_pull import PeerFetcher, check_peer_url
from kvfleet.runtime.kv_transfer.wire import BlockLayout, TransferError, encode_frame

LAYOUT = BlockLayout(model="m", dtype="float32", quantization="none", num_layers=1, num_kv_heads=1, head_size=2,
                     block_size=2, elem_size=4)
H = [hashlib.blake2b(bytes([i]), digest_size=16).digest() for i in range(3)]
KEYS = FleetKeys(b"k" * 32)


def seal(request: httpx.Request, frames: bytes, keys: FleetKeys = KEYS) -> bytes:
    """``frames`` answering ``request`` (a pull of this fleet), sealed for its nonce with ``keys``."""
    nonce = KEYS.check_pull_auth(request.headers.get(FLEET_AUTH_HEADER))
    assert nonce is not None
    sealer = Sealer(keys.seal_key(nonce))
    return sealer.add(frames) + sealer.seal()


@pytest.mark.parametrize("url", ["ftp://a:1", "a:1", "http://", "http://a:1/?x=1", "http://a:1#f"])
def test_only_http_base_urls_are_peers(url):
    with pytest.raises(TransferError) as exc:
        check_peer_url(url)
    assert exc.value.reason == "malformed"
    assert check_peer_url("http://10.0.0.5:8000/") == "http://10.0.0.5:8000"


def fetcher(handler, **cfg) -> PeerFetcher:
    f = PeerFetcher(KVTransferConfig(**cfg), LAYOUT, KEYS)
    f._client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    return f


def test_a_good_answer_its_request_and_the_http_failures():
    seen = []

    def good(request: httpx.Request):
        seen.append((request.url.path, request.headers.get("authorization"), request.content))
        return httpx.Response(200, content=seal(request, encode_frame(LAYOUT, H[0], b"\1" * LAYOUT.block_bytes)))

    blocks = asyncio.run(fetcher(good).fetch("http://p:1", H[:2]))
    assert blocks == [(H[0], b"\1" * LAYOUT.block_bytes)]  # the peer held one block: a shorter run
    # the fleet's auth, never a client's credentials
    assert seen[0][:2] == ("/kv_blocks", None) and H[1].hex().encode() in seen[0][2]
    for handler in (lambda r: httpx.Response(404, json={}), lambda r: (_ for _ in ()).throw(httpx.ConnectError("x"))):
        with pytest.raises(TransferError) as exc:
            asyncio.run(fetcher(handler).fetch("http://p:1", H))
        assert exc.value.reason == "http"


def test_pulls_beyond_the_bound_wait_and_the_time_limit_holds():
    state = {"now": 0, "most": 0}

    async def slow(request: httpx.Request):
        state["now"] += 1
        state["most"] = max(state["most"], state["now"])
        await asyncio.sleep(0.05)
        state["now"] -= 1
        return httpx.Response(200, content=seal(request, b""))

    async def burst(f):
        return await asyncio.gather(*(f.fetch("http://p:1", H) for _ in range(5)))

    assert asyncio.run(burst(fetcher(slow, max_concurrent_pulls=2))) == [[]] * 5
    assert state["most"] == 2
    with pytest.raises(TransferError) as exc:
        asyncio.run(fetcher(slow, pull_timeout=0.01).fetch("http://p:1", H))
    assert exc.value.reason == "http"


def test_frames_from_an_address_that_is_not_a_replica_are_refused():
    frames = encode_frame(LAYOUT, H[0], b"\1" * LAYOUT.block_bytes)
    for answer in (lambda r: frames, lambda r: seal(r, frames, FleetKeys(b"x" * 32))):  # no seal; another fleet's
        with pytest.raises(TransferError) as exc:
            asyncio.run(fetcher(lambda r, a=answer: httpx.Response(200, content=a(r))).fetch("http://p:1", H))
        assert exc.value.reason == "not_replica"
