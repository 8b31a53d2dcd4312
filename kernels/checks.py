"""The argument contract of the paged-KV-cache operations, checked the same way by every
backend (the torch reference in :mod:`kvfleet.kernels.reference`, the Triton kernels in
:mod:`kvfleet.kernels.triton_cache` and :mod:`kvfleet.kernels.triton_attention`).

Each check raises ``ValueError`` with the offending shape or value and returns the sizes the
kernel needs, so a backend never indexes past a badly shaped input. Shapes and options:
:func:`kvfleet.kernels.reference.reshape_and_cache_torch`,
:func:`kvfleet.kernels.reference.paged_attention_torch`.
"""

from __future__ import annotations

import math

import torch

__all__ = ["check_attention_options", "check_paged_attention_args", "check_reshape_and_cache_args"]


def _check_cache_pair(key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    if key_cache.dim() != 4:
        raise ValueError(
            "key_cache must be [num_blocks, block_size, num_kv_heads, head_size], "
            f"got shape {tuple(key_cache.shape)}"
        )
    if value_cache.shape != key_cache.shape:
        raise ValueError(
            f"value_cache shape {tuple(value_cache.shape)} != key_cache shape {tuple(key_cache.shape)}"
        )


def check_reshape_and_cache_args(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> tuple[int, int, int]:
    """Validate ``reshape_and_cache``'s arguments (shared by the torch and Triton paths);
    return ``(num_tokens, num_kv_heads, head_size)``.

    Raises ValueError on mismatched shapes or a non-contiguous cache.
    """
    _check_cache_pair(key_cache, value_cache)
    num_tokens = slot_mapping.shape[0]
    _, _, num_kv_heads, head_size = key_cache.shape
    if key.shape != (num_tokens, num_kv_heads, head_size) or value.shape != key.shape:
        raise ValueError(
            f"key/value must be [num_tokens={num_tokens}, num_kv_heads={num_kv_heads}, "
            f"head_size={head_size}], got {tuple(key.shape)} and {tuple(value.shape)}"
        )
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise ValueError("key_cache and value_cache must be contiguous")
    return num_tokens, num_kv_heads, head_size


def check_paged_attention_args(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
) -> tuple[int, int, int, int, int]:
    """Validate shapes; return ``(num_seqs, num_heads, num_kv_heads, head_size, block_size)``.

    Raises ValueError with the offending shape.
    """
    _check_cache_pair(key_cache, value_cache)
    if query.dim() != 3:
        raise ValueError(f"query must be [num_tokens, num_heads, head_size], got {tuple(query.shape)}")
    _, block_size, num_kv_heads, head_size = key_cache.shape
    num_heads = query.shape[1]
    if query.shape[2] != head_size:
        raise ValueError(f"query head_size {query.shape[2]} != cache head_size {head_size}")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if block_tables.dim() != 2:
        raise ValueError(f"block_tables must be [num_seqs, max_blocks], got {tuple(block_tables.shape)}")
    num_seqs = block_tables.shape[0]
    if seq_lens.shape != (num_seqs,):
        raise ValueError(f"seq_lens must be [num_seqs={num_seqs}], got {tuple(seq_lens.shape)}")
    if query_start_loc.shape != (num_seqs + 1,):
        raise ValueError(
            f"query_start_loc must be [num_seqs+1={num_seqs + 1}], got {tuple(query_start_loc.shape)}"
        )
    return num_seqs, num_heads, num_kv_heads, head_size, block_size


def check_attention_options(sliding_window: int | None, softcap: float | None) -> tuple[int | None, float | None]:
    """Validate the optional attention features (shared by the torch and Triton paths).

    Args:
        sliding_window: None (full causal attention) or a window of ``>= 1`` tokens
            (a query at position ``p`` sees keys ``p - sliding_window < k <= p``).
        softcap: None or a finite ``> 0`` cap on the scaled attention logits
            (``softcap * tanh(scores / softcap)``).

    Returns: ``(sliding_window as int or None, softcap as float or None)``.

    Raises:
        ValueError: a window that is not a positive integer (0 is not "no window": pass
            None), or a softcap that is not a positive finite number.
    """
    if sliding_window is not None:
        if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1:
            raise ValueError(f"sliding_window must be None or an integer >= 1, got {sliding_window!r}")
        sliding_window = int(sliding_window)
    if softcap is not None:
        if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not math.isfinite(softcap) \
                or softcap <= 0:
            raise ValueError(f"softcap must be None or a finite number > 0, got {softcap!r}")
        softcap = float(softcap)
    return sliding_window, softcap
