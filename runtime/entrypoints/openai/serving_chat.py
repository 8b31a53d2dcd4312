"""``POST /v1/chat/completions``: :class:`OpenAIServingChat`.

The messages (OpenAI's roles only, text content only) are rendered with the tokenizer's chat
template and tokenized on the tokenizer thread (``chat_template_kwargs`` reach the template, but
may not set the server's own arguments), then submitted as one engine request with ``n`` choices.
Streams open with one ``{"role": "assistant", "content": ""}`` delta per choice. Structured
outputs: :mod:`.structured_outputs`; tools (prompt, grammar, parsing, streamed ``tool_calls``
deltas, ``finish_reason: tool_calls``): :mod:`.tool_calls` and :mod:`.tool_parsers`.

:meth:`OpenAIServingChat.chat` is the typed entry point: a ``ChatCompletionResponse``, or a
:class:`~.streaming.ChunkStream` of ``ChatCompletionStreamResponse`` chunks. The route serializes
it; the Responses and Messages APIs translate from it.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from kvfleet.runtime.engine.outputs import CompletionOutput, RequestOutput
from kvfleet.runtime.engine.protocol import EngineClient
from kvfleet.runtime.entrypoints.openai import logprobs as LP
from kvfleet.runtime.entrypoints.openai import protocol as P
from kvfleet.runtime.entrypoints.openai.errors import APIError, checked
from kvfleet.runtime.entrypoints.openai.serving_engine import (
    OpenAIServing,
    StreamWriter,
    body_response,
    resolve_max_tokens,
    usage,
)
from kvfleet.runtime.entrypoints.openai.streaming import ChunkStream, sse_response
from kvfleet.runtime.entrypoints.openai.structured_outputs import structured_outputs_of
from kvfleet.runtime.entrypoints.openai.tool_calls import (
    ToolSetup,
    prepare_messages,
    resolve_tools,
    template_renders_tools,
)
from kvfleet.runtime.entrypoints.openai.tool_parsers import HermesStreamParser, tool_calls_body
from kvfleet.runtime.entrypoints.openai.tool_parsers_json import tool_parsers

_RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "tokenize",
        "return_dict",
        "return_tensors",
        "padding",
        "truncation",
        "max_length",
        "tokenizer_kwargs",
        "return_assistant_tokens_mask",
        "add_generation_prompt",
        "continue_final_message",
        "conversation",
        "messages",
        "tools",
    }
)
"""apply_chat_template arguments the server sets itself (a request may pass others, e.g.
``enable_thinking``, through ``chat_template_kwargs``)."""

_CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")
"""OpenAI's message roles; any other is a 400 (a chat template would render it verbatim)."""


@dataclass
class _Chat:
    """One tokenized chat request, as the response builders need it."""

    body: P.ChatCompletionRequest
    model: str
    prompt_ids: list[int]
    detok: LP.TokenText
    tools: ToolSetup | None = None
    request_id: str = field(default_factory=lambda: P.random_id("chatcmpl"))
    created: int = field(default_factory=P.now)

    @property
    def k(self) -> int:
        return (self.body.top_logprobs or 0) if self.body.logprobs else -1

    def logprobs(self, c: CompletionOutput, start: int) -> P.ChatChoiceLogprobs | None:
        return LP.chat_logprobs(c, start, len(c.token_ids), self.k, self.detok) if self.body.logprobs else None

    def response(self, final: RequestOutput | None) -> P.ChatCompletionResponse:
        """The response (on a worker thread: prompt_logprobs and logprobs of long sequences make big bodies)."""
        outputs = sorted(final.outputs, key=lambda c: c.index) if final else []
        choices = [
            P.ChatCompletionResponseChoice(
                index=c.index,
                message=self.message(c),
                logprobs=self.logprobs(c, 0),
                finish_reason=self.finish_reason(c),
                stop_reason=c.stop_reason,
            )
            for c in outputs
        ]
        resp = P.ChatCompletionResponse(
            id=self.request_id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=usage([len(self.prompt_ids)], outputs),
            prompt_logprobs=LP.prompt_logprobs_body(final.prompt_logprobs if final else None),
            kv_transfer_params=final.extra.get("kv_transfer_params") if final else None,
        )
        return resp

    @property
    def parser(self):
        """The parser class reading this request's output (``hermes`` under the tool grammar)."""
        return tool_parsers()[self.tools.parser]  # type: ignore[union-attr,index]

    @property
    def parses_tools(self) -> bool:
        return self.tools is not None and self.tools.parser is not None

    def message(self, c: CompletionOutput) -> P.ChatResponseMessage:
        if not self.parses_tools:
            return P.ChatResponseMessage(content=c.text)
        parsed = self.parser.parse(c.text)
        calls = parsed.calls if self.tools.parallel else parsed.calls[:1]  # type: ignore[union-attr]
        return P.ChatResponseMessage(content=parsed.content, tool_calls=tool_calls_body(calls))

    def finish_reason(self, c: CompletionOutput, made_calls: bool | None = None) -> str | None:
        """``tool_calls`` when the choice stopped after making calls, else the engine's reason."""
        if c.finish_reason != "stop" or not self.parses_tools:
            return c.finish_reason
        if made_calls is None:
            made_calls = bool(self.parser.parse(c.text).calls)
        return "tool_calls" if made_calls else c.finish_reason


