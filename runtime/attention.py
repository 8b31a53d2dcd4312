"""The engine's paged attention, plugged into transformers' attention-function registry.

``register()`` adds ``"kvfleet_paged"`` to ``transformers.AttentionInterface``. A model
whose ``config._attn_implementation`` is that name (set by the model runner) calls
:func:`paged_attention_forward` in every attention layer instead of sdpa/eager, so any
Llama/Qwen2/Mistral-style model definition from transformers runs on the engine's packed,
unpadded batch (``input_ids`` of shape ``[1, T]``, one sequence after another, with
per-token ``position_ids``) without a model file of our own.

No attention mask is built: the name is deliberately *not* in transformers'
``AttentionMaskInterface``, and for such names ``create_causal_mask`` returns ``None``
without doing any work (``masking_utils._preprocess_mask_arguments``: "For TGI/vLLM
backends, or other custom attention without equivalent mask creation: we don't need a
mask"). Causality and sequence boundaries come from ``seq_lens`` / ``query_start_loc``.

The per-step metadata reaches the layers as the extra forward keyword argument
``kvfleet_attn`` (transformers passes unknown keyword arguments of the model's forward
through to the attention function).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvfleet.kernels import paged_attention, reshape_and_cache

ATTN_IMPLEMENTATION = "kvfleet_paged"
"""Name under which the paged attention is registered in ``transformers.AttentionInterface``."""

METADATA_KWARG = "kvfleet_attn"
"""Keyword argument of the model's forward that carries :class:`AttentionMetadata`."""


@dataclass
class AttentionMetadata:
    """Everything the attention layers need for one forward pass over a packed batch.

    ``T`` = tokens in the step, ``B`` = sequences in the step.

    Attributes:
        slot_mapping: ``[T]`` int64, cache slot (``block_id * block_size + offset``) where
            each new token's K/V is written.
        block_tables: ``[B, max_blocks]`` int32, physical block ids of each sequence in
            logical order (rows padded with 0 past a sequence's last block).
        seq_lens: ``[B]`` int32, context length of each sequence after this step (tokens
            already cached + this step's tokens).
        query_start_loc: ``[B + 1]`` int32, offsets of each sequence's tokens in the batch.
        max_query_len: longest per-sequence chunk of new tokens, as a Python int.
        max_seq_len: longest ``seq_lens`` entry, as a Python int.
        kv_caches: per layer, ``(key_cache, value_cache)`` each of shape
            ``[num_blocks, block_size, num_kv_heads, head_size]`` (layout of
            :mod:`kvfleet.kernels`), indexed by the attention module's ``layer_idx``.
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    max_query_len: int
    max_seq_len: int
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention function with transformers' calling convention, over the paged KV cache.

    Args:
        module: the attention module; its ``layer_idx`` selects the layer's cache.
        query: ``[1, num_heads, T, head_size]`` (rotary embedding already applied).
        key, value: ``[1, num_kv_heads, T, head_size]``, this step's new keys/values.
        attention_mask: ignored (always None here, see the module docstring).
        scaling: softmax scale (the module's, e.g. ``head_size ** -0.5``).
        dropout: must be 0 (inference only).
        kvfleet_attn: the step's :class:`AttentionMetadata` (keyword argument).

    Writes the new K/V into the layer's cache at ``slot_mapping`` with
    ``kvfleet.kernels.reshape_and_cache``, then attends each query token over its
    sequence's cached tokens (causally) with ``kvfleet.kernels.paged_attention``.

    Returns: ``(attn_output, None)`` with ``attn_output`` of shape
    ``[1, T, num_heads, head_size]`` (what transformers' attention modules expect).

    Raises:
        RuntimeError: called without ``kvfleet_attn`` (the model was run outside the
            engine after the engine switched its attention implementation) or with a
            batch dimension other than 1.
    """
    meta: AttentionMetadata | None = kwargs.get(METADATA_KWARG)
    if meta is None:
        raise RuntimeError(
            f"attention implementation {ATTN_IMPLEMENTATION!r} needs the {METADATA_KWARG}= forward "
            "argument: this model is owned by a kvfleet engine (load another copy for plain use)"
        )
    if query.shape[0] != 1:
        raise RuntimeError(f"{ATTN_IMPLEMENTATION} runs packed batches of shape [1, T]; got batch {query.shape[0]}")
    key_cache, value_cache = meta.kv_caches[module.layer_idx]
    q = query[0].transpose(0, 1)  # [T, num_heads, head_size]
    k = key[0].transpose(0, 1)  # [T, num_kv_heads, head_size]
    v = value[0].transpose(0, 1)
    reshape_and_cache(k, v, key_cache, value_cache, meta.slot_mapping)
    out = paged_attention(
        q,
        key_cache,
        value_cache,
        meta.block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        scaling,
        max_query_len=meta.max_query_len,
        max_seq_len=meta.max_seq_len,
    )
    return out.unsqueeze(0), None


_registered = False


def register() -> str:
    """Register :func:`paged_attention_forward` with transformers (idempotent).

    Returns: the implementation name to put in ``config._attn_implementation``.
    """
    global _registered
    if not _registered:
        from transformers import AttentionInterface

        AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
        _registered = True
    return ATTN_IMPLEMENTATION
