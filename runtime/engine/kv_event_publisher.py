"""Publishes the block pool's KV cache events (:mod:`kvfleet.runtime.core.kv_events`) and keeps
the snapshot a late reader starts from.

Contract: :meth:`KVEventPublisher.publish` is called from the engine thread once per step with
that step's events; a non-empty list becomes one :class:`~kvfleet.runtime.kv_events.wire.KVEventBatch`
with the next ``seq`` (1, 2, ...), sent on the ZMQ PUB socket (``publisher="zmq"``; never blocks:
ZMQ drops messages past ``hwm``, the reader sees a ``seq`` gap and re-reads the snapshot).
:meth:`snapshot` (any thread) returns ``seq`` and the hashes cached after that batch, so the
snapshot plus every batch with a larger ``seq`` replays to the replica's current cache.
With ``auth: "fleet"`` (the default) the socket is a CURVE server that only the fleet's routers
can read (:mod:`kvfleet.runtime.kv_events.auth`); with no fleet secret to be had nothing is sent
(logged) and :attr:`bound_endpoint` is None, so routers do not subscribe.
"""

from __future__ import annotations

import logging
import threading
import time

from kvfleet.runtime.core import kv_events as ev
from kvfleet.runtime.kv_events import wire
from kvfleet.runtime.kv_events.config import KVEventsConfig

logger = logging.getLogger(__name__)


def to_wire(event: ev.KVCacheEvent, token_ids: bool = True):
    """The msgspec struct of one core event (``token_ids`` false: a ``BlockStored``'s are left out)."""
    if isinstance(event, ev.BlockStored):
        return wire.BlockStored(event.block_hashes, event.parent_block_hash, event.token_ids if token_ids else [],
                                event.block_size, event.lora_id, event.medium)
    if isinstance(event, ev.BlockRemoved):
        return wire.BlockRemoved(event.block_hashes, event.medium)
    return wire.AllBlocksCleared()


class KVEventPublisher:
    """Args: config (``enable_kv_cache_events`` must be on), block_size (for the snapshot),
    fleet_secret_file (where the fleet secret is when ``$KVFLEET_FLEET_SECRET`` is unset: the
    replica's ``kv_transfer_config.fleet_secret_file``; None: the default file).

    Raises:
        ValueError: a fleet secret that is too short, or a ``fleet_secret_file`` that cannot be read."""

    def __init__(self, config: KVEventsConfig, block_size: int, fleet_secret_file: str | None = None) -> None:
        self.config = config
        self.block_size = block_size
        self.seq = 0
        self._cached: set[bytes] = set()
        self._lock = threading.Lock()
        self._ctx = self._socket = self._secured = None
        if config.publisher == "zmq":
            import zmq  # only with the zmq publisher

            keys = None
            if config.auth == "fleet":
                from kvfleet.runtime.kv_events.auth import events_keys
                from kvfleet.runtime.kv_transfer.fleet_auth import load_fleet_keys

                fleet = load_fleet_keys(fleet_secret_file)
                if fleet is None:
                    logger.warning("KV events: no fleet secret, so nothing is published (routers route "
                                   "by characters); {\"auth\": \"none\"} publishes them in plaintext")
                    return
                keys = events_keys(fleet)
            self._ctx = zmq.Context()
            self._socket = self._ctx.socket(zmq.PUB)
            self._socket.setsockopt(zmq.SNDHWM, config.hwm)
            self._socket.setsockopt(zmq.LINGER, 0)
            if keys is not None:
                from kvfleet.runtime.kv_events.auth import SecuredPublisher

                self._secured = SecuredPublisher(self._ctx, self._socket, keys)
            try:
                self._socket.bind(config.endpoint)
            except zmq.ZMQError:
                self.close()
                raise

    @property
    def refused_subscribers(self) -> int:
        """Subscribers the fleet auth refused (a CURVE key that is not the fleet's reader key)."""
        return self._secured.refused if self._secured is not None else 0

    @property
    def bound_endpoint(self) -> str | None:
        """The endpoint the socket listens on (port resolved, e.g. for ``tcp://*:0``)."""
        if self._socket is None:
            return None
        import zmq

        return self._socket.getsockopt(zmq.LAST_ENDPOINT).decode()

    def publish(self, events: list[ev.KVCacheEvent]) -> None:
        """Send one step's events (nothing when empty) and fold them into the snapshot."""
        if not events:
            return
        batch = wire.KVEventBatch(time.time(), [to_wire(e, self.config.include_token_ids) for e in events])
        with self._lock:
            ev.replay(events, self._cached)
            self.seq += 1
            seq = self.seq
        if self._socket is not None:
            import zmq

            try:
                self._socket.send_multipart(wire.frames(self.config.topic, seq, batch), flags=zmq.NOBLOCK)
            except zmq.Again:  # no room past the high-water mark: the reader sees the gap
                pass

    def snapshot(self) -> ev.BlockSnapshot:
        with self._lock:
            return ev.BlockSnapshot(self.seq, self.block_size, sorted(self._cached))

    def snapshot_json(self) -> dict:
        """The snapshot as ``GET /kv_events/snapshot`` answers it: ``seq``, ``block_size``, the
        ``endpoint`` the events go out on (None with ``publisher="null"``, or with no fleet secret),
        ``auth`` (``fleet``: CURVE with the fleet's keys; ``none``: plaintext), ``block_hashes`` (hex)."""
        snap = self.snapshot()
        return {"seq": snap.seq, "block_size": snap.block_size, "endpoint": self.bound_endpoint,
                "auth": self.config.auth, "block_hashes": [h.hex() for h in snap.block_hashes]}

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close(0)
            if self._secured is not None:
                self._secured.stop()
            self._ctx.term()
            self._socket = self._ctx = self._secured = None
