"""Continuous-batching scheduler: one ``schedule()`` call per engine step.

Each step serves the running requests first (one decode token each, or the next chunk of a
long prefill), then admits waiting requests while the token budget
(``max_num_batched_tokens``), the sequence cap (``max_num_seqs``) and free KV blocks allow,
keeping a watermark of spare blocks (vLLM v0's ``watermark``, 1%). Prefill and decode
tokens share one packed forward pass (chunked prefill). When a running request cannot get a
block, the victim (lowest priority, then latest arrival) is preempted by recompute (Kwon et
al. 2023, PagedAttention, section 4.5) and goes back to the head of the waiting queue. With
a uniform sliding window, block needs count at most
:func:`~kvfleet.runtime.core.kv_cache_manager.max_num_blocks_per_request`; with ``n > 1`` and
prefix caching, a sequence waits for its ``prompt_leader`` to compute the prompt. With LoRA
(``enable_lora``) no more than ``max_loras`` distinct adapters run at once: a waiting request
of another adapter is passed over (it keeps its place) until one of them has no running request.
Shape of vLLM v1 (``vllm/v1/core/sched/scheduler.py``) and nano-vllm; no tensors. Admission
rule, sliding windows, parallel sampling: docs/scheduling.md.
"""

from __future__ import annotations

from kvfleet.runtime.config import EngineConfig
from kvfleet.runtime.core.kv_cache_manager import KVCacheManager
from kvfleet.runtime.core.request import Request, RequestStatus
from kvfleet.runtime.core.sched.budget import StepBudget
from kvfleet.runtime.core.sched.output import (
    RunnerFeed,
    ScheduledRequest,
    SchedulerOutput,
    SchedulerStats,
    SpecDecodingStats,
)
from kvfleet.runtime.core.sched.request_queue import create_request_queue


