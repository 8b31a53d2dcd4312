"""The disk tier in the engine (``--kv-transfer-config`` ``disk_path``; docs/routing.md "Disk tier").

Write-through: :class:`DiskWriter` is one of the engine's KV event sinks; after every step it
reads, through the engine's KV connector (:mod:`kvfleet.runtime.kv_transfer.connector`), the
blocks that step registered in the prefix cache (their ``BlockStored`` events: their K/V was
written by that step's forward pass, or by a pull) and hands them to a writer thread that stores
them in the :class:`~kvfleet.runtime.kv_transfer.disk_tier.DiskTier`. Blocks of LoRA adapters are
not written (their ids, part of the hash chain, are local to the process). Loading
back is the pulling side's first source (:class:`~kvfleet.runtime.engine.kv_pull.KVPuller`).
Writing after the step that computed a block, rather than when the block is evicted, needs no
hook inside the scheduler's allocation (where an evicted block's bytes are overwritten in the
same step) and leaves the tier warm after a crash as well.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

from kvfleet.runtime.core.kv_events import BlockStored
from kvfleet.runtime.engine.stats import IterationStats
from kvfleet.runtime.kv_transfer.disk_tier import DiskTier
from kvfleet.runtime.worker.kv_blocks import block_layout

logger = logging.getLogger(__name__)


class DiskWriter:
    """Args: engine (an ``LLMEngine``), disk (its tier), connector (the engine's KV connector, which
    reads the blocks out of the cache)."""

    def __init__(self, engine, disk: DiskTier, connector) -> None:
        self.engine = engine
        self.disk = disk
        self.connector = connector
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="kvfleet-kv-disk")

    def publish(self, events) -> None:
        """One step's KV events (engine thread): queue the newly cached blocks for the disk."""
        todo: dict[bytes, None] = {}
        for event in events:
            if not isinstance(event, BlockStored) or event.lora_id:
                continue
            todo.update((h, None) for h in event.block_hashes if h not in self.disk)
        blocks = self.connector.read_cached(list(todo)) if todo else []
        if blocks:
            self._writer.submit(self._write, blocks)

    def _write(self, blocks: list[tuple[bytes, bytes]]) -> None:
        for block_hash, payload in blocks:
            try:
                self.disk.put(block_hash, payload)
            except OSError as exc:  # a full or read-only disk costs hits, never the engine
                logger.warning("KV disk tier: block %s not written: %s", block_hash.hex(), exc)
                break
        self.report_size()

    def report_size(self) -> None:
        """The tier's bytes to the stat loggers (the ``kv_disk_usage_bytes`` gauge)."""
        for stat_logger in self.engine.stat_loggers:
            try:
                stat_logger.record(None, IterationStats(kv_disk_bytes=self.disk.num_bytes))
            except Exception:
                logger.exception("stat logger %r failed", stat_logger)

    def close(self) -> None:
        """Finish the queued writes."""
        self._writer.shutdown(wait=True)


def disk_writer(engine, connector) -> DiskWriter | None:
    """The engine's disk tier writer when ``kv_transfer_config.disk_path`` is set (it turns the block
    pool's KV event recording on), else None."""
    transfer = engine.config.kv_transfer_config
    if transfer is None or transfer.disk_path is None or connector is None:
        return None
    pool = engine.scheduler.kv_cache_manager.block_pool
    if pool.kv_event_queue is None:
        pool.kv_event_queue = []
    layout = block_layout(engine.runner, engine.model_name, engine.loaded.quantization)
    disk = DiskTier(transfer.disk_path, transfer.disk_max_bytes, layout)
    logger.info("KV disk tier %s: %d blocks (%.1f MiB) indexed", transfer.disk_path, len(disk), disk.num_bytes / 2**20)
    writer = DiskWriter(engine, disk, connector)
    writer.report_size()
    return writer
