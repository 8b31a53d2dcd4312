"""``LLMEngine``: the synchronous engine core.

One :meth:`LLMEngine.step` is one iteration of continuous batching::

    scheduler.schedule()            which requests, which tokens, which blocks
    runner.execute_model()          one forward pass over the packed batch -> logits [S, V]
                                    (and the prompt logprobs of requests that asked for them)
    grammar bitmask                 constrained rows: tokens their grammar forbids -> -inf
    sampler(logits)                 one token per sampling request
    scheduler.update_from_output()  append tokens; finish on EOS / stop ids / max_tokens / max_model_len
    output_processor                detokenize, finish on a stop string, logprobs, RequestOutput per
                                    user request (:mod:`kvfleet.runtime.engine.output_processor`)
    stats                           stat loggers' record()

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
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from kvfleet.runtime.config import EngineConfig
from kvfleet.runtime.core.kv_cache_manager import max_num_blocks_per_request, uniform_sliding_window
from kvfleet.runtime.core.request import Request, RequestStatus
from kvfleet.runtime.core.sched.output import SchedulerStats
from kvfleet.runtime.core.sched.scheduler import Scheduler
from kvfleet.runtime.engine.output_processor import OutputProcessor, RequestState
from kvfleet.runtime.engine.outputs import RequestOutput
from kvfleet.runtime.engine.stats import IterationStats, StatLoggerBase
from kvfleet.runtime.lora_request import LoRALoadError, LoRANotFoundError, LoRARequest
from kvfleet.runtime.lora_source import resolve_lora_path
from kvfleet.runtime.sampling_params import SamplingParams
from kvfleet.runtime.structured_output.manager import StructuredOutputManager
from kvfleet.runtime.worker.executor import MultiprocExecutor
from kvfleet.runtime.worker.model_loader import LoadedModel, load_model
from kvfleet.runtime.worker.model_runner import ModelRunner
from kvfleet.runtime.worker.sampler import Sampler

logger = logging.getLogger(__name__)

_LORA_IDS = itertools.count(1)
"""``lora_int_id`` s, unique in the process (engines sharing a model share its adapter slots)."""


@dataclass
class PreparedRequest:
    """A validated, tokenized request, ready for :meth:`LLMEngine.add_prepared` (the async
    engine validates in the caller's thread and adds in the engine thread). ``grammar``: the
    future of its compiled grammar (structured outputs), None when unconstrained."""

    state: RequestState
    grammar: Future | None = None


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
        if config.enable_lora and config.tensor_parallel_size > 1:
            raise ValueError("--enable-lora: not supported with tensor_parallel_size > 1 (the adapters' stacked "
                             "slots are not sharded over the ranks)")
        if config.enable_lora and not config.enforce_eager:
            raise ValueError("--enable-lora needs --enforce-eager: the compiled decoder graph does not read the "
                             "step's per-token adapter indices")
        if config.tensor_parallel_size > 1:
            if config.quantization is not None:  # before any worker starts
                raise ValueError(f"--quantization {config.quantization}: not supported with tensor_parallel_size > 1 "
                                 "(the tensor-parallel plan shards plain weights)")
            if loaded is not None:
                raise ValueError("tensor_parallel_size > 1: the engine loads its own shards; do not pass loaded=")
            self.executor = MultiprocExecutor.start(config)
            loaded = self.executor.loaded
        elif loaded is None:
            loaded = load_model(config.model, tokenizer=config.tokenizer, dtype=config.dtype, device=config.device,
                                quantization=config.quantization)  # fmt: skip
        if config.quantization != loaded.quantization:
            raise ValueError(f"--quantization {config.quantization}: the engine was given a model loaded with "
                             f"quantization={loaded.quantization} (load it with load_model(..., quantization=))")
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
        if self.executor is not None:
            self.executor.wrap_runner(self.runner)
        self.num_blocks = num_blocks
        self.scheduler = Scheduler(config, num_blocks, self.max_model_len, sliding_window=self.sliding_window)
        self.sampler = Sampler(loaded.device, seed=config.seed)
        self.vocab_size = self.runner.vocab_size
        self.eos_token_id, self._extra_eos_ids = self._eos_ids()
        self.output_processor = OutputProcessor(self.tokenizer, self.scheduler.finish_requests)
        self.structured_output = StructuredOutputManager(self.tokenizer, self.vocab_size,
                                                         [self.eos_token_id, *self._extra_eos_ids])  # fmt: skip
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
        ids = [rid for rid, (_, seq) in self.output_processor.seqs.items()
               if seq.request.lora_int_id == lora.lora_int_id]
        outputs = self.abort_request(ids)
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
        return len(self.output_processor.requests)

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
        return self.scheduler.reset_prefix_cache()

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
    ) -> PreparedRequest:
        """Validate and tokenize a request without touching engine state (thread-safe as
        far as the tokenizer is).

        Raises:
            ValueError: with the offending parameter's name first: ``request_id`` (not a
                non-empty string), ``prompt`` (empty, wrong type, token ids out of the
                vocabulary, or longer than ``max_model_len`` / the whole KV cache),
                ``sampling_params`` (wrong type), ``prompt_logprobs`` (asked of a model whose
                logits the runner cannot reproduce, see ``ModelRunner.prompt_logprobs_error``),
                ``priority`` (not an int), ``logit_bias`` / ``allowed_token_ids`` (token ids out of
                the vocabulary). A structured-output spec starts compiling here (``grammar``);
                its errors come from :meth:`add_prepared`.
            LoRANotFoundError: ``lora_name`` is not a loaded adapter.
        """
        lora = None
        if lora_name is not None:
            lora = self.loras.get(lora_name)
            if lora is None:
                raise LoRANotFoundError(f"The model `{lora_name}` does not exist (no LoRA adapter of that name).")
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if sampling_params is None:
            sampling_params = SamplingParams()
        if not isinstance(sampling_params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(sampling_params).__name__}")
        if sampling_params.prompt_logprobs is not None and self.runner.prompt_logprobs_error:
            raise ValueError(f"prompt_logprobs are not supported for this model: {self.runner.prompt_logprobs_error}")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        prompt_text: str | None
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            prompt_text = prompt
            prompt_ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)):
            prompt_text = None
            prompt_ids = list(prompt)
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt_ids):
                raise ValueError("prompt token ids must be integers")
            bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"prompt token ids must be in [0, {self.vocab_size}), got {bad[:5]}")
        else:
            raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not prompt_ids:
            raise ValueError("prompt must not be empty (it has no tokens)")
        if len(prompt_ids) > self.max_model_len:
            raise ValueError(
                f"prompt is {len(prompt_ids)} tokens, longer than max_model_len ({self.max_model_len})"
            )
        arrival = time.monotonic() if arrival_time is None else arrival_time
        params = sampling_params = self._check_token_controls(sampling_params)
        if self._extra_eos_ids and not params.ignore_eos:
            params = params.clone(stop_token_ids=list(params.stop_token_ids) + self._extra_eos_ids)
        state = RequestState(request_id, prompt_text, prompt_ids, sampling_params, arrival, priority)
        if params.prompt_logprobs is not None:
            state.prompt_logprobs = [None]
        n = params.n
        for i in range(n):
            child_params = params
            if n > 1:
                # Only the first child computes the prompt logprobs: the prompt is the same.
                # With prefix caching on, the others wait for it to compute the prompt (their
                # prompt_leader), then take its full blocks from the prefix cache.
                child_params = params.clone(
                    n=1,
                    seed=None if params.seed is None else params.seed + i,
                    prompt_logprobs=params.prompt_logprobs if i == 0 else None,
                )
            child_id = request_id if n == 1 else f"{request_id}-{i}"
            request = Request(
                child_id,
                prompt_ids,
                child_params,
                self.eos_token_id,
                arrival_time=arrival,
                priority=priority,
                tenant=tenant,
                prompt_leader=state.seqs[0].request if i else None,
                lora_name=lora.lora_name if lora else None,
                lora_int_id=lora.lora_int_id if lora else 0,
            )
            state.seqs.append(self.output_processor.new_sequence(request, i, child_params))
        spec = params.structured_outputs
        return PreparedRequest(state, self.structured_output.grammar_init(spec) if spec is not None else None)

    def _check_token_controls(self, params: SamplingParams) -> SamplingParams:
        """``logit_bias`` / ``allowed_token_ids`` in the vocabulary (ValueError naming the field);
        ``bad_words`` tokenized into ``bad_words_token_ids`` (each word with and without a leading
        space, as vLLM)."""
        for name, ids in (("logit_bias", list(params.logit_bias or ())), ("allowed_token_ids",
                                                                         params.allowed_token_ids or [])):
            bad = [t for t in ids if t >= self.vocab_size]
            if bad:
                raise ValueError(f"{name} token ids must be in [0, {self.vocab_size}), got {bad[:5]}")
        if not params.bad_words:
            return params
        seqs: list[list[int]] = []
        for word in params.bad_words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                if ids and ids not in seqs:
                    seqs.append(ids)
        return params.clone(bad_words_token_ids=seqs)

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
            for seq in state.seqs:  # one matcher per sequence (n > 1 included)
                seq.request.structured_output = self.structured_output.new_grammar(compiled)
        added: list[str] = []
        try:
            for seq in state.seqs:
                self.scheduler.add_request(seq.request)
                added.append(seq.request.request_id)
        except ValueError:
            self.scheduler.finish_requests(added, RequestStatus.FINISHED_ABORTED)
            raise
        self.output_processor.add(state)

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
        proc = self.output_processor
        now = time.monotonic()
        iteration = IterationStats()
        touched: dict[str, RequestState] = {}
        for rid in request_ids:
            if rid in proc.requests:
                state = proc.requests[rid]
                seqs = state.seqs
            elif rid in proc.seqs:
                state, seq = proc.seqs[rid]
                seqs = [seq]
            else:
                continue
            ids = [s.request.request_id for s in seqs if s.finish_reason is None]
            self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
            for s in seqs:
                if s.finish_reason is None:
                    s.request.status = RequestStatus.FINISHED_ABORTED
                    proc.finish_sequence(state, s, "abort", now, iteration)
            touched[state.request_id] = state
        outputs = [proc.make_output(state) for state in touched.values()]
        for state in touched.values():
            if state.finished:
                proc.drop(state)
        if iteration.finished_requests:
            self._record_stats(self.scheduler.make_stats(), iteration)
        return [o for o in outputs if o.finished]

    # ------------------------------------------------------------------ the step
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Run one engine iteration.

        Returns: a cumulative :class:`RequestOutput` for every user request that got a new
        token or finished this step.

        Raises:
            Exception: only from the forward pass or the sampler (engine-level failures);
                an error while post-processing one request aborts that request (its output
                carries ``finish_reason="abort"`` and ``extra["error"]``) and the step goes on.
        """
        proc = self.output_processor
        scheduler_output = self.scheduler.schedule()
        iteration = IterationStats()
        touched: dict[str, RequestState] = {}
        if scheduler_output.scheduled:
            now = time.monotonic()
            for sr in scheduler_output.scheduled:
                entry = proc.seqs.get(sr.request.request_id)
                if entry is not None and entry[1].first_scheduled_time is None:
                    entry[1].first_scheduled_time = now
                num_prompt = sr.request.num_prompt_tokens
                if sr.start_pos < num_prompt:
                    iteration.num_prompt_tokens += min(sr.seq_len, num_prompt) - sr.start_pos
            result = self.runner.execute_model(scheduler_output)
            sampling, logits = result.sampling, result.logits
            for rid, plp in result.prompt_logprobs.items():
                entry = proc.seqs.get(rid)
                if entry is None:
                    continue
                state, seq = entry
                try:
                    proc.add_prompt_logprobs(state, seq, plp)
                except Exception as exc:  # one bad request must not take the engine down
                    logger.exception("request %s failed while processing its prompt logprobs", rid)
                    proc.abort_sequence(state, seq, exc, time.monotonic(), iteration)
                    touched[state.request_id] = state
            requests = [s.request for s in sampling]
            if any(r.structured_output is not None for r in requests):  # before penalties and temperature
                self.structured_output.apply_bitmask(logits, requests)
            sampled = self.sampler(logits, requests)
            tokens = {r.request_id: t for r, t in zip(requests, sampled.token_ids)}
            logprobs = {r.request_id: lp for r, lp in zip(requests, sampled.logprobs) if lp is not None}
            changed = self.scheduler.update_from_output(scheduler_output, tokens)
            now = time.monotonic()
            iteration.num_generation_tokens = len(changed)
            for request in changed:
                entry = proc.seqs.get(request.request_id)
                if entry is None:
                    continue
                state, seq = entry
                try:
                    proc.process_token(state, seq, logprobs.get(request.request_id), now, iteration)
                except Exception as exc:  # one bad request must not take the engine down
                    logger.exception("request %s failed while processing its output", request.request_id)
                    proc.abort_sequence(state, seq, exc, now, iteration)
                touched[state.request_id] = state
        self.num_steps += 1
        outputs = []
        for state in touched.values():
            try:
                outputs.append(proc.make_output(state))
            except Exception as exc:
                logger.exception("request %s failed while building its output", state.request_id)
                self.abort_request(state.request_id)
                outputs.append(proc.error_output(state, exc))
            if state.finished:
                proc.drop(state)
        self._record_stats(self.scheduler.make_stats(), iteration)
        return outputs

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
