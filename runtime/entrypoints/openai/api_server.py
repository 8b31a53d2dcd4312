"""The OpenAI-compatible HTTP server (``kvfleet serve``): FastAPI on uvicorn.

Routes
------
``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
``GET /v1/models/{model}`` (every ``GET`` route also answers ``HEAD``: headers, no body)
    OpenAI's API (see :mod:`kvfleet.runtime.entrypoints.openai.protocol`), JSON or Server-Sent Events
    (``stream: true``: ``text/event-stream``, one ``data: {json}\\n\\n`` per chunk, ending
    with ``data: [DONE]\\n\\n``).
``POST /reset_prefix_cache``
    Drop every unreferenced cached KV block (vLLM's admin route).
``GET /health`` (and ``HEAD``)
    200 while the engine loop is alive (also while the model loads); 503 once it died or
    the model failed to load: a liveness probe.
``GET /ready`` (and ``HEAD``)
    200 when requests can be served, 503 while the model loads or after the engine died:
    a readiness probe.
``GET /metrics``
    Prometheus text exposition (:mod:`kvfleet.runtime.metrics`), one registry per app.

With an API key, ``/v1/*`` and ``/reset_prefix_cache`` need ``Authorization: Bearer <key>``
(401 otherwise); ``/health``, ``/ready`` and ``/metrics`` stay open.

Errors always have OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``:
400 for any malformed or invalid request (bad JSON, non-UTF-8 body, wrong types, values out
of range, prompt + max_tokens beyond max_model_len, unsupported features), 401 bad API key,
404 unknown model or route, 413 body over ``max_request_body_size``, 429 queue full
(``max_queue_len``), 503 model loading or engine dead, 500 only for server faults.

The event loop never tokenizes: prompts are tokenized (and chat templates applied) on one
dedicated worker thread per app (HF fast tokenizers are not safe to call from several threads
at once), so ``/health`` answers while a long prompt is being tokenized. A prompt string
that is certainly longer than ``max_model_len`` tokens (its length in characters over the
tokenizer's longest token, :mod:`kvfleet.runtime.entrypoints.openai.tokenizer_bounds`) is rejected with a 400
before it is tokenized.

A client that disconnects (streaming or not) has its engine request(s) aborted at once:
the engine frees their KV blocks and counts them as ``finished_reason="abort"``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import secrets
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvfleet.runtime.entrypoints.openai import protocol as P
from kvfleet.runtime.config import EngineConfig
from kvfleet.runtime.metrics import CONTENT_TYPE, KVFLEET_PREFIX, VLLM_PREFIX, PrometheusStatLogger, exposition
from kvfleet.runtime.engine.outputs import CompletionOutput, Logprob, RequestOutput
from kvfleet.runtime.entrypoints.openai.serve_args import ServerSettings
from kvfleet.runtime.entrypoints.openai.tokenizer_bounds import PromptLengthBound, prompt_length_bound

logger = logging.getLogger("kvfleet.server")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
"""Served name of the embedded default model (matches the model loader's display name)."""
LOGPROB_FLOOR = -9999.0
"""-inf / NaN log-probabilities are reported as this (JSON has no infinities)."""


# ----------------------------------------------------------------------------- errors


class APIError(Exception):
    """An error answered in OpenAI's shape with HTTP ``status``."""

    _TYPES = {
        400: "invalid_request_error",
        401: "invalid_request_error",
        404: "invalid_request_error",
        405: "invalid_request_error",
        413: "invalid_request_error",
        429: "rate_limit_error",
        500: "internal_server_error",
        503: "service_unavailable",
    }

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.body = P.ErrorResponse(
            error=P.ErrorInfo(
                message=message,
                type=type or self._TYPES.get(status, "invalid_request_error" if status < 500 else "server_error"),
                param=param,
                code=code,
            )
        )
        self.headers = headers

    def response(self) -> JSONResponse:
        return JSONResponse(self.body.model_dump(), status_code=self.status, headers=self.headers)


def _bad_request(exc: P.ProtocolError) -> APIError:
    return APIError(400, str(exc), param=exc.param, code=exc.code or "invalid_value")


def _validation_error(exc: ValidationError | RequestValidationError) -> APIError:
    """A pydantic/FastAPI validation error as a 400 naming the first offending field."""
    errors = exc.errors()
    parts, params = [], []
    for err in errors:
        loc = [str(x) for x in err.get("loc", ()) if x not in ("body",)]
        # union members show up as extra loc items like "str" or "list[int]"; keep field names.
        loc = [x for x in loc if not any(c in x for c in "[]") and x not in ("str", "int", "float", "bool")]
        name = ".".join(loc)
        if name not in params:
            params.append(name)
            parts.append(f"{name}: {err.get('msg')}" if name else str(err.get("msg")))
    return APIError(400, "; ".join(parts) or "invalid request", param=params[0] if params else None, code="invalid_type")


# ----------------------------------------------------------------------------- state


@dataclass
class ServerState:
    """Everything one app instance holds (``app.state.kvfleet``)."""

    config: EngineConfig
    settings: ServerSettings
    model_name: str
    stat_logger: PrometheusStatLogger
    engine: Any = None
    """The AsyncLLMEngine once loaded and started; None while loading."""
    load_error: BaseException | None = None
    pending: int = 0
    """Engine sequences submitted by this server that have not produced output yet."""
    on_fatal: Callable[[], None] | None = None
    """Called when the model fails to load (``main`` makes uvicorn exit)."""
    started_at: float = field(default_factory=time.time)
    prompt_bound: PromptLengthBound | None = None
    """Lower bound on a prompt's tokens from its length, set at load (None: the tokenizer
    gives none, prompts are just tokenized)."""
    tokenizer_pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvfleet-tokenizer")
    )
    """The one thread that tokenizes prompts and applies chat templates (never the event loop)."""

    @property
    def loading(self) -> bool:
        return self.engine is None and self.load_error is None

    def engine_dead(self) -> bool:
        if self.load_error is not None:
            return True
        e = self.engine
        return e is not None and (bool(getattr(e, "errored", False)) or not getattr(e, "is_running", True))

    def require_engine(self):
        if self.engine_dead():
            raise APIError(503, "the engine is not running", code="engine_dead")
        if self.engine is None:
            raise APIError(503, "the model is loading; retry later", code="model_loading", headers={"Retry-After": "5"})
        return self.engine


