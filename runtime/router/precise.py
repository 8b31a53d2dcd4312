"""Precise prefix routing (``--routing-algorithm precise-prefix-cache``): the request's prompt
becomes block hashes the way the replicas' block pools hash it, and the picker scores each
replica by how many leading blocks its KV events say it caches (docs/routing.md).

Tokens come from a replica's ``POST /tokenize`` (the same body: ``prompt``, or ``messages`` and
``tools`` rendered by the replica's own chat template, so the tokens equal the ones it will
prefill); the router stays free of tokenizers and templates. Only full blocks of a single text or
token-id prompt are hashed; with no ids (a batch prompt, a failed /tokenize, no block size known
yet) the request carries no hashes and the picker falls back to the char-prefix ring. Requests for
a LoRA adapter or with a ``cache_salt`` hash differently on the replica, match no block, and so
fall back the same way.

With ``--kv-peer-hint`` (on by default, any routing algorithm) the forwarder also tells the chosen
replica, in ``x-kvfleet-kv-peer``, which other available replica caches a longer prefix of the
prompt, so that the replica pulls those blocks instead of recomputing them (docs/routing.md, "Peer
KV pull"); every hint is signed with the fleet secret (``x-kvfleet-kv-peer-signature``,
:mod:`kvfleet.runtime.kv_transfer.fleet_auth`), and with no secret the router sends none.

:class:`PreciseForwarder` computes the hashes once per request and hands them to
:class:`PrecisePicker` through a context variable (the proxy's pick call is unchanged).
"""

from __future__ import annotations

import contextvars
import json

import httpx

from kvfleet.runtime.kv_events.hashing import prompt_block_hashes
from kvfleet.runtime.kv_transfer.fleet_auth import FleetKeys
from kvfleet.runtime.router.kv_index import KVIndex
from kvfleet.runtime.router.picker import Picker
from kvfleet.runtime.router.proxy import KV_PEER_HEADER, KV_PEER_SIGNATURE_HEADER, Forwarder
from kvfleet.runtime.router.routing import Algorithm

_HASHES: contextvars.ContextVar[list[bytes] | None] = contextvars.ContextVar("kvfleet_block_hashes", default=None)
TOKENIZE_PATHS = {"/v1/completions", "/v1/chat/completions"}


def tokenize_body(path: str, body) -> dict | None:
    """The ``/tokenize`` body for a request body, or None when it cannot be hashed."""
    if not isinstance(body, dict):
        return None
    if path == "/v1/chat/completions" and isinstance(body.get("messages"), list):
        return {k: body[k] for k in ("model", "messages", "tools", "add_generation_prompt") if k in body}
    if path == "/v1/completions" and isinstance(body.get("prompt"), str):
        return {"model": body.get("model"), "prompt": body["prompt"]}
    return None


class PrecisePicker(Picker):
    """A :class:`Picker` whose ``cached_blocks`` come from the index and this request's hashes."""

    def __init__(self, index: KVIndex, algorithm: str = Algorithm.PRECISE_PREFIX_CACHE, **kw) -> None:
        super().__init__(algorithm, **kw)
        self.index = index

    def pick(self, candidates, prefix_key, *, ring_keys=None, cached_blocks=None):
        hashes = _HASHES.get()
        if cached_blocks is None and hashes:
            cached_blocks = {c.key: self.index.matched_blocks(c.key, hashes) for c in candidates}
        return super().pick(candidates, prefix_key, ring_keys=ring_keys, cached_blocks=cached_blocks)


class PreciseForwarder(Forwarder):
    """Args: index (the replicas' cached blocks); kv_peer_hint: name, in ``x-kvfleet-kv-peer``, the
    available replica that caches the longest prefix of the prompt when it is not the one chosen,
    signed with ``fleet_keys`` (None: no hints)."""

    def __init__(self, *args, index: KVIndex, kv_peer_hint: bool = False, fleet_keys: FleetKeys | None = None,
                 **kw) -> None:
        super().__init__(*args, **kw)
        self.index = index
        self.kv_peer_hint = kv_peer_hint and fleet_keys is not None
        self.fleet_keys = fleet_keys

    def upstream_headers(self, ep, headers):
        hashes = _HASHES.get()
        if not self.kv_peer_hint or not hashes:
            return headers
        mine = self.index.matched_blocks(ep.url, hashes)
        best = max(((self.index.matched_blocks(e.url, hashes), e.url) for e in self.pool.available()
                    if e.url != ep.url), default=(0, ""))
        if best[0] <= mine:
            return headers
        self.metrics.kv_peer_hints.inc()
        assert self.fleet_keys is not None
        return [*headers, (KV_PEER_HEADER, best[1].encode()),
                (KV_PEER_SIGNATURE_HEADER, self.fleet_keys.sign_hint(best[1]).encode())]

    async def block_hashes(self, path: str, headers, body: bytes) -> list[bytes] | None:
        block_size = self.index.block_size()
        if block_size is None or path not in TOKENIZE_PATHS or not body:
            return None
        try:
            req = tokenize_body(path, json.loads(body))
        except ValueError:
            return None
        if req is None:
            return None
        ready = [e for e in self.pool.available() if self.index.has_events([e.url])] or self.pool.available()
        if not ready:
            return None
        ep = min(ready, key=lambda e: e.in_flight)
        auth = {k.decode(): v.decode() for k, v in headers if k.lower() == b"authorization"}
        try:
            resp = await self.client.post(ep.url + "/tokenize", json=req, headers=auth)
            tokens = resp.json().get("tokens") if resp.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None
        return prompt_block_hashes(tokens, block_size) if isinstance(tokens, list) else None

    async def forward(self, method, path, query, headers, body):
        hashes = await self.block_hashes(path, headers, body) if method == "POST" else None
        token = _HASHES.set(hashes)
        try:
            return await super().forward(method, path, query, headers, body)
        finally:
            _HASHES.reset(token)
