"""The engine's output side: per-request state, stop strings, logprobs and ``RequestOutput``.

As vLLM v1's ``OutputProcessor``: :class:`OutputProcessor` owns the engine-side state of every
live user request (:class:`RequestState`, one :class:`SequenceState` per output sequence: its
own token ids, detokenizer, logprobs, timestamps), turns new tokens into text, finds stop
strings, accumulates sample and prompt logprobs as vLLM's per-position ``{token_id: Logprob}``
dicts, records per-request stats on finish and builds each request's :class:`RequestOutput`
(cumulative, delta or final-only: ``SamplingParams.output_kind``).

Contract, plain data both ways: the engine tells it which sequences were scheduled
(:meth:`OutputProcessor.record_scheduled`), hands it prompt logprobs by sequence id
(:meth:`OutputProcessor.add_prompt_logprobs`) and one :class:`SequenceUpdate` per sequence
the scheduler appended tokens to; it answers with an :class:`OutputProcessorOutput`: the
outputs to send and the sequence ids the scheduler must finish (a stop string or an error
ended them here), by status. It never calls the scheduler, never touches a scheduler
``Request``, holds no tensors and never runs the model; the engine asks it about requests by
id only. A ``DELTA`` output copies only what is new, so a streamed request of ``n`` tokens
costs O(n) here; ``CUMULATIVE`` copies everything every time (O(n^2) over a stream).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvfleet.runtime.core.request import RequestStatus
from kvfleet.runtime.engine.detokenizer import IncrementalDetokenizer
from kvfleet.runtime.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from kvfleet.runtime.engine.stats import FinishedRequestStats, IterationStats
from kvfleet.runtime.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from kvfleet.runtime.worker.prompt_logprobs import PromptLogprobsTensors
    from kvfleet.runtime.worker.sampler import SampleLogprobs

logger = logging.getLogger(__name__)


@dataclass
class SequenceUpdate:
    """What the scheduler did to one sequence this step (vLLM's ``EngineCoreOutput``)."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    """``stop`` (EOS, a stop token id, a complete grammar) or ``length`` when the scheduler
    finished the sequence with these tokens; None while it runs."""
    stop_reason: int | None = None
    """The stop token id that finished it, if one did."""
    logprobs: SampleLogprobs | None = None
    """The sampler's logprobs of the last new token, when the request asked for them."""


@dataclass
class OutputProcessorOutput:
    """What the engine must do after output processing: send ``request_outputs``, and finish
    the sequences in ``finish`` (status -> sequence ids) in the scheduler (their blocks freed)."""

    request_outputs: list[RequestOutput] = field(default_factory=list)
    finish: dict[RequestStatus, list[str]] = field(default_factory=dict)

    def add_finish(self, status: RequestStatus, request_ids: Iterable[str]) -> None:
        self.finish.setdefault(status, []).extend(request_ids)


@dataclass
class SequenceState:
    """Engine-side state of one output sequence (one scheduler request, by ``request_id``)."""

    request_id: str
    index: int
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    num_cached_tokens: int = -1
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    sent_tokens: int = 0
    """How many tokens, characters of text and logprob entries earlier outputs carried (DELTA)."""
    sent_text: int = 0
    sent_logprobs: int = 0
    sent_finish: bool = False

    @classmethod
    def start(
        cls, tokenizer, request_id: str, index: int, prompt_token_ids: list[int], params: SamplingParams
    ) -> SequenceState:
        """Sequence ``index`` of a new user request (logprob lists only when ``params.logprobs``
        asks for them)."""
        seq = cls(request_id, index, IncrementalDetokenizer(tokenizer, prompt_token_ids, params))
        if params.logprobs is not None:
            seq.logprobs = []
            seq.cumulative_logprob = 0.0
        return seq


@dataclass
class RequestState:
    """A user request: a prompt and its ``n`` sequences."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    priority: int
    lora_name: str | None = None
    lora_int_id: int = 0
    seqs: list[SequenceState] = field(default_factory=list)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    """One entry per prompt token computed so far (the first is None), when asked for;
    filled from the first sequence only (the others share the prompt)."""
    sent_prompt_logprobs: int = 0

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.seqs)


class OutputProcessor:
    """Live user requests and the outputs built from them.

    Args:
        tokenizer: the model's tokenizer (incremental detokenizing, logprob token texts).
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._requests: dict[str, RequestState] = {}
        self._seqs: dict[str, tuple[RequestState, SequenceState]] = {}
        self._touched: dict[str, RequestState] = {}
        """Requests changed this step outside :meth:`process_outputs` (a prompt-logprobs failure)."""
        self._decoded: dict[int, str] = {}

    # ------------------------------------------------------------------ requests in and out
    @property
    def num_requests(self) -> int:
        """Live (unfinished) user requests."""
        return len(self._requests)

    def in_use(self, state: RequestState) -> bool:
        """True if ``state``'s request id or one of its sequences' ids is live."""
        return state.request_id in self._requests or any(s.request_id in self._seqs for s in state.seqs)

    def add_request(self, state: RequestState) -> None:
        """Track a user request (its sequences are already in the scheduler)."""
        self._requests[state.request_id] = state
        for seq in state.seqs:
            self._seqs[seq.request_id] = (state, seq)

    def request_ids_with_lora(self, lora_int_id: int) -> list[str]:
        """The live user requests that run on the LoRA adapter ``lora_int_id``."""
        return [rid for rid, state in self._requests.items() if state.lora_int_id == lora_int_id]

    def _drop(self, state: RequestState) -> None:
        self._requests.pop(state.request_id, None)
        for seq in state.seqs:
            self._seqs.pop(seq.request_id, None)

    # ------------------------------------------------------------------ the step
    def record_scheduled(self, num_cached_tokens: dict[str, int], now: float) -> None:
        """The sequences of this step (sequence id -> its prompt tokens served from the prefix
        cache): the first time a sequence is scheduled is its ``first_scheduled_time``."""
        for rid, cached in num_cached_tokens.items():
            entry = self._seqs.get(rid)
            if entry is not None and entry[1].first_scheduled_time is None:
                entry[1].first_scheduled_time = now
                entry[1].num_cached_tokens = cached

    def add_prompt_logprobs(self, request_id: str, plp: PromptLogprobsTensors) -> int | None:
        """Append one step's prompt logprobs of a sequence; returns how many prompt positions
        the request now holds (None: it did not ask for them or is not live). Entries it
        already has are skipped (a preempted request's prompt is computed again).

        Raises:
            Exception: any failure; the engine then calls :meth:`fail_sequence`."""
        entry = self._seqs.get(request_id)
        if entry is None or entry[0].prompt_logprobs is None:
            return None
        state = entry[0]
        acc = state.prompt_logprobs
        skip = len(acc) - plp.first_token
        if skip < 0:
            raise RuntimeError(f"prompt logprobs from token {plp.first_token} but only {len(acc)} entries so far")
        n = plp.token_logprobs.shape[0]
        if skip < n:
            prompt = state.prompt_token_ids
            lps = plp.token_logprobs[skip:].tolist()
            ranks = plp.token_ranks[skip:].tolist()
            top_ids = plp.top_ids[skip:].tolist()
            top_lps = plp.top_logprobs[skip:].tolist()
            first = plp.first_token + skip
            for j in range(n - skip):
                acc.append(self._logprob_dict(prompt[first + j], lps[j], ranks[j], top_ids[j], top_lps[j]))
        return len(acc)

    def fail_sequence(self, request_id: str, exc: Exception, now: float, iteration: IterationStats) -> list[str]:
        """Record ``exc`` as the sequence's error and, unless it already finished, finish it with
        ``finish_reason="abort"``; its request is in this step's outputs. Returns the ids the
        scheduler must abort (empty when it had already finished)."""
        entry = self._seqs.get(request_id)
        if entry is None:
            return []
        state, seq = entry
        self._touched[state.request_id] = state
        return self._fail(state, seq, exc, now, iteration)

    def process_outputs(
        self, updates: list[SequenceUpdate], now: float, iteration: IterationStats
    ) -> OutputProcessorOutput:
        """Account for this step's new tokens (timestamps: TTFT and ITL into ``iteration``,
        logprobs, text, stop strings) and build the outputs of every request that changed.
        A failure in one request aborts that request (``finish_reason="abort"``,
        ``extra["error"]``); the others go on."""
        result = OutputProcessorOutput()
        touched, self._touched = self._touched, {}
        for update in updates:
            entry = self._seqs.get(update.request_id)
            if entry is None:
                continue
            state, seq = entry
            touched[state.request_id] = state
            if seq.finish_reason is not None:  # it failed earlier in this step
                continue
            try:
                if self._process_update(state, seq, update, now, iteration):
                    result.add_finish(RequestStatus.FINISHED_STOPPED, [seq.request_id])
            except Exception as exc:  # one bad request must not take the engine down
                logger.exception("request %s failed while processing its output", seq.request_id)
                result.add_finish(RequestStatus.FINISHED_ABORTED, self._fail(state, seq, exc, now, iteration))
        for state in touched.values():
            try:
                out = self._make_output(state)
            except Exception as exc:
                logger.exception("request %s failed while building its output", state.request_id)
                for seq in state.seqs:
                    if seq.finish_reason is None:
                        result.add_finish(RequestStatus.FINISHED_ABORTED, [seq.request_id])
                        self._finish_sequence(state, seq, "abort", now, iteration)
                out = self._error_output(state, exc)
            if out is not None:
                result.request_outputs.append(out)
            if state.finished:
                self._drop(state)
        return result

    def abort_requests(self, request_ids: list[str], now: float, iteration: IterationStats) -> OutputProcessorOutput:
        """Abort user requests or single sequences (by their ``{id}-{i}`` id); unknown or
        finished ids are ignored. Returns the sequence ids the scheduler must abort and the
        final outputs (``finish_reason="abort"``) of the user requests this finished."""
        result = OutputProcessorOutput()
        touched: dict[str, RequestState] = {}
        for rid in request_ids:
            if rid in self._requests:
                state = self._requests[rid]
                seqs = state.seqs
            elif rid in self._seqs:
                state, seq = self._seqs[rid]
                seqs = [seq]
            else:
                continue
            for s in seqs:
                if s.finish_reason is None:
                    result.add_finish(RequestStatus.FINISHED_ABORTED, [s.request_id])
                    self._finish_sequence(state, s, "abort", now, iteration)
            touched[state.request_id] = state
        for state in touched.values():
            if state.finished:  # an unfinished one reports its aborted sequence in its next output
                out = self._make_output(state)
                if out is not None:
                    result.request_outputs.append(out)
                self._drop(state)
        return result

    # ------------------------------------------------------------------ one sequence
    def _process_update(
        self, state: RequestState, seq: SequenceState, update: SequenceUpdate, now: float, iteration: IterationStats
    ) -> bool:
        """Returns True when a stop string ended the sequence here (the scheduler must finish it)."""
        new = update.new_token_ids
        seq.token_ids.extend(new)
        if seq.first_token_time is None:
            seq.first_token_time = now
            iteration.time_to_first_tokens.append(now - state.arrival_time)
        else:
            iteration.inter_token_latencies.append(now - seq.last_token_time)
        seq.last_token_time = now
        lp = update.logprobs
        if seq.logprobs is not None and lp is not None:
            seq.logprobs.append(self._logprob_dict(new[-1], lp.logprob, lp.rank, lp.top_ids, lp.top_logprobs))
            seq.cumulative_logprob += lp.logprob
        finished = update.finish_reason is not None
        # EOS / stop token ids end the sequence and are not part of the text (vLLM).
        stop_token = update.finish_reason == "stop"
        if seq.detokenizer.update(new, len(seq.token_ids), skip_last=stop_token) and not finished:
            seq.stop_reason = seq.detokenizer.stop_reason
            self._finish_sequence(state, seq, "stop", now, iteration)
            return True
        if finished:
            seq.stop_reason = update.stop_reason
            self._finish_sequence(state, seq, update.finish_reason, now, iteration)
        return False

    def _fail(
        self, state: RequestState, seq: SequenceState, exc: Exception, now: float, iteration: IterationStats
    ) -> list[str]:
        seq.error = f"{type(exc).__name__}: {exc}"
        if seq.finish_reason is not None:
            return []
        self._finish_sequence(state, seq, "abort", now, iteration)
        return [seq.request_id]

    def _finish_sequence(
        self, state: RequestState, seq: SequenceState, reason: str, now: float, iteration: IterationStats
    ) -> None:
        """Mark ``seq`` finished with ``reason`` (``stop``, ``length``, ``abort``) at ``now``
        (``time.monotonic()`` seconds) and record its :class:`FinishedRequestStats`."""
        seq.finish_reason = reason
        seq.finished_time = now
        seq.detokenizer.finish()
        scheduled, first, last = seq.first_scheduled_time, seq.first_token_time, seq.last_token_time
        iteration.finished_requests.append(
            FinishedRequestStats(
                finish_reason=reason,
                e2e_latency=now - state.arrival_time,
                queue_time=(scheduled - state.arrival_time) if scheduled else 0.0,
                num_prompt_tokens=len(state.prompt_token_ids),
                num_generation_tokens=len(seq.token_ids),
                prefill_time=first - scheduled if scheduled and first else 0.0,
                decode_time=last - first if first and last else 0.0,
                inference_time=last - scheduled if scheduled and last else 0.0,
                max_tokens=state.params.max_tokens,
                n=state.params.n if state.finished else None,
                lora_name=state.lora_name,
            )
        )

    def _decode_token(self, token: int) -> str:
        """One token's text (``tokenizer.decode([token])``, as vLLM's ``decoded_token``), cached."""
        text = self._decoded.get(token)
        if text is None:
            text = self._decoded[token] = self.tokenizer.decode([token])
        return text

    def _logprob_dict(
        self, token: int, logprob: float, rank: int, top_ids: list[int], top_logprobs: list[float]
    ) -> dict[int, Logprob]:
        """vLLM's per-position dict: the given token first (its logprob and rank), then the
        top tokens (ranks 1..k) that are not that token."""
        decode = self._decode_token
        out = {token: Logprob(logprob, rank, decode(token))}
        for r, (tid, value) in enumerate(zip(top_ids, top_logprobs), start=1):
            if tid not in out:
                out[tid] = Logprob(value, r, decode(tid))
        return out

    # ------------------------------------------------------------------ outputs
    def _make_output(self, state: RequestState) -> RequestOutput | None:
        """The request's output as its ``output_kind`` asks (None: nothing to send now);
        sequence errors are joined into ``extra["error"]``."""
        kind = state.params.output_kind
        finished = state.finished
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        delta = kind == RequestOutputKind.DELTA
        completions = [c for c in (self._completion(seq, delta) for seq in state.seqs) if c is not None]
        plp = state.prompt_logprobs
        if plp is not None and delta:
            plp, state.sent_prompt_logprobs = plp[state.sent_prompt_logprobs:] or None, len(plp)
        elif plp is not None:
            plp = list(plp)
        out = RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=completions,
            finished=finished,
            prompt_logprobs=plp,
            num_cached_tokens=max(state.seqs[0].num_cached_tokens, 0),
            metrics=self._metrics(state, finished),
            priority=state.priority,
        )
        errors = [s.error for s in state.seqs if s.error]
        if errors:
            out.extra["error"] = "; ".join(errors)
        return out

    @staticmethod
    def _completion(seq: SequenceState, delta: bool) -> CompletionOutput | None:
        """The sequence's output: everything, or (``delta``) what earlier outputs did not
        carry (None when that is nothing)."""
        detok = seq.detokenizer
        end = detok.visible_length
        t0, k0, l0 = (seq.sent_text, seq.sent_tokens, seq.sent_logprobs) if delta else (0, 0, 0)
        if delta and end == t0 and len(seq.token_ids) == k0 and (seq.finish_reason is None or seq.sent_finish):
            return None
        logprobs = seq.logprobs
        out = CompletionOutput(
            index=seq.index,
            text=detok.text[t0:end] if (t0 or end != len(detok.text)) else detok.text,
            token_ids=seq.token_ids[k0:],
            cumulative_logprob=seq.cumulative_logprob,
            logprobs=logprobs[l0:] if logprobs is not None else None,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason if seq.finish_reason == "stop" else None,
        )
        if delta:
            seq.sent_text, seq.sent_tokens = end, len(seq.token_ids)
            seq.sent_logprobs = len(logprobs) if logprobs is not None else 0
            seq.sent_finish = seq.finish_reason is not None
        return out

    @staticmethod
    def _metrics(state: RequestState, finished: bool) -> RequestMetrics:
        seqs = state.seqs
        if len(seqs) == 1:  # the same values as the general case, without its generators
            first = seqs[0]
            return RequestMetrics(
                arrival_time=state.arrival_time,
                first_scheduled_time=first.first_scheduled_time or None,
                first_token_time=first.first_token_time or None,
                last_token_time=first.last_token_time or None,
                finished_time=(first.finished_time or 0) if finished else None,
            )
        return RequestMetrics(
            arrival_time=state.arrival_time,
            first_scheduled_time=min((s.first_scheduled_time for s in seqs if s.first_scheduled_time), default=None),
            first_token_time=min((s.first_token_time for s in seqs if s.first_token_time), default=None),
            last_token_time=max((s.last_token_time for s in seqs if s.last_token_time), default=None),
            finished_time=max((s.finished_time or 0 for s in seqs), default=None) if finished else None,
        )

    @staticmethod
    def _error_output(state: RequestState, exc: Exception) -> RequestOutput:
        """A finished, empty ``finish_reason="abort"`` output carrying ``exc`` in ``extra["error"]``."""
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=[CompletionOutput(index=s.index, text="", token_ids=[], finish_reason="abort") for s in state.seqs],
            finished=True,
            extra={"error": f"{type(exc).__name__}: {exc}"},
        )
