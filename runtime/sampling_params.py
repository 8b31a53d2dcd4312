"""Sampling parameters of one request (the fields and semantics of vLLM's
``SamplingParams``, which follow the OpenAI API plus vLLM's extras)."""

from __future__ import annotations

import enum
import json
import math
from dataclasses import dataclass, field, replace
from typing import Any

MAX_LOGPROBS = 20
"""Most top log-probabilities per token (``logprobs``, ``prompt_logprobs``): vLLM's default
``max_logprobs`` and OpenAI's limit."""


class RequestOutputKind(enum.IntEnum):
    """What each ``RequestOutput`` of a request holds (vLLM's ``RequestOutputKind``).

    ``CUMULATIVE``: everything so far (text, token ids, logprobs) in every output.
    ``DELTA``: only what is new since the request's previous output (each sequence that has
    something new, its ``finish_reason`` once); the server streams with it, so a long stream
    costs O(n), not O(n^2). ``FINAL_ONLY``: one output, when the request finished, cumulative
    (non-streamed answers and ``LLM.generate``)."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


class StructuredOutputError(ValueError):
    """A structured-output spec the grammar library cannot compile (bad JSON schema, regex,
    grammar, or an unsupported feature of one); the message is the library's, after a short
    prefix naming the kind of spec. Raised by the engine before the request is queued."""


@dataclass(frozen=True)
class StructuredOutputsParams:
    """What the output must match (vLLM's ``StructuredOutputsParams``): exactly one of ``json``
    (a JSON schema, dict or string), ``json_object`` (any JSON object), ``regex``, ``choice``
    (one of these strings), ``grammar`` (EBNF as xgrammar / llama.cpp's GBNF, or Lark) or
    ``structural_tag`` (an xgrammar structural tag as a JSON string; tool calling builds them).

    ``disable_any_whitespace`` (default True here): JSON is generated with fixed separators
    (``", "`` / ``": "``, one line), so a model cannot loop on whitespace forever (the known
    JSON-mode failure); False allows any whitespace between JSON tokens (vLLM's default).

    Raises:
        ValueError: none or several kinds given, or one of the wrong type.
    """

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = True

    def __post_init__(self) -> None:
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [k for k in ("json", "regex", "choice", "grammar", "structural_tag") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError(f"structured_outputs must set exactly one of json, json_object, regex, choice, grammar, "
                             f"structural_tag; got {given or 'none'}")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError("structured_outputs.json must be a JSON schema (an object or its JSON text)")
        for name in ("regex", "grammar", "structural_tag"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ValueError(f"structured_outputs.{name} must be a string")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings")

    @property
    def kind(self) -> str:
        """``json``, ``json_object``, ``regex``, ``choice``, ``grammar`` or ``structural_tag``."""
        if self.json_object:
            return "json_object"
        return next(k for k in ("json", "regex", "choice", "grammar", "structural_tag") if getattr(self, k) is not None)

    def key(self) -> tuple[str, str, bool]:
        """The compiled-grammar cache key: kind, the spec as canonical text, whitespace mode."""
        value: Any = getattr(self, self.kind)
        if isinstance(value, dict):
            value = json.dumps(value, sort_keys=True, separators=(",", ":"))
        elif isinstance(value, tuple):
            value = json.dumps(list(value))
        return self.kind, str(value), self.disable_any_whitespace


@dataclass
class SamplingParams:
    """How to sample the output tokens of one request.

    Penalties follow OpenAI's definition for ``presence_penalty`` and
    ``frequency_penalty`` (subtracted from the logits of tokens already generated:
    ``logit -= frequency_penalty * count + presence_penalty * (count > 0)``) and the
    CTRL paper (Keskar et al., 2019) as implemented in vLLM/transformers for
    ``repetition_penalty`` (over prompt and output tokens: positive logits are divided
    by it, negative ones multiplied).

    Raises:
        ValueError: on construction, when a field is out of range; the message starts
            with the field's name.
    """

    n: int = 1
    """Number of independent samples (output sequences) for the prompt."""
    max_tokens: int | None = 16
    """Maximum number of tokens to generate; ``None`` means up to ``max_model_len``."""
    min_tokens: int = 0
    """EOS and stop token ids are ignored until this many tokens are generated."""
    temperature: float = 1.0
    """0 means greedy (argmax)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability is >= top_p; in (0, 1]."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 or -1 disables."""
    min_p: float = 0.0
    """Drop tokens whose probability is below ``min_p`` times the top token's; in [0, 1]."""
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    """Seed of this request's own ``torch.Generator``: same seed, same text, in any batch."""
    stop: list[str] = field(default_factory=list)
    """Stop strings, matched on the detokenized text; not included in the output unless
    ``include_stop_str_in_output``."""
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    """Number of top log-probabilities to return per output token (0: only the sampled token's)."""
    prompt_logprobs: int | None = None
    """Number of top log-probabilities to return per prompt token, besides the prompt token's
    own (0: only the prompt token's); ``RequestOutput.prompt_logprobs``. ``log_softmax`` of
    the raw logits (no temperature or penalties), as vLLM's default. vLLM's -1 (the whole
    vocabulary) is refused: it is over the limit of 20 (vLLM's default ``max_logprobs``)."""
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    """Grammar-constrained decoding: each sampled token keeps the output a prefix of the
    spec's language (masks applied before penalties and temperature); the sequence stops when
    the grammar is complete and its stop token is sampled. See docs/server.md."""
    logit_bias: dict[int, float] | None = None
    """Token id -> bias added to its logit before sampling (OpenAI semantics: -100..100;
    -100 effectively bans a token, 100 makes it near certain)."""
    allowed_token_ids: list[int] | None = None
    """vLLM's extra: only these token ids may be sampled (with EOS not among them, a
    sequence ends only on ``max_tokens`` or a stop string)."""
    bad_words: list[str] = field(default_factory=list)
    """vLLM's extra: words never generated: the last token of each word's tokenization (with
    and without a leading space) is banned whenever the output ends with the tokens before it."""
    bad_words_token_ids: list[list[int]] | None = None
    """``bad_words`` tokenized (filled by the engine when it prepares the request)."""
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    """What each output of the request holds: :class:`RequestOutputKind`."""
    kv_transfer_params: dict[str, Any] | None = None
    """vLLM's ``kv_transfer_params`` (prefill/decode disaggregation, :mod:`kvfleet.runtime.kv_transfer.connector`):
    ``{"do_remote_decode": true}`` on a prefill leg; the prefill leg's answer on a decode leg."""

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.bad_words = list(self.bad_words or [])
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.output_kind, int) and self.output_kind in tuple(RequestOutputKind):
            self.output_kind = RequestOutputKind(self.output_kind)
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, why: str) -> None:
            raise ValueError(f"{name} {why}, got {getattr(self, name)!r}")

        if not isinstance(self.n, int) or self.n < 1:
            bad("n", "must be an integer >= 1")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            bad("max_tokens", "must be an integer >= 1")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                bad(name, "must be a finite number")
        if self.temperature < 0:
            bad("temperature", "must be >= 0")
        if not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            bad("top_k", "must be an integer >= 1, or 0 / -1 to disable")
        if not 0 <= self.min_p <= 1:
            bad("min_p", "must be in [0, 1]")
        if not -2 <= self.presence_penalty <= 2:
            bad("presence_penalty", "must be in [-2, 2]")
        if not -2 <= self.frequency_penalty <= 2:
            bad("frequency_penalty", "must be in [-2, 2]")
        if self.repetition_penalty <= 0:
            bad("repetition_penalty", "must be > 0")
        if self.seed is not None and not isinstance(self.seed, int):
            bad("seed", "must be an integer")
        if not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", "must be non-empty strings")
        if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be non-negative integers")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            bad("structured_outputs", "must be a StructuredOutputsParams")
        if self.kv_transfer_params is not None and (not isinstance(self.kv_transfer_params, dict)
                                                     or self.n != 1):
            bad("kv_transfer_params", "must be a JSON object, with n == 1")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or not all(
                    isinstance(t, int) and not isinstance(t, bool) and t >= 0 and isinstance(b, (int, float))
                    and not isinstance(b, bool) and math.isfinite(b) and -100 <= b <= 100
                    for t, b in self.logit_bias.items()):
                bad("logit_bias", "must map non-negative token ids to numbers in [-100, 100]")
        if self.allowed_token_ids is not None and (not self.allowed_token_ids or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.allowed_token_ids)):
            bad("allowed_token_ids", "must be a non-empty list of non-negative token ids")
        if not isinstance(self.output_kind, RequestOutputKind):
            bad("output_kind", "must be a RequestOutputKind")
        if not all(isinstance(w, str) and w.strip() for w in self.bad_words):
            bad("bad_words", "must be non-empty strings")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0 or value > MAX_LOGPROBS):
                if value == -1:
                    bad(name, f"must be an integer in [0, {MAX_LOGPROBS}] (-1, every vocabulary token, is over "
                              f"the limit of {MAX_LOGPROBS}, vLLM's default max_logprobs)")
                bad(name, f"must be an integer in [0, {MAX_LOGPROBS}]")

    @property
    def greedy(self) -> bool:
        """True when sampling is argmax (temperature 0)."""
        return self.temperature == 0.0

    def clone(self, **changes) -> SamplingParams:
        """A validated copy with some fields changed."""
        return replace(self, **changes)
