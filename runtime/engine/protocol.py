"""``EngineClient``: everything the HTTP server may ask of an engine (vLLM's ``EngineClient``).

The OpenAI server is typed against this protocol alone; :class:`~kvfleet.runtime.engine.async_llm.AsyncLLMEngine`
implements it. Torch-free: importing this module loads no model code.

Contract: ``generate`` yields :class:`~kvfleet.runtime.engine.outputs.RequestOutput` s (cumulative,
deltas or only the final one, as ``SamplingParams.output_kind`` asks) until one is ``finished``
(closing it early aborts the request), raises ``ValueError`` for invalid input before yielding
anything (``StructuredOutputError``, a subclass, for a grammar that does not compile); ``abort``
frees the request's KV blocks before it returns. The counts and ``kv_cache_usage`` and
``heartbeat_age`` are live values, read from the event loop.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol, runtime_checkable

from kvfleet.runtime.engine.outputs import RequestOutput
from kvfleet.runtime.lora_request import LoRARequest
from kvfleet.runtime.sampling_params import SamplingParams


@runtime_checkable
class EngineClient(Protocol):
    """The engine as the server sees it."""

    # -- facts, fixed once loaded
    @property
    def tokenizer(self) -> Any:
        """The HF tokenizer (``encode``, ``decode``, ``apply_chat_template``, ``chat_template``)."""

    @property
    def max_model_len(self) -> int: ...

    @property
    def vocab_size(self) -> int:
        """Token ids of a prompt must be in ``[0, vocab_size)``."""

    @property
    def model_name(self) -> str:
        """The model's display name (the server serves it as ``served_name``)."""

    def cache_config_info(self) -> dict[str, str]:
        """``block_size``, ``num_blocks``, ``gpu_memory_utilization`` (the ``cache_config_info`` metric)."""

    # -- live state
    @property
    def is_running(self) -> bool: ...

    @property
    def errored(self) -> bool: ...

    @property
    def dead_error(self) -> BaseException | None:
        """Why the engine loop died, or None."""

    @property
    def heartbeat_age(self) -> float:
        """Seconds since the engine loop last went round (a step, or an idle wake-up); 0 before start."""

    @property
    def num_waiting(self) -> int: ...

    @property
    def num_running(self) -> int: ...

    @property
    def kv_cache_usage(self) -> float:
        """Fraction 0-1 of KV blocks held by requests."""

    # -- lifecycle and requests
    async def start(self) -> None: ...

    async def shutdown(self) -> None: ...

    def generate(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams | None,
        request_id: str,
        *,
        priority: int = 0,
        tenant: str | None = None,
        lora_name: str | None = None,
        resume_output_ids: list[list[int]] | None = None,
        kv_peer: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """``kv_peer`` (the router's hint, docs/routing.md "Peer KV pull", its signature verified
        by the caller): a replica to pull the prompt's missing prefix blocks from before queueing it."""

    async def abort(self, request_id: str) -> None: ...

    async def embed(self, seqs: list[list[int]], pooler_config: Any) -> list[list[float]]:
        """One pooled vector per token-id sequence (``/v1/embeddings``, :mod:`kvfleet.runtime.worker.pooler`)."""

    # -- LoRA adapters (docs/lora.md)
    def list_loras(self) -> list[LoRARequest]:
        """The loaded adapters (empty with LoRA off)."""

    def lora_info(self) -> dict[str, str]:
        """``{"max_lora": ...}`` with LoRA on, else empty (the ``lora_requests_info`` gauge)."""

    async def add_lora(self, lora_name: str, lora_path: str, base_model_name: str | None = None) -> LoRARequest:
        """Load a PEFT adapter; raises ``LoRALoadError`` (a ValueError) saying why not."""

    async def remove_lora(self, lora_name: str) -> None:
        """Unload an adapter (its requests end aborted); raises ``LoRANotFoundError``."""

    async def reset_prefix_cache(self) -> bool:
        """Drop every unreferenced cached KV block; whether the reset happened."""

    async def kv_blocks(self, block_hashes: list[bytes]) -> list[tuple[bytes, bytes]] | None:
        """``(hash, payload)`` of the leading run of ``block_hashes`` this replica caches; None when it
        does not serve blocks (``--kv-transfer-config`` off or ``kv_role`` ``kv_consumer``)."""

    def kv_block_layout(self) -> Any:
        """The :class:`~kvfleet.runtime.kv_transfer.wire.BlockLayout` of this replica's KV blocks."""

    def kv_events_snapshot(self) -> dict | None:
        """``{"seq", "block_size", "block_hashes"}`` (hex): every block hash in the prefix cache
        after KV event batch ``seq``; None when KV events are off (``--kv-events-config``)."""
