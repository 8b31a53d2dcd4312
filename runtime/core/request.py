"""A request as the scheduler and KV cache manager see it (one output sequence).

A user request with ``n > 1`` is fanned out by the engine into ``n`` requests that
share the prompt (and, with prefix caching, its KV blocks: the later ones name the first as
their ``prompt_leader`` and wait for it to compute the prompt, see
:mod:`kvfleet.runtime.core.sched.scheduler`).
"""

from __future__ import annotations

import enum
import time
from typing import Protocol

from kvfleet.runtime.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything after this is finished.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()
    """Rejected: can never fit (prompt longer than max_model_len or than the whole cache)."""

    @property
    def finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        """OpenAI finish_reason: ``stop``, ``length``, ``abort``, or None while unfinished."""
        return _FINISH_REASON.get(self)


_FINISH_REASON = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_IGNORED: "length",
}


class GrammarState(Protocol):
    """The grammar matcher of one constrained sequence, as the scheduler sees it (implemented by
    :class:`kvfleet.runtime.structured_output.grammar.Grammar`; torch-free here)."""

    def accept_token(self, token: int) -> bool:
        """Advance by the sampled ``token``; True when the sequence must stop: the grammar
        terminated (its stop token was accepted) or rejected the token."""
        ...

    def validate_tokens(self, tokens: list[int]) -> int:
        """How many of ``tokens`` (speculative proposals) the grammar accepts in a row from its
        state now, without ending there; the state is left unchanged."""
        ...


class Request:
    """One sequence being generated.

    Attributes:
        request_id: unique id (a fanned-out child of a ``n > 1`` request is ``"{parent}-{i}"``).
        prompt_token_ids: the prompt, token ids.
        output_token_ids: tokens generated so far (appended by the scheduler).
        num_computed_tokens: tokens whose K/V are in the cache (prompt + output prefix).
        priority: lower runs first under the ``priority`` policy (vLLM semantics).
        tenant: fairness group under the ``fair`` policy (OpenAI ``user`` field or API key).
        arrival_time: ``time.monotonic()`` seconds when the request arrived.
        num_preemptions: how many times it was preempted (recompute).
        block_hashes: prefix-cache hashes of its full blocks, extended by the KV cache manager.
        stop_reason: the stop string or stop token id that finished it, if any.
        num_prompt_logprobs_done: with ``sampling_params.prompt_logprobs``, prompt positions
            whose logprobs the engine already holds (the first token's, which has none,
            counts): after a preemption the model runner does not compute them again.
        prompt_leader: for a later sequence of a fanned-out ``n > 1`` request, the first
            sequence (same prompt). With prefix caching on, the scheduler admits this one
            only once the leader has its whole prompt computed or scheduled in the current
            step (or finished), so that it
            reuses the leader's prompt blocks from the prefix cache instead of computing
            them again; then the scheduler sets it back to None. None otherwise.
        structured_output: the sequence's grammar matcher (``n > 1``: one per sequence), advanced
            by the scheduler with each token it appends; None when unconstrained. Preemption by
            recompute keeps the output tokens, so the matcher state stays valid.
        lora_name / lora_int_id: the LoRA adapter it runs with (``lora_int_id`` unique per
            adapter load, see :class:`kvfleet.runtime.lora_request.LoRARequest`); None / 0: the
            base model. The id seeds the prefix-cache hash chain and counts against ``max_loras``.
        spec_token_ids: speculative decoding's proposed next tokens (from the model runner's
            previous step), verified in the request's next decode step; never output tokens
            until the runner accepts them. Emptied on preemption.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None = None,
        *,
        arrival_time: float | None = None,
        priority: int = 0,
        tenant: str | None = None,
        cache_salt: str | None = None,
        prompt_leader: Request | None = None,
        lora_name: str | None = None,
        lora_int_id: int = 0,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError("prompt must not be empty")
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.priority = priority
        self.tenant = tenant
        self.cache_salt = cache_salt
        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.num_preemptions = 0
        self.block_hashes: list[int] = []
        self.stop_reason: int | str | None = None
        self.num_prompt_logprobs_done = 0
        self.prompt_leader = prompt_leader
        self.structured_output: GrammarState | None = None
        self.lora_name = lora_name
        self.lora_int_id = lora_int_id
        self.spec_token_ids: list[int] = []
        # Prefix-cache accounting: counted once per successful schedule from WAITING.
        self.num_cached_tokens = -1

    # -- derived ------------------------------------------------------------------
    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        """Token ids at positions ``[start, end)`` of prompt + output, without copying both lists."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, prompt={self.num_prompt_tokens}, "
            f"output={self.num_output_tokens}, computed={self.num_computed_tokens})"
        )
