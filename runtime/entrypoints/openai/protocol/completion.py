"""``/v1/completions``: the request body, the response and the streamed chunks."""

from __future__ import annotations

import typing
from typing import Any, Literal

from pydantic import BaseModel, Field

from kvfleet.runtime.entrypoints.openai.protocol.common import (
    PromptLogprobs,
    ProtocolError,
    UnsupportedFeature,
    UsageInfo,
)
from kvfleet.runtime.entrypoints.openai.protocol.sampling_fields import SamplingFields, build_sampling_params
from kvfleet.runtime.sampling_params import SamplingParams

PromptType = typing.Annotated[str | list[int] | list[str] | list[list[int]], Field(union_mode="left_to_right")]
"""A string, strings, token ids, or lists of token ids. Tried in this order, first match wins
(pydantic's default "smart" union also validated a token-id list against ``list[str]``, one
error per element: a 31 MiB body of ids took 17 s instead of 2.8 s, on the event loop, on a
busy 2-core machine)."""


class CompletionRequest(SamplingFields):
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
        params = build_sampling_params(kw)  # validates the values as sent
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


class CompletionLogProbs(BaseModel):
    """Legacy completions logprobs: parallel lists, one entry per output token (with
    ``echo``, per prompt token first: the first prompt token's logprob and top are None)."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


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
    kv_transfer_params: dict[str, Any] | None = None
    """A prefill leg's blocks for the decode replica (vLLM's field; only when the request asked)."""


class CompletionStreamChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    kvfleet_token_ids: list[int] | None = Field(default=None, exclude=True)
    """The delta's token ids, for the router (``kvfleet_token_ids``); never in the model's own
    dump: the SSE writer adds them (:func:`~kvfleet.runtime.entrypoints.openai.streaming.sse_chunk`)."""


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
