"""``GET /kv_blocks?hashes=H1,H2,...`` and ``POST /kv_blocks`` (``{"block_hashes": [...]}``):
this replica's cached KV blocks for a peer that pulls them (``--kv-transfer-config``; docs/routing.md,
"Peer KV pull").

Contract: the answer streams one frame per block (:mod:`kvfleet.runtime.kv_transfer.wire`,
content type ``application/x-kvfleet-kv-blocks``) for the leading run of the asked hashes that
the replica still caches, in order: a hash it lacks ends the answer (possibly empty), so every
frame extends the chain the asker computed. Blocks are read in the engine thread
``CHUNK_BLOCKS`` at a time. 400 for a malformed hash list, 404 when this replica does not serve
blocks (no ``--kv-transfer-config``, or ``kv_role`` ``kv_consumer``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from kvfleet.runtime.entrypoints.openai.errors import APIError
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


async def _frames(engine, layout, hashes: list[bytes]):
    for start in range(0, len(hashes), CHUNK_BLOCKS):
        chunk = hashes[start:start + CHUNK_BLOCKS]
        blocks = await engine.kv_blocks(chunk) or []
        if blocks:  # the digests off the event loop
            yield await asyncio.to_thread(lambda b=blocks: b"".join(encode_frame(layout, h, p) for h, p in b))
        if len(blocks) < len(chunk):
            return


def kv_blocks_router(auth: Sequence[Any]) -> APIRouter:
    """The two routes, behind the app's API-key dependency ``auth``."""
    router = APIRouter()

    async def answer(request: Request, hashes: list[bytes]) -> StreamingResponse:
        engine = request.app.state.kvfleet.require_engine()
        first = await engine.kv_blocks(hashes[:0])
        if first is None:
            raise APIError(404, "this replica does not serve KV blocks (--kv-transfer-config with kv_role "
                                "kv_both or kv_producer)", code="not_found")
        return StreamingResponse(_frames(engine, engine.kv_block_layout(), hashes), media_type=CONTENT_TYPE)

    @router.get("/kv_blocks", dependencies=list(auth))
    async def get_kv_blocks(request: Request, hashes: str = ""):
        return await answer(request, parse_hashes(hashes))

    @router.post("/kv_blocks", dependencies=list(auth))
    async def post_kv_blocks(request: Request):
        try:
            body = await request.json()
        except ValueError:
            raise APIError(400, "the body is not JSON", code="invalid_value") from None
        if not isinstance(body, dict):
            raise APIError(400, "the body must be a JSON object with block_hashes", code="invalid_value")
        return await answer(request, parse_hashes(body.get("block_hashes")))

    return router
