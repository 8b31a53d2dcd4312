"""What one ``Scheduler.schedule()`` call hands the model runner and the stat loggers.

``SchedulerOutput`` has two views of one engine step:

- the scheduler's own (``scheduled``: one ``ScheduledRequest`` per request, running ones first,
  then newly admitted, holding the scheduler's ``Request``; the engine and
  ``Scheduler.update_from_output`` use it, it never crosses to the model runner);
- the model runner's, ``runner_input`` (:class:`RunnerInput`), plain data only (vLLM v1's
  contract): ``scheduled_new_reqs`` gives a
  request's data once (:class:`NewRequestData`: prompt, sampling parameters, LoRA id, block
  table, tokens already computed), ``scheduled_cached_reqs`` the per-step diff of a request the
  runner already holds (:class:`CachedRequestData`: blocks and output tokens appended since,
  tokens computed, whether it resumes from a preemption), ``num_scheduled_tokens`` the step's
  tokens per request in scheduling order, ``finished_request_ids`` the requests whose state the
  runner drops. :class:`RunnerFeed` (the scheduler's) remembers what the runner was sent.

``SchedulerStats`` is the scheduler's state after the step (gauges) and its counters since the
previous step (deltas). Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvfleet.runtime.core.request import Request
from kvfleet.runtime.sampling_params import SamplingParams


@dataclass
class ScheduledRequest:
    """One request's share of an engine step.

    The model runner computes ``token_ids`` at positions ``[start_pos, start_pos + len)``,
    writes their K/V into the slots of ``block_ids``, and, when ``sample`` is True,
    samples the next token from the logits of the last one.
    """

    request: Request
    start_pos: int
    """Tokens already in the KV cache before this step (prefix-cache hits included)."""
    token_ids: list[int]
    """The new tokens to compute this step."""
    block_ids: list[int] = field(default_factory=list)
    """The request's whole block table after this step's allocation (physical block ids,
    logical order); block ``i`` holds positions ``[i*block_size, (i+1)*block_size)``."""
    sample: bool = False
    """True when this step reaches the request's last known token (end of the prompt for
    a prefill, always for a decode): the runner samples one token (1 .. k + 1 with drafts)."""
    spec_token_ids: list[int] = field(default_factory=list)
    """Speculative decoding: the ``k`` proposed tokens this decode step verifies; they are the
    last ``k`` of ``token_ids`` and not (yet) output tokens."""

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def seq_len(self) -> int:
        """Context length after this step (``start_pos + num_new_tokens``), tokens."""
        return self.start_pos + len(self.token_ids)

    @property
    def request_id(self) -> str:
        return self.request.request_id


@dataclass
class NewRequestData:
    """A request the model runner has not seen: its data, sent once (vLLM's ``NewRequestData``)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    lora_int_id: int
    block_ids: list[int]
    """The whole block table after this step's allocation."""
    num_computed_tokens: int
    """Tokens already in the KV cache before this step (prefix-cache hits)."""
    output_token_ids: list[int]
    """Tokens generated so far (empty unless a fanned-out copy or a restart carried some)."""
    num_prompt_logprobs_done: int = 0


@dataclass
class CachedRequestData:
    """A request the runner holds: what changed since it was last scheduled (vLLM's ``CachedRequestData``)."""

    request_id: str
    new_token_ids: list[int]
    """Output tokens appended since the runner last heard of the request."""
    new_block_ids: list[int]
    """Blocks appended to its table; the whole table when ``replace_block_ids``."""
    num_computed_tokens: int
    """Tokens in the KV cache before this step."""
    resumed_from_preemption: bool = False
    replace_block_ids: bool = False
    """The table changed other than at its end (a resume, a sliding window's freed blocks)."""
    num_prompt_logprobs_done: int = 0


class RunnerFeed:
    """The scheduler's memory of what the model runner holds, per request: its block table and
    the number of output tokens sent, and its preemption count. Turns a step's
    ``ScheduledRequest`` s into the runner's plain view (new data once, then diffs)."""

    def __init__(self) -> None:
        self._sent: dict[str, tuple[list[int], int, int]] = {}

    def drop(self, request_id: str) -> None:
        self._sent.pop(request_id, None)

    def fill(self, scheduled: list[ScheduledRequest], out: RunnerInput) -> None:
        for sr in scheduled:
            r = sr.request
            out.num_scheduled_tokens[r.request_id] = sr.num_new_tokens
            if sr.spec_token_ids:
                out.scheduled_spec_decode_tokens[r.request_id] = sr.spec_token_ids
            sent = self._sent.get(r.request_id)
            self._sent[r.request_id] = (sr.block_ids, r.num_output_tokens, r.num_preemptions)
            if sent is None:
                out.scheduled_new_reqs.append(NewRequestData(
                    r.request_id, r.prompt_token_ids, r.sampling_params, r.eos_token_id, r.lora_int_id,
                    sr.block_ids, sr.start_pos, list(r.output_token_ids), r.num_prompt_logprobs_done))
                continue
            blocks, num_out, preemptions = sent
            resumed = preemptions != r.num_preemptions
            k = len(blocks)
            replace = resumed or k > len(sr.block_ids) or sr.block_ids[:k] != blocks
            out.scheduled_cached_reqs.append(CachedRequestData(
                r.request_id, r.output_token_ids[num_out:], sr.block_ids if replace else sr.block_ids[k:],
                sr.start_pos, resumed, replace, r.num_prompt_logprobs_done))


@dataclass
class RunnerInput:
    """The step as the model runner gets it: plain data only (picklable: the tensor-parallel
    driver broadcasts it to every rank)."""

    finished_request_ids: set[str] = field(default_factory=set)
    """Requests finished since the previous schedule(): the runner drops their state."""
    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    """The runner's view: requests it has not seen, their data once."""
    scheduled_cached_reqs: list[CachedRequestData] = field(default_factory=list)
    """The runner's view: requests it holds, what changed."""
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    """The runner's view: request id -> tokens to compute this step, in scheduling order
    (drafts included)."""
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    """Speculative decoding: request id -> the proposed tokens it verifies this step (the
    last ``len`` of its scheduled tokens); requests without drafts are absent."""


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    """The scheduler's view: running requests first (in running order), then newly admitted ones."""
    total_num_scheduled_tokens: int
    preempted_request_ids: list[str] = field(default_factory=list)
    finished_request_ids: set[str] = field(default_factory=set)
    """Requests finished since the previous schedule() (the runner drops their state)."""
    runner_input: RunnerInput = field(default_factory=RunnerInput)
    """The model runner's view of the step (plain data; see :class:`RunnerInput`)."""
    num_prefill_tokens: int = 0
    """Tokens of requests still in their prompt (chunked or not), this step."""
    num_decode_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class SchedulerStats:
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    num_waiting_prompt_tokens: int = 0
    """Prompt tokens of the waiting requests (what a prefill pool is scaled on)."""
    kv_cache_usage: float = 0.0
    """Fraction (0-1) of KV blocks referenced by requests (cached-but-free blocks excluded)."""
    num_preemptions: int = 0
    """Delta: preemptions during this step."""
    prefix_cache_queries: int = 0
    """Delta, tokens: prompt tokens looked up in the prefix cache (once per scheduled request)."""
    prefix_cache_hits: int = 0
    """Delta, tokens: of those, tokens found cached."""
    running_lora_adapters: dict[str, int] = field(default_factory=dict)
    """With LoRA enabled: adapter name -> running requests using it (vLLM's scheduler stat)."""
    waiting_lora_adapters: dict[str, int] = field(default_factory=dict)
    """With LoRA enabled: adapter name -> waiting requests asking for it."""
    spec_decoding: SpecDecodingStats | None = None
    """Delta: speculative decoding's drafts and acceptances this step (None: speculation off)."""


@dataclass
class SpecDecodingStats:
    """Speculative decoding counters of one step (vLLM's ``SpecDecodingStats``): drafts verified,
    tokens proposed, tokens accepted, and acceptances by draft position (0-based)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """Count one verified draft of ``num_draft_tokens`` of which the first
        ``num_accepted_tokens`` were accepted."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        per_pos = self.num_accepted_tokens_per_pos
        if len(per_pos) < num_accepted_tokens:
            per_pos.extend([0] * (num_accepted_tokens - len(per_pos)))
        for j in range(num_accepted_tokens):
            per_pos[j] += 1
