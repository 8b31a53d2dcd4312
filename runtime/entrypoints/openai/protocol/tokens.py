"""vLLM's ``/tokenize`` and ``/detokenize`` bodies."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from kvfleet.runtime.entrypoints.openai.protocol.chat import ChatMessage
from kvfleet.runtime.entrypoints.openai.protocol.common import StrictRequest


class TokenizeRequest(StrictRequest):
    """``POST /tokenize`` (vLLM's shape): a ``prompt``, or chat ``messages`` rendered as
    ``/v1/chat/completions`` renders them (``tools`` and a request's own ``chat_template``
    included), so that ``count`` equals that request's ``usage.prompt_tokens``.
    ``add_special_tokens`` defaults to True for a prompt and False for messages (the chat template adds them)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None
    tools: list[dict[str, Any]] | None = None
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(StrictRequest):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str
