"""The pieces every body of the HTTP API shares: the 400 errors and OpenAI's error body, the
strict request base, ids and timestamps, ``usage``, vLLM's ``prompt_logprobs`` entries and the
router-only stream pieces (``kvfleet_token_ids``).

:class:`StrictRequest` is the base of every request body: types are validated strictly
(``"max_tokens": "5"`` or ``"n": 1.5`` is an error, not a coercion), unknown fields are ignored
and an explicit ``null`` for a non-nullable field means its default, as vLLM does.
"""

from __future__ import annotations

import time
import typing
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, model_validator


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


class StrictRequest(BaseModel):
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


# ----------------------------------------------------------------------------- responses


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class HeldTokenIds(BaseModel):
    """A choice of a :class:`TokenIdsChunk`."""

    index: int
    kvfleet_token_ids: list[int]
    kvfleet_text_held: Literal[True] = True


class TokenIdsChunk(BaseModel):
    """A router-only stream chunk (``kvfleet_token_ids``, docs/routing.md): tokens of a choice
    whose text the detokenizer still holds back."""

    id: str
    object: Literal["kvfleet.token_ids"] = "kvfleet.token_ids"
    choices: list[HeldTokenIds]


class PromptLogprob(BaseModel):
    """One entry of vLLM's ``prompt_logprobs`` (its ``Logprob``): natural-log probability
    (-inf as -9999.0), 1-based rank, the token's text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobs = list[dict[int, PromptLogprob] | None]
"""vLLM's shape: one entry per prompt token (the first None), token id -> PromptLogprob
(JSON object keys are the token ids as strings)."""
