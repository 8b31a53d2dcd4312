"""Model runner: one forward pass of a transformers model over a packed, unpadded batch.

Takes a step's plain :class:`~kvfleet.runtime.core.sched.output.RunnerInput` (a request's
data once, then per-step diffs; never the scheduler's ``Request`` objects) into its own per-request state
(:mod:`kvfleet.runtime.worker.request_state`), and turns the step into ``input_ids[T]``,
``positions[T]``, ``slot_mapping[T]`` (``block_id * block_size + offset``),
``block_tables[B, max_blocks]``, ``seq_lens[B]``, ``query_start_loc[B + 1]``; runs the model
once (the paged attention of :mod:`kvfleet.runtime.worker.attention` reads and writes the
per-layer KV caches it owns) and returns the logits of the last token of each request that
samples, ``[S, vocab_size]`` float32 (the LM head runs only on those ``S`` rows).
Prompt logprobs (vLLM's semantics, ``log_softmax`` of the raw float32 logits): the LM head
also runs on the prompt positions of requests that ask, in chunks of at most
``PROMPT_LOGPROBS_CHUNK_BYTES`` (:mod:`kvfleet.runtime.worker.prompt_logprobs`). KV cache: per layer
``[num_blocks, block_size, num_kv_heads, head_size]`` keys and values in
:attr:`ModelRunner.kv_cache_dtype` (``kv_cache_dtype``: the activation dtype, or bf16 beside float32
activations on the CPU, cast on write and widened on read by both attention paths);
``num_blocks`` from :meth:`ModelRunner.determine_num_blocks`. With ``enforce_eager=False`` the
decoder runs compiled (:mod:`kvfleet.runtime.worker.compilation`, warmed up at the end of
:meth:`ModelRunner.initialize_kv_cache`) and the LM head runs eagerly on its output. Details:
docs/engine.md, "How a step runs" and "Sampling semantics"; docs/performance.md, "Compiled forward".
With ``enable_lora`` the decoder's linear layers take per-token LoRA deltas
(:mod:`kvfleet.runtime.worker.lora_manager`, docs/lora.md).
"""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass, field

import torch

from kvfleet.runtime.config import DEFAULT_KV_CACHE_MEMORY, EngineConfig
from kvfleet.runtime.core.sched.output import RunnerInput
from kvfleet.runtime.worker import cpu_decode
from kvfleet.runtime.worker.attention import (
    METADATA_KWARG,
    AttentionMetadata,
    check_attention_support,
    probe_attention,
    register,
)
from kvfleet.runtime.worker.compilation import CompiledForward, compile_settings
from kvfleet.runtime.worker.cpu_decode import CpuDecodePath
from kvfleet.runtime.worker.input_batch import InputBatch
from kvfleet.runtime.worker.model_loader import LoadedModel
from kvfleet.runtime.worker.pipeline import PROMPT_LOGPROBS_REASON, PipelineStage
from kvfleet.runtime.worker.prompt_logprobs import (
    PROMPT_LOGPROBS_CHUNK_BYTES,
    PromptLogprobsTensors,
    prompt_logprob_rows,
    prompt_logprobs,
)
from kvfleet.runtime.worker.request_state import CachedRequestState, RequestStates, ScheduledRow
from kvfleet.runtime.worker.sampler import SampledRows, Sampler
from kvfleet.runtime.worker.speculator import CPU_ROW_COST, CPU_STEP_ROWS, Speculator

logger = logging.getLogger(__name__)

CPU_AUTO_KV_CACHE_DTYPE = torch.float32
"""``kv_cache_dtype auto``'s cache dtype on a CPU where the fused decoder runs its float32 matmuls.
float32 (docs/performance.md, "bf16 KV cache"): bf16 cut the C step's attention by 21-27 % at 48
rows, but W48's gain stayed inside this machine's noise and greedy tokens flip at near-ties (94 % of
tokens agree), which float32's "greedy output equals transformers' generate()" does not allow.
Where the fused decoder's matmuls run in bf16 (AMX tiles, AVX512-BF16 dot products: that equality
is gone already) ``auto`` is bf16: W48 341.6 -> 362.1 output tok/s on AMX tiles (Xeon with AMX,
``step_profile.py w48 --kv-cache-dtype float32 bfloat16``, load ~1)."""

