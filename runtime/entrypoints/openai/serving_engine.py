"""What the serving classes share: the app's :class:`ServerState`, the checks every generation
request passes, submitting to the engine, collecting or streaming its outputs.

A serving class (:class:`OpenAIServing` subclass, one per endpoint) validates a parsed request,
tokenizes it on the app's tokenizer thread (never on the event loop), submits it through a
:class:`~kvfleet.runtime.entrypoints.openai.streaming.Submission` and produces a typed result:
the protocol's response model (built off the event loop), or a
:class:`~kvfleet.runtime.entrypoints.openai.streaming.ChunkStream` of the protocol's chunk models,
which a :class:`StreamWriter` shapes. The HTTP route serializes that result (:func:`body_response`,
:func:`~kvfleet.runtime.entrypoints.openai.streaming.sse_response`); other APIs built on it
translate the typed result, never its bytes. It talks to the engine only through
:class:`~kvfleet.runtime.engine.protocol.EngineClient`.
"""

from __future__ import annotations

import asyncio
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from kvfleet.runtime.config import EngineConfig
from kvfleet.runtime.engine.input_processor import fits_context
from kvfleet.runtime.engine.outputs import CompletionOutput, RequestOutput
from kvfleet.runtime.engine.protocol import EngineClient
from kvfleet.runtime.entrypoints.openai import protocol as P
from kvfleet.runtime.entrypoints.openai.errors import APIError, engine_error, raise_for_error
from kvfleet.runtime.entrypoints.openai.serve_args import ServerSettings
from kvfleet.runtime.entrypoints.openai.streaming import ChunkStream, Submission, merge, sse_response
from kvfleet.runtime.entrypoints.openai.structured_outputs import grammar_error
from kvfleet.runtime.entrypoints.openai.tokenizer_bounds import PromptLengthBound
from kvfleet.runtime.metrics import PrometheusStatLogger
from kvfleet.runtime.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputError

T = TypeVar("T")

KV_FULL = 0.9
"""KV cache usage from which the scheduler's waiting requests count as waiting for memory (below
it they wait at most for a step's token budget, or for the prompt their ``n`` siblings share)."""


@dataclass
class ServerState:
    """Everything one app instance holds (``app.state.kvfleet``)."""

    config: EngineConfig
    settings: ServerSettings
    model_name: str
    stat_logger: PrometheusStatLogger
    engine: EngineClient | None = None
    """The engine once loaded and started; None while loading."""
    load_error: BaseException | None = None
    admitted: int = 0
    """Engine sequences of the requests submitted and not yet ended (running, waiting for a slot,
    or on their way into the scheduler)."""
    in_flight: int = 0
    """Generation requests being answered (:class:`~.lifecycle.InFlight`)."""
    draining_since: float | None = None
    """``time.monotonic()`` of the signal that started the drain; None while serving."""
    handing_off: bool = False
    """The drain's ``--drain-handoff-grace`` passed: router streams end with a ``resume elsewhere``
    event at their next token (docs/routing.md, "Migration")."""
    on_fatal: Callable[[], None] | None = None
    """Called when the model fails to load (``main`` makes uvicorn exit)."""
    started_at: float = field(default_factory=time.time)
    prompt_bound: PromptLengthBound | None = None
    """Lower bound on a prompt's tokens from its length, set at load (None: the tokenizer
    gives none, prompts are just tokenized)."""
    tool_parser: str | None = None
    """The ``tool_choice: auto`` parser: ``--tool-call-parser``, else detected at load."""
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
        return e is not None and (e.errored or not e.is_running)

    def check_model(self, requested: str | None) -> None:
        """404 unless ``requested`` is None, the served model's name or a loaded LoRA adapter's."""
        if requested is not None and requested != self.model_name and not self.is_lora(requested):
            adapters = [lora.lora_name for lora in self.engine.list_loras()] if (
                self.config.enable_lora and self.engine is not None) else []
            served = ", ".join(f"`{n}`" for n in [self.model_name, *adapters])
            raise APIError(
                404,
                f"The model `{requested}` does not exist. Served model{'s' if adapters else ''}: {served}.",
                param="model",
                code="model_not_found",
            )

    def response_model(self, requested: str | None) -> str:
        """The ``model`` a response names: the LoRA adapter the request asked for (as vLLM
        answers), else the served model's name."""
        return requested if requested is not None and requested != self.model_name and self.is_lora(requested) \
            else self.model_name

    def is_lora(self, name: str) -> bool:
        """Whether ``name`` is a loaded LoRA adapter (False with LoRA off or while loading)."""
        return (
            self.config.enable_lora
            and self.engine is not None
            and any(lora.lora_name == name for lora in self.engine.list_loras())
        )

    def require_engine(self) -> EngineClient:
        if self.engine_dead():
            raise APIError(503, "the engine is not running", code="engine_dead")
        if self.engine is None:
            raise APIError(503, "the model is loading; retry later", code="model_loading", headers={"Retry-After": "5"})
        return self.engine


