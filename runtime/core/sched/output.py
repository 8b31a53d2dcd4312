"""What one ``Scheduler.schedule()`` call hands the model runner and the stat loggers.

``SchedulerOutput`` lists the requests of one engine step (running ones first, then newly
admitted), each as a ``ScheduledRequest``: which tokens to compute at which positions into
which blocks, and whether to sample. ``SchedulerStats`` is the scheduler's state after the
step (gauges) and its counters since the previous step (deltas). Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvfleet.runtime.core.request import Request


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
    a prefill, always for a decode): the runner samples one token."""

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
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    """Running requests first (in running order), then newly admitted ones."""
    total_num_scheduled_tokens: int
    preempted_request_ids: list[str] = field(default_factory=list)
    finished_request_ids: set[str] = field(default_factory=set)
    """Requests finished since the previous schedule() (the runner drops their state)."""
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
