"""``AsyncLLMEngine``: the engine core in a background thread, one async stream per request.

``LLMEngine.step()`` is synchronous and CPU/GPU-bound, so it runs in a dedicated thread
(the *engine thread*); the event loop only validates/tokenizes requests and relays
outputs. All engine state is touched by the engine thread alone: adds, aborts and
prefix-cache resets are commands it executes between steps (at most one step's wait).

Typical use (what the OpenAI server does)::

    engine = await asyncio.to_thread(AsyncLLMEngine, config, stat_loggers)  # loads the model
    await engine.start()
    async for out in engine.generate("Hello", SamplingParams(max_tokens=8), "req-1"):
        print(out.outputs[0].text)          # cumulative text so far (output_kind CUMULATIVE)
    await engine.shutdown()
"""

from __future__ import annotations

import os

# Before torch loads its OpenMP runtime: idle OpenMP threads sleep instead of spinning.
# With spinning (the default) a CPU shared with other processes makes every parallel
# region wait for a descheduled spinner: decode steps measured 10-20x slower here.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import asyncio
import collections
import logging
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import Future, InvalidStateError

import torch

from kvfleet.runtime.config import EngineConfig
from kvfleet.runtime.engine.kv_pull import KVPuller, export_blocks
from kvfleet.runtime.engine.llm_engine import LLMEngine
from kvfleet.runtime.engine.outputs import RequestOutput
from kvfleet.runtime.kv_transfer.fleet_auth import FleetKeys, load_fleet_keys
from kvfleet.runtime.lora_request import LoRARequest
from kvfleet.runtime.sampling_params import RequestOutputKind, SamplingParams
from kvfleet.runtime.worker.model_loader import LoadedModel

logger = logging.getLogger(__name__)

IDLE_WAIT = 0.5
"""Seconds an idle engine loop sleeps between looks at its commands (and heartbeats)."""


class EngineDeadError(RuntimeError):
    """The engine loop died (``dead_error`` holds the cause) or was shut down."""


class _Stream:
    """Outputs of one request, handed from the engine thread to the event loop."""

    def __init__(self) -> None:
        self.items: collections.deque = collections.deque()
        self.event = asyncio.Event()
        self.finished = False

    def put(self, item) -> None:  # event-loop thread only
        self.items.append(item)
        self.event.set()


