"""What the engine returns: one ``RequestOutput`` per user request (vLLM's shapes).

An output is cumulative, a delta or the final one, as the request's
``SamplingParams.output_kind`` asks (:class:`~kvfleet.runtime.sampling_params.RequestOutputKind`);
:meth:`RequestOutput.add` merges consecutive deltas (the async engine coalesces outputs its
consumer has not taken yet)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """Log-probability (natural log) of one token at one position (vLLM's ``Logprob``).

    Output tokens (``SamplingParams.logprobs``): of the distribution sampled from, after
    penalties and temperature. Prompt tokens (``SamplingParams.prompt_logprobs``):
    ``log_softmax`` of the model's raw logits in float32.
    """

    logprob: float
    rank: int | None = None
    """1-based rank of the token in the distribution."""
    decoded_token: str | None = None


# One dict per output token: token id -> Logprob (the sampled token plus the top ones).
SampleLogprobs = list[dict[int, Logprob]]


@dataclass
class CompletionOutput:
    """One of the ``n`` output sequences of a request. ``text``/``token_ids``/``logprobs`` are
    cumulative, or with ``RequestOutputKind.DELTA`` what is new since the previous output
    (``cumulative_logprob`` is always the running total)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None
    """``stop``, ``length``, ``abort``, or None while generating."""
    stop_reason: int | str | None = None
    """The stop string or stop token id that ended it (None for EOS or length)."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Timestamps in ``time.monotonic()`` seconds."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    """The state of one user request after an engine step: cumulative, or with
    ``RequestOutputKind.DELTA`` what changed since its previous output (only the sequences
    with something new are in ``outputs``; ``prompt_logprobs`` holds the entries not sent
    before, None when there are none)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    """With ``SamplingParams.prompt_logprobs=k``: one entry per prompt token, the first None
    (nothing predicts it); entry ``i`` maps the prompt token ``i`` (its logprob and 1-based
    rank) and the ``k`` most likely tokens at that position (ranks 1..k) to their
    :class:`Logprob`. Complete once the whole prompt is computed (from the first output on)."""
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache."""
    metrics: RequestMetrics | None = None
    priority: int = 0
    extra: dict = field(default_factory=dict)

    def add(self, later: RequestOutput, aggregate: bool) -> RequestOutput:
        """This output followed by ``later`` (the request's next one) as one output (vLLM's
        ``RequestOutput.add``): with ``aggregate`` (deltas) ``later``'s new pieces are appended
        to this one's, in place; otherwise (cumulative outputs) ``later`` is returned."""
        if not aggregate:
            return later
        self.finished = later.finished
        self.metrics = later.metrics
        self.num_cached_tokens = later.num_cached_tokens
        self.extra.update(later.extra)
        if later.prompt_logprobs is not None:
            self.prompt_logprobs = (self.prompt_logprobs or []) + later.prompt_logprobs
        mine = {c.index: c for c in self.outputs}
        for c in later.outputs:
            have = mine.get(c.index)
            if have is None:
                self.outputs.append(c)
                continue
            have.text += c.text
            have.token_ids.extend(c.token_ids)
            if c.logprobs is not None:
                if have.logprobs is None:
                    have.logprobs = list(c.logprobs)
                else:
                    have.logprobs.extend(c.logprobs)
            have.cumulative_logprob = c.cumulative_logprob
            have.finish_reason, have.stop_reason = c.finish_reason, c.stop_reason
        return self