def served_name(config: EngineConfig) -> str:
    """The name clients put in ``model``: ``served_model_name``, else the model's display
    name (the default model's name, a GGUF file's stem, a checkpoint folder's name, a hub id)."""
    if config.served_model_name:
        return config.served_model_name
    if config.model is None:
        return DEFAULT_MODEL_NAME
    path = Path(config.model).expanduser()
    if path.suffix == ".gguf":
        return path.stem
    if path.is_dir():
        return path.resolve().name
    return config.model


def _default_engine_factory(config: EngineConfig, stat_loggers: list) -> Any:
    from kvfleet.runtime.engine.async_llm import AsyncLLMEngine

    return AsyncLLMEngine(config, stat_loggers=stat_loggers)


# ----------------------------------------------------------------------------- per-request plumbing


_BACKGROUND: set[asyncio.Task] = set()
"""Strong references to fire-and-forget tasks (asyncio keeps only weak ones)."""


class _Submission:
    """The engine requests of one HTTP request: tracks which finished, aborts the rest, and
    watches the client connection (a disconnect aborts at once)."""

    def __init__(self, state: ServerState, http_request: Request):
        self.state = state
        self.engine = state.engine
        self.http_request = http_request
        self.request_ids: list[str] = []
        self.finished: set[str] = set()
        self._watcher: asyncio.Task | None = None
        self.disconnected = False

    def watch_disconnect(self) -> None:
        async def watch() -> None:
            try:
                while True:
                    message = await self.http_request.receive()
                    if message["type"] == "http.disconnect":
                        break
            except Exception:  # noqa: BLE001 - the transport is gone either way
                pass
            self.disconnected = True
            logger.info("client disconnected: aborting %s", ", ".join(self.unfinished()) or "nothing")
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
            except Exception:  # noqa: BLE001
                logger.exception("abort of %s failed", rid)

    async def close(self) -> None:
        if self._watcher is not None and not self.disconnected:
            self._watcher.cancel()
        self._watcher = None
        await self.abort_unfinished()

    def stream(self, prompt_ids: list[int], params, request_id: str, *, priority: int, tenant: str | None):
        """The engine's cumulative outputs of one prompt; marks the request finished and keeps
        the server's pending count (queue back-pressure) up to date."""
        self.request_ids.append(request_id)
        return self._stream(prompt_ids, params, request_id, priority=priority, tenant=tenant)

    async def _stream(self, prompt_ids, params, request_id, *, priority, tenant) -> AsyncIterator[RequestOutput]:
        state = self.state
        n = params.n
        state.pending += n
        counted = True
        try:
            async with aclosing(
                self.engine.generate(prompt_ids, params, request_id, priority=priority, tenant=tenant)
            ) as outputs:
                async for out in outputs:
                    if counted:
                        state.pending -= n
                        counted = False
                    if out.finished:
                        self.finished.add(request_id)
                    yield out
            self.finished.add(request_id)
        except ValueError:
            if counted:  # rejected before it was queued (e.g. its id is in use): not ours to abort
                self.finished.add(request_id)
            raise
        finally:
            if counted:
                state.pending -= n


