"""KV cache manager: per-request block tables on top of the block pool, with automatic
prefix caching. Speaks only in requests, token counts and block ids.

The facade follows vLLM v1 (``vllm/v1/core/kv_cache_manager.py``): ``get_computed_blocks``
(longest cached prefix), ``allocate_slots`` (blocks for the tokens of this step), ``free``.
A fully cached prompt still recomputes its last token, so the model produces its logits.
Sliding window (``sliding_window=W``, only when every attention layer has the same window,
:func:`uniform_sliding_window`): as vLLM v1's ``SlidingWindowManager``, blocks whose
positions are all ``< num_computed_tokens + 1 - W`` go back to the pool at the request's
next allocation and the block table holds the pool's null block in their place; a
prefix-cache hit needs only the blocks of the last window. Hybrid models keep every block.
Details: docs/scheduling.md, "Sliding-window models".
"""

from __future__ import annotations

from kvfleet.runtime.core.block_pool import BlockPool, KVCacheBlock, hash_block_tokens
from kvfleet.runtime.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def uniform_sliding_window(layer_windows) -> int | None:
    """The window (tokens) when every attention layer has the same sliding window, else None.

    Args:
        layer_windows: per layer, the window or None (full attention), as
            :func:`kvfleet.runtime.worker.attention.layer_sliding_windows` returns them.

    Returns: the common window, or None for full-attention and hybrid (local + global
    layers, e.g. Gemma 2/3) models, whose out-of-window blocks are kept (a global layer
    still reads them).
    """
    windows = set(layer_windows)
    if len(windows) != 1:
        return None
    (window,) = windows
    return window


def max_num_blocks_per_request(num_tokens: int, block_size: int, sliding_window: int | None,
                               max_num_batched_tokens: int) -> int:
    """The most blocks one request of ``num_tokens`` tokens holds at once.

    Full attention: every block, ``cdiv(num_tokens, block_size)``. With a sliding window
    ``W`` the blocks of a step computing ``n <= max_num_batched_tokens`` tokens from position
    ``c`` on are those from the block of ``c + 1 - W`` to the block of ``c + n - 1``: at most
    ``cdiv(W - 1 + n, block_size) + 1`` (the +1 because the window need not start at a block
    boundary), and never more than the full count. vLLM's
    ``SlidingWindowSpec.max_memory_usage_bytes`` (``vllm/v1/kv_cache_interface.py``) bounds it
    the same way.
    """
    full = cdiv(num_tokens, block_size)
    if sliding_window is None:
        return full
    return min(full, cdiv(sliding_window - 1 + max_num_batched_tokens, block_size) + 1)


