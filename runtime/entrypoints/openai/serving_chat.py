"""``POST /v1/chat/completions``: :class:`OpenAIServingChat`.

The messages (OpenAI's roles only, text content only) are rendered with the tokenizer's chat
template and tokenized on the tokenizer thread (``chat_template_kwargs`` reach the template, but
may not set the server's own arguments), then submitted as one engine request with ``n`` choices.
Streams open with one ``{"role": "assistant", "content": ""}`` delta per choice.
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

_RESERVED_TEMPLATE_KWARGS = frozenset(
    {"tokenize", "return_dict", "return_tensors", "padding", "truncation", "max_length", "tokenizer_kwargs",
     "return_assistant_tokens_mask", "add_generation_prompt", "continue_final_message", "conversation"}
)  # fmt: skip
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
    request_id: str = field(default_factory=lambda: P.random_id("chatcmpl"))
    created: int = field(default_factory=P.now)

    @property
    def k(self) -> int:
        return (self.body.top_logprobs or 0) if self.body.logprobs else -1

    def logprobs(self, c: CompletionOutput, start: int) -> P.ChatChoiceLogprobs | None:
        return LP.chat_logprobs(c, start, len(c.token_ids), self.k, self.detok) if self.body.logprobs else None

    def response(self, final: RequestOutput | None) -> Response:
        """The JSON body (on a worker thread: prompt_logprobs and logprobs of long sequences make big bodies)."""
        outputs = sorted(final.outputs, key=lambda c: c.index) if final else []
        choices = [
            P.ChatCompletionResponseChoice(index=c.index, message=P.ChatResponseMessage(content=c.text),
                                           logprobs=self.logprobs(c, 0), finish_reason=c.finish_reason,
                                           stop_reason=c.stop_reason)
            for c in outputs
        ]  # fmt: skip
        resp = P.ChatCompletionResponse(
            id=self.request_id, created=self.created, model=self.model, choices=choices,
            usage=usage([len(self.prompt_ids)], outputs),
            prompt_logprobs=LP.prompt_logprobs_body(final.prompt_logprobs if final else None),
        )  # fmt: skip
        return body_response(resp)


class _ChatStream(StreamWriter):
    def __init__(self, req: _Chat):
        super().__init__(P.ChatCompletionStreamResponse, request_id=req.request_id, created=req.created,
                         model=req.model, n=req.body.n, prompt_lens=[len(req.prompt_ids)],
                         include_usage=req.body.include_usage)  # fmt: skip
        self.req = req

    def opening(self) -> list[P.ChatCompletionStreamChoice]:  # type: ignore[override]
        return [P.ChatCompletionStreamChoice(index=idx, delta=P.DeltaMessage(role="assistant", content=""))
                for idx in range(self.n)]  # fmt: skip

    def logprobs(self, c: CompletionOutput, idx: int, k0: int) -> P.ChatChoiceLogprobs | None:
        return self.req.logprobs(c, k0)

    def delta(self, idx: int, text: str, lp: P.ChatChoiceLogprobs | None) -> P.ChatCompletionStreamChoice:
        return P.ChatCompletionStreamChoice(index=idx, delta=P.DeltaMessage(content=text), logprobs=lp)

    def finish(self, idx: int, c: CompletionOutput) -> P.ChatCompletionStreamChoice:
        return P.ChatCompletionStreamChoice(index=idx, delta=P.DeltaMessage(), finish_reason=c.finish_reason,
                                            stop_reason=c.stop_reason)  # fmt: skip


class OpenAIServingChat(OpenAIServing):
    """``/v1/chat/completions`` over the app's engine."""

    async def create_chat_completion(self, body: P.ChatCompletionRequest, http_request: Request) -> Response:
        self.state.check_model(body.model)
        checked(body.check_supported)
        messages = checked(body.template_messages)
        for i, m in enumerate(messages):
            if m["role"] not in _CHAT_ROLES:
                raise APIError(400, f"messages[{i}].role must be one of {', '.join(_CHAT_ROLES)}, got {m['role']!r}",
                               param="messages", code="invalid_value")  # fmt: skip
        engine = self.state.require_engine()
        prompt_ids = await self._render(engine, body, messages)
        max_tokens = resolve_max_tokens(
            body.requested_max_tokens(),
            len(prompt_ids),
            engine.max_model_len,
            "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens",
            "messages",
        )
        params = checked(lambda: body.to_sampling_params(max_tokens))
        req = _Chat(body, self.state.model_name, prompt_ids, LP.TokenText(engine.tokenizer))
        if body.request_id:
            req.request_id = body.request_id
        gen = await self.submit(engine, http_request, [(prompt_ids, params, req.request_id)], body)
        if not body.stream:
            final = (await self.collect(gen)).get(0)
            return await asyncio.to_thread(req.response, final)  # off the event loop: /health keeps answering
        return self.stream_response(gen, _ChatStream(req))

    async def _render(self, engine: EngineClient, body: P.ChatCompletionRequest,
                      messages: list[dict[str, Any]]) -> list[int]:  # fmt: skip
        """The prompt's token ids: the chat template applied and tokenized on the tokenizer thread."""
        tokenizer = engine.tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise APIError(400, "this model has no chat template; use /v1/completions", param="messages",
                           code="no_chat_template")  # fmt: skip
        extra_kwargs = dict(body.chat_template_kwargs or {})
        reserved = sorted(set(extra_kwargs) & _RESERVED_TEMPLATE_KWARGS)
        if reserved:
            raise APIError(400, f"chat_template_kwargs may not set {', '.join(reserved)}", param="chat_template_kwargs",
                           code="invalid_value")  # fmt: skip

        def render_and_tokenize() -> list[int]:  # on the tokenizer thread
            try:
                text = tokenizer.apply_chat_template(
                    messages,
                    tokenize=False,
                    add_generation_prompt=body.add_generation_prompt,
                    continue_final_message=body.continue_final_message,
                    **extra_kwargs,
                )
            except Exception as exc:  # jinja TemplateError, ValueError, TypeError from the template
                raise APIError(400, f"cannot apply the chat template: {exc}", param="messages",
                               code="invalid_value") from None  # fmt: skip
            if not isinstance(text, str):
                raise APIError(400, "chat_template_kwargs must not change the template's output type",
                               param="chat_template_kwargs", code="invalid_value")  # fmt: skip
            self.check_prompt_bound(text, engine.max_model_len, "messages")
            return tokenizer.encode(text, add_special_tokens=False)

        return await self.on_tokenizer_thread(render_and_tokenize)
