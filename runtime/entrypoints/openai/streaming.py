"""Server-Sent Events framing (the server's one SSE writer) and the engine requests behind one HTTP request.

A streamed answer is a :class:`ChunkStream`: an async iterator of typed chunk models (the
protocol's stream responses), whose iteration raises an
:class:`~kvfleet.runtime.entrypoints.openai.errors.APIError` for a failure once streaming. The
serving layers produce and translate these typed chunks; only this module writes them as SSE
(:func:`sse_response`): one ``data: {json}\\n\\n`` per chunk, ending with ``data: [DONE]\\n\\n``; a
failure mid-stream is an ``{"error": ...}`` event, then ``[DONE]``. APIs with named events (the
Responses and Messages APIs) write them with :func:`sse_event`. :class:`Submission` owns the engine requests of one
HTTP request: a client that disconnects (streaming or not) has every unfinished one aborted at once,
and whatever ends the HTTP request aborts the rest. :func:`merge` interleaves several output streams.
A request's ``x-kvfleet-kv-peer`` hint reaches the engine only with the router's valid signature
(:mod:`~kvfleet.runtime.kv_transfer.fleet_auth`); any other is ignored and counted.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import anyio
from fastapi import Request
from fastapi.responses import StreamingResponse

from kvfleet.runtime.engine.outputs import RequestOutput
from kvfleet.runtime.engine.protocol import EngineClient
from kvfleet.runtime.entrypoints.openai import protocol as P
from kvfleet.runtime.entrypoints.openai.errors import APIError
from kvfleet.runtime.kv_transfer.fleet_auth import HINT_SIGNATURE_HEADER
from kvfleet.runtime.kv_transfer.peer_pull import PEER_HEADER as KV_PEER_HEADER
from kvfleet.runtime.sampling_params import SamplingParams

logger = logging.getLogger("kvfleet.server")

SSE_DONE = "data: [DONE]\n\n"

C = TypeVar("C")


@dataclass
class ChunkStream(Generic[C]):
    """A streamed answer as typed chunks: iterate it for the protocol's chunk models (router-only
    :class:`~.protocol.TokenIdsChunk` s come only with ``kvfleet_token_ids``). A failure once
    streaming is an :class:`APIError` raised by the iteration; one that comes before the first
    output is raised by the call that returned this stream. Iterate it to its end or close it
    (``aclose``): that releases its engine requests."""

    chunks: AsyncIterator[C]
    prompt_tokens: int
    """The prompt tokens of the request (every prompt's), known before the first chunk."""
    include_usage: bool
    """Whether the request asked for usage (``stream_options.include_usage``): the last chunk has
    it, and on the wire every chunk has a ``usage`` key (null but on the last)."""

    def __aiter__(self) -> AsyncIterator[C]:
        return self.chunks

    async def aclose(self) -> None:
        await self.chunks.aclose()  # type: ignore[attr-defined]


def sse_chunk(chunk: P.CompletionStreamResponse | P.ChatCompletionStreamResponse | P.TokenIdsChunk,
              include_usage: bool) -> str:
    """One chunk as an event: with ``include_usage`` every chunk has a ``usage`` key (null but on
    the last, choice-less chunk), without it none has; a choice's ``kvfleet_token_ids`` (the
    router's, excluded from the model's own dump) are added to it when set."""
    if isinstance(chunk, P.TokenIdsChunk):
        return f"data: {chunk.model_dump_json()}\n\n"
    exclude = None if include_usage else {"usage"}
    if all(c.kvfleet_token_ids is None for c in chunk.choices):
        return f"data: {chunk.model_dump_json(exclude=exclude)}\n\n"
    data = chunk.model_dump(mode="json", exclude=exclude)
    for choice, model in zip(data["choices"], chunk.choices, strict=True):
        if model.kvfleet_token_ids is not None:
            choice["kvfleet_token_ids"] = model.kvfleet_token_ids
    return f"data: {json.dumps(data)}\n\n"


def sse_error(body: P.ErrorResponse) -> str:
    return f"data: {body.model_dump_json()}\n\n"


def sse_event(kind: str, data: dict[str, Any], *, ensure_ascii: bool = True) -> str:
    """A named event (``event: kind``) whose data is ``data`` as JSON (the Responses and Messages APIs)."""
    return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=ensure_ascii)}\n\n"


async def sse_frames(stream: ChunkStream) -> AsyncIterator[str]:
    """The SSE frames of ``stream``: its chunks, ``[DONE]``; a failure is an error event and ``[DONE]``."""
    async with aclosing(stream.chunks) as chunks:  # type: ignore[type-var]
        try:
            async for chunk in chunks:
                yield sse_chunk(chunk, stream.include_usage)
        except APIError as exc:
            yield sse_error(exc.body)
        yield SSE_DONE


def sse_response(stream: ChunkStream) -> StreamingResponse:
    """``stream`` as a ``text/event-stream`` response."""
    return streaming_events(sse_frames(stream))


def streaming_events(frames: AsyncIterator[str], headers: dict[str, str] | None = None) -> StreamingResponse:
    """SSE ``frames`` (written by this module's functions) as a ``text/event-stream`` response."""
    headers = {"Cache-Control": "no-cache", **(headers or {})}
    return StreamingResponse(frames, media_type="text/event-stream", headers=headers)


