"""The router's index of every replica's cached KV blocks, built from their KV cache events
(``--kv-events-config`` on the replicas; docs/routing.md, "Precise prefix routing").

Contract: per endpoint, a set of block hashes and the ``seq`` of the last batch applied. A
replica's state starts from its ``GET /kv_events/snapshot`` (:meth:`KVIndex.load_snapshot`) and
then takes every batch with a larger ``seq`` (:meth:`KVIndex.apply`); a batch whose ``seq`` is
not the next one means lost messages: the endpoint is marked stale (it scores 0) until a new
snapshot is loaded. :meth:`KVIndex.matched_blocks` is the length of the longest run of a
request's block hashes, from the first, that the replica holds. Pure: no I/O (the subscriber
that feeds it is :mod:`.kv_subscriber`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvfleet.runtime.kv_events import wire


@dataclass
class ReplicaBlocks:
    hashes: set[bytes] = field(default_factory=set)
    seq: int = 0
    block_size: int | None = None
    stale: bool = True
    """True until a snapshot is loaded, and again after a ``seq`` gap."""
    pending: list[tuple[int, wire.KVEventBatch]] = field(default_factory=list)
    """Batches received while stale (applied after the snapshot if their seq is larger)."""


class KVIndex:
    def __init__(self) -> None:
        self.replicas: dict[str, ReplicaBlocks] = {}

    def _get(self, url: str) -> ReplicaBlocks:
        return self.replicas.setdefault(url, ReplicaBlocks())

    def block_counts(self) -> dict[str, int]:
        """Per endpoint, the blocks held (-1 while stale): the router's ``kv_index_blocks`` gauge."""
        return {url: -1 if rb.stale else len(rb.hashes) for url, rb in self.replicas.items()}

    def forget(self, url: str) -> None:
        self.replicas.pop(url, None)

    def apply(self, url: str, seq: int, batch: wire.KVEventBatch) -> bool:
        """Apply one batch of ``url``'s events. Returns False when the endpoint is (now) stale
        and needs a snapshot."""
        rep = self._get(url)
        if rep.stale:
            rep.pending.append((seq, batch))
            del rep.pending[:-10_000]
            return False
        if seq <= rep.seq:  # already in the snapshot
            return True
        if seq != rep.seq + 1:
            rep.stale = True
            rep.pending = [(seq, batch)]
            return False
        _replay(rep, batch)
        rep.seq = seq
        return True

    def load_snapshot(self, url: str, snapshot: dict) -> None:
        """Reset ``url``'s state to a ``GET /kv_events/snapshot`` answer, then apply the batches
        received meanwhile that are newer. Raises ValueError / KeyError on a malformed answer."""
        rep = self._get(url)
        rep.hashes = {bytes.fromhex(h) for h in snapshot["block_hashes"]}
        rep.seq = int(snapshot["seq"])
        rep.block_size = int(snapshot["block_size"])
        rep.stale = False
        pending, rep.pending = rep.pending, []
        for seq, batch in sorted(pending, key=lambda p: p[0]):
            if not self.apply(url, seq, batch):
                break

    def block_size(self) -> int | None:
        """The block size of the fresh replicas (they share one model config), or None."""
        sizes = {r.block_size for r in self.replicas.values() if not r.stale and r.block_size}
        return sizes.pop() if len(sizes) == 1 else None

    def has_events(self, urls: Sequence[str]) -> bool:
        """Whether any of ``urls`` has a fresh index (precise routing is possible)."""
        return any(not self.replicas[u].stale for u in urls if u in self.replicas)

    def matched_blocks(self, url: str, hashes: Sequence[bytes]) -> int:
        """Leading blocks of ``hashes`` that ``url`` caches (0 when unknown or stale)."""
        rep = self.replicas.get(url)
        if rep is None or rep.stale:
            return 0
        n = 0
        for h in hashes:
            if h not in rep.hashes:
                break
            n += 1
        return n


def _replay(rep: ReplicaBlocks, batch: wire.KVEventBatch) -> None:
    for event in batch.events:
        if isinstance(event, wire.BlockStored):
            rep.hashes.update(event.block_hashes)
            rep.block_size = event.block_size
        elif isinstance(event, wire.BlockRemoved):
            rep.hashes.difference_update(event.block_hashes)
        else:
            rep.hashes.clear()
