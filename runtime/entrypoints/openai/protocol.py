"""Request and response bodies of the OpenAI-compatible HTTP API (pydantic v2 models).

The shapes follow OpenAI's public API reference for ``/v1/completions``,
``/v1/chat/completions`` and ``/v1/models`` (https://platform.openai.com/docs/api-reference)
plus vLLM's sampling extras (``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``,
``min_tokens``, ``stop_token_ids``, ``include_stop_str_in_output``, ``skip_special_tokens``,
``priority``, ``prompt_logprobs``, ``bad_words``, ``allowed_token_ids``, ``structured_outputs`` and the
older ``guided_*`` names), so that the official ``openai`` client and clients written for vLLM work
unchanged. Structured-output fields become a ``StructuredOutputsParams`` in :mod:`.structured_outputs`;
tools in :mod:`.tool_calls`.

Request models validate *types* strictly (``"max_tokens": "5"`` or ``"n": 1.5`` is an
error, not a coercion) and ignore unknown fields, as vLLM does. Value ranges
(``temperature >= 0``, ``0 < top_p <= 1``, ...) are checked by
:class:`kvfleet.runtime.sampling_params.SamplingParams`, built by ``to_sampling_params``;
features the engine does not have (``suffix``, ``best_of != n``, image inputs) raise
:class:`UnsupportedFeature` from ``check_supported``.
"""

from __future__ import annotations

import time
import typing
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer, model_validator

from kvfleet.runtime.sampling_params import SamplingParams


class ProtocolError(ValueError):
    """A request the server rejects with HTTP 400.

    Attributes:
        param: the offending request field (OpenAI's ``error.param``), or None.
    """

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code


class UnsupportedFeature(ProtocolError):
    """A well-formed request asking for a feature kvfleet does not implement (HTTP 400)."""


# ----------------------------------------------------------------------------- errors


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorInfo


# ----------------------------------------------------------------------------- requests


MAX_N = 128
"""Most output sequences per prompt (OpenAI's limit for ``n``)."""


class _Request(BaseModel):
    # strict: no str->int or float->int coercion; unknown fields are ignored (vLLM does the same).
    model_config = ConfigDict(strict=True, extra="ignore", protected_namespaces=())

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        """``"field": null`` for a non-nullable field with a default means the default
        (clients such as LangChain send explicit nulls); nullable fields keep their null."""
        if isinstance(data, dict):
            fields = cls.model_fields

            def non_nullable_default(k: str) -> bool:
                f = fields.get(k)
                return f is not None and not f.is_required() and type(None) not in typing.get_args(f.annotation)

            data = {k: v for k, v in data.items() if not (v is None and non_nullable_default(k))}
        return data


class StreamOptions(_Request):
    include_usage: bool | None = False