def resolve_max_tokens(
    requested: int | None, prompt_len: int, max_model_len: int, param: str, prompt_param: str
) -> int:
    """The output budget: ``requested``, or what is left of ``max_model_len`` (400 if it does not fit)."""
    if requested is not None and (isinstance(requested, bool) or requested < 1):
        raise APIError(400, f"{param} must be an integer >= 1, got {requested}", param=param, code="invalid_value")
    if requested is None:
        if not fits_context(prompt_len, 1, max_model_len):
            raise APIError(
                400,
                f"This model's maximum context length is {max_model_len} tokens. However, your prompt is "
                f"{prompt_len} tokens, leaving no room for output. Please reduce the length of the prompt.",
                param=prompt_param,
                code="context_length_exceeded",
            )
        return max_model_len - prompt_len
    if not fits_context(prompt_len, requested, max_model_len):
        raise APIError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} for the completion "
            f"({param})). Please reduce the length of the prompt or {param}.",
            param=param,
            code="context_length_exceeded",
        )
    return requested


def usage(prompt_lens: list[int], outputs: list[CompletionOutput] | int) -> P.UsageInfo:
    """Token counts of a response: ``outputs`` its (cumulative) choices, or their token count."""
    prompt = sum(prompt_lens)
    completion = outputs if isinstance(outputs, int) else sum(len(c.token_ids) for c in outputs)
    return P.UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def resume_split(body: P.CompletionRequest | P.ChatCompletionRequest,
                 requests: list[tuple[list[int], SamplingParams, str]]) -> list[list[list[int]] | None]:
    """Per prompt, the resumed output token ids of its ``n`` choices (``kvfleet_resume``; stream
    index ``i * n + c``), or Nones; a 400 naming ``kvfleet_resume`` when the count is wrong."""
    if body.kvfleet_resume is None:
        return [None] * len(requests)
    ids = body.kvfleet_resume.output_token_ids
    n = requests[0][1].n if requests else 1
    if len(ids) != n * len(requests):
        raise APIError(400, f"kvfleet_resume.output_token_ids must hold {n * len(requests)} lists (one per choice)",
                       param="kvfleet_resume", code="invalid_value")
    return [ids[i * n:(i + 1) * n] for i in range(len(requests))]


def body_response(resp: P.CompletionResponse | P.ChatCompletionResponse) -> Response:
    """``resp`` as an ``application/json`` response, its choices encoded one at a time (on a
    worker thread, pydantic's encoder holds the GIL for a whole call: one call per choice keeps
    the event loop going). The bytes equal ``resp.model_dump_json()``."""
    head = resp.model_copy(update={"choices": []}).model_dump_json()
    marker = '"choices":[]'  # the key itself: inside a JSON string its quotes would be escaped
    at = head.index(marker) + len(marker) - 1
    body = head[:at] + ",".join(c.model_dump_json() for c in resp.choices) + head[at:]
    return Response(body.encode("utf-8"), media_type="application/json")


