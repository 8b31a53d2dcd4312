"""``LLMEngine``: the synchronous engine core.

One :meth:`LLMEngine.step` is one iteration of continuous batching::

    scheduler.schedule()            which requests, which tokens, which blocks; the runner's view
                                    (``runner_input``) is plain data: new requests once, then diffs
    runner.execute_model()          one forward pass over the packed batch -> logits [S, V] keyed by
                                    request id (and the prompt logprobs of requests that asked);
                                    with tensor parallelism every rank runs the same plain step
    runner.sample()                 grammar bitmask (constrained rows: forbidden tokens -> -inf), then
                                    one token per sampling request -> {request id: token}, logprobs
    scheduler.update_from_output()  append tokens; finish on EOS / stop ids / max_tokens / max_model_len
    output_processor                detokenize, stop strings, logprobs: the RequestOutputs to send and
                                    the sequences to finish (:mod:`kvfleet.runtime.engine.output_processor`)
    scheduler.finish_requests()     those sequences (a stop string or an error ended them)
    stats                           stat loggers' record()

With pipeline parallelism the forward pass and the rest of the step come apart: up to
``pipeline_parallel_size`` steps are in flight (:mod:`kvfleet.runtime.engine.micro_batches`).

Requests come in through :mod:`kvfleet.runtime.engine.input_processor` (every check of a prompt
and its parameters); the output processor is asked about requests by id only.

The engine is single-threaded and not thread-safe: the async wrapper
(:mod:`kvfleet.runtime.engine.async_llm`) drives it from one background thread.
"""

from __future__ import annotations

import os

# Before torch loads its OpenMP runtime: idle OpenMP threads sleep instead of spinning.
# With spinning (the default) a CPU shared with other processes makes every parallel
# region wait for a descheduled spinner: decode steps measured 10-20x slower here.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import itertools
import logging
import time

import torch

from kvfleet.runtime.config import EngineConfig
from kvfleet.runtime.core.kv_cache_manager import max_num_blocks_per_request, uniform_sliding_window
from kvfleet.runtime.core.request import RequestStatus
from kvfleet.runtime.core.sched.output import SchedulerStats
from kvfleet.runtime.core.sched.scheduler import Scheduler
from kvfleet.runtime.engine.input_processor import InputProcessor, PreparedRequest
from kvfleet.runtime.engine.kv_connector import attach_kv_transfer
from kvfleet.runtime.engine.kv_event_publisher import KVEventPublisher
from kvfleet.runtime.engine.micro_batches import MicroBatches
from kvfleet.runtime.engine.output_processor import OutputProcessor, OutputProcessorOutput
from kvfleet.runtime.engine.outputs import RequestOutput
from kvfleet.runtime.engine.stats import IterationStats, StatLoggerBase
from kvfleet.runtime.lora_request import LoRALoadError, LoRANotFoundError, LoRARequest
from kvfleet.runtime.lora_source import resolve_lora_path
from kvfleet.runtime.sampling_params import SamplingParams
from kvfleet.runtime.structured_output.manager import StructuredOutputManager
from kvfleet.runtime.worker.executor import MultiprocExecutor
from kvfleet.runtime.worker.model_loader import LoadedModel, load_model
from kvfleet.runtime.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

_LORA_IDS = itertools.count(1)
"""``lora_int_id`` s, unique in the process (engines sharing a model share its adapter slots)."""


