"""The OpenAI-compatible HTTP server (``kvfleet serve``): the FastAPI app, on uvicorn.

``create_app`` builds the app: its lifespan loads the engine in the background (``/ready`` is 503
meanwhile), probes (``/health`` liveness, ``/ready`` readiness), ``/metrics``, the API key check,
and one thin route per endpoint that parses the body and delegates to its serving class
(:mod:`.serving_completion`, :mod:`.serving_chat`, :mod:`.serving_tokenize`). Errors are always OpenAI's shape
(:mod:`.errors`). The engine is reached only through
:class:`~kvfleet.runtime.engine.protocol.EngineClient`. ``main`` is ``kvfleet serve``.
Routes, status codes and the reasons behind them: docs/server.md.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry

from kvfleet.runtime.config import EngineConfig
from kvfleet.runtime.engine.protocol import EngineClient
from kvfleet.runtime.entrypoints.anthropic.protocol import openapi_request_body as messages_request_body
from kvfleet.runtime.entrypoints.anthropic.serving_messages import count_tokens, create_message
from kvfleet.runtime.entrypoints.openai import lifecycle
from kvfleet.runtime.entrypoints.openai import protocol as P
from kvfleet.runtime.entrypoints.openai.errors import APIError, add_exception_handlers
from kvfleet.runtime.entrypoints.openai.request_body import BodyT, parse_body
from kvfleet.runtime.entrypoints.openai.serve_args import ServerSettings
from kvfleet.runtime.entrypoints.openai.serving_chat import OpenAIServingChat
from kvfleet.runtime.entrypoints.openai.serving_completion import OpenAIServingCompletion
from kvfleet.runtime.entrypoints.openai.serving_embeddings import OpenAIServingEmbedding, embeddings_router
from kvfleet.runtime.entrypoints.openai.serving_engine import ServerState
from kvfleet.runtime.entrypoints.openai.serving_kv_blocks import kv_blocks_router
from kvfleet.runtime.entrypoints.openai.serving_lora import lora_model_cards, lora_router
from kvfleet.runtime.entrypoints.openai.serving_responses import OpenAIServingResponses, responses_router
from kvfleet.runtime.entrypoints.openai.serving_tokenize import OpenAIServingTokenization
from kvfleet.runtime.entrypoints.openai.tokenizer_bounds import prompt_length_bound
from kvfleet.runtime.entrypoints.openai.tool_calls import detect_tool_parser
from kvfleet.runtime.http.auth import key_matches
from kvfleet.runtime.metrics import CONTENT_TYPE, KVFLEET_PREFIX, VLLM_PREFIX, PrometheusStatLogger, exposition
from kvfleet.runtime.model_errors import ModelLoadError

__all__ = ["DEFAULT_MODEL_NAME", "APIError", "ServerState", "create_app", "main", "served_name"]

logger = logging.getLogger("kvfleet.server")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
"""Served name of the embedded default model (matches the model loader's display name)."""

EngineFactory = Callable[[EngineConfig, list], EngineClient]


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


def _default_engine_factory(config: EngineConfig, stat_loggers: list) -> EngineClient:
    from kvfleet.runtime.engine.async_llm import AsyncLLMEngine  # loads torch: only when serving

    return AsyncLLMEngine(config, stat_loggers=stat_loggers)


# ----------------------------------------------------------------------------- app and lifespan


def create_app(
    engine_config: EngineConfig | None = None,
    settings: ServerSettings | None = None,
    *,
    engine_factory: EngineFactory | None = None,
) -> FastAPI:
    """Build the FastAPI app; the engine is created on startup.

    Args:
        engine_config: engine options (default: ``EngineConfig()``).
        settings: server options (API key, queue limit, metrics naming; host/port are
            ``main``'s business).
        engine_factory: ``(config, stat_loggers) -> EngineClient``; default constructs
            :class:`kvfleet.runtime.engine.async_llm.AsyncLLMEngine`. It runs in a worker thread
            (model loading blocks), so ``/ready`` answers 503 meanwhile; then ``await engine.start()``.

    Returns: the app; its :class:`ServerState` is ``app.state.kvfleet``.
    """
    config = engine_config or EngineConfig()
    settings = settings or ServerSettings()
    name = served_name(config)
    prefixes = (KVFLEET_PREFIX, VLLM_PREFIX) if settings.metrics_compat == "vllm" else (KVFLEET_PREFIX,)
    stat_logger = PrometheusStatLogger(name, registry=CollectorRegistry(), prefixes=prefixes)
    state = ServerState(config=config, settings=settings, model_name=name, stat_logger=stat_logger)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        task = asyncio.create_task(_load(state, engine_factory or _default_engine_factory))
        watchdog = asyncio.create_task(lifecycle.watch_engine(state))
        try:
            yield
        finally:
            for t in (task, watchdog):
                t.cancel()
            if state.engine is not None:
                try:
                    await state.engine.shutdown()
                except Exception:
                    logger.exception("engine shutdown failed")
            state.tokenizer_pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="kvfleet", version="0.1.0", lifespan=lifespan)
    app.state.kvfleet = state
    app.state.serving_completion = OpenAIServingCompletion(state)
    app.state.serving_chat = OpenAIServingChat(state)
    app.state.serving_responses = OpenAIServingResponses(app.state.serving_chat, settings.max_stored_responses)
    app.state.serving_embedding = OpenAIServingEmbedding(state)
    app.state.serving_tokenize = OpenAIServingTokenization(state, app.state.serving_chat)
    add_exception_handlers(app)
    app.include_router(router)
    app.include_router(lora_router(_AUTH, _parse_body))
    app.include_router(responses_router(_AUTH, _parse_body))
    app.include_router(embeddings_router(_AUTH, _parse_body))
    app.include_router(kv_blocks_router())
    app.add_middleware(lifecycle.InFlight, state=state)
    return app