class _ChatStream(StreamWriter):
    def __init__(self, req: _Chat):
        super().__init__(
            P.ChatCompletionStreamResponse,
            request_id=req.request_id,
            created=req.created,
            model=req.model,
            n=req.body.n,
            prompt_lens=[len(req.prompt_ids)],
            include_usage=req.body.include_usage,
        )
        self.req = req
        self.token_ids = req.body.kvfleet_token_ids
        self.parsers: dict[int, HermesStreamParser] = {}
        self.texts: dict[int, str] = {}

    def opening(self) -> list[P.ChatCompletionStreamChoice]:  # type: ignore[override]
        return [
            P.ChatCompletionStreamChoice(index=idx, delta=P.DeltaMessage(role="assistant", content=""))
            for idx in range(self.n)
        ]

    def logprobs(self, c: CompletionOutput, idx: int) -> P.ChatChoiceLogprobs | None:
        return self.req.logprobs(c, 0)

    def delta(self, idx: int, text: str, lp: P.ChatChoiceLogprobs | None) -> P.ChatCompletionStreamChoice | None:
        if not self.req.parses_tools:
            return P.ChatCompletionStreamChoice(index=idx, delta=P.DeltaMessage(content=text), logprobs=lp)
        self.texts[idx] = self.texts.get(idx, "") + text
        content, calls = self.parsers.setdefault(idx, HermesStreamParser(self.req.parser)).feed(self.texts[idx])
        return self._tool_delta(idx, content, calls, lp)

    def _tool_delta(self, idx: int, content: str, calls: list, lp=None) -> P.ChatCompletionStreamChoice | None:
        calls = [d for d in calls if self.req.tools.parallel or d["index"] == 0]  # type: ignore[union-attr]
        if not content and not calls and lp is None:
            return None
        return P.ChatCompletionStreamChoice(index=idx, delta=P.DeltaMessage(content=content or None,
                                                                            tool_calls=calls or None), logprobs=lp)

    def finish(self, idx: int, c: CompletionOutput) -> list[P.ChatCompletionStreamChoice]:
        made_calls = None
        chunks = []
        if self.req.parses_tools:
            text = self.texts.get(idx, "")  # the deltas so far (c is the last delta)
            content, calls, made_calls = self.parsers.setdefault(idx, HermesStreamParser(self.req.parser)).finish(text)
            chunks = [ch for ch in [self._tool_delta(idx, content, calls)] if ch is not None]
        return chunks + [
            P.ChatCompletionStreamChoice(
                index=idx,
                delta=P.DeltaMessage(),
                finish_reason=self.req.finish_reason(c, made_calls),
                stop_reason=c.stop_reason,
            )
        ]


ChatStream = ChunkStream[P.ChatCompletionStreamResponse | P.TokenIdsChunk]
"""A streamed chat completion's typed chunks (router-only ``TokenIdsChunk`` s with ``kvfleet_token_ids``)."""


