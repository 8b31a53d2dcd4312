"""The explicit state of one ``Scheduler.schedule()`` call: :class:`StepBudget`.

What the step has left (tokens of ``max_num_batched_tokens``, the free blocks the running
requests have reserved for their next token) and what it has decided so far (the scheduled
requests, in order; the preempted ids). Each phase of the step (running requests, their
speculative drafts, admission of waiting requests, the output) reads and updates one
``StepBudget``; giving tokens back when a request is unscheduled is :meth:`StepBudget.unschedule`.
Plain data, no policy: the scheduler decides, the budget keeps the books.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvfleet.runtime.core.sched.output import ScheduledRequest


@dataclass
class StepBudget:
    """One step's books (see the module doc)."""

    tokens: int
    """Tokens this step may still schedule (``max_num_batched_tokens`` at the start)."""
    scheduled: dict[str, ScheduledRequest] = field(default_factory=dict)
    """The step's requests by id, in the order they were scheduled."""
    preempted: list[str] = field(default_factory=list)
    """Ids of the requests preempted in this step, in order."""
    reserved_blocks: int | None = None
    """Free blocks the running requests need up to their next token (admission's lookahead);
    None: not counted yet, or stale after a preemption."""

    def schedule(self, sr: ScheduledRequest) -> None:
        """Add ``sr`` to the step, paying for its tokens."""
        self.scheduled[sr.request_id] = sr
        self.tokens -= sr.num_new_tokens

    def extend(self, sr: ScheduledRequest, spec_token_ids: list[int]) -> None:
        """Append the drafts ``sr`` verifies to its tokens, paying for them."""
        sr.token_ids = sr.token_ids + spec_token_ids
        sr.spec_token_ids = spec_token_ids
        self.tokens -= len(spec_token_ids)

    def unschedule(self, request_id: str) -> None:
        """Record ``request_id`` as preempted; its tokens of this step (if any) come back."""
        sr = self.scheduled.pop(request_id, None)
        if sr is not None:
            self.tokens += sr.num_new_tokens
        self.preempted.append(request_id)
        self.reserved_blocks = None

    def used(self, max_num_batched_tokens: int) -> int:
        """Tokens scheduled in this step."""
        return max_num_batched_tokens - self.tokens