class _SamplingFields(_Request):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    """Served model name; None: the (only) served model."""
    n: int = 1
    temperature: float | None = None
    """None: 1.0 (OpenAI's default)."""
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    """End-user id; becomes the request's tenant under the ``fair`` scheduling policy."""
    logit_bias: dict[str, float] | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: int = 0
    """Lower runs first under the ``priority`` scheduling policy (vLLM semantics)."""
    request_id: str | None = None
    prompt_logprobs: int | None = None
    """vLLM's extra: top log-probabilities per prompt token (0-20; 0: the prompt token's
    only), returned as ``prompt_logprobs`` (on each completions choice; on the chat response)."""
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    response_format: dict[str, Any] | None = None
    """OpenAI's ``text`` / ``json_object`` / ``json_schema`` (vLLM accepts it on completions too)."""
    structured_outputs: dict[str, Any] | None = None
    """vLLM's extra: one of ``json``, ``regex``, ``choice``, ``grammar``, ``json_object``
    (plus ``disable_any_whitespace``)."""
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def _common_checks(self) -> None:
        if self.n > MAX_N:
            raise ProtocolError(f"n must be <= {MAX_N}, got {self.n}", "n")
        if self.stream_options is not None and not self.stream:
            raise ProtocolError("stream_options is only allowed when stream is true", "stream_options")
        plp = self.prompt_logprobs
        if self.stream and plp is not None and (plp > 0 or plp == -1):
            # vLLM's rule: streamed responses have no place for them.
            raise ProtocolError("prompt_logprobs are not available when stream is true", "prompt_logprobs")

    def _logit_bias(self) -> dict[int, float] | None:
        if not self.logit_bias:
            return None
        try:
            return {int(k): v for k, v in self.logit_bias.items()}
        except ValueError:
            raise ProtocolError("logit_bias keys must be token ids (integers, as JSON strings)", "logit_bias") from None

    def _sampling_kwargs(self) -> dict[str, Any]:
        stop = self.stop
        if isinstance(stop, str):
            stop = [stop]
        kw: dict[str, Any] = dict(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            seed=self.seed,
            stop=list(stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            skip_special_tokens=self.skip_special_tokens,
            top_k=0 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logit_bias=self._logit_bias(),
            allowed_token_ids=self.allowed_token_ids,
            bad_words=list(self.bad_words or []),
        )
        return kw

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


def _build_sampling_params(kwargs: dict[str, Any]) -> SamplingParams:
    """SamplingParams(**kwargs), its ValueError turned into a ProtocolError naming the field."""
    try:
        return SamplingParams(**kwargs)
    except ValueError as exc:
        message = str(exc)
        param = message.split(" ", 1)[0]
        raise ProtocolError(message, param if param.isidentifier() else None) from None


PromptType = typing.Annotated[str | list[int] | list[str] | list[list[int]], Field(union_mode="left_to_right")]
"""A string, strings, token ids, or lists of token ids. Tried in this order, first match wins
(pydantic's default "smart" union also validated a token-id list against ``list[str]``, one
error per element: a 31 MiB body of ids took 17 s instead of 2.8 s, on the event loop, on a
busy 2-core machine)."""


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions`` body."""

    prompt: PromptType
    max_tokens: int | None = 16
    """OpenAI's default is 16; None: up to ``max_model_len``."""
    logprobs: int | None = None
    """Top log-probabilities per output token (0-20; 0: the sampled token's only); with
    ``echo``, per prompt token too."""
    echo: bool | None = False
    """Return the prompt text before the completion (and, with ``logprobs``, the prompt
    tokens' logprobs first, the first token's None), as OpenAI's legacy completions and vLLM."""
    suffix: str | None = None
    best_of: int | None = None

    def check_supported(self) -> None:
        """Raises UnsupportedFeature/ProtocolError for what the server cannot do."""
        self._common_checks()
        if self.suffix:
            raise UnsupportedFeature("suffix is not supported", "suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise UnsupportedFeature("best_of is not supported (it must be unset or equal to n)", "best_of")

    def prompts(self) -> list[str | list[int]]:
        """The prompt(s) as a list: each a string or a list of token ids.

        Raises:
            ProtocolError: empty list or empty prompt.
        """
        p = self.prompt
        if isinstance(p, str):
            prompts: list[str | list[int]] = [p]
        elif not p:
            raise ProtocolError("prompt must not be empty", "prompt")
        elif isinstance(p[0], int):  # validated: all ids, all strings or all id lists
            prompts = [list(p)]  # type: ignore[arg-type]
        else:
            prompts = list(p)  # type: ignore[arg-type]
        for x in prompts:
            if len(x) == 0:
                raise ProtocolError("prompt must not be empty", "prompt")
        return prompts

    def to_sampling_params(self, max_tokens: int) -> SamplingParams:
        """Engine sampling parameters; ``max_tokens`` is the resolved output budget.

        Raises:
            ProtocolError: a value out of range (``param`` names the field).
        """
        kw = self._sampling_kwargs()
        prompt_logprobs = self.prompt_logprobs
        if prompt_logprobs is None and self.echo:
            prompt_logprobs = self.logprobs  # vLLM: echo + logprobs scores the prompt too
        kw.update(max_tokens=max_tokens, logprobs=self.logprobs, prompt_logprobs=prompt_logprobs)
        params = _build_sampling_params(kw)  # validates the values as sent
        if self.echo and params.logprobs is not None and (params.prompt_logprobs or 0) < params.logprobs:
            # The echoed prompt's legacy top_logprobs hold the top ``logprobs`` too, even when an
            # explicit smaller ``prompt_logprobs`` is sent (vLLM would give them only the top
            # ``prompt_logprobs``); the raw ``prompt_logprobs`` in the response are cut back to it.
            params = params.clone(prompt_logprobs=params.logprobs)
        return params

    @property
    def echo_only(self) -> bool:
        """``echo`` with ``max_tokens: 0``: return the prompt (and its logprobs) only. The
        engine still generates one token (vLLM does the same), which is not returned."""
        return bool(self.echo) and self.max_tokens == 0


class TextContentPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
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


class ChatCompletionRequest(_SamplingFields):
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
            return _build_sampling_params(kw)
        except ProtocolError as exc:
            if exc.param == "logprobs":
                exc.param = "top_logprobs"
            raise


# ----------------------------------------------------------------------------- responses


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogProbs(BaseModel):
    """Legacy completions logprobs: parallel lists, one entry per output token (with
    ``echo``, per prompt token first: the first prompt token's logprob and top are None)."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """One entry of vLLM's ``prompt_logprobs`` (its ``Logprob``): natural-log probability
    (-inf as -9999.0), 1-based rank, the token's text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobs = list[dict[int, PromptLogprob] | None]
"""vLLM's shape: one entry per prompt token (the first None), token id -> PromptLogprob
(JSON object keys are the token ids as strings)."""


class CompletionResponseChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None


class CompletionStreamChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionStreamResponse(BaseModel):
    """One SSE chunk of a streamed completion; ``usage`` is a key of every chunk with
    ``include_usage`` (null but on the last, choice-less one), else of none."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionStreamChoice]
    system_fingerprint: str | None = None
    usage: UsageInfo | None = None


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


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "kvfleet"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


class TokenizeRequest(_Request):
    """``POST /tokenize`` (vLLM's shape): a ``prompt``, or chat ``messages`` rendered as
    ``/v1/chat/completions`` renders them (``tools`` included), so that ``count`` equals that
    request's ``usage.prompt_tokens``. ``add_special_tokens`` defaults to True for a prompt and
    False for messages (the chat template adds them)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class LoadLoRAAdapterRequest(BaseModel):
    """``POST /v1/load_lora_adapter`` (vLLM's body)."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(BaseModel):
    """``POST /v1/unload_lora_adapter`` (vLLM's body; ``lora_int_id`` is accepted and ignored)."""

    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None
