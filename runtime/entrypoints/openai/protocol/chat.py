"""``/v1/chat/completions``: messages, the request body, the response and the streamed chunks
(``delta`` messages, tool-call fragments). Tools are checked in
:mod:`kvfleet.runtime.entrypoints.openai.tool_calls`."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, SerializerFunctionWrapHandler, model_serializer

from kvfleet.runtime.entrypoints.openai.protocol.common import (
    PromptLogprobs,
    ProtocolError,
    StrictRequest,
    UnsupportedFeature,
    UsageInfo,
)
from kvfleet.runtime.entrypoints.openai.protocol.sampling_fields import SamplingFields, build_sampling_params
from kvfleet.runtime.sampling_params import SamplingParams


class TextContentPart(StrictRequest):
    type: Literal["text"]
    text: str


class ChatMessage(StrictRequest):
    role: str
    content: str | list[TextContentPart | dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    """An assistant message's calls: ``{"id", "type": "function", "function": {"name", "arguments"}}``."""
    tool_call_id: str | None = None
    """A ``tool`` message: the call it answers."""

    def text(self) -> str | None:
        """The content as one string (text parts joined by newlines).

        Raises:
            UnsupportedFeature: a non-text content part (images, audio).
        """
        if self.content is None or isinstance(self.content, str):
            return self.content
        texts = []
        for part in self.content:
            if isinstance(part, TextContentPart):
                texts.append(part.text)
            else:
                raise UnsupportedFeature(
                    f"content part of type {part.get('type')!r} is not supported (text only)", "messages"
                )
        return "\n".join(texts)


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions`` body."""

    messages: list[ChatMessage]
    max_tokens: int | None = None
    """Deprecated by OpenAI in favour of ``max_completion_tokens``; None: up to ``max_model_len``."""
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    """``none``, ``auto`` (the default with tools), ``required`` or ``{"type": "function",
    "function": {"name": ...}}``; checked in :mod:`.tool_calls`."""
    parallel_tool_calls: bool | None = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None
    """A Jinja template for this request only (vLLM's extra field); None: the server's."""

    def check_supported(self) -> None:
        """Raises UnsupportedFeature/ProtocolError for what the server cannot do."""
        self._common_checks()
        if not self.messages:
            raise ProtocolError("messages must not be empty", "messages")
        if self.top_logprobs is not None and not self.logprobs:
            raise ProtocolError("top_logprobs requires logprobs to be true", "top_logprobs")
        if self.continue_final_message and self.add_generation_prompt:
            raise ProtocolError(
                "continue_final_message and add_generation_prompt cannot both be true", "continue_final_message"
            )

    def requested_max_tokens(self) -> int | None:
        """``max_completion_tokens`` if set, else ``max_tokens``."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def template_messages(self) -> list[dict[str, Any]]:
        """Messages as plain dicts for ``tokenizer.apply_chat_template``."""
        out = []
        for m in self.messages:
            d: dict[str, Any] = {"role": m.role, "content": m.text() or ""}
            for key in ("name", "tool_calls", "tool_call_id"):
                if getattr(m, key) is not None:
                    d[key] = getattr(m, key)
            out.append(d)
        return out

    def to_sampling_params(self, max_tokens: int) -> SamplingParams:
        """Engine sampling parameters; ``max_tokens`` is the resolved output budget.

        Raises:
            ProtocolError: a value out of range (``param`` names the field).
        """
        kw = self._sampling_kwargs()
        logprobs = None
        if self.logprobs:
            logprobs = self.top_logprobs or 0
        kw.update(max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=self.prompt_logprobs)
        try:
            return build_sampling_params(kw)
        except ProtocolError as exc:
            if exc.param == "logprobs":  # the chat request's field is top_logprobs: name it in the message too
                exc.param = "top_logprobs"
                exc.args = (f"top_{exc.args[0]}" if str(exc.args[0]).startswith("logprobs ") else exc.args[0],)
            raise


# ----------------------------------------------------------------------------- responses


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None
    refusal: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: str | None = None
    tool_calls: list[dict] = Field(default_factory=list)


class ChatCompletionResponseChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None
    prompt_logprobs: PromptLogprobs | None = None
    """vLLM's extra, with ``prompt_logprobs`` in the request (on the response, as vLLM)."""
    kv_transfer_params: dict[str, Any] | None = None
    """A prefill leg's blocks for the decode replica (vLLM's field; only when the request asked)."""


class DeltaMessage(BaseModel):
    """A chat chunk's ``delta``: only the keys that are not None (``{}`` on a choice's last chunk).
    ``tool_calls``: OpenAI's streamed calls, ``{"index", "id", "type", "function": {"name",
    "arguments"}}`` first, then ``{"index", "function": {"arguments": fragment}}``."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatCompletionStreamChoice(BaseModel):
    """``stop_reason`` is sent with the ``finish_reason``, on a choice's last chunk only."""

    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    kvfleet_token_ids: list[int] | None = Field(default=None, exclude=True)
    """The delta's token ids, for the router (``kvfleet_token_ids``); never in the model's own
    dump: the SSE writer adds them (:func:`~kvfleet.runtime.entrypoints.openai.streaming.sse_chunk`)."""

    @model_serializer(mode="wrap")
    def _stop_reason_when_finished(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        if self.finish_reason is None:
            data.pop("stop_reason", None)
        return data


class ChatCompletionStreamResponse(BaseModel):
    """One SSE chunk of a streamed chat completion; ``usage`` as :class:`CompletionStreamResponse`."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None