class AsyncLLMEngine:
    """Async front of :class:`~kvfleet.runtime.engine.llm_engine.LLMEngine`; implements
    :class:`~kvfleet.runtime.engine.protocol.EngineClient` (what the HTTP server uses).

    Args:
        config: engine configuration (default ``EngineConfig()``).
        stat_loggers: passed to the engine (``record()`` is called from the engine thread).
        loaded: optional already loaded model (see ``LLMEngine``).

    The constructor loads the model and allocates the KV cache: it BLOCKS for seconds
    (call it through ``asyncio.to_thread`` from async code). Nothing runs until
    ``await start()``.
    """

    def __init__(
        self,
        config: EngineConfig | None = None,
        stat_loggers: list | None = None,
        *,
        loaded: LoadedModel | None = None,
    ) -> None:
        self.engine = LLMEngine(config, stat_loggers, loaded=loaded)
        self.config = self.engine.config
        self._streams: dict[str, _Stream] = {}
        self._commands: collections.deque = collections.deque()
        self._wakeup = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.dead_error: BaseException | None = None
        self._heartbeat = time.monotonic()
        """``time.monotonic()`` when the engine loop last went round (idle: every ``IDLE_WAIT`` s)."""
        transfer = self.config.kv_transfer_config
        self.fleet_keys: FleetKeys | None = (load_fleet_keys(transfer.fleet_secret_file)
                                             if transfer is not None else None)
        """The fleet's keys (:mod:`~kvfleet.runtime.kv_transfer.fleet_auth`): the router's hints are
        checked, ``/kv_blocks`` served and peers pulled from with them; None: none of the three."""
        self.kv_puller = (KVPuller(self.engine, self._call, self.fleet_keys)
                          if transfer is not None and (transfer.pulls or transfer.disk_path) else None)
        """Fills a request's missing prefix blocks from the disk tier and the peer the router names
        (``--kv-transfer-config``)."""

    # ------------------------------------------------------------------ properties
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def is_running(self) -> bool:
        """True while the engine thread is alive."""
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    @property
    def errored(self) -> bool:
        """True once the engine loop died of an exception (see ``dead_error``)."""
        return self.dead_error is not None

    @property
    def heartbeat_age(self) -> float:
        """Seconds since the engine loop last went round: at most one step's duration (or
        ``IDLE_WAIT``) while it works; it grows without bound when a step hangs."""
        return time.monotonic() - self._heartbeat if self._thread is not None else 0.0

    @property
    def num_waiting(self) -> int:
        return self.engine.num_waiting

    @property
    def num_running(self) -> int:
        return self.engine.num_running

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    @property
    def kv_cache_usage(self) -> float:
        """Fraction 0-1 of KV blocks held by requests (read from the event loop; a float is atomic)."""
        return float(self.engine.scheduler.kv_cache_manager.usage)

    def cache_config_info(self) -> dict[str, str]:
        return self.engine.cache_config_info()

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Start the engine thread (idempotent)."""
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._heartbeat = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="kvfleet-engine", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        """Stop the engine thread after the current step; pending streams end with
        :class:`EngineDeadError`; then stop the tensor-parallel workers (``LLMEngine.shutdown``)."""
        self._stopping = True
        self._wakeup.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 60)
        self._fail_streams(EngineDeadError("the engine was shut down"))
        if self.kv_puller is not None:
            await self.kv_puller.aclose()
        if self._thread is None or not self._thread.is_alive():
            await asyncio.to_thread(self.engine.shutdown)  # tensor-parallel workers, if any

    # ------------------------------------------------------------------ requests
    async def generate(
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
        """Submit a request and yield its outputs until it finishes (``lora_name``: a loaded
        LoRA adapter, None: the base model): cumulative, deltas or only the final one, as
        ``sampling_params.output_kind`` asks. ``kv_peer``: the base URL of a replica that caches
        the prompt's prefix (the router's hint, its signature verified by the caller); with peer
        pull on (``--kv-transfer-config``) its missing prefix blocks are pulled from there first.

        Consecutive outputs produced while the consumer was busy are coalesced into one
        (cumulative: the latest; deltas: joined with ``RequestOutput.add``).

        Raises:
            ValueError: invalid input (naming the parameter) or a ``request_id`` in use,
                before anything is yielded; ``StructuredOutputError`` (a ValueError) when its
                grammar does not compile (awaited here, off the engine loop, before queueing).
            EngineDeadError: the engine is not running or died.

        Closing the iterator early (client gone) aborts the request.
        """
        self._check_alive()
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        prepared = self.engine.prepare_request(
            request_id, prompt, sampling_params, priority=priority, tenant=tenant, lora_name=lora_name,
            resume_output_ids=resume_output_ids,
        )
        if prepared.grammar is not None:
            # Compiled on the grammar thread pool; only this request waits (StructuredOutputError: 400).
            await asyncio.shield(asyncio.wrap_future(prepared.grammar))  # a cancelled wait keeps the shared compile
            self._check_alive()
            if request_id in self._streams:
                raise ValueError(f"request_id {request_id!r} is already in use")
        remote = (prepared.state.params.kv_transfer_params or {}).get("do_remote_prefill")
        if self.kv_puller is not None and (kv_peer is not None or self.kv_puller.disk is not None or remote):
            if remote:  # a decode leg: its prompt's blocks from the prefill replica
                await self.kv_puller.fetch_remote_prefill(prepared.requests[0])
            else:
                await self.kv_puller.pull(prepared.requests[0], kv_peer)
            self._check_alive()
            if request_id in self._streams:
                raise ValueError(f"request_id {request_id!r} is already in use")
        aggregate = prepared.state.params.output_kind == RequestOutputKind.DELTA
        stream = _Stream()
        self._streams[request_id] = stream
        try:
            await self._call(self.engine.add_prepared, prepared)
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        try:
            while True:
                if not stream.items:
                    stream.event.clear()
                    await stream.event.wait()
                item = stream.items.popleft()
                while stream.items and not isinstance(item, BaseException):
                    later = stream.items.popleft()
                    item = later if isinstance(later, BaseException) else item.add(later, aggregate)
                if isinstance(item, BaseException):
                    raise item
                if item.finished and self.engine.kv_connector is not None:  # a prefill leg's answer
                    params = self.engine.kv_connector.finished_params.pop(prepared.requests[0].request_id, None)
                    if params is not None:
                        item.extra["kv_transfer_params"] = params
                yield item
                if item.finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not stream.finished and self.is_running:
                self._submit(self.engine.abort_request, [request_id], None)

    async def abort(self, request_id: str) -> None:
        """Abort a request: its blocks are freed before this returns (counted as
        ``finish_reason="abort"``); its stream ends with a final aborted output. Unknown or
        finished ids are ignored."""
        if not self.is_running:
            return
        await self._call(self.engine.abort_request, [request_id])

    # ------------------------------------------------------------------ LoRA adapters
    def list_loras(self) -> list[LoRARequest]:
        """The loaded LoRA adapters (read from the event loop: a copy of the engine's dict)."""
        return list(dict(self.engine.loras).values())

    def lora_info(self) -> dict[str, str]:
        return self.engine.lora_info()

    async def add_lora(self, lora_name: str, lora_path: str, base_model_name: str | None = None) -> LoRARequest:
        """Load an adapter (in the engine thread, between steps). Raises LoRALoadError (see
        :meth:`LLMEngine.add_lora <kvfleet.runtime.engine.llm_engine.LLMEngine.add_lora>`)."""
        return await self._call(self.engine.add_lora, lora_name, lora_path, base_model_name)

    async def remove_lora(self, lora_name: str) -> None:
        """Unload an adapter; its requests end aborted. Raises LoRANotFoundError."""
        await self._call(self.engine.remove_lora, lora_name)

    async def embed(self, seqs: list[list[int]], pooler_config) -> list[list[float]]:
        """Pooled vectors of ``seqs`` (:func:`kvfleet.runtime.worker.pooler.embed`), one forward
        with scratch KV caches in the engine thread between steps."""
        from kvfleet.runtime.worker.pooler import embed

        return await self._call(embed, self.engine.runner, seqs, pooler_config)

    async def reset_prefix_cache(self) -> bool:
        """Drop unreferenced prefix-cache blocks (in the engine thread)."""
        self._check_alive()
        return await self._call(self.engine.reset_prefix_cache)

    def kv_events_snapshot(self) -> dict | None:
        """The KV events snapshot (thread-safe: read from the publisher, not the engine thread)."""
        return self.engine.kv_events_snapshot()

    async def kv_blocks(self, block_hashes: list[bytes]) -> list[tuple[bytes, bytes]] | None:
        """``(hash, payload)`` of the leading run of ``block_hashes`` this replica caches (read in
        the engine thread); None when it does not serve blocks (``--kv-transfer-config``)."""
        transfer = self.config.kv_transfer_config
        if transfer is None or not transfer.serves:
            return None
        return await self._call(export_blocks, self.engine, block_hashes)

    def kv_block_layout(self):
        """The :class:`~kvfleet.runtime.kv_transfer.wire.BlockLayout` of this replica's blocks."""
        from kvfleet.runtime.worker.kv_blocks import block_layout

        return block_layout(self.engine.runner, self.engine.model_name, self.engine.loaded.quantization)

    # ------------------------------------------------------------------ engine thread
    def _check_alive(self) -> None:
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine loop died: {self.dead_error!r}") from self.dead_error
        if self._thread is None:
            raise EngineDeadError("the engine is not started (await start())")
        if not self.is_running:
            raise EngineDeadError("the engine is shut down")

    def _submit(self, fn, args, future: Future | None) -> None:
        self._commands.append((fn, args, future))
        self._wakeup.set()

    async def _call(self, fn, *args):
        """Run ``fn(*args)`` in the engine thread between steps; return its result."""
        self._check_alive()
        future: Future = Future()
        self._submit(fn, list(args), future)
        return await asyncio.wrap_future(future)

    def _run(self) -> None:
        with torch.inference_mode():
            try:
                while not self._stopping:
                    self._heartbeat = time.monotonic()
                    if self.engine.executor is not None:  # a lost tensor-parallel rank kills the loop, idle or not
                        self.engine.executor.check_health()
                    self._run_commands()
                    if self.engine.has_unfinished_requests():
                        outputs = self.engine.step()
                        if outputs:
                            self._dispatch(outputs)
                    else:
                        self._wakeup.wait(IDLE_WAIT)
                        self._wakeup.clear()
            except BaseException as exc:  # the loop is dead: tell everyone
                logger.exception("the engine loop died")
                self.dead_error = exc
                self._fail_pending_commands(exc)
                if self._loop is not None and not self._loop.is_closed():
                    self._loop.call_soon_threadsafe(
                        self._fail_streams, EngineDeadError(f"the engine loop died: {exc!r}")
                    )

    def _run_commands(self) -> None:
        while self._commands:
            fn, args, future = self._commands.popleft()
            try:
                result = fn(*args)
            except Exception as exc:
                _resolve(future, exc=exc)
                continue
            if fn in (self.engine.abort_request, self.engine.remove_lora) and result:
                self._dispatch(result)
            _resolve(future, result)

    def _fail_pending_commands(self, exc: BaseException) -> None:
        while self._commands:
            _, _, future = self._commands.popleft()
            if future is not None and not future.done():
                future.set_exception(EngineDeadError(f"the engine loop died: {exc!r}"))

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._deliver, outputs)

    def _deliver(self, outputs: list[RequestOutput]) -> None:  # event-loop thread
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                stream.finished = True
            stream.put(out)

    def _fail_streams(self, exc: BaseException) -> None:  # event-loop thread
        for stream in list(self._streams.values()):
            if not stream.finished:
                stream.finished = True
                stream.put(exc)


def _resolve(future: Future | None, result=None, exc: BaseException | None = None) -> None:
    """Hand a command's result to its caller, unless the caller stopped waiting: a
    cancelled await (a client that went away) must never kill the engine loop."""
    if future is None:
        return
    try:
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(result)
    except InvalidStateError:
        pass  # cancelled by the caller
