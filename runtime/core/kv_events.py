"""KV cache events of one replica: the block pool's stored / removed / cleared blocks, as
plain data, in vLLM's shapes (``vllm/distributed/kv_events.py``: ``BlockStored``,
``BlockRemoved``, ``AllBlocksCleared``, ``KVEventBatch``), so an llm-d / GIE KV indexer can
read them.

Contract: the block pool appends an event whenever a hash enters or leaves its prefix-cache
map, in order; replaying every event from the start (or from a :class:`BlockSnapshot` taken
at sequence number ``seq``, then every batch with a larger ``seq``) yields exactly the set of
hashes the pool holds. Hashes are kvfleet's 16-byte BLAKE2b chain
(:func:`~kvfleet.runtime.core.block_pool.hash_block_tokens`), not vLLM's int / sha256 ones.
Torch-free and I/O-free: publishing is :mod:`kvfleet.runtime.engine.kv_event_publisher`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MEDIUM_CPU = "cpu"
"""Where the blocks live (vLLM's ``medium``: "GPU", "CPU"...); kvfleet's KV sits in host RAM."""


@dataclass(frozen=True)
class BlockStored:
    """Blocks entered the prefix cache, in chain order; ``parent_block_hash`` is the hash of
    the block before the first one (None: the first block of a sequence)."""

    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM_CPU


@dataclass(frozen=True)
class BlockRemoved:
    """Blocks left the prefix cache (evicted for reuse, or their hash dropped)."""

    block_hashes: list[bytes]
    medium: str | None = MEDIUM_CPU


@dataclass(frozen=True)
class AllBlocksCleared:
    """Every block of the prefix cache was dropped (vLLM: ``reset_prefix_cache``). kvfleet
    keeps the hashes of blocks that running requests still reference, so it emits
    :class:`BlockRemoved` for the dropped ones instead; this event is kept for readers
    and for a replica whose engine restarted."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True)
class KVEventBatch:
    """Events of one engine step: ``ts`` (seconds since the epoch), ``seq`` (the publisher's
    batch counter; a gap means the reader lost batches and must re-read the snapshot),
    ``data_parallel_rank`` as in vLLM (kvfleet: always None)."""

    ts: float
    events: list[KVCacheEvent]
    seq: int = 0
    data_parallel_rank: int | None = None


@dataclass
class BlockSnapshot:
    """The hashes a replica holds after batch ``seq`` (the state a late reader starts from)."""

    seq: int
    block_size: int
    block_hashes: list[bytes] = field(default_factory=list)


def replay(events, into: set[bytes] | None = None) -> set[bytes]:
    """Apply ``events`` (in order) to a set of cached hashes; returns the set."""
    cached = set() if into is None else into
    for event in events:
        if isinstance(event, BlockStored):
            cached.update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            cached.difference_update(event.block_hashes)
        elif isinstance(event, AllBlocksCleared):
            cached.clear()
    return cached
