"""Continuous-batching scheduler (interface; implementation in progress)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvfleet.runtime.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    """One request's share of an engine step.

    The model runner computes ``token_ids`` at positions ``[start_pos, start_pos + len)``,
    writes their K/V into the slots of ``block_ids``, and, when ``sample`` is True,
    samples the next token from the logits of the last one.
    """

    request: Request
    start_pos: int
    """Tokens already in the KV cache (``request.num_computed_tokens`` before this step)."""
    token_ids: list[int]
    """The new tokens to compute this step."""
    block_ids: list[int]
    """The request's whole block table (physical block ids, logical order)."""
    sample: bool
    """True when this step reaches the request's last known token (the end of the prompt
    for a prefill, always for a decode): the runner samples one token."""

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def seq_len(self) -> int:
        """Context length after this step (``start_pos + num_new_tokens``)."""
        return self.start_pos + len(self.token_ids)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    """Running requests first (in running order), then newly admitted ones."""
    total_num_scheduled_tokens: int
    preempted_request_ids: list[str] = field(default_factory=list)
    finished_request_ids: set[str] = field(default_factory=set)
    """Requests finished since the previous schedule() (the runner drops their state)."""
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
