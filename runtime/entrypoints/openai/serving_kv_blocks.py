"""``GET /kv_blocks?hashes=H1,H2,...`` and ``POST /kv_blocks`` (``{"block_hashes": [...]}``):
this replica's cached KV blocks for a peer that pulls them (``--kv-transfer-config``; docs/routing.md,
"Peer KV pull").

Contract: the answer streams one frame per block (:mod:`kvfleet.runtime.kv_transfer.wire`,
content type ``application/x-kvfleet-kv-blocks``) for the leading run of the asked hashes that
the replica still caches, in order: a hash it lacks ends the answer (possibly empty), so every
frame extends the chain the asker computed, and the answer ends with the fleet's seal over them
(:mod:`~kvfleet.runtime.kv_transfer.fleet_auth`). Blocks are read in the engine thread
``CHUNK_BLOCKS`` at a time. For the fleet only: 403 unless the request carries a fresh
``x-kvfleet-fleet-auth`` of this fleet (the API key plays no part: a client never reads blocks).
400 for a malformed hash list, 404 when this replica does not serve blocks (peer KV off, or
``kv_role`` ``kv_consumer``, or no fleet secret).
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from kvfleet.runtime.entrypoints.openai.errors import APIError
from kvfleet.runtime.kv_transfer.fleet_auth import FLEET_AUTH_HEADER, Sealer
from kvfleet.runtime.kv_transfer.wire import CONTENT_TYPE, encode_frame

CHUNK_BLOCKS = 16
"""Blocks read per engine-thread command (bounds the bytes held and the engine's pause)."""
MAX_BLOCKS = 65536
"""Most hashes one request may ask for (a 1M-token prompt at block size 16)."""


def parse_hashes(values: Any) -> list[bytes]:
    """Hex block hashes (a list, or one comma-separated string) as bytes; APIError 400 otherwise."""
    if isinstance(values, str):
        values = [v for v in values.split(",") if v]
    if not isinstance(values, list) or len(values) > MAX_BLOCKS:
        raise APIError(400, f"block_hashes: a list of at most {MAX_BLOCKS} hex strings is expected",
                       param="block_hashes", code="invalid_value")
    try:
        out = [bytes.fromhex(v) for v in values]
    except (TypeError, ValueError):
        raise APIError(400, "block_hashes: every hash must be a hex string", param="block_hashes",
                       code="invalid_value") from None
    if any(len(h) != 16 for h in out):
        raise APIError(400, "block_hashes: every hash is 16 bytes (32 hex digits)", param="block_hashes",
                       code="invalid_value")
    return out


async def _frames(engine, layout, hashes: list[bytes], sealer: Sealer):
    for start in range(0, len(hashes), CHUNK_BLOCKS):
        chunk = hashes[start:start + CHUNK_BLOCKS]
        blocks = await engine.kv_blocks(chunk) or []
        if blocks:  # the digests off the event loop
            yield sealer.add(await asyncio.to_thread(
                lambda b=blocks: b"".join(encode_frame(layout, h, p) for h, p in b)))
        if len(blocks) < len(chunk):
            break
    yield sealer.seal()


def kv_blocks_router() -> APIRouter:
    """The two routes, for the fleet only (its auth header checked in each)."""
    router = APIRouter()

    async def fleet_only(request: Request) -> bytes:
        """The pull's nonce; 404 when this replica serves no blocks, 403 for anyone but the fleet."""
        engine = request.app.state.kvfleet.require_engine()
        keys = getattr(engine, "fleet_keys", None)
        if keys is None or await engine.kv_blocks([]) is None:
            raise APIError(404, "this replica does not serve KV blocks (peer KV pull off, kv_role kv_consumer, "
                                "or no fleet secret)", code="not_found")
        nonce = keys.check_pull_auth(request.headers.get(FLEET_AUTH_HEADER))
        if nonce is None:
            raise APIError(403, "KV blocks are served to the replicas of this fleet only", code="forbidden")
        return nonce

    def answer(request: Request, nonce: bytes, hashes: list[bytes]) -> StreamingResponse:
        engine = request.app.state.kvfleet.require_engine()
        sealer = Sealer(engine.fleet_keys.seal_key(nonce))
        return StreamingResponse(_frames(engine, engine.kv_block_layout(), hashes, sealer), media_type=CONTENT_TYPE)

    @router.get("/kv_blocks")
    async def get_kv_blocks(request: Request, hashes: str = ""):
        nonce = await fleet_only(request)
        return answer(request, nonce, parse_hashes(hashes))

    @router.post("/kv_blocks")
    async def post_kv_blocks(request: Request):
        nonce = await fleet_only(request)
        try:
            body = await request.json()
        except ValueError:
            raise APIError(400, "the body is not JSON", code="invalid_value") from None
        if not isinstance(body, dict):
            raise APIError(400, "the body must be a JSON object with block_hashes", code="invalid_value")
        return answer(request, nonce, parse_hashes(body.get("block_hashes")))

    return router