RESUME_ELSEWHERE = "kvfleet_resume_elsewhere"
"""The error code that tells the router to migrate a stream (docs/routing.md)."""


def resume_elsewhere() -> APIError:
    """The error that hands a router stream back to the router (a drain hand-off): the stream's SSE
    error event carries :data:`RESUME_ELSEWHERE` (streaming.py writes it)."""
    return APIError(503, "the replica is draining: resume this stream elsewhere", type="server_error",
                    code=RESUME_ELSEWHERE)

StreamChoice = P.CompletionStreamChoice | P.ChatCompletionStreamChoice
StreamChunk = P.CompletionStreamResponse | P.ChatCompletionStreamResponse | P.TokenIdsChunk
StreamLogprobs = P.CompletionLogProbs | P.ChatChoiceLogprobs


class StreamWriter(ABC):
    """The chunks of one streamed request. Choice ``c`` of prompt ``i`` is index ``i * n + c.index``.

    The engine's outputs are deltas (``RequestOutputKind.DELTA``): each new piece of a choice is
    one chunk of ``delta(index, text, logprobs)`` (None: nothing to send yet) and its end the
    chunk(s) of ``finish(index, output)``; ``logprobs(output, index)`` gives the logprobs of the
    delta's tokens (None: not requested). ``opening()`` choices are sent first, one chunk each;
    ``echo(prompt index, index, output)`` gives ``(text, logprobs)`` sent as a choice's first chunk
    (None: no echo); with ``echo_only`` the choice's own tokens are not sent, only its end."""

    def __init__(
        self,
        response_type: type[P.CompletionStreamResponse] | type[P.ChatCompletionStreamResponse],
        *,
        request_id: str,
        created: int,
        model: str,
        n: int,
        prompt_lens: list[int],
        include_usage: bool,
        echo_only: bool = False,
    ):
        self.response_type, self.request_id, self.created, self.model = response_type, request_id, created, model
        self.n, self.prompt_lens, self.include_usage, self.echo_only = n, prompt_lens, include_usage, echo_only

    def opening(self) -> list[StreamChoice]:
        return []

    def echo(self, i: int, idx: int, out: RequestOutput) -> tuple[str, StreamLogprobs | None] | None:
        return None

    def logprobs(self, c: CompletionOutput, idx: int) -> StreamLogprobs | None:
        return None

    @abstractmethod
    def delta(self, idx: int, text: str, lp: Any) -> StreamChoice | None: ...

    @abstractmethod
    def finish(self, idx: int, c: CompletionOutput) -> StreamChoice | list[StreamChoice]: ...

    token_ids = False
    """The router asked for each delta's token ids (``kvfleet_token_ids``, docs/routing.md)."""

    def chunk(self, choices: list[Any], usage: P.UsageInfo | None = None,
              token_ids: list[int] | None = None) -> P.CompletionStreamResponse | P.ChatCompletionStreamResponse:
        """One chunk of ``choices`` (``token_ids``: the one choice's delta token ids, its
        ``kvfleet_token_ids`` for the router)."""
        if token_ids is not None:
            choices[0].kvfleet_token_ids = token_ids
        return self.response_type(id=self.request_id, created=self.created, model=self.model, choices=choices,
                                  usage=usage)

    def token_ids_chunk(self, idx: int, token_ids: list[int]) -> P.TokenIdsChunk:
        """A router-only chunk: tokens whose text the detokenizer still holds back."""
        return P.TokenIdsChunk(id=self.request_id, choices=[P.HeldTokenIds(index=idx, kvfleet_token_ids=token_ids)])


@dataclass
class Generation:
    """A submitted request: its engine requests, their merged outputs, the first output (None: none)."""

    sub: Submission
    merged: AsyncIterator[tuple[int, RequestOutput]]
    first: tuple[int, RequestOutput] | None


