"""kvfleet kernels: paged-KV-cache attention as Triton kernels (CUDA) with torch
reference implementations (CPU, and the oracle in tests).

Public API::

    reshape_and_cache(key, value, key_cache, value_cache, slot_mapping) -> None
    paged_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                    scale=None, *, max_query_len=None, max_seq_len=None, out=None,
                    sliding_window=None, softcap=None) -> Tensor

KV cache layout (per layer, vLLM's FlashAttention-backend layout): ``key_cache, value_cache:
[num_blocks, block_size, num_kv_heads, head_size]``, ``slot = block_id * block_size + offset``
(slot -1: skip the token). CUDA tensors use Triton, anything else torch;
``KVFLEET_ATTENTION_BACKEND=auto|torch|triton`` (read at every call) forces one (``triton``
on CPU needs ``TRITON_INTERPRET=1`` before triton is imported). Modules: ``reference``,
``triton_cache`` / ``triton_attention`` (lazy), ``testing``, ``aot``. Design and sources:
docs/performance.md.
"""

from __future__ import annotations

import torch

import kvfleet.runtime.env as env  # the settings registry: stdlib only, below every layer
from kvfleet.kernels.reference import paged_attention_torch, reshape_and_cache_torch

__all__ = [
    "reshape_and_cache",
    "paged_attention",
    "reshape_and_cache_torch",
    "paged_attention_torch",
    "reshape_and_cache_triton",
    "paged_attention_triton",
    "select_backend",
    "BACKEND_ENV",
]

BACKEND_ENV = env.ATTENTION_BACKEND.name
_BACKENDS = env.ATTENTION_BACKEND.choices


def select_backend(device: torch.device) -> str:
    """Return ``"torch"`` or ``"triton"`` for tensors on ``device``.

    ``KVFLEET_ATTENTION_BACKEND=auto`` (or unset): triton on CUDA, torch elsewhere.
    Raises ValueError for an unknown value of the variable.
    """
    choice = env.ATTENTION_BACKEND.get()
    if choice == "auto":
        return "triton" if device.type == "cuda" else "torch"
    return choice


def reshape_and_cache_triton(key, value, key_cache, value_cache, slot_mapping) -> None:
    """Triton implementation of :func:`reshape_and_cache` (imports triton lazily)."""
    from kvfleet.kernels.triton_cache import reshape_and_cache_triton as impl

    return impl(key, value, key_cache, value_cache, slot_mapping)


def paged_attention_triton(
    query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale=None, **kwargs
) -> torch.Tensor:
    """Triton implementation of :func:`paged_attention` (imports triton lazily)."""
    from kvfleet.kernels.triton_attention import paged_attention_triton as impl

    return impl(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, **kwargs)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``key``/``value`` (``[num_tokens, num_kv_heads, head_size]``) into the paged
    caches (``[num_blocks, block_size, num_kv_heads, head_size]``) at ``slot_mapping``
    (``[num_tokens]`` int; ``-1`` skips the token). In place; returns None.

    Dispatches on the device / ``KVFLEET_ATTENTION_BACKEND``; see
    :func:`kvfleet.kernels.reference.reshape_and_cache_torch` for the full contract.
    """
    if select_backend(key_cache.device) == "triton":
        return reshape_and_cache_triton(key, value, key_cache, value_cache, slot_mapping)
    return reshape_and_cache_torch(key, value, key_cache, value_cache, slot_mapping)


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float | None = None,
    *,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    out: torch.Tensor | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of a packed varlen batch over the paged KV cache.

    ``query [num_tokens, num_heads, head_size]``; ``block_tables [num_seqs, max_blocks]``
    int32; ``seq_lens [num_seqs]`` (context length including this step's tokens);
    ``query_start_loc [num_seqs+1]`` int32. Query token ``i`` of sequence ``s`` sits at
    position ``seq_lens[s] - q_len_s + i`` and attends to keys ``[0, pos]``, or to
    ``(pos - sliding_window, pos]`` with a ``sliding_window`` (tokens, ``>= 1``; the
    transformers/FlashAttention convention); ``softcap`` caps the scaled logits at
    ``softcap * tanh(x / softcap)`` (Gemma 2). GQA when
    ``num_heads`` is a multiple of ``num_kv_heads``. Returns
    ``[num_tokens, num_heads, head_size]`` in ``query.dtype`` (fp32 accumulation).

    Dispatches on the device / ``KVFLEET_ATTENTION_BACKEND``; see
    :func:`kvfleet.kernels.reference.paged_attention_torch` for the full contract.
    """
    kwargs = dict(max_query_len=max_query_len, max_seq_len=max_seq_len, out=out, sliding_window=sliding_window,
                  softcap=softcap)
    if select_backend(query.device) == "triton":
        return paged_attention_triton(
            query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, **kwargs
        )
    return paged_attention_torch(
        query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, **kwargs
    )