@dataclass
class ModelRunnerOutput:
    """What one :meth:`ModelRunner.execute_model` call returns.

    Attributes:
        req_ids: the ids of the scheduled requests that sample this step, in scheduling order.
        logits: their next-token logits ``[R, vocab_size]`` float32 (model device): one row per
            request, ``1 + k`` for one verifying ``k`` drafts.
        prompt_logprobs: request id -> prompt logprobs computed this step, for the
            requests with ``sampling_params.prompt_logprobs`` set whose step covered prompt
            positions before the last prompt token.
    """

    req_ids: list[str]
    logits: torch.Tensor
    prompt_logprobs: dict[str, PromptLogprobsTensors] = field(default_factory=dict)
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    """Speculative decoding: request id -> the drafts its rows verify (``1 + k`` consecutive
    rows of ``logits`` for such a request, in ``req_ids`` order)."""


class ModelRunner:
    """Owns the model (switched to paged attention) and the KV caches.

    Args:
        config: the engine configuration (``block_size``, memory budget fields,
            ``max_num_batched_tokens``, ``max_num_seqs``).
        loaded: the loaded model and tokenizer. Its model's attention implementation is
            switched to ``kvfleet_paged``: from then on the model only runs inside an
            engine (several engines may share it; each has its own KV caches).
    """

    def __init__(self, config: EngineConfig, loaded: LoadedModel) -> None:
        self.config = config
        self.model = loaded.model
        self.device = loaded.device
        self.dtype = loaded.dtype
        self.cpu_plan = loaded.cpu_plan
        self.block_size = config.block_size
        text_config = self.model.config.get_text_config()
        self.hf_config = text_config
        self.num_layers = text_config.num_hidden_layers
        self.num_heads = text_config.num_attention_heads
        self.num_kv_heads = getattr(text_config, "num_key_value_heads", None) or self.num_heads
        self.head_size = getattr(text_config, "head_dim", None) or text_config.hidden_size // self.num_heads
        # Tensor parallelism (kvfleet.runtime.worker.executor): this rank computes and caches only
        # its 1/tp share of the query and KV heads.
        self.tp_size = config.tensor_parallel_size
        self.num_heads //= self.tp_size
        self.num_kv_heads //= self.tp_size
        # Pipeline parallelism (kvfleet.runtime.worker.pipeline): this rank runs and caches its stage's layers.
        self.pp = PipelineStage(self.model, self.tp_size) if config.pipeline_parallel_size > 1 else None
        self.layer_range = self.pp.layer_range if self.pp is not None else range(self.num_layers)
        self.vocab_size = text_config.vocab_size
        self.model_max_len = int(getattr(text_config, "max_position_embeddings", 0) or 0) or None
        # Per-layer sliding windows; ValueError for attention features the kernels lack.
        self.sliding_windows = check_attention_support(self.model.config)
        name = register()
        self.model.set_attn_implementation(name)
        if self.model.config._attn_implementation != name:
            raise RuntimeError(
                f"{type(self.model).__name__} does not support transformers' attention-function "
                "registry; kvfleet needs a model that does (Llama, Qwen2, Mistral, ...)"
            )
        self._logit_scale = 1.0
        # Its two-token probe forward also checks every layer's attention call before any request.
        self.prompt_logprobs_error = self._check_compute_logits() if self.pp is None else PROMPT_LOGPROBS_REASON
        """None, or why prompt logprobs cannot be computed for this model (the engine then
        refuses requests that ask for them)."""
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.num_blocks = 0
        self.kv_connector = None  # the KV connector's worker side (kv_transfer/connector.py; the engine sets it)
        self.compiled: CompiledForward | None = None
        self.cpu_decode: CpuDecodePath | None = None
        """The fused CPU decode path (:mod:`kvfleet.runtime.worker.cpu_decode`), built by
        :meth:`initialize_kv_cache` when the model and machine allow it; it runs the steps whose
        sequences each have one new token."""
        """The compiled decoder (``enforce_eager=False``), built by :meth:`initialize_kv_cache`."""
        self.lora = None
        """The LoRA adapters (``enable_lora``): :class:`~kvfleet.runtime.worker.lora_manager.LoRAManager`."""
        if config.enable_lora:
            from kvfleet.runtime.worker.lora_manager import shared_lora_manager

            self.lora = shared_lora_manager(self.model, config, self.device, self.dtype)
        self._pin = self.device.type == "cuda"
        self.kv_cache_dtype = self._kv_cache_dtype(config.kv_cache_dtype)
        """The KV cache's dtype (``kv_cache_dtype``); activations are :attr:`dtype`."""
        windowed = any(w is not None for w in self.sliding_windows or ())
        self.sampler = Sampler(self.device, seed=config.seed)
        self.states = RequestStates()
        """The runner's own per-request state, by request id (plain data from the scheduler's output)."""
        self.input_batch = InputBatch(self.block_size, sliding_window=windowed)
        """Persistent host state of the step's inputs (block-table rows), see :meth:`prepare_inputs`."""
        self.speculator: Speculator | None = None
        """Speculative decoding (``--speculative-config``): verifies and proposes drafts."""
        if config.speculative_config is not None:
            self.speculator = Speculator(config.speculative_config, self.sampler)

    @property
    def logit_scale(self) -> float:
        """The constant factor the model's forward applies to the LM head's logits (1.0 for
        most models; see :meth:`_check_compute_logits`)."""
        return self._logit_scale

    # ------------------------------------------------------------------ KV cache sizing
    @property
    def bytes_per_block(self) -> int:
        """Bytes of one KV block over all layers: ``2 * layers * block_size * kv_heads * head_size * elem``."""
        elem = torch.empty((), dtype=self.kv_cache_dtype).element_size()
        return 2 * len(self.layer_range) * self.block_size * self.num_kv_heads * self.head_size * elem

    def determine_num_blocks(self) -> int:
        """Number of KV blocks the memory budget allows.

        - ``config.num_blocks`` when set;
        - CPU: ``kv_cache_memory`` (default ``DEFAULT_KV_CACHE_MEMORY``) / bytes per block;
          with tensor parallelism each rank gets ``1 / tp`` of it (and its blocks are ``1 / tp``
          the size: the same block count);
        - CUDA: ``kv_cache_memory`` when set, else
          ``gpu_memory_utilization * total - peak_torch_memory - non_torch_memory`` where the
          peak comes from a dummy forward pass of ``max_num_batched_tokens`` tokens (weights
          + activations), and non-torch memory is what other users of the device hold
          (vLLM's profiling rule).

        Raises:
            ValueError: the budget leaves no room for a single block.
        """
        if self.config.num_blocks is not None:
            return self.config.num_blocks
        if self.device.type != "cuda" or self.config.kv_cache_memory is not None:
            budget = self.config.kv_cache_memory or DEFAULT_KV_CACHE_MEMORY
            source = "kv_cache_memory"
            if self.device.type != "cuda":  # ranks share the host's memory: each gets 1/tp of it
                budget /= self.tp_size * (self.pp.pp_size if self.pp is not None else 1)
        else:
            budget = self._profile_cuda_budget()
            source = "gpu_memory_utilization"
        num_blocks = int(budget // self.bytes_per_block)
        if num_blocks < 1:
            raise ValueError(
                f"{source}: the KV cache budget ({budget / 2**20:.1f} MiB) is smaller than one block "
                f"({self.bytes_per_block / 2**20:.2f} MiB)"
            )
        return num_blocks

    @torch.inference_mode()
    def _profile_cuda_budget(self) -> float:
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        num_tokens = self.config.max_num_batched_tokens
        if self.model_max_len:
            num_tokens = min(num_tokens, self.model_max_len)
        nb = math.ceil(num_tokens / self.block_size)
        shape = (nb, self.block_size, self.num_kv_heads, self.head_size)
        caches = [
            (torch.zeros(shape, dtype=self.dtype, device=self.device),
             torch.zeros(shape, dtype=self.dtype, device=self.device))
            for _ in range(self.num_layers)
        ]
        num_sample = min(self.config.max_num_seqs, num_tokens)
        meta = AttentionMetadata(
            slot_mapping=torch.arange(num_tokens, device=self.device),
            block_tables=torch.arange(nb, dtype=torch.int32, device=self.device).unsqueeze(0),
            seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=self.device),
            query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=self.device),
            max_query_len=num_tokens,
            max_seq_len=num_tokens,
            kv_caches=caches,
            sliding_windows=self.sliding_windows,
        )
        ids = torch.zeros((1, num_tokens), dtype=torch.long, device=self.device)
        pos = torch.arange(num_tokens, device=self.device).unsqueeze(0)
        keep = torch.arange(num_tokens - num_sample, num_tokens, device=self.device)
        out = self.model(input_ids=ids, position_ids=pos, logits_to_keep=keep, use_cache=False,
                         **{METADATA_KWARG: meta})
        logits = out.logits.float()
        torch.softmax(logits, dim=-1)  # the sampler's fp32 working set
        # A step with prompt logprobs: one chunk of fp32 logits, its log_softmax and the rank
        # comparison (see prompt_logprobs.prompt_logprobs), on top of the sampler's working set.
        rows = min(num_tokens, max(1, PROMPT_LOGPROBS_CHUNK_BYTES // (4 * self.vocab_size)))
        chunk = torch.zeros((rows, self.vocab_size), dtype=torch.float32, device=self.device)
        chunk_lp = torch.log_softmax(chunk, dim=-1)
        (chunk_lp > chunk_lp[:, :1]).sum(dim=1)
        del chunk, chunk_lp
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        dummy_cache = sum(k.numel() * k.element_size() * 2 for k, _ in caches)
        del caches, meta, out, logits
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        non_torch = max(0, (total - free) - torch.cuda.memory_reserved(self.device))
        budget = total * self.config.gpu_memory_utilization - (peak - dummy_cache) - non_torch
        logger.info(
            "CUDA memory: total %.1f GiB, peak weights+activations %.2f GiB, non-torch %.2f GiB -> KV budget %.2f GiB",
            total / 2**30, (peak - dummy_cache) / 2**30, non_torch / 2**30, budget / 2**30,
        )
        return max(budget, 0.0)

    def _kv_cache_dtype(self, requested: str) -> torch.dtype:
        """The cache dtype for ``kv_cache_dtype`` (see :class:`~kvfleet.runtime.config.EngineConfig`):
        ``auto`` is :data:`CPU_AUTO_KV_CACHE_DTYPE` where the fused CPU decoder will run, else the
        activation dtype. Raises ValueError for a CUDA cache dtype other than the activations'."""
        if requested == "auto":
            if self.device.type != "cpu" or self.dtype != torch.float32:
                return self.dtype
            why = cpu_decode.unsupported(self) if self.pp is None else "pipeline parallelism"
            bf16 = why is None and cpu_decode.matmul_asked(self) != "float32"
            dtype = torch.bfloat16 if bf16 else CPU_AUTO_KV_CACHE_DTYPE if why is None else self.dtype
            logger.info("KV cache dtype: %s (kv_cache_dtype auto: %s)", str(dtype).removeprefix("torch."),
                        "the fused CPU decoder's matmuls run in bf16" if bf16 else
                        "the fused CPU decoder runs" if why is None else f"the fused CPU decoder is off: {why}")
            return dtype
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[requested]
        if self.device.type == "cuda" and dtype != self.dtype:
            raise ValueError(f"kv_cache_dtype={requested}: on CUDA the KV cache is kept in the activation dtype "
                             f"({str(self.dtype).removeprefix('torch.')}); use auto")
        return dtype

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate (zeroed) key and value caches of ``num_blocks`` blocks for every layer, in
        :attr:`kv_cache_dtype`."""
        shape = (num_blocks, self.block_size, self.num_kv_heads, self.head_size)
        none = torch.empty(0, dtype=self.kv_cache_dtype, device=self.device)  # another stage's layer
        self.kv_caches = [
            (torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device),
             torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device))
            if i in self.layer_range else (none, none) for i in range(self.num_layers)
        ]
        self.num_blocks = num_blocks
        logger.info(
            "KV cache: %d blocks x %d tokens, %s (%.1f MiB)", num_blocks, self.block_size,
            str(self.kv_cache_dtype).removeprefix("torch."), num_blocks * self.bytes_per_block / 2**20
        )
        self.cpu_decode = cpu_decode.build(self) if self.pp is None else None  # the fused step runs every layer
        if self.speculator is not None and self.cpu_decode is not None:
            self.speculator.max_step_rows = CPU_STEP_ROWS  # within the fused path's rows, where drafts pay
            self.speculator.row_cost = CPU_ROW_COST
        settings = compile_settings(self.config, self.device, self.prompt_logprobs_error)
        if settings is not None:
            self.compiled = CompiledForward(self.model.get_decoder(), self.device, **settings)
            self.compiled.warm_up(self._dummy_step)

    def _dummy_step(self, num_seqs: int, num_tokens: int, full_width: bool = False) -> tuple:
        """A throw-away step for warm-up: ``num_seqs`` sequences sharing ``num_tokens`` new
        tokens over block 0, written nowhere (slots -1); ``full_width``: block tables as wide
        as ``max_model_len`` needs (a CUDA graph's static width)."""
        dev = self.device
        per = [num_tokens // num_seqs + (i < num_tokens % num_seqs) for i in range(num_seqs)]
        max_len = self.config.max_model_len or self.model_max_len or num_tokens
        width = math.ceil(max_len / self.block_size) if full_width else math.ceil(max(per) / self.block_size)
        qsl = [0]
        for n in per:
            qsl.append(qsl[-1] + n)
        meta = AttentionMetadata(
            slot_mapping=torch.full((num_tokens,), -1, dtype=torch.long, device=dev),
            block_tables=torch.zeros((num_seqs, max(width, 1)), dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(per, dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            max_query_len=max(per), max_seq_len=max_len if full_width else max(per),
            kv_caches=self.kv_caches, sliding_windows=self.sliding_windows,
        )
        positions = torch.cat([torch.arange(n, device=dev) for n in per]).unsqueeze(0)
        return torch.zeros((1, num_tokens), dtype=torch.long, device=dev), positions, meta

    # ------------------------------------------------------------------ one step
    def prepare_inputs(
        self, scheduled: list[ScheduledRow]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """Build the step's tensors (numpy on the host, then one copy each to the device)
        from the persistent :class:`~kvfleet.runtime.worker.input_batch.InputBatch` (block-table
        rows updated incrementally as requests join and leave).

        Returns:
            ``(input_ids [1, T] int64, positions [1, T] int64, AttentionMetadata,
            logits_indices [S] int64)`` where ``logits_indices`` are the batch rows of the
            last token of every request with ``sample=True``, in scheduling order.
        """
        return self.input_batch.prepare(scheduled, self.kv_caches, self.sliding_windows, self.device, self._pin)

    @torch.inference_mode()
    def _check_compute_logits(self) -> str | None:
        """Compare :meth:`compute_logits` on the decoder's hidden states with the model's own
        logits over one two-token probe forward (:func:`probe_attention`). A forward that
        multiplies the LM head's output by a constant (Cohere's ``logit_scale``, Granite's
        ``1 / logits_scaling``, ...) is matched by fitting that factor (least squares over the
        vocabulary) and checking the fit; it is then applied by :meth:`compute_logits`.
        Returns None when they agree, else why not (prompt logprobs would be wrong).

        Raises:
            ValueError: from :func:`probe_attention`, a layer's attention call the kernels
                cannot serve (this probe is the model's only one at start-up)."""
        hidden: list[torch.Tensor] = []
        logits: list[torch.Tensor] = []
        h1 = self.model.get_decoder().register_forward_hook(
            lambda _m, _a, o: hidden.append(o.last_hidden_state if hasattr(o, "last_hidden_state") else o[0])
        )
        h2 = self.model.register_forward_hook(lambda _m, _a, o: logits.append(o.logits))
        try:
            probe_attention(self.model, num_kv_heads=self.num_kv_heads, head_size=self.head_size,
                            block_size=self.block_size, sliding_windows=self.sliding_windows,
                            device=self.device, dtype=self.dtype)
        finally:
            h1.remove()
            h2.remove()
        if not hidden or not logits:
            return f"{type(self.model).__name__}: its decoder's hidden states or logits could not be observed"
        mine = self.compute_logits(hidden[0][0, -1:])
        theirs = logits[0][0, -1:].float()
        if mine.shape != theirs.shape:
            return (f"{type(self.model).__name__}: LM head logits of shape {tuple(mine.shape)}, "
                    f"the model's {tuple(theirs.shape)}")
        if torch.allclose(mine, theirs, rtol=1e-3, atol=1e-4):
            return None
        scale = float((mine * theirs).sum() / (mine * mine).sum().clamp_min(1e-30))
        if math.isfinite(scale) and scale != 0 and torch.allclose(mine * scale, theirs, rtol=1e-3, atol=1e-4):
            self._logit_scale = scale
            logger.info("%s scales its logits by %.6g after the LM head", type(self.model).__name__, scale)
            return None
        return (
            f"{type(self.model).__name__}'s forward changes the LM head's logits in a way kvfleet does not "
            "repeat for prompt positions"
        )

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The LM head on hidden states ``[N, hidden_size]`` -> logits ``[N, vocab_size]``
        float32, as the model's own forward computes them: ``model.get_output_embeddings()``,
        times the constant factor some models apply (see :meth:`_check_compute_logits`), then
        ``tanh`` soft-capping when the config has ``final_logit_softcapping`` (Gemma 2)."""
        logits = self.model.get_output_embeddings()(hidden_states).float()
        if self._logit_scale != 1.0:
            logits = logits * self._logit_scale
        cap = getattr(self.hf_config, "final_logit_softcapping", None)
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    @torch.inference_mode()
    def sample(self, output: ModelRunnerOutput, grammar_mask=None) -> SampledRows:
        """Sample each request of ``output`` from the runner's own state of it (with speculative
        decoding: verify its drafts, then propose its next ones); ``grammar_mask(logits, req_ids,
        drafts)`` first masks constrained rows in place (the engine's grammars; ``drafts`` per
        request, or None). Returns the tokens and logprobs keyed by request id."""
        drafts = output.draft_token_ids
        if grammar_mask is not None:
            grammar_mask(output.logits, output.req_ids, [drafts.get(r, []) for r in output.req_ids] if drafts else None)
        rows: list[CachedRequestState] = [self.states.requests[rid] for rid in output.req_ids]
        if self.speculator is None:
            return SampledRows.of(output.req_ids, self.sampler(output.logits, rows))
        tokens, logprobs = self.speculator.verify(output.logits, output.req_ids, rows, drafts)
        return SampledRows(tokens, logprobs, self.speculator.propose(output.req_ids, rows, tokens))

    @torch.inference_mode()
    def execute_model(self, runner_input: RunnerInput) -> ModelRunnerOutput:
        """Run one forward pass over the scheduled tokens.

        Returns:
            A :class:`ModelRunnerOutput`: the ids of the scheduled requests that sample, in
            order, their next-token logits ``[len(sampling), vocab_size]`` float32 (on the
            model's device; both empty when nothing samples this step, a prefill chunk),
            and the prompt logprobs computed this step.

        Raises:
            RuntimeError: the KV cache was not initialised.
        """
        if not self.kv_caches:
            raise RuntimeError("initialize_kv_cache() must be called before execute_model()")
        if self.kv_connector is not None:  # KV loaded instead of computed (a decode leg's prompt)
            self.kv_connector.start_load_kv()
        if self.speculator is not None and runner_input.finished_request_ids:
            done = {rid: st.prompt_token_ids + st.output_token_ids for rid in runner_input.finished_request_ids
                    if (st := self.states.requests.get(rid)) is not None}
            self.speculator.finish(runner_input.finished_request_ids, done)
        scheduled = self.states.update(runner_input)
        sampling = [s.request_id for s in scheduled if s.sample]
        drafts = {s.request_id: s.spec_token_ids for s in scheduled if s.sample and s.spec_token_ids}
        if not scheduled:
            empty = torch.empty((0, self.vocab_size), dtype=torch.float32, device=self.device)
            return ModelRunnerOutput(sampling, empty)
        input_ids, positions, meta, logits_indices = self.prepare_inputs(scheduled)
        rows = prompt_logprob_rows(scheduled)
        max_query = 1 + (self.speculator.config.num_speculative_tokens if self.speculator is not None else 0)
        if self.pp is not None:  # this stage's layers; rank 0 gets the last stage's logits
            logits = self.pp.execute(input_ids, positions, {METADATA_KWARG: meta}, logits_indices, self.vocab_size)
            return ModelRunnerOutput(sampling, logits, draft_token_ids=drafts)
        adapters = self.lora is not None and any(s.request.lora_int_id for s in scheduled)
        lora_slots = self.cpu_decode.lora_slots(scheduled) if adapters and self.cpu_decode is not None else None
        if self.cpu_decode is not None and (lora_slots is not None or not adapters) and self.cpu_decode.applies(
            input_ids.shape[1], len(scheduled), bool(rows), meta.num_actual_tokens is not None,
            meta.max_query_len, max_query,
        ):  # adapter tokens run fused where the C step has their layers' tables (else the LoRA layers below)
            logits = self.cpu_decode.execute(input_ids, positions, meta, logits_indices, lora_slots)
            return ModelRunnerOutput(sampling, logits, draft_token_ids=drafts)
        if self.compiled is not None:
            hidden = self.compiled(input_ids, positions, meta)  # [T, hidden_size]
            logits = self.compute_logits(hidden.index_select(0, logits_indices))
            plps = prompt_logprobs(hidden, rows, self.compute_logits, self.vocab_size) if rows else {}
            return ModelRunnerOutput(sampling, logits, plps, drafts)
        captured: list[torch.Tensor] = []
        hook = None
        if rows:
            def keep_hidden(_module, _args, output):
                captured.append(output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0])

            hook = self.model.get_decoder().register_forward_hook(keep_hidden)
        try:
            with self.lora.step(scheduled) if self.lora is not None else contextlib.nullcontext():
                out = self.model(
                    input_ids=input_ids,
                    position_ids=positions,
                    logits_to_keep=logits_indices,
                    use_cache=False,
                    **{METADATA_KWARG: meta},
                )
        finally:
            if hook is not None:
                hook.remove()
        logits = out.logits[0]
        if logits.dtype != torch.float32:
            logits = logits.float()
        plps = prompt_logprobs(captured[0][0], rows, self.compute_logits, self.vocab_size) if rows else {}
        return ModelRunnerOutput(sampling, logits, plps, drafts)