async def _merge(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several output streams as ``(stream index, output)``, in arrival order."""
    if len(streams) == 1:
        try:
            async for out in streams[0]:
                yield 0, out
        finally:
            await streams[0].aclose()
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
        except BaseException as exc:  # noqa: BLE001 - re-raised by the consumer
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


class GenerationError(RuntimeError):
    """The engine finished a request with an internal error (``RequestOutput.extra["error"]``)."""


def _raise_for_error(out: RequestOutput) -> None:
    error = (out.extra or {}).get("error")
    if error:
        raise GenerationError(f"request {out.request_id} failed in the engine: {error}")


def _finite(x: float | None) -> float:
    if x is None or math.isnan(x):
        return LOGPROB_FLOOR
    return max(float(x), LOGPROB_FLOOR)


class _Detok:
    """Token strings for logprobs: the engine's ``decoded_token`` or the tokenizer's."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __call__(self, token_id: int, lp: Logprob | None) -> str:
        if lp is not None and lp.decoded_token is not None:
            return lp.decoded_token
        return self.tokenizer.decode([token_id])


def _legacy_top(entries: dict[int, Logprob], tid: int, k: int, detok: _Detok) -> dict[str, float]:
    """One position's legacy ``top_logprobs``: token text -> logprob (-inf as -9999.0) of the
    entries of rank <= ``k``, by rank, plus token ``tid`` (the sampled or prompt token) always,
    as vLLM; texts that decode alike keep the better-ranked entry."""
    top: dict[str, float] = {}
    for tok_id, lp in sorted(entries.items(), key=lambda kv: kv[1].rank or 0):
        if tok_id == tid or lp.rank is None or lp.rank <= k:
            top.setdefault(detok(tok_id, lp), _finite(lp.logprob))
    return top


def _completion_logprobs(
    c: CompletionOutput, start: int, end: int, k: int, detok: _Detok, offset: int
) -> tuple[P.CompletionLogProbs, int]:
    """Legacy logprobs of output tokens ``[start, end)``; returns them and the next text offset."""
    out = P.CompletionLogProbs()
    for j in range(start, end):
        tid = c.token_ids[j]
        entries = (c.logprobs[j] if c.logprobs is not None and j < len(c.logprobs) else None) or {}
        sampled = entries.get(tid)
        token = detok(tid, sampled)
        out.tokens.append(token)
        out.token_logprobs.append(_finite(sampled.logprob) if sampled is not None else None)
        out.top_logprobs.append(_legacy_top(entries, tid, k, detok))
        out.text_offset.append(offset)
        offset += len(token)
    return out, offset


def _echo_logprobs(
    prompt_ids: list[int], prompt_logprobs: list[dict[int, Logprob] | None] | None, k: int, detok: _Detok
) -> tuple[P.CompletionLogProbs, int]:
    """Legacy logprobs of the prompt tokens (``echo``), as vLLM: a position without an entry
    (the first) has token_logprobs and top_logprobs None; returns them and the next text offset."""
    out = P.CompletionLogProbs()
    offset = 0
    for j, tid in enumerate(prompt_ids):
        entries = prompt_logprobs[j] if prompt_logprobs is not None and j < len(prompt_logprobs) else None
        if entries is None:
            token = detok(tid, None)
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
        else:
            actual = entries.get(tid)
            token = detok(tid, actual)
            out.token_logprobs.append(_finite(actual.logprob) if actual is not None else None)
            out.top_logprobs.append(_legacy_top(entries, tid, k, detok))
        out.tokens.append(token)
        out.text_offset.append(offset)
        offset += len(token)
    return out, offset


def _join_logprobs(a: P.CompletionLogProbs, b: P.CompletionLogProbs) -> P.CompletionLogProbs:
    return P.CompletionLogProbs(
        text_offset=a.text_offset + b.text_offset,
        token_logprobs=a.token_logprobs + b.token_logprobs,
        tokens=a.tokens + b.tokens,
        top_logprobs=a.top_logprobs + b.top_logprobs,
    )


def _prompt_logprobs_body(
    plp: list[dict[int, Logprob] | None] | None, prompt_ids: list[int] | None = None, k: int | None = None
) -> P.PromptLogprobs | None:
    """vLLM's ``prompt_logprobs`` for a response body (-inf clamped to -9999.0, as vLLM).

    With ``prompt_ids`` and ``k``: only the prompt token and the entries of rank <= ``k`` (the
    engine scored more for ``echo`` + a larger ``logprobs``)."""
    if plp is None:
        return None
    return [
        None if entries is None else {
            tid: P.PromptLogprob(logprob=_finite(lp.logprob), rank=lp.rank, decoded_token=lp.decoded_token)
            for tid, lp in entries.items()
            if k is None or prompt_ids is None or tid == prompt_ids[j] or lp.rank is None or lp.rank <= k
        }
        for j, entries in enumerate(plp)
    ]  # fmt: skip


def _chat_logprobs(c: CompletionOutput, start: int, end: int, k: int, detok: _Detok) -> P.ChatChoiceLogprobs:
    content = []
    for j in range(start, end):
        tid = c.token_ids[j]
        entries = (c.logprobs[j] if c.logprobs is not None and j < len(c.logprobs) else None) or {}
        sampled = entries.get(tid)
        token = detok(tid, sampled)
        top = []
        ranked = sorted(((lp.rank, tok_id, lp) for tok_id, lp in entries.items() if lp.rank is not None), key=lambda t: t[0])
        for rank, tok_id, lp in ranked:
            if rank <= k:
                s = detok(tok_id, lp)
                top.append(P.TopLogprob(token=s, logprob=_finite(lp.logprob), bytes=list(s.encode("utf-8"))))
        content.append(
            P.ChatTokenLogprob(
                token=token,
                logprob=_finite(sampled.logprob if sampled is not None else None),
                bytes=list(token.encode("utf-8")),
                top_logprobs=top[:k],
            )
        )
    return P.ChatChoiceLogprobs(content=content)


def _body_response(resp: P.CompletionResponse | P.ChatCompletionResponse) -> Response:
    """``resp`` as an ``application/json`` response, its choices encoded one at a time.

    Called on a worker thread for big bodies: pydantic's encoder holds the GIL for a whole
    call, so one call over a 117 MB body (echo + logprobs 20, n 16) starved the event loop for
    seconds; one call per choice holds it for a fraction of that. The bytes equal
    ``resp.model_dump_json()`` (compact, UTF-8, OpenAI's field order)."""
    head = resp.model_copy(update={"choices": []}).model_dump_json()
    marker = '"choices":[]'  # the key itself: inside a JSON string its quotes would be escaped
    at = head.index(marker) + len(marker) - 1
    body = head[:at] + ",".join(c.model_dump_json() for c in resp.choices) + head[at:]
    return Response(body.encode("utf-8"), media_type="application/json")


def _sse(payload: dict | str) -> str:
    if isinstance(payload, str):
        return f"data: {payload}\n\n"
    return "data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")) + "\n\n"


# ----------------------------------------------------------------------------- the app