class LLMEngine:
    """Continuous-batching engine over a paged KV cache.

    Args:
        config: engine configuration (default ``EngineConfig()``: the embedded default model).
        stat_loggers: objects with ``record(scheduler_stats, iteration_stats)`` called after
            every step (and after every abort), e.g. the Prometheus exporter.
        loaded: an already loaded model to use instead of loading ``config.model`` (several
            engines may share one model; each gets its own KV cache).

    Loading the model and allocating the KV cache happen here (blocking, seconds).

    Raises:
        ValueError: inconsistent configuration (``max_model_len`` longer than the model's
            context or than the KV cache; a memory budget smaller than one block;
            ``tensor_parallel_size`` that does not divide the model's attention or KV heads,
            or a model without a tensor-parallel plan).
        FileNotFoundError: the model path does not exist.
        TensorParallelError: a tensor-parallel worker failed to start (see
            :mod:`kvfleet.runtime.worker.executor`; with ``tensor_parallel_size > 1`` this
            process is rank 0 and spawns the other ranks; call :meth:`shutdown` to stop them).
    """

    def __init__(
        self,
        config: EngineConfig | None = None,
        stat_loggers: list[StatLoggerBase] | None = None,
        *,
        loaded: LoadedModel | None = None,
    ) -> None:
        self.config = config = config or EngineConfig()
        self.stat_loggers = list(stat_loggers or [])
        self.executor: MultiprocExecutor | None = None  # tensor parallelism: rank 0 drives the workers
        config.check_engine_support()  # before any worker starts
        if config.world_size > 1:  # tensor and/or pipeline parallelism
            if loaded is not None:
                raise ValueError("tensor_parallel_size > 1: the engine loads its own shards; do not pass loaded=")
            self.executor = MultiprocExecutor.start(config)
            loaded = self.executor.loaded
        elif loaded is None:
            loaded = load_model(config.model, tokenizer=config.tokenizer, dtype=config.dtype, device=config.device,
                                quantization=config.quantization, batch_invariant=config.batch_invariant)
        if config.quantization != loaded.quantization:
            raise ValueError(f"--quantization {config.quantization}: the engine was given a model loaded with "
                             f"quantization={loaded.quantization} (load it with load_model(..., quantization=))")
        if config.batch_invariant and loaded.cpu_plan is not None and loaded.cpu_plan.native_bf16_prefill:
            raise ValueError("--batch-invariant: the engine was given a model loaded for native bf16 prefill "
                             "(load it with load_model(..., batch_invariant=True))")
        self.loaded = loaded
        self.model_name = config.served_model_name or loaded.name
        self.tokenizer = loaded.tokenizer
        try:  # a failed start stops the tensor-parallel workers
            self.runner = ModelRunner(config, loaded)
            if self.executor is None:
                num_blocks = self.runner.determine_num_blocks()
            else:
                num_blocks = self.executor.determine_num_blocks(self.runner)  # the minimum over the ranks
            # Mistral-style models (one window on every layer) free out-of-window blocks.
            self.sliding_window = uniform_sliding_window(self.runner.sliding_windows)
            self.max_model_len = self._resolve_max_model_len(num_blocks)
        except BaseException:
            if self.executor is not None:
                self.executor.shutdown(terminate=True)
            raise
        self.runner.initialize_kv_cache(num_blocks)
        self.num_blocks = num_blocks
        self.scheduler = Scheduler(config, num_blocks, self.max_model_len, sliding_window=self.sliding_window)
        self.micro_batches = MicroBatches(self, config.pipeline_parallel_size)
        """Steps in flight: one, or up to ``pipeline_parallel_size`` so that the stages overlap."""
        kv_events = config.kv_events_config
        self.kv_event_publisher = (KVEventPublisher(kv_events, config.block_size)
                                   if kv_events is not None and kv_events.enable_kv_cache_events else None)
        self.kv_connector, self.kv_event_sinks = attach_kv_transfer(self)
        """The KV connector (``--kv-transfer-config``); the sinks of each step's KV events (ZMQ, disk tier)."""
        self.vocab_size = self.runner.vocab_size
        self.eos_token_id, self._extra_eos_ids = self._eos_ids()
        self.output_processor = OutputProcessor(self.tokenizer)
        self.structured_output = StructuredOutputManager(self.tokenizer, self.vocab_size,
                                                         [self.eos_token_id, *self._extra_eos_ids])
        self.input_processor = InputProcessor(self.tokenizer, self.vocab_size, self.max_model_len, self.eos_token_id,
                                              self._extra_eos_ids, self.runner.prompt_logprobs_error,
                                              self.structured_output.grammar_init)
        self.num_steps = 0
        self.loras: dict[str, LoRARequest] = {}
        """Loaded LoRA adapters by name (``enable_lora``); see :meth:`add_lora`."""
        self.lora_load_errors: dict[str, str] = {}
        """``lora_modules`` entries skipped at start (``skip_failed_lora_modules``): name -> why."""
        for module in config.lora_modules:
            try:
                self.add_lora(module.name, module.path, module.base_model_name)
            except LoRALoadError as exc:
                if not config.skip_failed_lora_modules:
                    raise
                logger.error("LoRA adapter %s skipped: %s", module.name, exc)
                self.lora_load_errors[module.name] = str(exc)

    # ------------------------------------------------------------------ LoRA adapters
    def add_lora(self, lora_name: str, lora_path: str, base_model_name: str | None = None) -> LoRARequest:
        """Load a PEFT LoRA adapter that requests may then name (vLLM's ``add_lora``); ``lora_path``
        is a folder, ``file:///PATH`` or ``hf://ORG/NAME[@REV]`` (:mod:`kvfleet.runtime.lora_source`).

        Raises:
            LoRALoadError: LoRA is off, the name is in use (or is the base model's), or the
                checkpoint cannot be served (:mod:`kvfleet.runtime.worker.lora_checkpoint`)."""
        if self.runner.lora is None:
            raise LoRALoadError("LoRA adapters need --enable-lora")
        if not isinstance(lora_name, str) or not lora_name:
            raise LoRALoadError("lora_name must be a non-empty string")
        if lora_name in self.loras or lora_name == self.model_name:
            raise LoRALoadError(f"lora_name {lora_name!r} is already in use (a loaded adapter or the base model)")
        lora_path = resolve_lora_path(str(lora_path))  # hf:// and file:// URIs: a local folder
        lora = LoRARequest(lora_name, next(_LORA_IDS), lora_path, base_model_name or self.model_name)
        self.runner.lora.add(lora)
        self.loras[lora_name] = lora
        return lora

    def remove_lora(self, lora_name: str) -> list[RequestOutput]:
        """Unload an adapter; its unfinished requests are aborted (their final outputs returned).

        Raises:
            LoRANotFoundError: no adapter of that name."""
        lora = self.loras.get(lora_name)
        if lora is None or self.runner.lora is None:
            raise LoRANotFoundError(f"The lora adapter '{lora_name}' cannot be found.")
        outputs = self.abort_request(self.output_processor.request_ids_with_lora(lora.lora_int_id))
        del self.loras[lora_name]
        self.runner.lora.remove(lora.lora_int_id)
        return outputs

    def lora_info(self) -> dict[str, str]:
        """``max_lora`` for the ``lora_requests_info`` gauge (empty with LoRA off)."""
        return {"max_lora": str(self.config.max_loras)} if self.config.enable_lora else {}

    # ------------------------------------------------------------------ setup helpers
    def _resolve_max_model_len(self, num_blocks: int) -> int:
        capacity = num_blocks * self.config.block_size
        model_max = self.runner.model_max_len
        wanted = self.config.max_model_len
        window = self.sliding_window
        if window is not None:
            # One block is the null block; a request holds at most its window's and a
            # step's blocks at once, so it may be longer than the cache (as in vLLM).
            usable = num_blocks - 1
            if usable < 1:
                raise ValueError(
                    f"a sliding-window model needs at least 2 KV blocks (one is the null block), got {num_blocks}")
            capacity = usable * self.config.block_size
            per_request = max_num_blocks_per_request(
                10**12, self.config.block_size, window, self.config.max_num_batched_tokens)
            if per_request <= usable:
                capacity = model_max if model_max is not None else capacity
        if wanted is not None:
            if model_max is not None and wanted > model_max:
                raise ValueError(
                    f"max_model_len ({wanted}) is longer than the model's context length ({model_max})"
                )
            if wanted > capacity:
                raise ValueError(
                    f"max_model_len ({wanted}) is longer than the KV cache holds ({num_blocks} blocks of "
                    f"{self.config.block_size} = {capacity} tokens); raise kv_cache_memory / "
                    "gpu_memory_utilization or lower max_model_len"
                )
            return wanted
        length = min(model_max or capacity, capacity)
        if not self.config.enable_chunked_prefill:
            length = min(length, self.config.max_num_batched_tokens)
        return length

    def _eos_ids(self) -> tuple[int | None, list[int]]:
        eos = getattr(self.tokenizer, "eos_token_id", None)
        gen_cfg = getattr(self.loaded.model, "generation_config", None)
        gen_eos = getattr(gen_cfg, "eos_token_id", None) if gen_cfg is not None else None
        gen_list = [gen_eos] if isinstance(gen_eos, int) else list(gen_eos or [])
        if eos is None and gen_list:
            eos = gen_list[0]
        return eos, [t for t in gen_list if t != eos]

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (idempotent). The engine cannot step after
        it (a step raises ``TensorParallelError``); with ``tensor_parallel_size=1`` a no-op."""
        self.structured_output.shutdown()
        for sink in self.kv_event_sinks:
            sink.close()
        if self.executor is not None:
            self.executor.shutdown()

    # ------------------------------------------------------------------ properties
    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    def has_unfinished_requests(self) -> bool:
        """True while any request is waiting or running."""
        return self.scheduler.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        """Unfinished user requests."""
        return self.output_processor.num_requests

    def cache_config_info(self) -> dict[str, str]:
        """KV cache settings for the metrics info gauge (values as strings, as Prometheus
        ``Info`` labels need): ``block_size``, ``num_blocks``, ``gpu_memory_utilization``,
        ``cache_dtype`` (the resolved dtype of the KV cache and weights, ``dtype auto`` resolved),
        ``quantization`` (``none``, ``int8``, ``int4``)."""
        return {
            "block_size": str(self.config.block_size),
            "num_blocks": str(self.num_blocks),
            "gpu_memory_utilization": str(self.config.gpu_memory_utilization),
            "cache_dtype": str(self.loaded.dtype).removeprefix("torch."),
            "quantization": self.loaded.quantization or "none",
        }

    def reset_prefix_cache(self) -> bool:
        """Drop unreferenced prefix-cache blocks. Returns True."""
        done = self.scheduler.reset_prefix_cache()
        self._publish_kv_events()
        return done

    def _publish_kv_events(self) -> None:
        events = self.scheduler.kv_cache_manager.take_events()
        for sink in self.kv_event_sinks:
            sink.publish(events)

    def kv_events_snapshot(self) -> dict | None:
        """The cached block hashes (hex) after KV event batch ``seq`` and the ZMQ endpoint the
        events go out on (None with ``publisher="null"``); None when events are off."""
        return None if self.kv_event_publisher is None else self.kv_event_publisher.snapshot_json()

    # ------------------------------------------------------------------ requests in
    def prepare_request(
        self,
        request_id: str,
        prompt: str | list[int],
        sampling_params: SamplingParams | None = None,
        *,
        priority: int = 0,
        tenant: str | None = None,
        arrival_time: float | None = None,
        lora_name: str | None = None,
        resume_output_ids: list[list[int]] | None = None,
    ) -> PreparedRequest:
        """Validate and tokenize a request without touching engine state (thread-safe as
        far as the tokenizer is): :meth:`InputProcessor.process
        <kvfleet.runtime.engine.input_processor.InputProcessor.process>` on the adapter named.

        Raises:
            ValueError: naming the offending parameter (see ``InputProcessor.process``).
            LoRANotFoundError: ``lora_name`` is not a loaded adapter.
        """
        lora = None
        if lora_name is not None:
            lora = self.loras.get(lora_name)
            if lora is None:
                raise LoRANotFoundError(f"The model `{lora_name}` does not exist (no LoRA adapter of that name).")
        return self.input_processor.process(request_id, prompt, sampling_params, priority=priority, tenant=tenant,
                                            arrival_time=arrival_time, lora=lora,
                                            resume_output_ids=resume_output_ids)

    def add_prepared(self, prepared: PreparedRequest) -> None:
        """Queue a request made by :meth:`prepare_request`.

        Raises:
            ValueError: ``request_id`` already in use (or a child id ``{id}-{i}`` of it), or
                the scheduler rejects the prompt (``prompt ...``).
            StructuredOutputError: (a ValueError) its grammar did not compile. This waits for
                the compile; the async engine awaits ``prepared.grammar`` before, on the event loop.
        """
        state = prepared.state
        if self.output_processor.in_use(state):
            raise ValueError(f"request_id {state.request_id!r} is already in use")
        if prepared.grammar is not None:
            compiled = prepared.grammar.result()
            for request in prepared.requests:  # one matcher per sequence (n > 1 included)
                request.structured_output = self.structured_output.new_grammar(compiled)
                for token in request.output_token_ids:  # a resumed request: advance over its output
                    if request.structured_output.accept_token(token):
                        raise ValueError("resume_output_ids end or break the request's grammar")
        added: list[str] = []
        try:
            for request in prepared.requests:
                self.scheduler.add_request(request)
                added.append(request.request_id)
        except ValueError:
            self.scheduler.finish_requests(added, RequestStatus.FINISHED_ABORTED)
            raise
        self.output_processor.add_request(state)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        sampling_params: SamplingParams | None = None,
        *,
        priority: int = 0,
        tenant: str | None = None,
        arrival_time: float | None = None,
        lora_name: str | None = None,
    ) -> None:
        """Validate, tokenize and queue a request (``n > 1`` fans out into child requests
        ``"{request_id}-{i}"``, with seeds ``seed + i`` when seeded).

        Args:
            request_id: unique among live requests.
            prompt: text (tokenized with the model's tokenizer, special tokens as the
                tokenizer adds them) or token ids.
            sampling_params: default ``SamplingParams()``.
            priority: lower runs first under the ``priority`` policy.
            tenant: fairness group under the ``fair`` policy.
            arrival_time: ``time.monotonic()`` seconds; default now.
            lora_name: a loaded LoRA adapter (:meth:`add_lora`); None: the base model.

        Raises:
            ValueError: naming the bad parameter (see :meth:`prepare_request`); the engine
                state is unchanged.
        """
        self.add_prepared(
            self.prepare_request(
                request_id, prompt, sampling_params, priority=priority, tenant=tenant, arrival_time=arrival_time,
                lora_name=lora_name,
            )
        )

    def abort_request(self, request_ids: str | list[str]) -> list[RequestOutput]:
        """Abort user requests (or single child sequences by their ``{id}-{i}`` id): their
        blocks are freed at once. Unknown or finished ids are ignored.

        Returns: the final output (``finish_reason="abort"``) of every user request that
        this finished.
        """
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        iteration = IterationStats()
        result = self.output_processor.abort_requests(request_ids, time.monotonic(), iteration)
        self._finish(result)
        if iteration.finished_requests:
            self._record_stats(self.scheduler.make_stats(), iteration)
        return result.request_outputs

    # ------------------------------------------------------------------ the step
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Run one engine iteration.

        Returns: a :class:`RequestOutput` for every user request that got a new token or
        finished this step, as its ``SamplingParams.output_kind`` asks (cumulative by
        default; a delta; or only the final one, when it finished).

        Raises:
            Exception: only from the forward pass or the sampler (engine-level failures);
                an error while post-processing one request aborts that request (its output
                carries ``finish_reason="abort"`` and ``extra["error"]``) and the step goes on.
        """
        proc = self.output_processor
        iteration = IterationStats()
        updates = self.micro_batches.step(iteration)  # launch one, complete the oldest (see micro_batches)
        self.num_steps += 1
        self._publish_kv_events()
        processed = proc.process_outputs(updates, time.monotonic(), iteration)
        self._finish(processed)
        self._record_stats(self.scheduler.make_stats(), iteration)
        return processed.request_outputs

    def _grammar_mask(self, logits: torch.Tensor, req_ids: list[str], drafts: list[list[int]] | None = None) -> None:
        """Mask in place the rows of constrained sequences (before penalties and temperature);
        ``drafts``: per sequence, the speculative tokens its extra rows verify.
        A sequence failed this step (its prompt logprobs) is gone: unconstrained, its token dropped."""
        live = self.scheduler.requests
        grammars = [live[rid].structured_output if rid in live else None for rid in req_ids]
        if any(g is not None for g in grammars):
            self.structured_output.apply_bitmask(logits, grammars, drafts)

    def _add_prompt_logprobs(self, scheduler_output, prompt_logprobs: dict, iteration: IterationStats) -> None:
        """Hand the step's prompt logprobs to the output processor; tell each request how many
        prompt positions it holds (the runner does not compute them again after a preemption)."""
        requests = {sr.request.request_id: sr.request for sr in scheduler_output.scheduled}
        for rid, plp in prompt_logprobs.items():
            try:
                done = self.output_processor.add_prompt_logprobs(rid, plp)
            except Exception as exc:  # one bad request must not take the engine down
                logger.exception("request %s failed while processing its prompt logprobs", rid)
                failed = self.output_processor.fail_sequence(rid, exc, time.monotonic(), iteration)
                self.scheduler.finish_requests(failed, RequestStatus.FINISHED_ABORTED)
                continue
            if done is not None and rid in requests:
                requests[rid].num_prompt_logprobs_done = done

    def _finish(self, processed: OutputProcessorOutput) -> None:
        """Finish in the scheduler the sequences the output processor ended (stop strings, errors)."""
        for status, request_ids in processed.finish.items():
            self.scheduler.finish_requests(request_ids, status)

    def _record_stats(self, scheduler_stats: SchedulerStats, iteration: IterationStats) -> None:
        for stat_logger in self.stat_loggers:
            try:
                stat_logger.record(scheduler_stats, iteration)
            except Exception:
                logger.exception("stat logger %r failed", stat_logger)

    # ------------------------------------------------------------------ convenience
    @torch.inference_mode()
    def run_until_done(self) -> dict[str, RequestOutput]:
        """Step until no request is left; returns the final output of each user request."""
        final: dict[str, RequestOutput] = {}
        while self.has_unfinished_requests():
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return final
