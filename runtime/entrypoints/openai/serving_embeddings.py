"""``POST /v1/embeddings``: :class:`OpenAIServingEmbedding`.

Strings are tokenized on the tokenizer thread (the tokenizer's own special tokens), token ids
are checked against the vocabulary, every input must fit ``max_model_len``. The inputs of one
request go to the engine in groups of at most ``max_num_batched_tokens`` tokens; each group is
one pooled forward (:mod:`kvfleet.runtime.worker.pooler`) run in the engine thread between
two generation steps, so generation and embeddings share the one loaded model. Pooling
(``LAST`` / ``MEAN``, L2 ``normalize``) is the server's ``--pooler-config``. ``base64`` is the
little-endian float32 bytes of the vector, as OpenAI sends it (the ``openai`` SDK asks for it).
"""

from __future__ import annotations

import base64
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np
from fastapi import APIRouter, Request

from kvfleet.runtime.entrypoints.openai.errors import APIError, checked
from kvfleet.runtime.entrypoints.openai.protocol.embeddings import EmbeddingRequest
from kvfleet.runtime.entrypoints.openai.serving_engine import OpenAIServing


class OpenAIServingEmbedding(OpenAIServing):
    """``/v1/embeddings`` over the app's engine."""

    async def create_embedding(self, body: EmbeddingRequest) -> dict[str, Any]:
        self.state.check_model(body.model)
        if body.model is not None and body.model != self.state.model_name and self.state.is_lora(body.model):
            # The pooled forward runs the base model's weights only: an adapter's vectors would
            # silently be the base model's.
            raise APIError(400, f"model: {body.model!r} is a LoRA adapter; embeddings are served for the base "
                           f"model {self.state.model_name!r} only", param="model", code="unsupported")
        items = checked(body.inputs)
        engine = self.state.require_engine()
        if self.state.config.world_size > 1:
            raise APIError(400, "embeddings are not served with tensor or pipeline parallelism", param="input",
                           code="unsupported")
        tokenizer = engine.tokenizer
        seqs = await self.on_tokenizer_thread(lambda: [tokenizer.encode(x) if isinstance(x, str) else x for x in items])
        for i, s in enumerate(seqs):
            if len(s) > engine.max_model_len:
                raise APIError(
                    400,
                    f"input[{i}] has {len(s)} tokens, more than max_model_len {engine.max_model_len}",
                    param="input",
                    code="context_length_exceeded",
                )
            if any(t < 0 or t >= engine.vocab_size for t in s):
                raise APIError(
                    400, f"input[{i}] holds token ids outside the vocabulary", param="input", code="invalid_value"
                )
        vectors: list[list[float]] = []
        for group in _groups(seqs, self.state.config.max_num_batched_tokens):
            vectors += await engine.embed(group, self.state.settings.pooler_config)
        dim = len(vectors[0])
        if body.dimensions is not None and body.dimensions != dim:
            raise APIError(
                400,
                f"dimensions: this model's embeddings have {dim} dimensions and cannot be shortened",
                param="dimensions",
                code="unsupported",
            )
        data = [
            {"object": "embedding", "index": i, "embedding": _encode(v, body.encoding_format)}
            for i, v in enumerate(vectors)
        ]
        n = sum(len(s) for s in seqs)
        return {
            "object": "list",
            "data": data,
            "model": self.state.response_model(body.model),
            "usage": {"prompt_tokens": n, "total_tokens": n},
        }


def _groups(seqs: list[list[int]], budget: int) -> list[list[list[int]]]:
    """Consecutive groups of at most ``budget`` tokens (a longer sequence alone)."""
    out: list[list[list[int]]] = []
    tokens = budget
    for s in seqs:
        if tokens + len(s) > budget:
            out.append([])
            tokens = 0
        out[-1].append(s)
        tokens += len(s)
    return out


def _encode(v: list[float], fmt: str) -> list[float] | str:
    if fmt == "float":
        return v
    return base64.b64encode(np.asarray(v, dtype="<f4").tobytes()).decode()


def embeddings_router(auth: Sequence[Any], parse_body: Callable[[Request, type], Awaitable[Any]]) -> APIRouter:
    router = APIRouter()

    schema = {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": EmbeddingRequest.model_json_schema()}},
        }
    }

    @router.post("/v1/embeddings", dependencies=list(auth), openapi_extra=schema, summary="Create embeddings")
    async def create_embedding(request: Request):
        body = await parse_body(request, EmbeddingRequest)
        return await request.app.state.serving_embedding.create_embedding(body)

    return router