class AdmittedCount(Protocol):
    """Where the server counts the engine sequences of its live submissions (its ``ServerState``)."""

    admitted: int


_BACKGROUND: set[asyncio.Task] = set()
"""Strong references to fire-and-forget tasks (asyncio keeps only weak ones)."""


class Submission:
    """The engine requests of one HTTP request: tracks which finished, aborts the rest, and
    watches the client connection (a disconnect aborts at once). Its ``num_seqs`` engine
    sequences count in ``state.admitted`` from now until it is closed or the client left."""

    def __init__(self, state: AdmittedCount, engine: EngineClient, http_request: Request, num_seqs: int):
        self.state = state
        self.engine = engine
        self.http_request = http_request
        self.request_ids: list[str] = []
        self.finished: set[str] = set()
        self._watcher: asyncio.Task | None = None
        self.disconnected = False
        self._admitted = num_seqs
        state.admitted += num_seqs
        self.lora_name: str | None = None
        """The LoRA adapter the request names (None: the base model)."""
        self._peer: tuple[str | None] | None = None

    def _kv_peer(self) -> str | None:
        """The router's peer hint when its signature verifies (docs/routing.md, "Peer KV pull");
        any other hint is ignored, logged and counted by reason (once per HTTP request)."""
        if self._peer is None:
            peer = self.http_request.headers.get(KV_PEER_HEADER) or None
            if peer is not None:
                keys = getattr(self.engine, "fleet_keys", None)
                reason = "no_secret" if keys is None else keys.check_hint(
                    peer, self.http_request.headers.get(HINT_SIGNATURE_HEADER))
                if reason is not None:
                    logger.warning("ignored a KV peer hint naming %r (%s): hints are the router's only", peer, reason)
                    stat_logger = getattr(self.state, "stat_logger", None)
                    if stat_logger is not None:
                        stat_logger.count_refused_hint(reason)
                    peer = None
            self._peer = (peer,)
        return self._peer[0]

    def release(self) -> None:
        """Stop counting this submission's sequences as admitted (idempotent)."""
        self.state.admitted -= self._admitted
        self._admitted = 0

    def watch_disconnect(self) -> None:
        async def watch() -> None:
            try:
                while True:
                    message = await self.http_request.receive()
                    if message["type"] == "http.disconnect":
                        break
            except Exception:  # the transport is gone either way
                pass
            self.disconnected = True
            logger.info("client disconnected: aborting %s", ", ".join(self.unfinished()) or "nothing")
            self.release()  # also when the response never starts (and so never closes this)
            await self.abort_unfinished()

        self._watcher = asyncio.create_task(watch())

    def unfinished(self) -> list[str]:
        return [r for r in self.request_ids if r not in self.finished]

    async def abort_unfinished(self) -> None:
        """Abort every unfinished engine request.

        The aborts run in their own task, so that cancelling the caller (Starlette cancels a
        streaming response whose client left) can neither interrupt them nor cancel the
        engine-side call half-way."""
        ids = self.unfinished()
        self.finished.update(ids)
        if not ids:
            return
        task = asyncio.ensure_future(self._abort(ids))
        _BACKGROUND.add(task)
        task.add_done_callback(_BACKGROUND.discard)
        with anyio.CancelScope(shield=True):
            await asyncio.shield(task)

    async def _abort(self, ids: list[str]) -> None:
        for rid in ids:
            try:
                await self.engine.abort(rid)
            except Exception:
                logger.exception("abort of %s failed", rid)

    async def close(self) -> None:
        if self._watcher is not None and not self.disconnected:
            self._watcher.cancel()
        self._watcher = None
        self.release()
        await self.abort_unfinished()

    def stream(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str, *, priority: int, tenant: str | None,
        resume: list[list[int]] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """The engine's cumulative outputs of one prompt (``resume``: its choices' resumed output
        token ids); marks the request finished."""
        self.request_ids.append(request_id)
        return self._stream(prompt_ids, params, request_id, priority=priority, tenant=tenant, resume=resume)

    async def _stream(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str, *, priority: int, tenant: str | None,
        resume: list[list[int]] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        started = False
        extra: dict = {"lora_name": self.lora_name} if self.lora_name else {}
        if resume is not None:
            extra["resume_output_ids"] = resume
        peer = self._kv_peer()
        if peer:  # the router's hint: a replica that caches this prompt's prefix (docs/routing.md)
            extra["kv_peer"] = peer
        try:
            async with aclosing(
                self.engine.generate(prompt_ids, params, request_id, priority=priority, tenant=tenant, **extra)
            ) as outputs:
                async for out in outputs:
                    started = True
                    if out.finished:
                        self.finished.add(request_id)
                    yield out
            self.finished.add(request_id)
        except ValueError:
            if not started:  # rejected before it was queued (e.g. its id is in use): not ours to abort
                self.finished.add(request_id)
            raise


async def merge(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several output streams as ``(stream index, output)``, in arrival order."""
    if len(streams) == 1:
        try:
            async for out in streams[0]:
                yield 0, out
        finally:
            await streams[0].aclose()  # type: ignore[attr-defined]
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, s: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in s:
                await queue.put((i, out))
            await queue.put((i, done))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # re-raised by the consumer
            await queue.put((i, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
