"""Request and response bodies of the OpenAI-compatible HTTP API (pydantic v2 models).

The shapes follow OpenAI's public API reference for ``/v1/completions``,
``/v1/chat/completions`` and ``/v1/models`` (https://platform.openai.com/docs/api-reference)
plus vLLM's sampling extras (``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``,
``min_tokens``, ``stop_token_ids``, ``include_stop_str_in_output``, ``skip_special_tokens``,
``priority``, ``prompt_logprobs``, ``bad_words``, ``allowed_token_ids``, ``structured_outputs`` and the
older ``guided_*`` names), so that the official ``openai`` client and clients written for vLLM work
unchanged. Structured-output fields become a ``StructuredOutputsParams`` in :mod:`..structured_outputs`;
tools in :mod:`..tool_calls`.

Request models validate *types* strictly (``"max_tokens": "5"`` or ``"n": 1.5`` is an
error, not a coercion) and ignore unknown fields, as vLLM does. Value ranges
(``temperature >= 0``, ``0 < top_p <= 1``, ...) are checked by
:class:`kvfleet.runtime.sampling_params.SamplingParams`, built by ``to_sampling_params``;
features the engine does not have (``suffix``, ``best_of != n``, image inputs) raise
:class:`UnsupportedFeature` from ``check_supported``.

One module per API: :mod:`.common` (errors, the strict request base, ids, usage),
:mod:`.sampling_fields` (the fields both generation APIs share, to ``SamplingParams``),
:mod:`.completion`, :mod:`.chat`, :mod:`.tokens` (``/tokenize``, ``/detokenize``) and
:mod:`.models` (``/v1/models``, the LoRA adapter bodies). This package is their one public
entry: the server's modules use ``from kvfleet.runtime.entrypoints.openai import protocol as P``
and every wire model is ``P.<Name>``.
"""

from __future__ import annotations

from kvfleet.runtime.entrypoints.openai.protocol.chat import (
    ChatChoiceLogprobs,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    ChatResponseMessage,
    ChatTokenLogprob,
    DeltaMessage,
    TextContentPart,
    TopLogprob,
)
from kvfleet.runtime.entrypoints.openai.protocol.common import (
    MAX_N,
    ErrorInfo,
    ErrorResponse,
    HeldTokenIds,
    PromptLogprob,
    PromptLogprobs,
    ProtocolError,
    StrictRequest,
    TokenIdsChunk,
    UnsupportedFeature,
    UsageInfo,
    now,
    random_id,
)
from kvfleet.runtime.entrypoints.openai.protocol.completion import (
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionStreamChoice,
    CompletionStreamResponse,
    PromptType,
)
from kvfleet.runtime.entrypoints.openai.protocol.models import (
    LoadLoRAAdapterRequest,
    ModelCard,
    ModelList,
    UnloadLoRAAdapterRequest,
)
from kvfleet.runtime.entrypoints.openai.protocol.sampling_fields import (
    StreamOptions,
)
from kvfleet.runtime.entrypoints.openai.protocol.tokens import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)

__all__ = [
    "ChatChoiceLogprobs",
    "ChatCompletionRequest",
    "ChatCompletionResponse",
    "ChatCompletionResponseChoice",
    "ChatCompletionStreamChoice",
    "ChatCompletionStreamResponse",
    "ChatMessage",
    "ChatResponseMessage",
    "ChatTokenLogprob",
    "CompletionLogProbs",
    "CompletionRequest",
    "CompletionResponse",
    "CompletionResponseChoice",
    "CompletionStreamChoice",
    "CompletionStreamResponse",
    "DeltaMessage",
    "DetokenizeRequest",
    "DetokenizeResponse",
    "ErrorInfo",
    "ErrorResponse",
    "HeldTokenIds",
    "LoadLoRAAdapterRequest",
    "MAX_N",
    "ModelCard",
    "ModelList",
    "PromptLogprob",
    "PromptLogprobs",
    "PromptType",
    "ProtocolError",
    "StreamOptions",
    "StrictRequest",
    "TextContentPart",
    "TokenIdsChunk",
    "TokenizeRequest",
    "TokenizeResponse",
    "TopLogprob",
    "UnloadLoRAAdapterRequest",
    "UnsupportedFeature",
    "UsageInfo",
    "now",
    "random_id",
]