class OpenAIServingChat(OpenAIServing):
    """``/v1/chat/completions`` over the app's engine: :meth:`chat` gives the typed result (what
    the Responses and Messages APIs translate), :meth:`create_chat_completion` its HTTP answer."""

    async def create_chat_completion(self, body: P.ChatCompletionRequest, http_request: Request) -> Response:
        """The route's answer: :meth:`chat`'s result as JSON or as SSE."""
        result = await self.chat(body, http_request)
        if isinstance(result, ChunkStream):
            return sse_response(result)
        return await asyncio.to_thread(body_response, result)  # off the event loop: /health keeps answering

    async def chat(self, body: P.ChatCompletionRequest, http_request: Request) -> P.ChatCompletionResponse | ChatStream:
        """The chat completion of ``body``: the response (not streamed) or its typed chunks
        (``body.stream``). A failure before the first output is raised here as an
        :class:`APIError`; one once streaming, by the stream's iteration."""
        self.state.check_model(body.model)
        checked(body.check_supported)
        tools = checked(lambda: resolve_tools(body, self.state.tool_parser))
        spec, spec_param = checked(lambda: structured_outputs_of(body))
        if tools is not None and tools.grammar() is not None:
            if spec is not None:
                raise APIError(
                    400,
                    f"{spec_param} cannot be combined with tool_choice {tools.choice!r}",
                    param=spec_param,
                    code="invalid_value",
                )
            spec, spec_param = tools.grammar(), "tools"
        engine = self.state.require_engine()
        prompt_ids = await self.prompt_ids(engine, body, body.tools)
        max_tokens = resolve_max_tokens(
            body.requested_max_tokens(),
            len(prompt_ids),
            engine.max_model_len,
            "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens",
            "messages",
        )
        params = checked(lambda: body.to_sampling_params(max_tokens))
        if spec is not None:
            params = params.clone(structured_outputs=spec)
        detok = LP.TokenText(engine.tokenizer, self.as_token_ids(body))
        req = _Chat(body, self.state.response_model(body.model), prompt_ids, detok, tools)
        if body.request_id:
            req.request_id = body.request_id
        gen = await self.submit(engine, http_request, [(prompt_ids, params, req.request_id)], body, spec_param)
        if not body.stream:
            final = (await self.collect(gen)).get(0)
            return await asyncio.to_thread(req.response, final)  # off the event loop: /health keeps answering
        return self.stream(gen, _ChatStream(req))

    async def prompt_ids(self, engine: EngineClient, body: P.ChatCompletionRequest,
                         tools: list[dict[str, Any]] | None, add_special_tokens: bool = False) -> list[int]:
        """The prompt's token ids: the messages (with ``tools``, see :mod:`.tool_calls`) through the
        chat template, tokenized on the tokenizer thread (``/tokenize`` uses it too)."""
        messages = checked(body.template_messages)
        for i, m in enumerate(messages):
            if m["role"] not in _CHAT_ROLES:
                raise APIError(
                    400,
                    f"messages[{i}].role must be one of {', '.join(_CHAT_ROLES)}, got {m['role']!r}",
                    param="messages",
                    code="invalid_value",
                )
        tokenizer = engine.tokenizer
        template = body.chat_template or getattr(tokenizer, "chat_template", None)
        if not template:
            raise APIError(
                400,
                "this model has no chat template; use /v1/completions, or start the server with --chat-template",
                param="messages",
                code="no_chat_template",
            )
        extra_kwargs = dict(body.chat_template_kwargs or {})
        reserved = sorted(set(extra_kwargs) & _RESERVED_TEMPLATE_KWARGS)
        if reserved:
            raise APIError(
                400,
                f"chat_template_kwargs may not set {', '.join(reserved)}",
                param="chat_template_kwargs",
                code="invalid_value",
            )

        native = template_renders_tools(template)
        messages = prepare_messages(messages, tools, native)
        if tools and native:
            extra_kwargs["tools"] = tools

        def render_and_tokenize() -> list[int]:  # on the tokenizer thread
            try:
                text = tokenizer.apply_chat_template(
                    messages,
                    tokenize=False,
                    add_generation_prompt=body.add_generation_prompt,
                    continue_final_message=body.continue_final_message,
                    chat_template=template,
                    **extra_kwargs,
                )
            except Exception as exc:  # jinja TemplateError, ValueError, TypeError from the template
                raise APIError(
                    400, f"cannot apply the chat template: {exc}", param="messages", code="invalid_value"
                ) from None
            if not isinstance(text, str):
                raise APIError(
                    400,
                    "chat_template_kwargs must not change the template's output type",
                    param="chat_template_kwargs",
                    code="invalid_value",
                )
            self.check_prompt_bound(text, engine.max_model_len, "messages")
            return tokenizer.encode(text, add_special_tokens=add_special_tokens)

        return await self.on_tokenizer_thread(render_and_tokenize)
