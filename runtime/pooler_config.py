"""``PoolerConfig``: how ``/v1/embeddings`` pools a decoder's hidden states (vLLM's
``--pooler-config`` fields kvfleet implements). Plain data shared by the server options and the
pooling forward (:mod:`kvfleet.runtime.worker.pooler`)."""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict


class PoolerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    pooling_type: Literal["LAST", "MEAN"] = "LAST"
    """``LAST``: the last token's hidden state (what a causal decoder has read the whole input
    into); ``MEAN``: the average over the input's tokens."""
    normalize: bool = True
    """L2-normalise each vector (cosine similarity is then a dot product)."""

    @classmethod
    def parse(cls, value):
        """A JSON string (the command line, the environment) or a mapping."""
        return cls.model_validate(json.loads(value) if isinstance(value, str) else value)
