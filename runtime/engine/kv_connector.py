"""The engine's side of the KV connector seam (:mod:`kvfleet.runtime.kv_transfer.connector`).

:func:`attach_kv_transfer` builds, for an engine with ``--kv-transfer-config``, the connector over
an :class:`EngineKVAccess` (the scheduler's block pool, the runner's cache read and written as
bytes by :mod:`kvfleet.runtime.worker.kv_blocks`) and plugs it in at its call sites: the scheduler
(``scheduler.kv_connector``: admission and finish) and the model runner (``runner.kv_connector``:
``start_load_kv`` before the forward). It also returns the engine's KV event sinks, the disk tier's
writer among them (:mod:`.kv_disk`), which reads blocks through the connector.
"""

from __future__ import annotations

from kvfleet.runtime.engine.kv_disk import disk_writer
from kvfleet.runtime.kv_transfer.connector import PeerPullConnector
from kvfleet.runtime.worker.kv_blocks import read_blocks, write_blocks


class EngineKVAccess:
    """:class:`~kvfleet.runtime.kv_transfer.connector.KVCacheAccess` of one ``LLMEngine``."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.pool = engine.scheduler.kv_cache_manager.block_pool
        self.block_size = engine.config.block_size

    def read(self, block_ids: list[int]) -> list[bytes]:
        return read_blocks(self.engine.runner.kv_caches, block_ids)

    def write(self, block_ids: list[int], payloads: list[bytes]) -> None:
        write_blocks(self.engine.runner.kv_caches, block_ids, payloads)


def attach_kv_transfer(engine) -> tuple[PeerPullConnector | None, list]:
    """``(connector, KV event sinks)`` of ``engine``: the connector (None without
    ``kv_transfer_config``) attached to its scheduler and runner; the sinks are the KV events
    publisher (when on) and the disk tier's writer (when ``disk_path`` is set)."""
    transfer = engine.config.kv_transfer_config
    connector = None
    if transfer is not None:
        connector = PeerPullConnector(EngineKVAccess(engine), hold_timeout=transfer.hold_timeout)
        engine.scheduler.kv_connector = connector
        engine.runner.kv_connector = connector
    sinks = [engine.kv_event_publisher, disk_writer(engine, connector)]
    return connector, [s for s in sinks if s is not None]
