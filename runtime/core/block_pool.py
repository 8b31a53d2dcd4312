"""The KV block pool: fixed-size blocks, a free-block queue, reference counts and the
prefix-cache map. It speaks only in block ids and never touches tensors.

Layout follows vLLM v1 (``vllm/v1/core/block_pool.py``): free blocks sit in one doubly
linked queue whose head is evicted first. Blocks freed *without* a prefix-cache hash go
to the head (reused first); blocks freed *with* a hash go to the tail, so unreferenced
cached blocks are evicted least-recently-used first; a free cached block that gets a hit
is taken out of the middle of the queue in O(1). With ``use_null_block=True``
(sliding-window models) the last physical block is the *null block* (vLLM v1's
``BlockPool.null_block``): never handed out, written, cached or reference-counted (why
the last one: docs/scheduling.md, "Sliding-window models").
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvfleet.runtime.core.kv_events import BlockRemoved, BlockStored, KVCacheEvent
from kvfleet.runtime.kv_events.hashing import BlockHash, hash_block_tokens

__all__ = ["BlockHash", "BlockPool", "FreeBlockQueue", "KVCacheBlock", "hash_block_tokens"]


class KVCacheBlock:
    """Metadata of one physical KV block (the tensors live in the model runner)."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        cached = self.block_hash.hex()[:8] if self.block_hash else None
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hash={cached})"


class FreeBlockQueue:
    """Doubly linked list of free blocks with O(1) pop-left, append, append-left and remove."""

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)  # sentinels
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def _insert_after(self, prev: KVCacheBlock, block: KVCacheBlock) -> None:
        nxt = prev.next_free
        assert nxt is not None and block.prev_free is None and block.next_free is None, "block already free"
        block.prev_free, block.next_free = prev, nxt
        prev.next_free = nxt.prev_free = block
        self.num_free_blocks += 1

    def append(self, block: KVCacheBlock) -> None:
        """Put ``block`` at the tail (evicted last)."""
        self._insert_after(self._tail.prev_free, block)  # type: ignore[arg-type]

    def appendleft(self, block: KVCacheBlock) -> None:
        """Put ``block`` at the head (reused first)."""
        self._insert_after(self._head, block)

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"{block} is not in the free queue")
        prev.next_free, nxt.prev_free = nxt, prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is None or block is self._tail:
            raise ValueError("no free block")
        self.remove(block)
        return block

    def __iter__(self):
        block = self._head.next_free
        while block is not None and block is not self._tail:
            yield block
            block = block.next_free


