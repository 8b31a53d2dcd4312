"""Mid-stream migration: a streamed generation that survives its replica (docs/routing.md, "Migration").

A streamed ``/v1/completions`` or ``/v1/chat/completions`` request goes to its replica with
``kvfleet_token_ids: true``: every chunk's choice carries the delta's token ids
(``kvfleet_token_ids``), and tokens whose text the replica still holds back come in router-only
chunks (``object: kvfleet.token_ids``). :class:`MigratingStream` reads the SSE events, records
per choice the token ids whose text the client has received (*committed*), strips the router-only
fields, and forwards each event. When the upstream breaks -- a transport error, the stream ending
without ``[DONE]``, or the replica's ``kvfleet_resume_elsewhere`` error event (a drain hand-off)
-- it re-submits the same body to another ready replica with ``kvfleet_resume.output_token_ids``
set to the committed ids of each choice, and continues: the client sees one stream with the
first replica's ``id`` and ``created``, the same choice indexes, the role chunk once, the new
replica's ``finish_reason``, and ``usage.completion_tokens`` counted once (the resumed replica
counts only its own tokens; the router adds the delivered ones). At most ``max_migrations``
migrations per request; a request that cannot migrate (tool-call parsing, the bound reached, no
replica within the pending timeout, the new replica refused) ends with an SSE error event naming
why, then ``[DONE]`` -- never a silent cut.
"""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx

from kvfleet.runtime.http.errors import error_event

logger = logging.getLogger("kvfleet.router")

MIGRATABLE_PATHS = ("/v1/completions", "/v1/chat/completions")
RESUME_ELSEWHERE = "kvfleet_resume_elsewhere"
"""The ``code`` of the error event a draining replica ends a stream with (resume it elsewhere)."""


def wants_migration(path: str, body: object) -> bool:
    """Whether a request is a stream this router can migrate (JSON object, ``stream: true``)."""
    return path in MIGRATABLE_PATHS and isinstance(body, dict) and body.get("stream") is True


def upstream_body(body: dict) -> dict:
    """The body sent to replicas: the client's, asking for token ids."""
    return {**body, "kvfleet_token_ids": True}


def why_not_migratable(body: dict) -> str | None:
    """Why a stream cannot be resumed on another replica (None: it can)."""
    if body.get("tools") and body.get("tool_choice") != "none":
        return "tool-call streams are parsed on the replica and cannot resume elsewhere"
    if body.get("prompt_logprobs") is not None:
        return "prompt_logprobs streams cannot resume elsewhere"
    return None