async def _load(state: ServerState, factory: EngineFactory) -> None:
    """Create and start the engine (``state.engine``), or record why it failed (``state.load_error``)."""
    try:
        t0 = time.monotonic()
        engine = await asyncio.to_thread(factory, state.config, [state.stat_logger])
        state.stat_logger.log_engine_initialized(engine.max_model_len, engine.cache_config_info())
        if state.config.enable_lora:
            state.stat_logger.log_lora_config(engine.lora_info())
        try:
            state.prompt_bound = await asyncio.to_thread(prompt_length_bound, engine.tokenizer)
        except Exception:  # only a shortcut: without it prompts are just tokenized
            logger.warning("no prompt length bound for this tokenizer", exc_info=True)
        if state.prompt_bound is not None:
            logger.info(
                "prompts longer than %d characters per token of max_model_len are rejected untokenized",
                state.prompt_bound.chars_per_token,
            )
        if state.settings.chat_template is not None:  # --chat-template replaces the tokenizer's
            engine.tokenizer.chat_template = state.settings.chat_template
        _pick_tool_parser(state, getattr(engine.tokenizer, "chat_template", None))
        await engine.start()
        state.engine = engine
        logger.info(
            "model %s ready in %.1f s (max_model_len %s)", state.model_name, time.monotonic() - t0, engine.max_model_len
        )
    except ModelLoadError as exc:  # the model itself: one line, no traceback
        state.load_error = exc
        logger.error("the engine failed to start: %s", exc.line())
        lifecycle.report_fatal(state, exc)
    except Exception as exc:  # reported by /health and the exit status
        state.load_error = exc
        # The reason on the ERROR line itself (a bad option such as a tensor_parallel_size that
        # does not divide the heads is a ValueError), the traceback after it -- except for a model
        # file that cannot be read (a missing path, a hub id that cannot be fetched: OSError, or an
        # error marked ``bad_input`` such as a bad GGUF file's): that one line is the whole story.
        bad_input = isinstance(exc, OSError) or getattr(exc, "bad_input", False)
        model = state.config.model or state.model_name
        about_model = getattr(exc, "about_model", True)  # e.g. a --lora-modules adapter's error is not
        named = f" ({model})" if bad_input and about_model and str(model) not in str(exc) else ""
        logger.error("the engine failed to start%s: %s: %s", named, type(exc).__name__, exc, exc_info=not bad_input)
        lifecycle.report_fatal(state, exc)


