"""KV cache manager: per-request block tables on top of the block pool, with automatic
prefix caching. Speaks only in requests, token counts and block ids.

The facade follows vLLM v1 (``vllm/v1/core/kv_cache_manager.py``):
``get_computed_blocks`` (longest cached prefix), ``allocate_slots`` (blocks for the
tokens of this step), ``free``. A fully cached prompt still recomputes its last token,
so the model produces logits for it.
"""

from __future__ import annotations

from kvfleet.runtime.block_pool import BlockPool, KVCacheBlock, hash_block_tokens
from kvfleet.runtime.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Block tables of the live requests.

    Args:
        num_blocks: physical KV blocks (from the memory budget).
        block_size: tokens per block.
        enable_caching: automatic prefix caching on/off.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self._num_cached_blocks: dict[str, int] = {}

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def usage(self) -> float:
        """KV cache usage (0-1): blocks referenced by requests; cached free blocks excluded."""
        return self.block_pool.usage

    def _update_block_hashes(self, request: Request, num_tokens: int) -> None:
        """Extend ``request.block_hashes`` to cover every full block of its first ``num_tokens`` tokens."""
        hashes = request.block_hashes
        bs = self.block_size
        extra = (request.cache_salt,) if request.cache_salt else ()
        for i in range(len(hashes), num_tokens // bs):
            parent = hashes[i - 1] if i else None
            hashes.append(hash_block_tokens(parent, request.token_ids_slice(i * bs, (i + 1) * bs), extra))

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest run of cached full blocks that prefixes ``request``'s tokens.

        Returns ``(blocks, num_computed_tokens)``; at most ``request.num_tokens - 1`` tokens
        count as computed, so at least the last token is recomputed and yields logits.
        Requests asking for prompt logprobs skip the cache (their prompt must be computed).
        Does not take references: pass the blocks to ``allocate_slots``.
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        self._update_block_hashes(request, request.num_tokens)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        blocks: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    @property
    def num_free_blocks(self) -> int:
        """Blocks the pool can hand out now (free, including unreferenced cached ones)."""
        return self.block_pool.num_free_blocks

    def get_num_blocks_to_allocate(
        self, request: Request, num_tokens: int, new_computed_blocks: list[KVCacheBlock] = ()
    ) -> int:
        """Blocks that ``request`` would take from the free pool to hold its first
        ``num_tokens`` tokens (positions ``[0, num_tokens)``), counting the blocks it holds
        and the prefix-cache hits ``new_computed_blocks`` (a hit on a free block takes that
        block out of the pool too). Changes nothing. As vLLM v1's
        ``get_num_blocks_to_allocate`` (``vllm/v1/core/single_type_kv_cache_manager.py``).
        """
        have = len(self.req_to_blocks.get(request.request_id, ())) + len(new_computed_blocks)
        num_new = max(0, cdiv(num_tokens, self.block_size) - have)
        return num_new + sum(1 for b in new_computed_blocks if b.ref_cnt == 0)

    def can_allocate(self, request: Request, num_new_tokens: int, new_computed_blocks: list[KVCacheBlock] = ()) -> bool:
        return self._num_blocks_needed(request, num_new_tokens, new_computed_blocks) is not None

    def _num_blocks_needed(self, request, num_new_tokens, new_computed_blocks) -> int | None:
        have = len(self.req_to_blocks.get(request.request_id, ())) + len(new_computed_blocks)
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        need = max(0, cdiv(num_computed + num_new_tokens, self.block_size) - have)
        # Cache hits on blocks that are currently free take them out of the free pool too.
        num_free_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
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
            supply them; then nothing changed.
        """
        need = self._num_blocks_needed(request, num_new_tokens, new_computed_blocks)
        if need is None:
            return None
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        if new_computed_blocks:
            self.block_pool.touch(new_computed_blocks)
            blocks.extend(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(need)
        blocks.extend(new_blocks)
        if self.enable_caching and request.sampling_params.prompt_logprobs is None:
            # Register the blocks that will be full after this step. Their K/V is written in
            # this step's forward pass, before any later step can read them.
            num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
            num_full = (num_computed + num_new_tokens) // self.block_size
            start = self._num_cached_blocks.get(request.request_id, len(new_computed_blocks))
            start = max(start, len(new_computed_blocks))
            if num_full > start:
                self._update_block_hashes(request, num_full * self.block_size)
                for i in range(start, num_full):
                    self.block_pool.cache_block(blocks[i], request.block_hashes[i])
            self._num_cached_blocks[request.request_id] = max(start, num_full)
        return new_blocks

    def free(self, request: Request) -> None:
        """Release all of ``request``'s blocks (last block first, so its tail is evicted first)."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self._num_cached_blocks.pop(request.request_id, None)
        self.block_pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        """The block table of a request: physical block ids in logical order."""
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def reset_prefix_cache(self) -> int:
        """Drop every unreferenced cached block. Returns the number dropped."""
        return self.block_pool.reset_prefix_cache()