class OpenAIServing:
    """Base of the serving classes (one per endpoint) over the app's :class:`ServerState`."""

    def __init__(self, state: ServerState):
        self.state = state

    def as_token_ids(self, body) -> bool:
        """Whether logprobs name tokens ``"token_id:{id}"``: the request's field, else the server's."""
        own = getattr(body, "return_tokens_as_token_ids", None)
        return self.state.settings.return_tokens_as_token_ids if own is None else own

    def check_queue(self, engine: EngineClient) -> None:
        """429 while ``max_queue_len`` sequences truly wait: the admitted ones beyond the
        ``max_num_seqs`` slots, or, when the KV cache is full (:data:`KV_FULL`), the scheduler's
        waiting ones. Sequences that merely have not been scheduled yet do not count."""
        limit = self.state.settings.max_queue_len
        if limit is None:
            return
        waiting = max(self.state.admitted - self.state.config.max_num_seqs, 0)
        if engine.kv_cache_usage >= KV_FULL:
            waiting = max(waiting, engine.num_waiting)
        if waiting >= limit:
            raise APIError(
                429,
                f"the server is overloaded: {waiting} requests are waiting (max_queue_len {limit}); retry later",
                code="queue_full",
                headers={"Retry-After": "1"},
            )

    def check_prompt_bound(self, text: str, max_model_len: int, param: str) -> None:
        """400 for a prompt text that is certainly longer than ``max_model_len`` tokens, from its
        length alone (:class:`~kvfleet.runtime.entrypoints.openai.tokenizer_bounds.PromptLengthBound`):
        no room for output is left, whatever ``max_tokens``."""
        bound = self.state.prompt_bound
        if bound is None or len(text) <= bound.chars_per_token * (max_model_len - 1):  # ceil(n / L) < max_model_len
            return
        at_least = bound.min_tokens(text)
        if at_least >= max_model_len:
            raise APIError(
                400,
                f"This model's maximum context length is {max_model_len} tokens. However, your prompt is "
                f"{len(text)} characters long, which is at least {at_least} tokens (no token of this model is "
                f"longer than {bound.chars_per_token} characters), leaving no room for output. Please reduce the "
                "length of the prompt.",
                param=param,
                code="context_length_exceeded",
            )

    async def on_tokenizer_thread(self, fn: Callable[[], T]) -> T:
        """``fn()`` on the app's tokenizer thread (one at a time, never on the event loop); its
        exceptions (APIError included) are raised here."""
        return await asyncio.get_running_loop().run_in_executor(self.state.tokenizer_pool, fn)

    def engine_error(self, exc: BaseException) -> APIError:
        return engine_error(exc, engine_dead=self.state.engine_dead())

    async def submit(
        self,
        engine: EngineClient,
        http_request: Request,
        requests: list[tuple[list[int], SamplingParams, str]],
        body: P.CompletionRequest | P.ChatCompletionRequest,
        grammar_param: str | None = None,
    ) -> Generation:
        """Check the queue, submit ``(prompt ids, params, request id)`` s, abort them if the client
        disconnects, and wait for the first output. A stream gets the engine's deltas, a JSON
        answer only each request's final output. On any error the streams are closed before it
        propagates; a grammar that does not compile is a 400 naming ``grammar_param``."""
        self.check_queue(engine)
        kind = RequestOutputKind.DELTA if body.stream else RequestOutputKind.FINAL_ONLY
        requests = [(ids, sp.clone(output_kind=kind), rid) for ids, sp, rid in requests]
        resume = resume_split(body, requests)
        sub = Submission(self.state, engine, http_request, sum(sp.n for _, sp, _ in requests))
        if self.state.is_lora(body.model or ""):  # the adapter the request's model names
            sub.lora_name = body.model
        merged = merge([
            sub.stream(ids, sp, rid, priority=body.priority, tenant=body.user, resume=resume[i])
            for i, (ids, sp, rid) in enumerate(requests)
        ])
        sub.watch_disconnect()
        try:
            try:
                return Generation(sub, merged, await merged.__anext__())
            except StopAsyncIteration:
                return Generation(sub, merged, None)
            except APIError:
                raise
            except StructuredOutputError as exc:
                raise grammar_error(exc, grammar_param) from None
            except Exception as exc:
                raise self.engine_error(exc) from None
        except BaseException:
            await sub.close()
            await merged.aclose()  # type: ignore[attr-defined]
            raise

    async def collect(self, gen: Generation) -> dict[int, RequestOutput]:
        """The final output of each prompt (by prompt index) of a non-streamed request."""
        final: dict[int, RequestOutput] = {}
        try:
            item = gen.first
            while item is not None:
                i, out = item
                raise_for_error(out)
                final[i] = out
                try:
                    item = await gen.merged.__anext__()
                except StopAsyncIteration:
                    break
        except APIError:
            raise
        except Exception as exc:
            raise self.engine_error(exc) from None
        finally:
            await gen.sub.close()
            await gen.merged.aclose()  # type: ignore[attr-defined]
        return final

    def stream(self, gen: Generation, writer: StreamWriter) -> ChunkStream:
        """The typed chunks of a submitted streamed request (see :class:`ChunkStream`)."""
        return ChunkStream(self._chunks(gen, writer), sum(writer.prompt_lens), writer.include_usage)

    def stream_response(self, gen: Generation, writer: StreamWriter) -> StreamingResponse:
        return sse_response(self.stream(gen, writer))

    async def _chunks(self, gen: Generation, w: StreamWriter) -> AsyncIterator[StreamChunk]:
        """The chunks, then the usage chunk (include_usage); a failure is raised as an
        :class:`APIError`. The engine requests are closed at the end, also when the consumer goes."""
        started: set[int] = set()
        done: set[int] = set()
        num_tokens = 0
        try:
            for choice in w.opening():
                yield w.chunk([choice])
            item = gen.first
            while item is not None:
                i, out = item
                raise_for_error(out)
                for c in out.outputs:  # a delta: the choices with something new
                    idx = i * w.n + c.index
                    if idx in done:
                        continue
                    if idx not in started and (echo := w.echo(i, idx, out)) is not None:
                        yield w.chunk([w.delta(idx, *echo)])
                        await asyncio.sleep(0)  # a prompt's echo chunk can be MBs: let /health etc. in between
                    started.add(idx)
                    lp = w.logprobs(c, idx) if c.token_ids else None
                    if (c.text or lp is not None) and not w.echo_only:
                        choice = w.delta(idx, c.text, lp)
                        if choice is not None:
                            yield w.chunk([choice], token_ids=list(c.token_ids) if w.token_ids else None)
                        elif w.token_ids and c.token_ids:
                            yield w.token_ids_chunk(idx, list(c.token_ids))
                    elif w.token_ids and c.token_ids:
                        yield w.token_ids_chunk(idx, list(c.token_ids))
                    num_tokens += len(c.token_ids)
                    if c.finish_reason is not None:
                        done.add(idx)
                        end = w.finish(idx, c)
                        for choice in end if isinstance(end, list) else [end]:
                            yield w.chunk([choice])
                if self.state.handing_off and w.token_ids and len(done) < w.n * len(w.prompt_lens):
                    raise resume_elsewhere()
                try:
                    item = await gen.merged.__anext__()
                except StopAsyncIteration:
                    item = None
            if w.include_usage:
                yield w.chunk([], usage(w.prompt_lens, num_tokens))
        except APIError:
            raise
        except Exception as exc:
            # the drain's deadline stopped the engine under a router stream: handed off, never cut
            if self.state.handing_off and w.token_ids and len(done) < w.n * len(w.prompt_lens):
                raise resume_elsewhere() from None
            raise self.engine_error(exc) from None
        finally:
            await gen.sub.close()
            with anyio.CancelScope(shield=True):
                await gen.merged.aclose()  # type: ignore[attr-defined]
