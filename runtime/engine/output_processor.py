"""The engine's output side: per-request state, stop strings, logprobs and ``RequestOutput``.

As vLLM v1's ``OutputProcessor``: :class:`OutputProcessor` owns the engine-side state of
every live user request (:class:`RequestState`, one :class:`SequenceState` per output
sequence: detokenizer, logprobs, timestamps), turns each new token into text (finishing a
sequence on a stop string, through the scheduler's ``finish_requests``), accumulates sample
and prompt logprobs as vLLM's per-position ``{token_id: Logprob}`` dicts, records per-request
stats on finish and builds the cumulative :class:`RequestOutput` of a user request. It holds
no tensors and never runs the model; :class:`~kvfleet.runtime.engine.llm_engine.LLMEngine`
calls it once per step with the tokens the scheduler appended.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvfleet.runtime.core.request import Request, RequestStatus
from kvfleet.runtime.engine.detokenizer import IncrementalDetokenizer
from kvfleet.runtime.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from kvfleet.runtime.engine.stats import FinishedRequestStats, IterationStats
from kvfleet.runtime.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvfleet.runtime.worker.model_runner import PromptLogprobsTensors
    from kvfleet.runtime.worker.sampler import SampleLogprobs


@dataclass
class SequenceState:
    """Engine-side state of one output sequence (one scheduler ``Request``)."""

    request: Request
    index: int
    detokenizer: IncrementalDetokenizer
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    finish_reason: str | None = None
    error: str | None = None


@dataclass
class RequestState:
    """A user request: a prompt and its ``n`` sequences."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    priority: int
    seqs: list[SequenceState] = field(default_factory=list)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    """One entry per prompt token computed so far (the first is None), when asked for;
    filled from the first sequence only (the others share the prompt)."""

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.seqs)


