"""``--speculative-config``: which proposer, how many tokens, and its knobs (vLLM's field names).

The JSON object vLLM takes (``{"method": "ngram", "num_speculative_tokens": 4,
"prompt_lookup_max": 4, "prompt_lookup_min": 2}``) parses into :class:`SpeculativeConfig`;
unknown fields are refused with their name. Torch-free: the operator and the CLI import it.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvfleet.runtime.json_option import parse_json_option


class SpeculativeConfig(BaseModel):
    """One engine's speculative decoding.

    ``method``: ``ngram`` (prompt lookup) or ``suffix`` (suffix decoding); see
    :mod:`kvfleet.runtime.spec_decode`. ``num_speculative_tokens`` is the most tokens proposed
    per step (k); the engine verifies k + 1 positions per speculating sequence.
    """

    model_config = ConfigDict(extra="forbid")

    method: Literal["ngram", "suffix"] = "ngram"
    num_speculative_tokens: int = Field(4, ge=1, le=16)
    prompt_lookup_max: int = Field(4, ge=1, le=64)
    """ngram: the longest context n-gram looked up (tried first)."""
    prompt_lookup_min: int = Field(2, ge=1, le=64)
    """ngram: the shortest context n-gram looked up."""
    suffix_decoding_max_tree_depth: int = Field(24, ge=1, le=64)
    """suffix: the longest context the continuation table is keyed by."""
    suffix_decoding_max_cached_requests: int = Field(1000, ge=0)
    """suffix: finished requests whose outputs stay in the replica-wide table (0: own request only)."""
    suffix_decoding_min_token_prob: float = Field(0.1, ge=0.0, le=1.0)
    """suffix: a proposed token's estimated probability (its share of the continuations seen)
    below which the proposal stops."""
    disable_by_batch_size: int | None = Field(None, ge=1)
    """Speculate only while fewer requests than this run (the step turns compute-bound)."""
    min_acceptance_rate: float = Field(0.3, ge=0.0, le=1.0)
    """Adaptive k: a request whose recent acceptance falls below this proposes fewer tokens
    (down to none, with a periodic retry)."""

    @model_validator(mode="after")
    def _check_lookup(self) -> SpeculativeConfig:
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min ({self.prompt_lookup_min}) must be <= prompt_lookup_max "
                             f"({self.prompt_lookup_max})")
        return self

    @classmethod
    def parse(cls, value) -> SpeculativeConfig | None:
        """A JSON object string (the CLI, the environment), a mapping, a config, or None.

        Raises:
            ValueError: not JSON, not an object, or a field pydantic refuses."""
        return parse_json_option(cls, value, "speculative_config")
