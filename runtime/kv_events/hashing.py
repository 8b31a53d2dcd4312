"""The prefix-cache block hash chain, shared by the engine's block pool and the router's
precise prefix routing (both must hash a prompt's blocks identically). Torch-free, no I/O."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

BlockHash = bytes
"""A 16-byte BLAKE2b digest of (parent block's hash, the block's token ids, extra keys)."""


def hash_block_tokens(parent: BlockHash | None, token_ids: Sequence[int], extra_keys: tuple = ()) -> BlockHash:
    """Prefix-cache hash of one full block (the hash chain of vLLM's automatic prefix caching).

    Args:
        parent: the hash of the previous block of the same sequence, None for the first block.
        token_ids: the block's ``block_size`` token ids.
        extra_keys: anything else that changes the block's K/V (a cache salt, a LoRA id...).

    Returns:
        16 bytes. A cryptographic hash, so two different prefixes colliding (and one
        request reading another's K/V) is not a practical concern, unlike Python's ``hash``.
    """
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"\0" * 16)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    if extra_keys:
        h.update(repr(extra_keys).encode())
    return h.digest()


def prompt_block_hashes(token_ids: Sequence[int], block_size: int) -> list[BlockHash]:
    """The hashes of every full block of a base-model prompt without a cache salt (what the
    block pool registers for it): the router's side of precise prefix routing."""
    out: list[BlockHash] = []
    for i in range(len(token_ids) // block_size):
        out.append(hash_block_tokens(out[-1] if out else None, token_ids[i * block_size:(i + 1) * block_size]))
    return out
