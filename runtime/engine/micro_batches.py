"""Micro-batches in flight: the launch and the completion of an engine step, apart.

Contract: :class:`MicroBatches` keeps up to ``depth`` scheduled steps whose forward pass has
started and whose tokens are not back (``depth`` = ``pipeline_parallel_size``, vLLM's
``max_concurrent_batches``: while the last stage runs one micro-batch the first runs the next;
1 without pipeline parallelism, where a step is launched and completed in the same
``LLMEngine.step()`` as before). :meth:`MicroBatches.step` is vLLM's ``step_with_batch_queue``:
an engine step that launched a micro-batch and still has room returns no outputs; requests that
arrive while one is in flight form the next one, so the running requests split into ``depth``
groups that take turns. Their request ids are in the scheduler's ``in_flight`` set:
``Scheduler.schedule()`` leaves those requests out (one request is in one micro-batch at a time,
so each one's next token is sampled before its next step) and never preempts them. Completion is
oldest first: the logits (from the last stage), prompt logprobs, sampling, the scheduler's update.
"""

from __future__ import annotations

import time
from collections import deque

from kvfleet.runtime.core.sched.output import SchedulerOutput
from kvfleet.runtime.engine.output_processor import SequenceUpdate
from kvfleet.runtime.engine.stats import IterationStats


class MicroBatches:
    """The engine's steps in flight (see the module docstring).

    Args:
        engine: the :class:`~kvfleet.runtime.engine.llm_engine.LLMEngine` whose scheduler, runner
            and executor run the steps.
        depth: at most this many in flight (>= 1).
    """

    def __init__(self, engine, depth: int) -> None:
        self.engine, self.depth = engine, max(1, depth)
        self.pending: deque[tuple[SchedulerOutput, object]] = deque()

    def __len__(self) -> int:
        return len(self.pending)

    def step(self, iteration: IterationStats) -> list[SequenceUpdate]:
        """One engine step's share (vLLM's ``step_with_batch_queue``): launch a micro-batch when
        fewer than ``depth`` are in flight; complete the oldest when the queue is full or nothing
        new was launched. Returns the completed step's sequence updates (none: nothing completed)."""
        launched = len(self.pending) < self.depth and self.launch(iteration)
        if launched and len(self.pending) < self.depth:
            return []  # the next call launches the next micro-batch while this one runs
        return self.complete(iteration)

    def launch(self, iteration: IterationStats) -> bool:
        """Schedule and start one step. Returns False when nothing was scheduled."""
        engine = self.engine
        scheduler_output = engine.scheduler.schedule()
        if not scheduler_output.scheduled:
            return False
        scheduled = scheduler_output.scheduled
        engine.output_processor.record_scheduled(
            {sr.request.request_id: sr.request.num_cached_tokens for sr in scheduled}, time.monotonic())
        for sr in scheduled:
            num_prompt = sr.request.num_prompt_tokens
            if sr.start_pos < num_prompt:
                iteration.num_prompt_tokens += min(sr.seq_len, num_prompt) - sr.start_pos
        step = scheduler_output.runner_input  # plain data: no scheduler Request crosses to the runner
        if engine.executor is None:
            result = engine.runner.execute_model(step)
        else:  # every rank runs the same step (a pipeline's logits come back at completion)
            result = engine.executor.execute_model(engine.runner, step)
        engine.scheduler.in_flight.update(sr.request_id for sr in scheduled)
        self.pending.append((scheduler_output, result))
        return True

    def complete(self, iteration: IterationStats) -> list[SequenceUpdate]:
        """Finish the oldest step in flight (none: no updates): sample, update the scheduler.
        Returns the sequences' updates for the output processor."""
        if not self.pending:
            return []
        engine = self.engine
        scheduler_output, result = self.pending.popleft()
        engine.scheduler.in_flight.difference_update(sr.request_id for sr in scheduler_output.scheduled)
        if engine.executor is not None:
            result = engine.executor.receive_logits(result)
        if result.prompt_logprobs:
            engine._add_prompt_logprobs(scheduler_output, result.prompt_logprobs, iteration)
        sampled = engine.runner.sample(result, engine._grammar_mask)  # rows keyed by request id
        logprobs = sampled.logprobs
        before = {sr.request_id: sr.request.num_output_tokens for sr in scheduler_output.scheduled}
        changed = engine.scheduler.update_from_output(scheduler_output, sampled.token_ids, sampled.spec_token_ids)
        updates = [
            SequenceUpdate(r.request_id, r.output_token_ids[before[r.request_id]:], r.status.finish_reason,
                           r.stop_reason, logprobs.get(r.request_id))
            for r in changed
        ]
        iteration.num_generation_tokens = sum(len(u.new_token_ids) for u in updates)
        return updates