class OutputProcessor:
    """Live user requests and the outputs built from them.

    Args:
        tokenizer: the model's tokenizer (incremental detokenizing, logprob token texts).
        finish_requests: ``finish_requests(request_ids, status)`` of the scheduler: frees a
            sequence's blocks when a stop string or an error ends it here.

    ``requests`` maps a user request id to its :class:`RequestState`; ``seqs`` maps each
    sequence's scheduler request id to ``(RequestState, SequenceState)``.
    """

    def __init__(self, tokenizer, finish_requests: Callable[[list[str], RequestStatus], None]) -> None:
        self.tokenizer = tokenizer
        self._finish_requests = finish_requests
        self.requests: dict[str, RequestState] = {}
        self.seqs: dict[str, tuple[RequestState, SequenceState]] = {}
        self._decoded: dict[int, str] = {}

    def new_sequence(self, request: Request, index: int, params: SamplingParams) -> SequenceState:
        """The state of output sequence ``index`` of a new user request (``request`` is its
        scheduler request; logprob lists only when ``params.logprobs`` asks for them)."""
        seq = SequenceState(request, index, IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, params))
        if params.logprobs is not None:
            seq.logprobs = []
            seq.cumulative_logprob = 0.0
        return seq

    def in_use(self, state: RequestState) -> bool:
        """True if ``state``'s request id or one of its sequences' ids is live."""
        return state.request_id in self.requests or any(s.request.request_id in self.seqs for s in state.seqs)

    def add(self, state: RequestState) -> None:
        """Track a user request (its sequences are already in the scheduler)."""
        self.requests[state.request_id] = state
        for seq in state.seqs:
            self.seqs[seq.request.request_id] = (state, seq)

    def process_token(
        self, state: RequestState, seq: SequenceState, lp: SampleLogprobs | None, now: float, iteration: IterationStats
    ) -> None:
        """Account for the token the scheduler just appended to ``seq``: timestamps (TTFT,
        ITL into ``iteration``), logprobs, text; finish on a stop string (freeing its blocks)
        or on the scheduler's own finish (EOS, stop token ids, ``max_tokens``, ``max_model_len``)."""
        request = seq.request
        token = request.output_token_ids[-1]
        if seq.first_token_time is None:
            seq.first_token_time = now
            iteration.time_to_first_tokens.append(now - request.arrival_time)
        else:
            iteration.inter_token_latencies.append(now - seq.last_token_time)
        seq.last_token_time = now
        if seq.logprobs is not None and lp is not None:
            seq.logprobs.append(self.logprob_dict(token, lp.logprob, lp.rank, lp.top_ids, lp.top_logprobs))
            seq.cumulative_logprob += lp.logprob
        finished = request.is_finished
        # EOS / stop token ids end the sequence and are not part of the text (vLLM).
        stop_token = finished and request.status == RequestStatus.FINISHED_STOPPED
        if seq.detokenizer.update([token], request.num_output_tokens, skip_last=stop_token) and not finished:
            self._finish_requests([request.request_id], RequestStatus.FINISHED_STOPPED)
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = seq.detokenizer.stop_reason
            finished = True
        if finished:
            self.finish_sequence(state, seq, request.status.finish_reason or "stop", now, iteration)

    def abort_sequence(
        self, state: RequestState, seq: SequenceState, exc: Exception, now: float, iteration: IterationStats
    ) -> None:
        """Record ``exc`` as ``seq``'s error and, unless it already finished, abort it in the
        scheduler (its blocks freed) and finish it with ``finish_reason="abort"``."""
        seq.error = f"{type(exc).__name__}: {exc}"
        if seq.finish_reason is None:
            self._finish_requests([seq.request.request_id], RequestStatus.FINISHED_ABORTED)
            seq.request.status = RequestStatus.FINISHED_ABORTED
            self.finish_sequence(state, seq, "abort", now, iteration)

    def decode_token(self, token: int) -> str:
        """One token's text (``tokenizer.decode([token])``, as vLLM's ``decoded_token``), cached."""
        text = self._decoded.get(token)
        if text is None:
            text = self._decoded[token] = self.tokenizer.decode([token])
        return text

    def logprob_dict(
        self, token: int, logprob: float, rank: int, top_ids: list[int], top_logprobs: list[float]
    ) -> dict[int, Logprob]:
        """vLLM's per-position dict: the given token first (its logprob and rank), then the
        top tokens (ranks 1..k) that are not that token."""
        decode = self.decode_token
        out = {token: Logprob(logprob, rank, decode(token))}
        for r, (tid, value) in enumerate(zip(top_ids, top_logprobs), start=1):
            if tid not in out:
                out[tid] = Logprob(value, r, decode(tid))
        return out

    def add_prompt_logprobs(self, state: RequestState, seq: SequenceState, plp: PromptLogprobsTensors) -> None:
        """Append one step's prompt logprobs. Entries the request already has are skipped (the
        runner does not compute them again after a preemption, see
        ``Request.num_prompt_logprobs_done``; this keeps the list right regardless)."""
        acc = state.prompt_logprobs
        if acc is None:
            return
        skip = len(acc) - plp.first_token
        if skip < 0:
            raise RuntimeError(
                f"prompt logprobs from token {plp.first_token} but only {len(acc)} entries so far"
            )
        n = plp.token_logprobs.shape[0]
        if skip >= n:
            return
        prompt = state.prompt_token_ids
        lps = plp.token_logprobs[skip:].tolist()
        ranks = plp.token_ranks[skip:].tolist()
        top_ids = plp.top_ids[skip:].tolist()
        top_lps = plp.top_logprobs[skip:].tolist()
        first = plp.first_token + skip
        for j in range(n - skip):
            acc.append(self.logprob_dict(prompt[first + j], lps[j], ranks[j], top_ids[j], top_lps[j]))
        seq.request.num_prompt_logprobs_done = len(acc)

    def finish_sequence(
        self, state: RequestState, seq: SequenceState, reason: str, now: float, iteration: IterationStats
    ) -> None:
        """Mark ``seq`` finished with ``reason`` (``stop``, ``length``, ``abort``) at ``now``
        (``time.monotonic()`` seconds) and record its :class:`FinishedRequestStats`."""
        seq.finish_reason = reason
        seq.finished_time = now
        seq.detokenizer.finish()
        request = seq.request
        scheduled, first, last = seq.first_scheduled_time, seq.first_token_time, seq.last_token_time
        queue_time = (scheduled - request.arrival_time) if scheduled else 0.0
        iteration.finished_requests.append(
            FinishedRequestStats(
                finish_reason=reason,
                e2e_latency=now - request.arrival_time,
                queue_time=queue_time,
                num_prompt_tokens=request.num_prompt_tokens,
                num_generation_tokens=request.num_output_tokens,
                prefill_time=first - scheduled if scheduled and first else 0.0,
                decode_time=last - first if first and last else 0.0,
                inference_time=last - scheduled if scheduled and last else 0.0,
                max_tokens=state.params.max_tokens,
                n=state.params.n if state.finished else None,
                lora_name=request.lora_name,
            )
        )

    def drop(self, state: RequestState) -> None:
        """Forget a (finished) user request and its sequences."""
        self.requests.pop(state.request_id, None)
        for seq in state.seqs:
            self.seqs.pop(seq.request.request_id, None)

    def make_output(self, state: RequestState) -> RequestOutput:
        """The cumulative output of a user request (all its sequences); sequence errors
        are joined into ``extra["error"]``."""
        completions = []
        errors = []
        for seq in state.seqs:
            request = seq.request
            completions.append(
                CompletionOutput(
                    index=seq.index,
                    text=seq.detokenizer.output_text,
                    token_ids=list(request.output_token_ids),
                    cumulative_logprob=seq.cumulative_logprob,
                    logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
                    finish_reason=seq.finish_reason,
                    stop_reason=request.stop_reason if seq.finish_reason == "stop" else None,
                )
            )
            if seq.error:
                errors.append(seq.error)
        first = state.seqs[0]
        seqs = state.seqs
        finished = state.finished
        if len(seqs) == 1:  # the same values as the general case, without its generators
            metrics = RequestMetrics(
                arrival_time=state.arrival_time,
                first_scheduled_time=first.first_scheduled_time or None,
                first_token_time=first.first_token_time or None,
                last_token_time=first.last_token_time or None,
                finished_time=(first.finished_time or 0) if finished else None,
            )
        else:
            metrics = RequestMetrics(
                arrival_time=state.arrival_time,
                first_scheduled_time=min((s.first_scheduled_time for s in seqs if s.first_scheduled_time),
                                         default=None),
                first_token_time=min((s.first_token_time for s in seqs if s.first_token_time), default=None),
                last_token_time=max((s.last_token_time for s in seqs if s.last_token_time), default=None),
                finished_time=max((s.finished_time or 0 for s in seqs), default=None) if finished else None,
            )
        out = RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=completions,
            finished=finished,
            prompt_logprobs=list(state.prompt_logprobs) if state.prompt_logprobs is not None else None,
            num_cached_tokens=max(first.request.num_cached_tokens, 0),
            metrics=metrics,
            priority=state.priority,
        )
        if errors:
            out.extra["error"] = "; ".join(errors)
        return out

    def error_output(self, state: RequestState, exc: Exception) -> RequestOutput:
        """A finished, empty ``finish_reason="abort"`` output carrying ``exc`` in ``extra["error"]``."""
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=[CompletionOutput(index=s.index, text="", token_ids=[], finish_reason="abort") for s in state.seqs],
            finished=True,
            extra={"error": f"{type(exc).__name__}: {exc}"},
        )
