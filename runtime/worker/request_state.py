"""The model runner's own per-request state, kept from step to step (vLLM v1's ``CachedRequestState``).

Contract: :meth:`RequestStates.update` takes the plain view of a step, a ``RunnerInput``
(:mod:`kvfleet.runtime.core.sched.output`: ``scheduled_new_reqs`` once per request,
``scheduled_cached_reqs`` diffs afterwards, ``num_scheduled_tokens`` in scheduling order,
``finished_request_ids``, ``scheduled_spec_decode_tokens``) and returns the step's
:class:`ScheduledRow` s, in scheduling order: which tokens to compute at which positions into
which blocks, whether to sample, and which of the tokens are speculative drafts to verify. It never
sees the scheduler's ``Request`` objects; the state is plain data (lists and
``SamplingParams``) the sampler, the LoRA context and the input batch read. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvfleet.runtime.core.sched.output import RunnerInput
from kvfleet.runtime.sampling_params import SamplingParams


@dataclass(eq=False)
class CachedRequestState:
    """One request as the runner holds it (identity matters: the input batch keys rows by it)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    lora_int_id: int
    block_ids: list[int]
    num_computed_tokens: int
    output_token_ids: list[int] = field(default_factory=list)
    num_prompt_logprobs_done: int = 0
    num_preemptions: int = 0
    """Resumes seen: the input batch rewrites the request's block-table row after one."""

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        """Token ids at positions ``[start, end)`` of prompt + output."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]


@dataclass
class ScheduledRow:
    """One request's share of the step, as the runner computes it: ``token_ids`` at positions
    ``[start_pos, start_pos + len)`` into the slots of ``block_ids``; ``sample``: the step
    reaches the request's last known token, so one token is sampled from its last row."""

    request: CachedRequestState
    start_pos: int
    token_ids: list[int]
    block_ids: list[int]
    sample: bool
    spec_token_ids: list[int] = field(default_factory=list)
    """Speculative decoding: the last ``len`` of ``token_ids`` are proposed tokens this step
    verifies; the runner then keeps the logits of the last ``1 + len`` rows."""

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def seq_len(self) -> int:
        return self.start_pos + len(self.token_ids)


class RequestStates:
    """The runner's persistent per-request state, by request id."""

    def __init__(self) -> None:
        self.requests: dict[str, CachedRequestState] = {}

    def __len__(self) -> int:
        return len(self.requests)

    def update(self, scheduler_output: RunnerInput) -> list[ScheduledRow]:
        """Apply one step's plain view (drop finished, add new, apply diffs); the step's rows."""
        for rid in scheduler_output.finished_request_ids:
            self.requests.pop(rid, None)
        for new in scheduler_output.scheduled_new_reqs:
            self.requests[new.request_id] = CachedRequestState(
                new.request_id, new.prompt_token_ids, new.sampling_params, new.eos_token_id, new.lora_int_id,
                list(new.block_ids), new.num_computed_tokens, list(new.output_token_ids),
                new.num_prompt_logprobs_done,
            )
        for diff in scheduler_output.scheduled_cached_reqs:
            state = self.requests[diff.request_id]
            state.output_token_ids.extend(diff.new_token_ids)
            if diff.replace_block_ids:
                state.block_ids = list(diff.new_block_ids)
            else:
                state.block_ids.extend(diff.new_block_ids)
            state.num_computed_tokens = diff.num_computed_tokens
            state.num_prompt_logprobs_done = diff.num_prompt_logprobs_done
            state.num_preemptions += diff.resumed_from_preemption
        rows = []
        spec = scheduler_output.scheduled_spec_decode_tokens
        for rid, n in scheduler_output.num_scheduled_tokens.items():
            state = self.requests[rid]
            start = state.num_computed_tokens
            drafts = spec.get(rid, [])
            end = start + n - len(drafts)
            rows.append(ScheduledRow(state, start, state.token_ids_slice(start, end) + drafts, state.block_ids,
                                     end == state.num_tokens, drafts))
            state.num_computed_tokens = end + len(drafts)
        return rows