class BlockPool:
    """All ``num_blocks`` blocks: allocation, reference counting, the prefix-cache map.

    Invariants (checked after every step by tests/support/fake_runner.py):
    a block other than the null block is in the free queue iff its ``ref_cnt`` is 0;
    ``ref_cnt`` is never negative; ``cached_blocks[h].block_hash == h`` for every cached
    hash ``h``; the null block is never free, cached or referenced (``ref_cnt`` 0).

    Args:
        num_blocks: physical blocks, the null block included.
        enable_caching: automatic prefix caching on/off.
        use_null_block: reserve block ``num_blocks - 1`` as the null block (then
            ``num_blocks - 1`` blocks can be handed out).
        enable_kv_cache_events: record a :mod:`~kvfleet.runtime.core.kv_events` event each
            time a hash enters or leaves the prefix-cache map (drained by :meth:`take_events`).

    Raises:
        ValueError: no block to hand out (``num_blocks < 1``, or ``< 2`` with a null block).
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True, use_null_block: bool = False,
                 enable_kv_cache_events: bool = False) -> None:
        if num_blocks < 1 + use_null_block:
            raise ValueError(f"num_blocks must be >= {1 + use_null_block}, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block: KVCacheBlock | None = self.blocks[-1] if use_null_block else None
        """Placeholder of freed out-of-window blocks in block tables (None: no null block)."""
        usable = self.blocks[:-1] if use_null_block else self.blocks
        self.free_queue = FreeBlockQueue(usable)
        self.cached_blocks: dict[BlockHash, KVCacheBlock] = {}
        self.block_size = 0
        """Tokens per block, stamped on BlockStored events (set by the KV cache manager)."""
        self.kv_event_queue: list[KVCacheEvent] | None = [] if enable_kv_cache_events else None

    def take_events(self) -> list[KVCacheEvent]:
        """The events recorded since the last call, oldest first (empty when events are off)."""
        if not self.kv_event_queue:
            return []
        events, self.kv_event_queue = self.kv_event_queue, []
        return events

    @property
    def num_usable_blocks(self) -> int:
        """Blocks that can be handed out: ``num_blocks``, less the null block if any."""
        return self.num_blocks - (self.null_block is not None)

    # -- queries ------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks with no reference (including unreferenced cached blocks, which are evictable)."""
        return self.free_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction (0-1) of the usable blocks referenced by at least one request."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached_blocks.get(block_hash)

    # -- allocation ---------------------------------------------------------------
    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` blocks from the head of the free queue, evicting their cached
        contents, with ``ref_cnt`` 1.

        Raises:
            ValueError: fewer than ``num_blocks`` blocks are free.
        """
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"cannot allocate {num_blocks} blocks: {self.num_free_blocks} free")
        out = []
        for _ in range(num_blocks):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self.cached_blocks.get(block.block_hash) is block:
                del self.cached_blocks[block.block_hash]
                if self.kv_event_queue is not None:
                    self.kv_event_queue.append(BlockRemoved([block.block_hash]))
            block.block_hash = None

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Add a reference to each block (prefix-cache hits), taking free ones out of the
        queue. The null block is skipped."""
        for block in blocks:
            if block is self.null_block:
                continue
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; blocks reaching 0 join the free queue in the
        given order (the first is evicted first among cached ones). The null block is skipped.

        Raises:
            ValueError: a block's reference count would go negative (a double free).
        """
        for block in ordered_blocks:
            if block is self.null_block:
                continue
            if block.ref_cnt <= 0:
                raise ValueError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self.free_queue.appendleft(block)
                else:
                    self.free_queue.append(block)

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash, token_ids: Sequence[int] = (),
                    parent_block_hash: BlockHash | None = None, lora_id: int | None = None) -> bool:
        """Register a full block under ``block_hash``. Returns False (and leaves the block
        uncached) when another block already holds that hash. ``token_ids``,
        ``parent_block_hash`` and ``lora_id`` only feed the BlockStored event."""
        if not self.enable_caching or block.block_hash is not None or block is self.null_block:
            return False
        if block_hash in self.cached_blocks:
            return False
        block.block_hash = block_hash
        self.cached_blocks[block_hash] = block
        if self.kv_event_queue is not None:
            self.kv_event_queue.append(BlockStored([block_hash], parent_block_hash, list(token_ids),
                                                   self.block_size, lora_id or None))
        return True

    def uncache_block(self, block: KVCacheBlock) -> None:
        """Drop ``block``'s prefix-cache hash (its K/V will not be written after all). Call
        it on a referenced block only; its free-queue place is chosen when it is freed."""
        self._evict(block)

    def reset_prefix_cache(self) -> int:
        """Drop the hash of every unreferenced cached block. Returns how many were dropped.
        Blocks still referenced by running requests keep theirs."""
        dropped = []
        for block_hash, block in list(self.cached_blocks.items()):
            if block.ref_cnt == 0:
                del self.cached_blocks[block_hash]
                dropped.append(block_hash)
                block.block_hash = None
                # Unhashed free blocks belong at the head of the queue.
                self.free_queue.remove(block)
                self.free_queue.appendleft(block)
        if dropped and self.kv_event_queue is not None:
            self.kv_event_queue.append(BlockRemoved(dropped))
        return len(dropped)