def _pick_tool_parser(state: ServerState, chat_template: str | None) -> None:
    """``state.tool_parser``: ``--tool-call-parser`` if given, else the detected one (logged)."""
    if state.settings.tool_call_parser is not None:
        state.tool_parser = state.settings.tool_call_parser
        logger.info("tool_choice auto: parser %s (--tool-call-parser)", state.tool_parser)
        return
    state.tool_parser, why = detect_tool_parser(chat_template, state.config.model or state.model_name)
    logger.info("tool_choice auto: parser %s (%s)", state.tool_parser, why)


def _state(request: Request) -> ServerState:
    return request.app.state.kvfleet


async def check_api_key(request: Request) -> None:
    """401 unless the request carries ``Authorization: Bearer <api_key>`` (no key set: open)."""
    key = _state(request).settings.api_key
    if not key:
        return
    if not key_matches(request.headers, key):
        raise APIError(
            401,
            "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )


router = APIRouter()
_AUTH: Sequence[Any] = [Depends(check_api_key)]

# ----------------------------------------------------------------------------- probes and metrics
# Every GET route answers HEAD too (RFC 9110, 9.1; kubelets and load balancers send HEAD).


@router.api_route("/health", methods=["GET", "HEAD"])
async def health(request: Request):
    state = _state(request)
    if state.engine_dead():
        error = state.load_error or (state.engine.dead_error if state.engine is not None else None)
        return JSONResponse({"status": "dead", "error": repr(error)}, status_code=503)
    if (stalled := lifecycle.engine_stalled(state)) is not None:
        return JSONResponse({"status": "stalled", "error": stalled}, status_code=503)
    return {"status": "loading" if state.loading else "ok"}


@router.api_route("/ready", methods=["GET", "HEAD"])
async def ready(request: Request):
    status = lifecycle.not_ready(_state(request))
    if status is not None:
        return JSONResponse({"status": status}, status_code=503)
    return {"status": "ready"}


@router.api_route("/metrics", methods=["GET", "HEAD"])
async def metrics(request: Request):
    state = _state(request)
    _refresh_gauges(state)
    return Response(exposition(state.stat_logger.registry), media_type=CONTENT_TYPE)


def _refresh_gauges(state: ServerState) -> None:
    """Set the state gauges from the engine's live counts (so that an idle engine, which
    records no steps, still reports its current queue and KV usage)."""
    engine = state.engine
    if engine is None or state.engine_dead():
        return
    try:
        state.stat_logger.set_scheduler_state(engine.num_running, engine.num_waiting, engine.kv_cache_usage)
    except Exception:  # metrics must never fail the scrape
        logger.debug("gauge refresh failed", exc_info=True)


@router.post("/reset_prefix_cache", dependencies=_AUTH)
async def reset_prefix_cache(request: Request):
    engine = _state(request).require_engine()
    return {"reset": bool(await engine.reset_prefix_cache())}


@router.get("/kv_events/snapshot", dependencies=_AUTH)
async def kv_events_snapshot(request: Request):
    """Every block hash this replica caches after KV event batch ``seq`` (a late router's
    starting index); 404 when KV events are off."""
    snapshot = _state(request).require_engine().kv_events_snapshot()
    if snapshot is None:
        raise APIError(404, "KV cache events are off (--kv-events-config)")
    return snapshot


# ----------------------------------------------------------------------------- OpenAI routes


def _model_card(state: ServerState) -> P.ModelCard:
    return P.ModelCard(
        id=state.model_name,
        created=int(state.started_at),
        root=state.config.model or DEFAULT_MODEL_NAME,
        max_model_len=state.engine.max_model_len if state.engine is not None else None,
    )


@router.api_route("/v1/models", methods=["GET", "HEAD"], dependencies=_AUTH)
async def models(request: Request):
    state = _state(request)
    return P.ModelList(data=[_model_card(state), *lora_model_cards(state)]).model_dump()


@router.api_route("/v1/models/{model_id:path}", methods=["GET", "HEAD"], dependencies=_AUTH)  # ids may hold "/"
async def retrieve_model(request: Request, model_id: str):
    """OpenAI's "retrieve model" (``client.models.retrieve``); unknown id: 404 as OpenAI."""
    state = _state(request)
    state.check_model(model_id)
    cards = [c for c in lora_model_cards(state) if c.id == model_id]
    return (cards[0] if cards else _model_card(state)).model_dump()


@router.post("/v1/completions", dependencies=_AUTH)
async def completions(request: Request):
    body = await _parse_body(request, P.CompletionRequest)
    serving: OpenAIServingCompletion = request.app.state.serving_completion
    return await serving.create_completion(body, request)


@router.post("/v1/chat/completions", dependencies=_AUTH)
async def chat_completions(request: Request):
    body = await _parse_body(request, P.ChatCompletionRequest)
    serving: OpenAIServingChat = request.app.state.serving_chat
    return await serving.create_chat_completion(body, request)


@router.post("/v1/messages", openapi_extra={"requestBody": messages_request_body()})  # Anthropic's; own errors
async def messages(request: Request):
    return await create_message(request, request.app.state.serving_chat)


@router.post("/v1/messages/count_tokens")  # Anthropic's; own errors
async def messages_count_tokens(request: Request):
    return await count_tokens(request, request.app.state.serving_chat)


@router.post("/tokenize", dependencies=_AUTH)
async def tokenize(request: Request):
    body = await _parse_body(request, P.TokenizeRequest)
    return (await request.app.state.serving_tokenize.tokenize(body)).model_dump(exclude_none=True)


@router.post("/detokenize", dependencies=_AUTH)
async def detokenize(request: Request):
    body = await _parse_body(request, P.DetokenizeRequest)
    return (await request.app.state.serving_tokenize.detokenize(body)).model_dump()


async def _parse_body(request: Request, model: type[BodyT]) -> BodyT:
    """The body as ``model`` under the server's ``max_request_body_size`` (:mod:`.request_body`)."""
    return await parse_body(request, model, _state(request).settings.max_request_body_size)


# ----------------------------------------------------------------------------- entry point


def main(argv: list[str] | None = None) -> int:
    """``kvfleet serve``: parse options (:mod:`kvfleet.runtime.entrypoints.openai.serve_args`), load the
    model in the background and serve until SIGINT/SIGTERM, which drains first
    (:class:`~kvfleet.runtime.entrypoints.openai.lifecycle.DrainingServer`).

    Returns: 0 after a clean shutdown, 1 when the engine failed to start or died. After a
    signal, uvicorn re-raises it once the shutdown is over, so the process then ends *by that
    signal* (status 143 for SIGTERM in a shell, ``-15`` from :mod:`subprocess`).
    """
    import uvicorn

    from kvfleet.runtime.entrypoints.openai.serve_args import parse_serve_args

    args = parse_serve_args(argv)
    level = args.server.log_level.upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("kvfleet").setLevel(level)
    if args.engine.headless:  # a worker node: no HTTP server, no scheduler
        from kvfleet.runtime.worker.headless import main_headless

        return main_headless(args.engine)
    app = create_app(args.engine, args.server)
    state: ServerState = app.state.kvfleet
    # The drain waits for the requests in flight; uvicorn's own graceful shutdown after it only
    # has to see the last bytes out.
    config = uvicorn.Config(
        app,
        host=args.server.host,
        port=args.server.port,
        log_level=args.server.log_level,
        timeout_graceful_shutdown=5,
        lifespan="on",
    )
    server = lifecycle.DrainingServer(config, state)

    def fatal() -> None:
        server.should_exit = True

    state.on_fatal = fatal
    logger.info("serving %s on http://%s:%d", state.model_name, args.server.host, args.server.port)
    server.run()
    return 1 if state.load_error is not None or (state.engine is not None and state.engine.errored) else 0