class KVCacheManager:
    """Block tables of the live requests.

    Args:
        num_blocks: physical KV blocks (from the memory budget).
        block_size: tokens per block.
        enable_caching: automatic prefix caching on/off.
        sliding_window: the window (tokens) shared by every attention layer, or None (full
            attention, or a hybrid model): with a window, out-of-window blocks are freed and
            block ``num_blocks - 1`` is reserved as the null block (see the module doc).
        enable_kv_cache_events: record KV cache events (:meth:`take_events`).

    Raises:
        ValueError: ``sliding_window`` not None or an integer >= 1; no block to hand out.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 sliding_window: int | None = None, enable_kv_cache_events: bool = False) -> None:
        if sliding_window is not None and (
                isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1):
            raise ValueError(f"sliding_window must be None or an integer >= 1, got {sliding_window!r}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.sliding_window = sliding_window
        self.block_pool = BlockPool(num_blocks, enable_caching, use_null_block=sliding_window is not None,
                                    enable_kv_cache_events=enable_kv_cache_events)
        self.block_pool.block_size = block_size
        self.null_block = self.block_pool.null_block
        """Placeholder of freed out-of-window blocks (None without a sliding window)."""
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self._num_cached_blocks: dict[str, int] = {}

    @property
    def num_blocks(self) -> int:
        """Physical blocks, the null block included."""
        return self.block_pool.num_blocks

    @property
    def num_usable_blocks(self) -> int:
        """Blocks requests can hold: ``num_blocks`` less the null block, if any."""
        return self.block_pool.num_usable_blocks

    def max_num_blocks_per_request(self, num_tokens: int, max_num_batched_tokens: int) -> int:
        """:func:`max_num_blocks_per_request` for this manager's block size and window."""
        return max_num_blocks_per_request(num_tokens, self.block_size, self.sliding_window, max_num_batched_tokens)

    @property
    def usage(self) -> float:
        """KV cache usage (0-1): blocks referenced by requests; cached free blocks excluded."""
        return self.block_pool.usage

    def _update_block_hashes(self, request: Request, num_tokens: int) -> None:
        """Extend ``request.block_hashes`` to cover every full block of its first ``num_tokens`` tokens."""
        hashes = request.block_hashes
        bs = self.block_size
        extra = (request.cache_salt,) if request.cache_salt else ()
        # A LoRA adapter changes every layer's K/V: its id seeds the chain (the first block's
        # hash; every later one hashes its parent), so no block is shared across adapters.
        first = (*extra, ("lora", request.lora_int_id)) if request.lora_int_id else extra
        for i in range(len(hashes), num_tokens // bs):
            parent = hashes[i - 1] if i else None
            keys = extra if i else first
            hashes.append(hash_block_tokens(parent, request.token_ids_slice(i * bs, (i + 1) * bs), keys))

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest run of cached full blocks that prefixes ``request``'s tokens.

        Returns ``(blocks, num_computed_tokens)``; at most ``request.num_tokens - 1`` tokens
        count as computed, so at least the last token is recomputed and yields logits.
        Requests asking for prompt logprobs skip the lookup (every prompt position must be
        computed for its logits), but ``allocate_slots`` still inserts their full blocks.
        Does not take references: pass the blocks to ``allocate_slots``.

        With a sliding window a hit needs only the blocks the next query can see: the
        longest prefix whose last ``cdiv(W - 1, block_size)`` blocks are cached (earlier
        entries are the null block), or else the cached blocks at the very start (vLLM v1's
        ``SlidingWindowManager.find_longest_cache_hit``).
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        self._update_block_hashes(request, request.num_tokens)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        if self.sliding_window is not None:
            blocks = self._find_longest_window_hit(request.block_hashes[:max_hit_blocks])
            return blocks, len(blocks) * self.block_size
        blocks: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    def _find_longest_window_hit(self, block_hashes) -> list[KVCacheBlock]:
        # Scan right to left for `needed` consecutive cached blocks: then the prefix up to
        # their end is a hit, its earlier blocks never read again (null). At least one
        # block, so that a window of 1 still matches real tokens.
        needed = max(1, cdiv(self.sliding_window - 1, self.block_size))
        out: list[KVCacheBlock] = [self.null_block] * len(block_hashes)
        run = 0
        for i in range(len(block_hashes) - 1, -1, -1):
            block = self.block_pool.get_cached_block(block_hashes[i])
            if block is None:
                run = 0
                continue
            out[i] = block
            run += 1
            if run >= needed:
                return out[:i + run]
        return out[:run]  # fewer than `needed` blocks at the start still count

    def _remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Free the blocks of ``request_id`` that no query from position
        ``num_computed_tokens`` on can see (all their positions ``< num_computed_tokens + 1
        - W``) and put the null block in their place (vLLM v1's ``remove_skipped_blocks``).
        The most recent is freed first, so among cached blocks the oldest is evicted last,
        as vLLM does."""
        if self.sliding_window is None:
            return
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return
        num_skipped = max(0, num_computed_tokens + 1 - self.sliding_window) // self.block_size
        removed = []
        for i in range(min(num_skipped, len(blocks)) - 1, -1, -1):
            if blocks[i] is self.null_block:
                break  # everything before it was nulled by an earlier call
            removed.append(blocks[i])
            blocks[i] = self.null_block
        self.block_pool.free_blocks(removed)

    @property
    def num_free_blocks(self) -> int:
        """Blocks the pool can hand out now (free, including unreferenced cached ones)."""
        return self.block_pool.num_free_blocks

    def get_num_blocks_to_allocate(
        self, request: Request, num_tokens: int, new_computed_blocks: list[KVCacheBlock] = (),
        max_num_batched_tokens: int | None = None,
    ) -> int:
        """Blocks that ``request`` would take from the free pool to hold its first
        ``num_tokens`` tokens (positions ``[0, num_tokens)``), counting the blocks it holds
        and the prefix-cache hits ``new_computed_blocks`` (a hit on a free block takes that
        block out of the pool too). Changes nothing. As vLLM v1's
        ``get_num_blocks_to_allocate`` (``vllm/v1/core/single_type_kv_cache_manager.py``).

        With a sliding window, the most blocks the request holds at once on the way
        (:func:`max_num_blocks_per_request` for steps of at most ``max_num_batched_tokens``
        tokens, default: the rest in one step) less the live (non-null) blocks it holds:
        the blocks it frees behind its window go back to the pool as it advances.
        """
        blocks = self.req_to_blocks.get(request.request_id, ())
        num_free_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0 and b is not self.null_block)
        if self.sliding_window is None:
            have = len(blocks) + len(new_computed_blocks)
            return max(0, cdiv(num_tokens, self.block_size) - have) + num_free_hits
        live = sum(1 for b in (*blocks, *new_computed_blocks) if b is not self.null_block)
        computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        chunk = max(1, num_tokens - computed)
        if max_num_batched_tokens is not None:
            chunk = min(chunk, max_num_batched_tokens)
        peak = max_num_blocks_per_request(num_tokens, self.block_size, self.sliding_window, chunk)
        return max(0, peak - live) + num_free_hits

    def _num_blocks_needed(self, request, num_new_tokens, new_computed_blocks) -> int | None:
        have = len(self.req_to_blocks.get(request.request_id, ())) + len(new_computed_blocks)
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        need = max(0, cdiv(num_computed + num_new_tokens, self.block_size) - have)
        # Cache hits on blocks that are currently free take them out of the free pool too.
        num_free_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0 and b is not self.null_block)
        if need > self.block_pool.num_free_blocks - num_free_hits:
            return None
        return need

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] = (),
    ) -> list[KVCacheBlock] | None:
        """Give ``request`` the blocks for ``num_new_tokens`` more tokens.

        Args:
            request: its ``num_computed_tokens`` tokens are already in its blocks.
            num_new_tokens: tokens to compute this step.
            new_computed_blocks: prefix-cache hits from ``get_computed_blocks`` (first
                allocation of a waiting request only); they are referenced, not copied.

        Returns:
            The newly allocated blocks (possibly empty), or None when the pool cannot
            supply them; then nothing changed, except that with a sliding window the
            request's blocks before its window were freed first (they are freed in any case:
            no query of this step or a later one reads them).
        """
        self._remove_skipped_blocks(request.request_id, request.num_computed_tokens)
        need = self._num_blocks_needed(request, num_new_tokens, new_computed_blocks)
        if need is None:
            return None
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        if new_computed_blocks:
            self.block_pool.touch(new_computed_blocks)
            blocks.extend(new_computed_blocks)
            # Hits only cover the window: nothing to free, unless a hit run started at 0.
            self._remove_skipped_blocks(
                request.request_id, request.num_computed_tokens + len(new_computed_blocks) * self.block_size)
        new_blocks = self.block_pool.get_new_blocks(need)
        blocks.extend(new_blocks)
        if self.enable_caching:
            # Register the blocks that will be full after this step. Their K/V is written in
            # this step's forward pass, before any later step can read them. A request asking
            # for prompt logprobs registers its blocks too (their K/V does not depend on it;
            # only its lookup is skipped, as in vLLM v1).
            # Speculative drafts (tokens past ``request.num_tokens``) may be rejected: a block
            # is registered only once it is full of the request's own tokens.
            num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
            num_full = min(num_computed + num_new_tokens, request.num_tokens) // self.block_size
            start = self._num_cached_blocks.get(request.request_id, len(new_computed_blocks))
            start = max(start, len(new_computed_blocks))
            if num_full > start:
                self._update_block_hashes(request, num_full * self.block_size)
                self._cache_blocks(request, blocks, start, num_full)
            self._num_cached_blocks[request.request_id] = max(start, num_full)
        return new_blocks

    def _cache_blocks(self, request: Request, blocks: list[KVCacheBlock], start: int, end: int) -> None:
        """Register ``blocks[start:end]`` under ``request``'s block hashes (with the block's
        tokens, parent hash and LoRA id when KV events are on)."""
        pool, bs, hashes = self.block_pool, self.block_size, request.block_hashes
        events = pool.kv_event_queue is not None
        for i in range(start, end):
            if not events:
                pool.cache_block(blocks[i], hashes[i])
                continue
            pool.cache_block(blocks[i], hashes[i], request.token_ids_slice(i * bs, (i + 1) * bs),
                             hashes[i - 1] if i else None, request.lora_int_id)

    def take_events(self):
        """The block pool's KV cache events since the last call (:meth:`BlockPool.take_events`)."""
        return self.block_pool.take_events()

    def cached_block_hashes(self) -> list[bytes]:
        """Every hash in the prefix cache now (the state behind a KV events snapshot)."""
        return list(self.block_pool.cached_blocks)

    def remove_skipped_blocks(self, request: Request) -> None:
        """With a sliding window, free ``request``'s blocks that no query after its
        ``num_computed_tokens`` computed tokens can see (see the module doc); a no-op
        otherwise. The scheduler calls it after each step, so the blocks are free before
        the next one is planned. Safe only once the step that computed those tokens ran."""
        self._remove_skipped_blocks(request.request_id, request.num_computed_tokens)

    def free(self, request: Request, num_written_tokens: int | None = None) -> None:
        """Release all of ``request``'s blocks (last block first, so its tail is evicted
        first); null-block entries are skipped.

        Args:
            num_written_tokens: tokens whose K/V are in the cache (default: all). Blocks that
                ``allocate_slots`` registered in the prefix cache for a step that will not
                run (a request preempted in the step that allocated them) and that are full
                only past this count lose their hash first, so that no later request gets a
                hit on K/V that was never written.
        """
        blocks = self.req_to_blocks.pop(request.request_id, [])
        num_registered = self._num_cached_blocks.pop(request.request_id, 0)
        if num_written_tokens is not None:
            for i in range(num_written_tokens // self.block_size, min(num_registered, len(blocks))):
                if blocks[i].ref_cnt == 1:
                    self.block_pool.uncache_block(blocks[i])
        self.block_pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        """The block table of a request: physical block ids in logical order (the null
        block's id in place of freed out-of-window blocks)."""
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def reset_prefix_cache(self) -> int:
        """Drop every unreferenced cached block. Returns the number dropped."""
        return self.block_pool.reset_prefix_cache()