def create_app(
    engine_config: EngineConfig | None = None,
    settings: ServerSettings | None = None,
    *,
    engine_factory: Callable[[EngineConfig, list], Any] | None = None,
) -> FastAPI:
    """Build the FastAPI app; the engine is created on startup.

    Args:
        engine_config: engine options (default: ``EngineConfig()``).
        settings: server options (API key, queue limit, metrics naming; host/port are
            ``main``'s business).
        engine_factory: ``(config, stat_loggers) -> engine`` with AsyncLLMEngine's
            interface; default constructs :class:`kvfleet.runtime.engine.async_llm.AsyncLLMEngine`.
            It runs in a worker thread (model loading blocks), so ``/ready`` answers 503
            meanwhile; then ``await engine.start()``.

    Returns: the app; its :class:`ServerState` is ``app.state.kvfleet``.
    """
    config = engine_config or EngineConfig()
    settings = settings or ServerSettings()
    factory = engine_factory or _default_engine_factory
    name = served_name(config)
    prefixes = (KVFLEET_PREFIX, VLLM_PREFIX) if settings.metrics_compat == "vllm" else (KVFLEET_PREFIX,)
    from prometheus_client import CollectorRegistry

    stat_logger = PrometheusStatLogger(name, registry=CollectorRegistry(), prefixes=prefixes)
    state = ServerState(config=config, settings=settings, model_name=name, stat_logger=stat_logger)

    async def load() -> None:
        try:
            t0 = time.monotonic()
            engine = await asyncio.to_thread(factory, config, [stat_logger])
            info = None
            core = getattr(engine, "engine", None)
            if core is not None and hasattr(core, "cache_config_info"):
                info = core.cache_config_info()
            stat_logger.log_engine_initialized(engine.max_model_len, info)
            try:
                state.prompt_bound = await asyncio.to_thread(prompt_length_bound, engine.tokenizer)
            except Exception:  # noqa: BLE001 - only a shortcut: without it prompts are just tokenized
                logger.warning("no prompt length bound for this tokenizer", exc_info=True)
            if state.prompt_bound is not None:
                logger.info("prompts longer than %d characters per token of max_model_len are rejected untokenized",
                            state.prompt_bound.chars_per_token)
            await engine.start()
            state.engine = engine
            logger.info("model %s ready in %.1f s (max_model_len %s)", name, time.monotonic() - t0, engine.max_model_len)
        except Exception as exc:  # noqa: BLE001 - reported by /health and the exit status
            state.load_error = exc
            # The reason on the ERROR line itself (a bad option such as a tensor_parallel_size that
            # does not divide the heads is a ValueError), the traceback after it.
            logger.exception("the engine failed to start: %s: %s", type(exc).__name__, exc)
            if state.on_fatal is not None:
                state.on_fatal()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        task = asyncio.create_task(load())
        try:
            yield
        finally:
            if not task.done():
                task.cancel()
            if state.engine is not None:
                try:
                    await state.engine.shutdown()
                except Exception:  # noqa: BLE001
                    logger.exception("engine shutdown failed")
            state.tokenizer_pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="kvfleet", version="0.1.0", lifespan=lifespan)
    app.state.kvfleet = state

    # -- error handlers: always OpenAI's shape, never 422 ------------------------------
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _request_validation(_: Request, exc: RequestValidationError):
        return _validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return APIError(exc.status_code, str(exc.detail), code=code, headers=getattr(exc, "headers", None)).response()

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception):
        logger.exception("internal error")
        return APIError(500, f"internal server error: {type(exc).__name__}", code="internal_error").response()

    # -- auth --------------------------------------------------------------------------
    async def check_api_key(request: Request) -> None:
        key = settings.api_key
        if not key:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), key.encode()):
            raise APIError(
                401,
                "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )

    auth = [Depends(check_api_key)]

    # -- probes and metrics ------------------------------------------------------------
    @app.api_route("/health", methods=["GET", "HEAD"])  # kubelets and load balancers send HEAD
    async def health():
        if state.engine_dead():
            return JSONResponse({"status": "dead", "error": repr(state.load_error or getattr(state.engine, "dead_error", None))}, status_code=503)
        return {"status": "loading" if state.loading else "ok"}

    @app.api_route("/ready", methods=["GET", "HEAD"])
    async def ready():
        if state.engine_dead():
            return JSONResponse({"status": "dead"}, status_code=503)
        if state.loading:
            return JSONResponse({"status": "loading"}, status_code=503)
        return {"status": "ready"}

    @app.api_route("/metrics", methods=["GET", "HEAD"])  # every GET route answers HEAD (RFC 9110, 9.1)
    async def metrics():
        _refresh_gauges(state)
        return Response(exposition(stat_logger.registry), media_type=CONTENT_TYPE)

    @app.post("/reset_prefix_cache", dependencies=auth)
    async def reset_prefix_cache():
        engine = state.require_engine()
        fn = getattr(engine, "reset_prefix_cache", None)
        if fn is not None:
            result = fn()
            if asyncio.iscoroutine(result):
                result = await result
        else:
            result = engine.engine.scheduler.reset_prefix_cache()
        return {"reset": bool(result) if result is not None else True}

    # -- OpenAI routes -----------------------------------------------------------------
    def model_card() -> P.ModelCard:
        return P.ModelCard(
            id=name,
            created=int(state.started_at),
            root=config.model or DEFAULT_MODEL_NAME,
            max_model_len=getattr(state.engine, "max_model_len", None),
        )

    @app.api_route("/v1/models", methods=["GET", "HEAD"], dependencies=auth)
    async def models():
        return P.ModelList(data=[model_card()]).model_dump()

    @app.api_route("/v1/models/{model_id:path}", methods=["GET", "HEAD"], dependencies=auth)  # ids may hold "/"
    async def retrieve_model(model_id: str):
        """OpenAI's "retrieve model" (``client.models.retrieve``); unknown id: 404 as OpenAI."""
        _check_model(state, model_id)
        return model_card().model_dump()

    @app.post("/v1/completions", dependencies=auth)
    async def completions(request: Request):
        body = await _parse_body(request, P.CompletionRequest, settings.max_request_body_size)
        return await _serve_completion(state, request, body)

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(request: Request):
        body = await _parse_body(request, P.ChatCompletionRequest, settings.max_request_body_size)
        return await _serve_chat(state, request, body)

    return app


def _refresh_gauges(state: ServerState) -> None:
    """Set the state gauges from the engine's live counts (so that an idle engine, which
    records no steps, still reports its current queue and KV usage)."""
    engine = state.engine
    if engine is None or state.engine_dead():
        return
    try:
        usage = None
        core = getattr(engine, "engine", None)
        scheduler = getattr(core, "scheduler", None)
        kv = getattr(scheduler, "kv_cache_manager", None)
        if kv is not None:
            usage = float(kv.usage)
        state.stat_logger.set_scheduler_state(int(engine.num_running), int(engine.num_waiting), usage)
    except Exception:  # noqa: BLE001 - metrics must never fail the scrape
        logger.debug("gauge refresh failed", exc_info=True)


async def _read_body(request: Request, limit: int) -> bytes:
    """The request body, at most ``limit`` bytes: a larger ``Content-Length`` is refused before
    anything is read, a body without one (chunked) as soon as its chunks pass the limit.

    Raises:
        APIError: 413 (code ``request_too_large``).
    """

    def too_large(size: str) -> APIError:
        return APIError(413, f"request body is {size} bytes, over the limit of {limit} bytes (max_request_body_size)",
                        code="request_too_large")  # fmt: skip

    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large(declared)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(f"more than {limit}")
        chunks.append(chunk)
    return b"".join(chunks)


async def _parse_body(request: Request, model: type[P._Request], limit: int):
    raw = await _read_body(request, limit)
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise APIError(400, f"request body is not valid UTF-8: {exc}", code="invalid_encoding") from None
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        if any(err.get("type") == "json_invalid" for err in exc.errors()):
            _explain_invalid_json(raw)  # raises the clearer error when there is one
        raise _validation_error(exc) from None


def _explain_invalid_json(raw: bytes) -> None:
    """Why pydantic's JSON parser refused ``raw``: not JSON at all (Python's parser says where),
    or JSON whose strings hold a lone surrogate escape (``"\\ud800"``), which is no Unicode
    text (it cannot be encoded as UTF-8) -- the error names the top-level field holding it."""
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # RecursionError: nesting deeper than the stack
        raise APIError(400, f"request body is not valid JSON: {exc}", code="invalid_json") from None
    for key, value in data.items() if isinstance(data, dict) else ():
        bad = _lone_surrogate(key)
        if bad is not None:  # never echoed back: it cannot be encoded in the answer either
            raise APIError(400, f"request body is not valid UTF-8 text: a field name contains a lone surrogate "
                                f"(\\u{ord(bad):04x})", code="invalid_encoding")  # fmt: skip
        bad = _lone_surrogate(value)
        if bad is not None:
            raise APIError(
                400,
                f"{key} is not valid UTF-8 text: it contains a lone surrogate (\\u{ord(bad):04x}) that is not part "
                "of a surrogate pair",
                param=str(key),
                code="invalid_encoding",
            )


def _lone_surrogate(value: Any) -> str | None:
    """The first lone surrogate in a parsed JSON value's strings (keys included), or None."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError as exc:
                return v[exc.start]
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return None


def _check_model(state: ServerState, requested: str | None) -> None:
    if requested is not None and requested != state.model_name:
        raise APIError(
            404,
            f"The model `{requested}` does not exist. Served model: `{state.model_name}`.",
            param="model",
            code="model_not_found",
        )


def _check_queue(state: ServerState, engine, n_new: int) -> None:
    limit = state.settings.max_queue_len
    if limit is None:
        return
    waiting = max(int(getattr(engine, "num_waiting", 0)), state.pending)
    if waiting >= limit:
        raise APIError(
            429,
            f"the server is overloaded: {waiting} requests are waiting (max_queue_len {limit}); retry later",
            code="queue_full",
            headers={"Retry-After": "1"},
        )


def _resolve_max_tokens(requested: int | None, prompt_len: int, max_model_len: int, param: str, prompt_param: str) -> int:
    if requested is not None and (isinstance(requested, bool) or requested < 1):
        raise APIError(400, f"{param} must be an integer >= 1, got {requested}", param=param, code="invalid_value")
    if requested is None:
        if prompt_len >= max_model_len:
            raise APIError(
                400,
                f"This model's maximum context length is {max_model_len} tokens. However, your prompt is "
                f"{prompt_len} tokens, leaving no room for output. Please reduce the length of the prompt.",
                param=prompt_param,
                code="context_length_exceeded",
            )
        return max_model_len - prompt_len
    if prompt_len + requested > max_model_len:
        raise APIError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} for the completion "
            f"({param})). Please reduce the length of the prompt or {param}.",
            param=param,
            code="context_length_exceeded",
        )
    return requested


def _check_prompt_bound(state: ServerState, text: str, max_model_len: int, param: str) -> None:
    """400 for a prompt text that is certainly longer than ``max_model_len`` tokens, from its
    length alone (:class:`~kvfleet.runtime.entrypoints.openai.tokenizer_bounds.PromptLengthBound`): no room for
    output is left, whatever ``max_tokens``."""
    bound = state.prompt_bound
    if bound is None or len(text) <= bound.chars_per_token * (max_model_len - 1):  # ceil(n / L) < max_model_len
        return
    at_least = bound.min_tokens(text)
    if at_least >= max_model_len:
        raise APIError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt is "
            f"{len(text)} characters long, which is at least {at_least} tokens (no token of this model is longer "
            f"than {bound.chars_per_token} characters), leaving no room for output. Please reduce the length of "
            "the prompt.",
            param=param,
            code="context_length_exceeded",
        )


async def _on_tokenizer_thread(state: ServerState, fn: Callable[[], Any]) -> Any:
    """``fn()`` on the app's tokenizer thread (one at a time, never on the event loop); its
    exceptions (APIError included) are raised here."""
    return await asyncio.get_running_loop().run_in_executor(state.tokenizer_pool, fn)


def _check_token_ids(ids: list[int], vocab_size: int) -> None:
    if ids and 0 <= min(ids) and max(ids) < vocab_size:  # C loops: ~0.1 s for 10M ids on the event loop
        return
    for t in ids:  # the first id out of range, for the message
        if t < 0 or t >= vocab_size:
            raise APIError(400, f"prompt token id {t} is out of range [0, {vocab_size})", param="prompt", code="invalid_value")


def _usage(prompt_lens: list[int], outputs: list[CompletionOutput]) -> P.UsageInfo:
    prompt = sum(prompt_lens)
    completion = sum(len(c.token_ids) for c in outputs)
    return P.UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


async def _start(state: ServerState, sub: "_Submission", streams: list[AsyncIterator[RequestOutput]]):
    """Merge a request's engine streams, abort them if the client disconnects, and wait for
    the first output. Returns ``(merged, first, has_first)``. The engine's input errors
    (ValueError) become 400s, a dead engine 503, anything else 500; on any error the
    streams are closed before it propagates."""
    merged = _merge(streams)
    sub.watch_disconnect()
    try:
        try:
            return merged, await merged.__anext__(), True
        except StopAsyncIteration:
            return merged, None, False
        except APIError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise _engine_failure(state, exc) from None
    except BaseException:
        await sub.close()
        await merged.aclose()
        raise


_REQUEST_FIELDS = frozenset(P.CompletionRequest.model_fields) | frozenset(P.ChatCompletionRequest.model_fields)


def _engine_failure(state: ServerState, exc: BaseException) -> APIError:
    if isinstance(exc, ValueError):  # the engine's messages start with the field they refuse
        first = str(exc).split(" ", 1)[0]
        return APIError(400, str(exc), param=first if first in _REQUEST_FIELDS else None, code="invalid_value")
    logger.error("generation failed: %r", exc, exc_info=exc)
    if state.engine_dead():
        return APIError(503, f"the engine died: {exc}", code="engine_dead")
    return APIError(500, f"generation failed: {type(exc).__name__}: {exc}", code="internal_error")


async def _stream_chunks(
    state: ServerState,
    sub: _Submission,
    merged: AsyncIterator,
    first: Any,
    *,
    request_id: str,
    object_name: str,
    created: int,
    include_usage: bool,
    prompt_lens: list[int],
    n: int,
    delta_choice: Callable[[int, str, Any], dict],
    finish_choice: Callable[[int, CompletionOutput], dict],
    logprobs: Callable[[CompletionOutput, int, int], Any] | None,
    opening: list[dict] | None = None,
    fingerprint_before_choices: bool = False,
    echo: Callable[[int, int, RequestOutput], tuple[str, Any]] | None = None,
    echo_only: bool = False,
) -> AsyncIterator[str]:
    """The SSE frames of a streaming completion or chat completion.

    Choice ``c`` of prompt ``i`` is index ``i * n + c.index``. Each new piece of a choice is one
    chunk of ``delta_choice(index, text, logprobs)`` and its end one of ``finish_choice(index, c)``;
    ``logprobs(c, index, first_new_token)`` (None: not requested) gives the new tokens' logprobs.
    ``opening`` choices are sent first, one chunk each. ``echo(prompt index, index, output)``
    (completions' ``echo``) gives ``(text, logprobs)`` of the prompt, sent as a choice's first
    chunk; with ``echo_only`` the completion's own tokens are not sent, only its end. Then the
    usage chunk (include_usage) and
    ``[DONE]``; a failure is an error event and ``[DONE]``. The streams are closed at the end,
    also when the client goes away."""

    def chunk(choices: list[dict], usage: P.UsageInfo | None = None) -> str:
        payload: dict[str, Any] = {"id": request_id, "object": object_name, "created": created, "model": state.model_name}
        if fingerprint_before_choices:
            payload["system_fingerprint"] = None
        payload["choices"] = choices
        if not fingerprint_before_choices:
            payload["system_fingerprint"] = None
        if include_usage:
            payload["usage"] = usage.model_dump() if usage is not None else None
        return _sse(payload)

    sent_text: dict[int, int] = {}
    sent_tokens: dict[int, int] = {}
    done: set[int] = set()
    last: dict[int, RequestOutput] = {}
    try:
        for choice in opening or []:
            yield chunk([choice])
        item = first
        while item is not None:
            i, out = item
            _raise_for_error(out)
            last[i] = out
            for c in out.outputs:
                idx = i * n + c.index
                if idx in done:
                    continue
                if echo is not None and idx not in sent_text:
                    text, lp = echo(i, idx, out)
                    yield chunk([delta_choice(idx, text, lp.model_dump() if lp else None)])
                    sent_text[idx] = sent_tokens[idx] = 0
                    await asyncio.sleep(0)  # a prompt's echo chunk can be MBs: let /health etc. in between
                t0, k0 = sent_text.get(idx, 0), sent_tokens.get(idx, 0)
                delta = c.text[t0:]
                lp = None
                if logprobs is not None and len(c.token_ids) > k0:
                    lp = logprobs(c, idx, k0)
                if (delta or lp is not None) and not echo_only:
                    yield chunk([delta_choice(idx, delta, lp.model_dump() if lp else None)])
                sent_text[idx], sent_tokens[idx] = len(c.text), len(c.token_ids)
                if c.finish_reason is not None:
                    done.add(idx)
                    yield chunk([finish_choice(idx, c)])
            try:
                item = await merged.__anext__()
            except StopAsyncIteration:
                item = None
        if include_usage:
            outs = [c for out in last.values() for c in out.outputs]
            yield chunk([], _usage(prompt_lens, outs))
        yield _sse("[DONE]")
    except Exception as exc:  # noqa: BLE001
        err = _engine_failure(state, exc)
        yield _sse(err.body.model_dump())
        yield _sse("[DONE]")
    finally:
        await sub.close()
        with anyio.CancelScope(shield=True):
            await merged.aclose()


async def _serve_completion(state: ServerState, request: Request, body: P.CompletionRequest):
    _check_model(state, body.model)
    try:
        body.check_supported()
        prompts = body.prompts()
    except P.ProtocolError as exc:
        raise _bad_request(exc) from None
    engine = state.require_engine()
    tokenizer = engine.tokenizer
    max_model_len = engine.max_model_len
    for p in prompts:
        if isinstance(p, str):
            _check_prompt_bound(state, p, max_model_len, "prompt")
        else:  # token ids: one that fills the context alone is refused before its ids are checked
            _resolve_max_tokens(None, len(p), max_model_len, "max_tokens", "prompt")
    texts = [p for p in prompts if isinstance(p, str)]
    encoded = iter(await _on_tokenizer_thread(state, lambda: [tokenizer.encode(t) for t in texts]) if texts else [])
    prompt_ids: list[list[int]] = []
    for p in prompts:
        ids = next(encoded) if isinstance(p, str) else list(p)
        if not isinstance(p, str):
            _check_token_ids(ids, int(getattr(getattr(engine, "engine", None), "vocab_size", 0) or len(tokenizer)))
        if not ids:
            raise APIError(400, "prompt must not be empty (it tokenizes to no tokens)", param="prompt", code="invalid_value")
        prompt_ids.append(ids)
    params = []
    echo_only = body.echo_only
    for ids in prompt_ids:
        # echo with max_tokens 0: the engine generates one token, which is not returned (vLLM).
        requested = 1 if echo_only else body.max_tokens
        max_tokens = _resolve_max_tokens(requested, len(ids), max_model_len, "max_tokens", "prompt")
        try:
            params.append(body.to_sampling_params(max_tokens))
        except P.ProtocolError as exc:
            raise _bad_request(exc) from None
    _check_queue(state, engine, body.n * len(prompts))

    request_id = P.random_id("cmpl") if not body.request_id else body.request_id
    created = P.now()
    n = body.n
    k = body.logprobs if body.logprobs is not None else -1
    detok = _Detok(tokenizer)
    # echo: the prompt as text (token-id prompts decoded, as vLLM does, on the tokenizer thread:
    # a 32 MiB body of id lists takes seconds to decode). Without echo nothing is decoded.
    prompt_texts: list[str] = []
    if body.echo:
        id_prompts = [ids for p, ids in zip(prompts, prompt_ids) if not isinstance(p, str)]
        decoded = iter(await _on_tokenizer_thread(state, lambda: [tokenizer.decode(x) for x in id_prompts])
                       if id_prompts else [])  # fmt: skip
        prompt_texts = [p if isinstance(p, str) else next(decoded) for p in prompts]
    sub = _Submission(state, request)
    streams = [
        sub.stream(ids, sp, f"{request_id}-{i}", priority=body.priority, tenant=body.user)
        for i, (ids, sp) in enumerate(zip(prompt_ids, params))
    ]
    merged, first, has_first = await _start(state, sub, streams)

    if not body.stream:
        try:
            final: dict[int, RequestOutput] = {}
            item = first
            while has_first:
                i, out = item
                _raise_for_error(out)
                final[i] = out
                try:
                    item = await merged.__anext__()
                except StopAsyncIteration:
                    break
        except APIError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise _engine_failure(state, exc) from None
        finally:
            await sub.close()
            await merged.aclose()
        def build() -> Response:
            choices, outputs = [], []
            for i in range(len(prompts)):
                out = final.get(i)
                plp = out.prompt_logprobs if out else None
                # Cut back to an explicit prompt_logprobs (echo + a larger logprobs scores more).
                plp_body = _prompt_logprobs_body(plp, prompt_ids[i], body.prompt_logprobs)
                # The echoed prompt's logprobs are the same for every choice of a prompt: once.
                echo_lp = _echo_logprobs(prompt_ids[i], plp, k, detok) if body.echo and body.logprobs is not None else None
                for c in sorted(out.outputs if out else [], key=lambda c: c.index):
                    lp = None
                    text = "" if echo_only else c.text
                    if body.logprobs is not None:
                        offset = 0
                        if echo_lp is not None:
                            lp, offset = echo_lp
                        if not echo_only:
                            out_lp, _ = _completion_logprobs(c, 0, len(c.token_ids), k, detok, offset)
                            lp = _join_logprobs(lp, out_lp) if lp is not None else out_lp
                    if body.echo:
                        text = prompt_texts[i] + text
                    choices.append(
                        P.CompletionResponseChoice(
                            index=i * n + c.index, text=text, logprobs=lp, finish_reason=c.finish_reason,
                            stop_reason=c.stop_reason, prompt_logprobs=plp_body,
                        )
                    )  # fmt: skip
                    outputs.append(c)
            resp = P.CompletionResponse(
                id=request_id,
                created=created,
                model=state.model_name,
                choices=choices,
                usage=_usage([len(x) for x in prompt_ids], outputs),
            )
            return _body_response(resp)

        # Off the event loop: with echo, logprobs 20 and n up to 128 the body reaches hundreds
        # of MB, tens of seconds of building and encoding (/health must keep answering).
        return await asyncio.to_thread(build)

    offsets: dict[int, int] = {}

    def logprobs(c: CompletionOutput, idx: int, k0: int) -> P.CompletionLogProbs:
        lp, offsets[idx] = _completion_logprobs(c, k0, len(c.token_ids), k, detok, offsets.get(idx, 0))
        return lp

    echoed: dict[int, tuple[P.CompletionLogProbs, int]] = {}  # per prompt: the same for each of its choices

    def echo(i: int, idx: int, out: RequestOutput) -> tuple[str, P.CompletionLogProbs | None]:
        if body.logprobs is None:
            return prompt_texts[i], None
        if i not in echoed:
            echoed[i] = _echo_logprobs(prompt_ids[i], out.prompt_logprobs, k, detok)
        lp, offsets[idx] = echoed[i]
        return prompt_texts[i], lp

    stream = _stream_chunks(
        state, sub, merged, first,
        request_id=request_id, object_name="text_completion", created=created, include_usage=body.include_usage,
        prompt_lens=[len(x) for x in prompt_ids], n=n,
        delta_choice=lambda idx, text, lp: {"index": idx, "text": text, "logprobs": lp, "finish_reason": None,
                                            "stop_reason": None},
        finish_choice=lambda idx, c: {"index": idx, "text": "", "logprobs": None, "finish_reason": c.finish_reason,
                                      "stop_reason": c.stop_reason},
        logprobs=logprobs if body.logprobs is not None else None,
        echo=echo if body.echo else None,
        echo_only=echo_only,
    )  # fmt: skip
    return StreamingResponse(stream, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


_RESERVED_TEMPLATE_KWARGS = frozenset(
    {"tokenize", "return_dict", "return_tensors", "padding", "truncation", "max_length", "tokenizer_kwargs",
     "return_assistant_tokens_mask", "add_generation_prompt", "continue_final_message", "conversation"}
)  # fmt: skip
"""apply_chat_template arguments the server sets itself (a request may pass others, e.g.
``enable_thinking``, through ``chat_template_kwargs``)."""


_CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")
"""OpenAI's message roles; any other is a 400 (a chat template would render it verbatim)."""


async def _serve_chat(state: ServerState, request: Request, body: P.ChatCompletionRequest):
    _check_model(state, body.model)
    try:
        body.check_supported()
        messages = body.template_messages()
    except P.ProtocolError as exc:
        raise _bad_request(exc) from None
    for i, m in enumerate(messages):
        if m["role"] not in _CHAT_ROLES:
            raise APIError(400, f"messages[{i}].role must be one of {', '.join(_CHAT_ROLES)}, got {m['role']!r}",
                           param="messages", code="invalid_value")  # fmt: skip
    engine = state.require_engine()
    tokenizer = engine.tokenizer
    if not getattr(tokenizer, "chat_template", None):
        raise APIError(400, "this model has no chat template; use /v1/completions", param="messages", code="no_chat_template")
    extra_kwargs = dict(body.chat_template_kwargs or {})
    reserved = sorted(set(extra_kwargs) & _RESERVED_TEMPLATE_KWARGS)
    if reserved:
        raise APIError(400, f"chat_template_kwargs may not set {', '.join(reserved)}", param="chat_template_kwargs",
                       code="invalid_value")

    def render_and_tokenize() -> list[int]:  # on the tokenizer thread
        try:
            text = tokenizer.apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=body.add_generation_prompt,
                continue_final_message=body.continue_final_message,
                **extra_kwargs,
            )
        except Exception as exc:  # noqa: BLE001 - jinja TemplateError, ValueError, TypeError from the template
            raise APIError(400, f"cannot apply the chat template: {exc}", param="messages", code="invalid_value") from None
        if not isinstance(text, str):
            raise APIError(400, "chat_template_kwargs must not change the template's output type",
                           param="chat_template_kwargs", code="invalid_value")  # fmt: skip
        _check_prompt_bound(state, text, engine.max_model_len, "messages")
        return tokenizer.encode(text, add_special_tokens=False)

    prompt_ids = await _on_tokenizer_thread(state, render_and_tokenize)
    max_tokens = _resolve_max_tokens(
        body.requested_max_tokens(),
        len(prompt_ids),
        engine.max_model_len,
        "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens",
        "messages",
    )
    try:
        params = body.to_sampling_params(max_tokens)
    except P.ProtocolError as exc:
        raise _bad_request(exc) from None
    _check_queue(state, engine, body.n)

    request_id = P.random_id("chatcmpl") if not body.request_id else body.request_id
    created = P.now()
    k = (body.top_logprobs or 0) if body.logprobs else -1
    detok = _Detok(tokenizer)
    sub = _Submission(state, request)
    streams = [sub.stream(prompt_ids, params, request_id, priority=body.priority, tenant=body.user)]
    merged, first, has_first = await _start(state, sub, streams)

    if not body.stream:
        final = first[1] if has_first else None
        try:
            while has_first:
                _raise_for_error(final)
                try:
                    final = (await merged.__anext__())[1]
                except StopAsyncIteration:
                    break
        except APIError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise _engine_failure(state, exc) from None
        finally:
            await sub.close()
            await merged.aclose()
        def build() -> Response:
            outputs = sorted(final.outputs, key=lambda c: c.index) if final else []
            choices = [
                P.ChatCompletionResponseChoice(
                    index=c.index,
                    message=P.ChatResponseMessage(content=c.text),
                    logprobs=_chat_logprobs(c, 0, len(c.token_ids), k, detok) if body.logprobs else None,
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                )
                for c in outputs
            ]
            resp = P.ChatCompletionResponse(
                id=request_id, created=created, model=state.model_name, choices=choices,
                usage=_usage([len(prompt_ids)], outputs),
                prompt_logprobs=_prompt_logprobs_body(final.prompt_logprobs if final else None),
            )  # fmt: skip
            return _body_response(resp)

        # Off the event loop (prompt_logprobs and logprobs of long sequences make big bodies).
        return await asyncio.to_thread(build)

    stream = _stream_chunks(
        state, sub, merged, first,
        request_id=request_id, object_name="chat.completion.chunk", created=created, include_usage=body.include_usage,
        prompt_lens=[len(prompt_ids)], n=body.n,
        delta_choice=lambda idx, text, lp: {"index": idx, "delta": {"content": text}, "logprobs": lp,
                                            "finish_reason": None},
        finish_choice=lambda idx, c: {"index": idx, "delta": {}, "logprobs": None, "finish_reason": c.finish_reason,
                                      "stop_reason": c.stop_reason},
        logprobs=(lambda c, idx, k0: _chat_logprobs(c, k0, len(c.token_ids), k, detok)) if body.logprobs else None,
        opening=[{"index": idx, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                 for idx in range(body.n)],
        fingerprint_before_choices=True,
    )  # fmt: skip
    return StreamingResponse(stream, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


# ----------------------------------------------------------------------------- entry point


def main(argv: list[str] | None = None) -> int:
    """``kvfleet serve``: parse options (see :mod:`kvfleet.runtime.entrypoints.openai.serve_args`), load the
    model in the background and serve until SIGINT/SIGTERM.

    Returns: 0 after a clean shutdown, 1 when the engine failed to start. On SIGINT/SIGTERM
    uvicorn (>= 0.29) re-raises the signal once the graceful shutdown is over, so the process
    then ends *by that signal* (status 143 for SIGTERM in a shell, ``-15`` from
    :mod:`subprocess`), after open streams finished and the engine stopped.
    """
    import uvicorn

    from kvfleet.runtime.entrypoints.openai.serve_args import parse_serve_args

    args = parse_serve_args(argv)
    level = args.server.log_level.upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("kvfleet").setLevel(level)
    app = create_app(args.engine, args.server)
    state: ServerState = app.state.kvfleet
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=args.server.host,
            port=args.server.port,
            log_level=args.server.log_level,
            # SIGTERM lets open streams finish for up to 30 s (the operator's pods get 60 s).
            timeout_graceful_shutdown=30,
            lifespan="on",
        )
    )

    def fatal() -> None:
        server.should_exit = True

    state.on_fatal = fatal
    logger.info("serving %s on http://%s:%d", state.model_name, args.server.host, args.server.port)
    server.run()
    return 1 if state.load_error is not None else 0
