"""The pulling side's HTTP client: ``POST {peer}/kv_blocks`` for a list of block hashes, the
answer read frame by frame through :class:`~kvfleet.runtime.kv_transfer.wire.FrameReader`.

Contract: :meth:`PeerFetcher.fetch` returns the leading blocks the peer sent (it sends the
longest run it still caches, possibly none), every one checked (layout, hash, digest); anything
else raises :class:`~kvfleet.runtime.kv_transfer.wire.TransferError` and nothing is used: a bad
peer URL (``malformed``), a transport error, a non-200 answer or the time limit (``http``),
a refused frame or a truncated stream (its own reason), an answer without the seal of a
replica of this fleet (``not_replica``: :mod:`~kvfleet.runtime.kv_transfer.fleet_auth`; every
pull carries the fleet's auth and a fresh nonce the seal must be made with). At most ``max_concurrent_pulls`` fetches
run at once (the others wait). Torch-free.
"""

from __future__ import annotations

import asyncio
from urllib.parse import urlsplit

import httpx

from kvfleet.runtime.kv_transfer.config import KVTransferConfig
from kvfleet.runtime.kv_transfer.fleet_auth import FLEET_AUTH_HEADER, FleetKeys
from kvfleet.runtime.kv_transfer.wire import BlockLayout, FrameReader, TransferError

PEER_HEADER = "x-kvfleet-kv-peer"
"""The router's hint: the base URL of the replica that caches the longest prefix of the prompt
(taken only with the router's signature, :mod:`~kvfleet.runtime.kv_transfer.fleet_auth`)."""


def check_peer_url(url: str) -> str:
    """``url`` without a trailing slash; TransferError ``malformed`` unless it is http(s)://host[:port]."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc or parts.query or parts.fragment:
        raise TransferError("malformed", f"peer {url!r} is not an http(s) base URL")
    return url.rstrip("/")


class PeerFetcher:
    """Args: config (the limits), layout (this replica's: every frame must match it), keys (the
    fleet's: the pull's auth and the answer's seal)."""

    def __init__(self, config: KVTransferConfig, layout: BlockLayout, keys: FleetKeys) -> None:
        self.config = config
        self.layout = layout
        self.keys = keys
        self._slots = asyncio.Semaphore(config.max_concurrent_pulls)
        self._client: httpx.AsyncClient | None = None

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=httpx.Timeout(self.config.pull_timeout))
        return self._client

    async def fetch(self, peer: str, hashes: list[bytes]) -> list[tuple[bytes, bytes]]:
        """The peer's leading blocks of ``hashes`` as ``(hash, payload)``; raises TransferError."""
        url = check_peer_url(peer) + "/kv_blocks"
        auth, nonce = self.keys.pull_auth()
        headers = {FLEET_AUTH_HEADER: auth}
        reader = FrameReader(self.layout, hashes, seal_key=self.keys.seal_key(nonce))
        async with self._slots:
            try:
                await asyncio.wait_for(self._read(url, hashes, headers, reader), self.config.pull_timeout)
            except (TimeoutError, httpx.HTTPError) as exc:
                raise TransferError("http", f"{type(exc).__name__}: {exc}") from None
        return reader.finish()

    async def _read(self, url: str, hashes: list[bytes], headers: dict, reader: FrameReader) -> None:
        body = {"block_hashes": [h.hex() for h in hashes]}
        async with self._http().stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                raise TransferError("http", f"{url} answered HTTP {resp.status_code}")
            async for chunk in resp.aiter_bytes():
                reader.feed(chunk)

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None