class StreamBroken(Exception):
    """The upstream stream ended before ``[DONE]`` (``reason``: a ``migrations_total`` label)."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


class MigratingStream:
    """The client's SSE body of one migratable stream, across replicas.

    Args:
        body: the client's JSON body.
        first: the first replica's streaming response (status 200).
        reopen: ``(body, reason) -> response or error message``: send a resumed body to another
            ready replica (the failed one excluded), or say why none could take it.
        max_migrations: the bound per request.
        on_migrated: ``(reason, tokens) -> None`` for the metrics.
    """

    def __init__(self, body: dict, first: httpx.Response,
                 reopen: Callable[[dict, str], Awaitable[httpx.Response | str]], max_migrations: int,
                 on_migrated: Callable[[str, int], None]):
        self.body = body
        self.upstream = first
        self.reopen = reopen
        self.max_migrations = max_migrations
        self.on_migrated = on_migrated
        n = body.get("n") or 1
        prompts = body.get("prompt")
        num_prompts = len(prompts) if isinstance(prompts, list) and prompts and not isinstance(prompts[0], int) else 1
        self.num_choices = n * num_prompts
        self.committed: list[list[int]] = [[] for _ in range(self.num_choices)]
        self.held: list[list[int]] = [[] for _ in range(self.num_choices)]
        self.done: set[int] = set()
        self.identity: tuple[str, int] | None = None  # the first replica's (id, created)
        self.migrations = 0
        self.resumed_tokens = 0  # delivered before the current replica started (added to usage)
        self.failed: str | None = None  # why the stream ended with a migration_failed event

    async def events(self) -> AsyncIterator[bytes]:
        """The SSE bytes the client receives."""
        while True:
            try:
                async for event in self._read(self.upstream):
                    yield event
                return
            except StreamBroken as broken:
                await self.upstream.aclose()
                error = await self._migrate(broken)
                if error is not None:
                    self.failed = error
                    yield _error_event(error)
                    yield b"data: [DONE]\n\n"
                    return

    async def aclose(self) -> None:
        await self.upstream.aclose()

    async def _read(self, upstream: httpx.Response) -> AsyncIterator[bytes]:
        buffer = ""
        try:
            async for text in upstream.aiter_text():
                buffer += text
                while "\n\n" in buffer:
                    raw, buffer = buffer.split("\n\n", 1)
                    out = self._event(raw)
                    if out is _DONE:
                        yield b"data: [DONE]\n\n"
                        return
                    if out:
                        yield out
        except httpx.HTTPError as exc:
            raise StreamBroken("upstream_error", f"{type(exc).__name__}: {exc}") from None
        raise StreamBroken("upstream_closed", "the replica closed the stream before [DONE]")

    def _event(self, raw: str) -> bytes | object | None:
        """One SSE event: its bytes for the client, ``_DONE``, or None (router-only)."""
        data = "".join(line[5:].lstrip() for line in raw.splitlines() if line.startswith("data:"))
        if data == "[DONE]":
            return _DONE
        try:
            chunk = json.loads(data)
        except ValueError:
            return (raw + "\n\n").encode()
        if isinstance(chunk.get("error"), dict):
            if chunk["error"].get("code") == RESUME_ELSEWHERE:
                raise StreamBroken("drain", chunk["error"].get("message", "the replica is draining"))
            return (raw + "\n\n").encode()
        if chunk.get("object") == "kvfleet.token_ids":
            for choice in chunk.get("choices", []):
                self.held[choice["index"]].extend(choice.get("kvfleet_token_ids", []))
            return None
        if self.identity is None:
            self.identity = (chunk.get("id"), chunk.get("created"))
        else:
            chunk["id"], chunk["created"] = self.identity
        keep = []
        for choice in chunk.get("choices", []):
            idx = choice.get("index", 0)
            ids = choice.pop("kvfleet_token_ids", None)
            if ids is not None:
                self.committed[idx].extend(self.held[idx] + ids)
                self.held[idx] = []
            if self.migrations and _is_role_only(choice):
                continue  # the resumed replica's opening chunk: the client has it
            if idx in self.done:
                continue
            if choice.get("finish_reason") is not None:
                self.done.add(idx)
            keep.append(choice)
        if chunk.get("choices") and not keep:
            return None
        chunk["choices"] = keep
        usage = chunk.get("usage")
        if isinstance(usage, dict) and self.resumed_tokens:
            usage["completion_tokens"] = usage.get("completion_tokens", 0) + self.resumed_tokens
            usage["total_tokens"] = usage.get("prompt_tokens", 0) + usage["completion_tokens"]
        return f"data: {json.dumps(chunk)}\n\n".encode()

    async def _migrate(self, broken: StreamBroken) -> str | None:
        """Re-submit to another replica; None when a new upstream is open, else why not."""
        why = why_not_migratable(self.body)
        if why is None and self.migrations >= self.max_migrations:
            why = f"the stream broke {self.migrations + 1} times (--max-migrations {self.max_migrations})"
        if why is not None:
            return f"the replica's stream broke ({broken}) and {why}"
        ids = [list(c) if i not in self.done else c[:-1] for i, c in enumerate(self.committed)]
        # the resumed replica too must send token ids: for a later migration, and for its drain
        # hand-off (a replica hands off only the streams that asked for them)
        body = upstream_body(copy.deepcopy(self.body))
        body["kvfleet_resume"] = {"output_token_ids": ids}
        if body.get("echo"):
            body["echo"] = False  # the client has the prompt's echo already
        logger.warning("stream broke (%s: %s): migrating with %d delivered tokens", broken.reason, broken,
                       sum(len(c) for c in ids))
        answer = await self.reopen(body, broken.reason)
        if isinstance(answer, str):
            return f"the replica's stream broke ({broken}) and could not migrate: {answer}"
        self.migrations += 1
        self.held = [[] for _ in range(self.num_choices)]
        self.resumed_tokens = sum(len(c) for c in ids)  # the new replica counts only what follows
        self.on_migrated(broken.reason, self.resumed_tokens)
        self.upstream = answer
        return None


_DONE = object()


def _is_role_only(choice: dict) -> bool:
    delta = choice.get("delta")
    return (isinstance(delta, dict) and "role" in delta and not delta.get("content")
            and not delta.get("tool_calls") and choice.get("finish_reason") is None)


def _error_event(message: str) -> bytes:
    return error_event(message, "server_error", code="migration_failed")