class Scheduler:
    """Decides, each step, which requests run, how many tokens each, and which blocks.

    Args:
        config: ``block_size``, ``max_num_seqs``, ``max_num_batched_tokens``,
            ``enable_prefix_caching``, ``enable_chunked_prefill``, ``scheduling_policy``.
        num_blocks: physical KV blocks.
        max_model_len: longest prompt + output, tokens.
        watermark: fraction of ``num_blocks`` kept free when admitting a request beside
            running ones (vLLM v0's ``BlockSpaceManager(watermark=0.01)``). The watermark is
            ``max(1, int(watermark * num_blocks))`` blocks (vLLM rounds down, to 0 below 100
            blocks; at least one block here), or 0 when ``watermark`` is 0.
        sliding_window: the window (tokens) of every attention layer, or None (full
            attention or a hybrid model): out-of-window blocks are freed, and the last
            block is the null block (``num_blocks - 1`` blocks for requests).

    Raises:
        ValueError: ``watermark`` outside ``[0, 1)``; chunked prefill off with
            ``max_num_batched_tokens < max_model_len``.
    """

    def __init__(self, config: EngineConfig, num_blocks: int, max_model_len: int, watermark: float = 0.01,
                 sliding_window: int | None = None) -> None:
        if not 0 <= watermark < 1:
            raise ValueError(f"watermark must be in [0, 1), got {watermark}")
        self.config = config
        self.block_size = config.block_size
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = max_model_len
        self.policy = config.scheduling_policy
        self.chunked_prefill = config.enable_chunked_prefill
        if not self.chunked_prefill and self.max_num_batched_tokens < max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_model_len "
                f"({max_model_len}) when chunked prefill is disabled"
            )
        events = config.kv_events_config is not None and config.kv_events_config.enable_kv_cache_events
        self.kv_cache_manager = KVCacheManager(num_blocks, self.block_size, config.enable_prefix_caching,
                                               sliding_window=sliding_window, enable_kv_cache_events=events)
        self.watermark_blocks = max(1, int(watermark * num_blocks)) if watermark > 0 else 0
        """Free blocks kept back when admitting a request beside running ones."""
        self.waiting = create_request_queue(self.policy)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_ids: set[str] = set()
        self.in_flight: set[str] = set()
        """Requests of the engine's micro-batches in flight (pipeline parallelism): never scheduled
        again nor preempted until their step's tokens are back; their finished ids reach the
        runner only after that (its state of them is read when their step samples)."""
        self._feed = RunnerFeed()
        """What the model runner holds (the runner's plain view of each step, see ``output``)."""
        self._stats = SchedulerStats()
        self.max_loras: int | None = config.max_loras if config.enable_lora else None
        """Most distinct LoRA adapters among the running requests (None: LoRA off)."""
        self.kv_connector = None
        """The KV connector's scheduler side (:mod:`kvfleet.runtime.kv_transfer.connector`; the engine sets it)."""

    # -- requests in and out ------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def add_request(self, request: Request) -> None:
        """Queue a request.

        Raises:
            ValueError: its id is already live, or it can never fit: the prompt is longer
                than ``max_model_len`` or needs more blocks at once than the whole cache
                holds (with a sliding window, only the window's and a step's blocks are
                held at once: :meth:`KVCacheManager.max_num_blocks_per_request`).
        """
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        n = request.num_prompt_tokens
        if n > self.max_model_len:
            raise ValueError(f"prompt is {n} tokens, longer than max_model_len ({self.max_model_len})")
        kv = self.kv_cache_manager
        if kv.max_num_blocks_per_request(n, self.max_num_batched_tokens) > kv.num_usable_blocks:
            raise ValueError(
                f"prompt is {n} tokens, more than the whole KV cache holds "
                f"({kv.num_usable_blocks} blocks of {self.block_size})"
            )
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def finish_requests(self, request_ids, status: RequestStatus) -> None:
        """Finish live requests (abort, or a stop string found by the detokenizer): free
        their blocks at once. Unknown or already finished ids are ignored."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            self._free(request, status)

    def _free(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        if self.kv_connector is not None:  # a prefill leg's blocks may be held for the decode replica
            self.kv_connector.request_finished(request, self.kv_cache_manager.req_to_blocks.get(request.request_id, []))
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        self._finished_ids.add(request.request_id)
        self._feed.drop(request.request_id)

    # -- the step -------------------------------------------------------------------
    def _victim(self) -> Request | None:
        idle = [r for r in self.running if r.request_id not in self.in_flight]
        return max(idle, key=lambda r: (r.priority, r.arrival_time)) if idle else None

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        request.spec_token_ids = []
        # Called before the step's num_computed_tokens advance: blocks registered for this
        # step (which will not run for the victim) are not in the prefix cache afterwards.
        self.kv_cache_manager.free(request, num_written_tokens=request.num_computed_tokens)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.waiting.prepend(request)
        self._stats.num_preemptions += 1

    def schedule(self) -> SchedulerOutput:
        """Pick this step's requests and tokens, allocating their blocks (see the module doc):
        the running requests, their speculative drafts, then (unless the step had to preempt
        for memory, memory being short) waiting requests, all over one :class:`StepBudget`."""
        step = StepBudget(self.max_num_batched_tokens)
        self._schedule_running(step)
        self._schedule_drafts(step)
        if not step.preempted:
            self._admit_waiting(step)
        return self._step_output(step)

    def _unschedule(self, step: StepBudget, victim: Request) -> None:
        """Preempt ``victim``, giving its tokens of this step back to ``step``."""
        step.unschedule(victim.request_id)
        self._preempt(victim)

    def _schedule_running(self, step: StepBudget) -> None:
        """Running requests: a decode token each, or the next chunk of their prefill; a request
        that cannot get a block preempts the victim (itself, at worst)."""
        for request in list(self.running):
            if step.tokens <= 0:
                break
            if request.status != RequestStatus.RUNNING or request.request_id in self.in_flight:
                continue  # preempted earlier in this loop, or in a micro-batch in flight
            num_new = min(request.num_tokens - request.num_computed_tokens, step.tokens)
            if num_new <= 0:
                continue
            while self.kv_cache_manager.allocate_slots(request, num_new) is None:
                victim = self._victim()
                self._unschedule(step, victim)
                if victim is request:
                    break
            else:
                start = request.num_computed_tokens
                step.schedule(ScheduledRequest(request, start, request.token_ids_slice(start, start + num_new)))

    def _schedule_drafts(self, step: StepBudget) -> None:
        """Speculative drafts of the scheduled requests, only from what is left: never a
        preemption, nor the watermark's blocks (a request's draft slots stay in its table for
        its next tokens)."""
        kv = self.kv_cache_manager
        for sr in step.scheduled.values():
            request = sr.request
            spec = self._drafts(request, step.tokens + 1) if request.spec_token_ids else []  # its 1 token is counted
            request.spec_token_ids = []
            if not spec:
                continue
            need = kv.get_num_blocks_to_allocate(request, request.num_computed_tokens + sr.num_new_tokens + len(spec))
            if kv.num_free_blocks - need < self.watermark_blocks:
                continue
            if kv.allocate_slots(request, sr.num_new_tokens + len(spec)) is None:
                continue
            step.extend(sr, spec)

    def _admit_waiting(self, step: StepBudget) -> None:
        """Waiting requests, in policy order, while the token budget, the sequence cap and the
        blocks allow (the watermark kept beside running requests); the ``priority`` policy may
        preempt a running request of lower priority to make room."""
        loras = None if self.max_loras is None else {r.lora_int_id for r in self.running if r.lora_int_id}
        while len(self.waiting) and step.tokens > 0:
            request = self._next_waiting(step.scheduled, loras)
            if request is None:
                break  # only siblings waiting for their leader's prompt
            if len(self.running) >= self.max_num_seqs:
                if not self._preempt_for_priority(request, step):
                    break
                continue
            hit_blocks, num_cached = self.kv_cache_manager.get_computed_blocks(request)
            # tokens the KV connector loads instead of computing (a decode leg's prompt)
            external = self.kv_connector.get_num_new_matched_tokens(request, num_cached) if self.kv_connector else 0
            num_new = request.num_tokens - num_cached - external
            if num_new > step.tokens:
                if not self.chunked_prefill:
                    break
                num_new = step.tokens
            if not self._fits(step, request, hit_blocks) or \
                    self.kv_cache_manager.allocate_slots(request, external + num_new, hit_blocks) is None:
                if self._preempt_for_priority(request, step):
                    continue
                break
            if external:
                self.kv_connector.update_state_after_alloc(
                    request, self.kv_cache_manager.get_block_ids(request.request_id), external)
            self._start(step, request, num_cached, num_new, external)
            if loras is not None and request.lora_int_id:
                loras.add(request.lora_int_id)

    def _fits(self, step: StepBudget, request: Request, hit_blocks) -> bool:
        """Whether admitting ``request`` beside the running ones leaves the watermark free once
        every running request has its next token's blocks (alone, a request needs only this
        step's blocks: no deadlock)."""
        if not self.running:
            return True
        if step.reserved_blocks is None:
            step.reserved_blocks = sum(self._num_lookahead_blocks(r) for r in self.running)
        need = self._num_lookahead_blocks(request, hit_blocks)
        return self.kv_cache_manager.num_free_blocks - step.reserved_blocks - need >= self.watermark_blocks

    def _start(self, step: StepBudget, request: Request, num_cached: int, num_new: int, external: int = 0) -> None:
        """Move the admitted ``request`` from waiting to running and schedule its first tokens
        (after its ``num_cached`` prefix-cache hits and the ``external`` tokens the KV connector loads)."""
        self.waiting.take(request)
        if request.num_cached_tokens < 0:
            # Prefix-cache counters: once per request, at its first successful schedule.
            request.num_cached_tokens = num_cached
            self._stats.prefix_cache_queries += request.num_prompt_tokens
            self._stats.prefix_cache_hits += min(num_cached, request.num_prompt_tokens)
        request.status = RequestStatus.RUNNING
        start = request.num_computed_tokens = num_cached + external
        self.running.append(request)
        if step.reserved_blocks is not None:
            step.reserved_blocks += self._num_lookahead_blocks(request)
        step.schedule(ScheduledRequest(request, start, request.token_ids_slice(start, start + num_new)))

    def _step_output(self, step: StepBudget) -> SchedulerOutput:
        """The step's output: block tables, num_computed_tokens advanced, prefill / decode
        token counts, the runner's plain view."""
        out = SchedulerOutput(
            scheduled=list(step.scheduled.values()),
            total_num_scheduled_tokens=step.used(self.max_num_batched_tokens),
            preempted_request_ids=step.preempted,
            finished_request_ids=self._finished_ids - self.in_flight,
        )
        self._finished_ids &= self.in_flight  # aborted in flight: the runner still samples them
        for sr in out.scheduled:
            request = sr.request
            sr.block_ids = self.kv_cache_manager.get_block_ids(request.request_id)
            request.num_computed_tokens = sr.seq_len
            sr.sample = sr.seq_len >= request.num_tokens  # beyond it: the drafts it verifies
            if sr.start_pos < request.num_prompt_tokens:
                out.num_prefill_tokens += sr.num_new_tokens
            else:
                out.num_decode_tokens += sr.num_new_tokens
        out.runner_input.finished_request_ids = out.finished_request_ids
        self._feed.fill(out.scheduled, out.runner_input)
        return out

    def _drafts(self, request: Request, budget: int) -> list[int]:
        """The proposed tokens ``request`` verifies in this decode step: its drafts, cut so that
        the step stays within ``budget``, the output within ``max_tokens`` and the sequence within
        ``max_model_len`` even when all are accepted (plus the bonus token), and to the prefix its
        grammar accepts. Only a decoding request (one known token not yet computed) verifies."""
        if request.num_tokens - request.num_computed_tokens != 1:
            return []
        k = min(len(request.spec_token_ids), budget - 1, self.max_model_len - request.num_tokens - 1)
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None:
            k = min(k, max_tokens - request.num_output_tokens - 1)
        if k <= 0:
            return []
        drafts = request.spec_token_ids[:k]
        if request.structured_output is not None:
            drafts = drafts[: request.structured_output.validate_tokens(drafts)]
        return drafts

    def _next_waiting(self, scheduled: dict[str, ScheduledRequest], loras: set[int] | None = None) -> Request | None:
        """The first waiting request, in policy order, that may be admitted now: not a
        sibling still waiting for its ``prompt_leader`` (see :meth:`_waits_for_leader`), and
        with LoRA on (``loras``: the adapter ids running), not of a new adapter when
        ``max_loras`` adapters already run. None when no waiting request may be admitted.
        The requests passed over keep their places."""
        head = self.waiting.peek()
        if not self._waits_for_leader(head, scheduled) and not self._lora_blocked(head, loras):
            return head
        for request in self.waiting:
            if not self._waits_for_leader(request, scheduled) and not self._lora_blocked(request, loras):
                return request
        return None

    def _lora_blocked(self, request: Request, loras: set[int] | None) -> bool:
        """True when admitting ``request`` would run more than ``max_loras`` distinct adapters."""
        if loras is None or not request.lora_int_id or request.lora_int_id in loras:
            return False
        return len(loras) >= self.max_loras  # type: ignore[operator]

    def _waits_for_leader(self, request: Request, scheduled: dict[str, ScheduledRequest]) -> bool:
        """True while ``request`` (a later sequence of an ``n > 1`` request) must wait for
        its ``prompt_leader`` to compute the shared prompt. With prefix caching on it waits
        until the leader, running, has its whole prompt computed or scheduled in this step
        (``scheduled``): ``allocate_slots`` has then hashed every full prompt block into the
        prefix cache, and blocks of this step are written in its forward pass before any
        attention reads them (the same rule as any prefix-cache hit on a block allocated
        earlier in the step). Only the ``priority`` policy preempts during admission, and only
        for a request of strictly better priority, which its queue order puts before the
        siblings (they share the leader's priority): no request admitted after them can
        unschedule the leader whose blocks they share. Or until the leader
        finished (aborted). A preempted leader is waited for (it is ahead in the queue and
        always admitted when nothing else runs, so this cannot deadlock). Once released, a
        request never waits again (the link is cleared). With prefix caching off nothing
        waits (each sequence computes the prompt, as before)."""
        leader = request.prompt_leader
        if leader is None:
            return False
        if not self.kv_cache_manager.enable_caching or leader.is_finished:
            request.prompt_leader = None
            return False
        if leader.status == RequestStatus.RUNNING:
            sr = scheduled.get(leader.request_id)
            computed = sr.seq_len if sr is not None else leader.num_computed_tokens
            if computed >= leader.num_prompt_tokens:
                request.prompt_leader = None
                return False
        return True

    def _num_lookahead_blocks(self, request: Request, new_computed_blocks=()) -> int:
        """Free blocks ``request`` still needs to hold every token it knows (the rest of its
        prompt, and for a preempted request the tokens it had generated) plus the one it
        samples next, beyond the blocks it holds (and the prefix-cache hits
        ``new_computed_blocks`` it is about to take)."""
        num_tokens = min(request.num_tokens + 1, self.max_model_len)
        return self.kv_cache_manager.get_num_blocks_to_allocate(
            request, num_tokens, new_computed_blocks, max_num_batched_tokens=self.max_num_batched_tokens)

    def _preempt_for_priority(self, request: Request, step: StepBudget) -> bool:
        """Under the ``priority`` policy, make room for a waiting request by preempting a
        running one of strictly lower priority (larger number). Returns True if it did."""
        if self.policy != "priority" or not self.running:
            return False
        victim = self._victim()
        if victim is None or victim.priority <= request.priority:
            return False
        self._unschedule(step, victim)
        return True

    def update_from_output(self, scheduler_output: SchedulerOutput, sampled_token_ids: dict[str, int | list[int]],
                           spec_token_ids: dict[str, list[int]] | None = None) -> list[Request]:
        """Append each request's new tokens and finish requests that are done.

        ``sampled_token_ids``: request id -> the token sampled, or the tokens a speculative step
        emitted (the accepted drafts and one more; the request's ``num_computed_tokens`` goes back
        by the drafts rejected: their K/V slots are overwritten later, never cached).
        ``spec_token_ids``: request id -> drafts the runner proposes for the request's next step.

        A request finishes (its blocks freed at once, its later tokens of this step dropped) when
        its grammar (``structured_output``) accepts its stop token, on its EOS token (unless
        ``ignore_eos``) or one of its ``stop_token_ids`` -- both only after ``min_tokens``
        -- or when it reaches ``max_tokens`` or ``max_model_len``. With a sliding window,
        every scheduled request still running frees the blocks that fell out of its window
        (the step that read them has run).

        Returns:
            The requests that got a token this step, finished or not, in scheduled order.
        """
        emitted: dict[str, list[int]] = {}
        for sr in scheduler_output.scheduled:
            tokens = sampled_token_ids.get(sr.request_id)
            if tokens is None or sr.request.is_finished:
                continue
            tokens = [tokens] if isinstance(tokens, int) else tokens
            emitted[sr.request_id] = tokens
            if sr.spec_token_ids:
                num_accepted = len(tokens) - 1
                sr.request.num_computed_tokens -= len(sr.spec_token_ids) - num_accepted
                self._spec_stats().observe(len(sr.spec_token_ids), num_accepted)
        if self.kv_cache_manager.sliding_window is not None:
            for sr in scheduler_output.scheduled:
                if sr.request.status == RequestStatus.RUNNING:
                    self.kv_cache_manager.remove_skipped_blocks(sr.request)
        changed = []
        for sr in scheduler_output.scheduled:
            request = sr.request
            tokens = emitted.get(request.request_id)
            if tokens is None:
                continue
            changed.append(request)
            for token in tokens:
                request.output_token_ids.append(token)
                status = self._check_stop(request, token)
                if status is not None:
                    if request.status == RequestStatus.RUNNING:
                        self.running.remove(request)
                    self._free(request, status)
                    break
            else:
                if spec_token_ids:
                    request.spec_token_ids = spec_token_ids.get(request.request_id, [])
        return changed

    def _spec_stats(self):
        if self._stats.spec_decoding is None:
            self._stats.spec_decoding = SpecDecodingStats()
        return self._stats.spec_decoding

    def _check_stop(self, request: Request, token: int) -> RequestStatus | None:
        params = request.sampling_params
        num_out = request.num_output_tokens
        grammar = request.structured_output
        if grammar is not None and grammar.accept_token(token):
            return RequestStatus.FINISHED_STOPPED  # the grammar is complete (its stop token accepted)
        if num_out >= params.min_tokens:
            if not params.ignore_eos and token == request.eos_token_id:
                return RequestStatus.FINISHED_STOPPED
            if token in params.stop_token_ids:
                request.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and num_out >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    # -- stats and admin ------------------------------------------------------------
    def make_stats(self) -> SchedulerStats:
        """Gauges now, and the counters' deltas since the previous call."""
        stats = self._stats
        stats.num_running_reqs = len(self.running)
        stats.num_waiting_reqs = len(self.waiting)
        stats.kv_cache_usage = self.kv_cache_manager.usage
        if self.max_loras is not None:
            for counts, requests in ((stats.running_lora_adapters, self.running),
                                     (stats.waiting_lora_adapters, self.waiting)):
                for r in requests:
                    if r.lora_name:
                        counts[r.lora_name] = counts.get(r.lora_name, 0) + 1
        self._stats = SchedulerStats()
        return stats

    def reset_prefix_cache(self) -> bool:
        """Drop every unreferenced cached block (``POST /reset_prefix_cache``). Returns True."""
        self.kv_cache_manager.reset_prefix_cache()
        return True
