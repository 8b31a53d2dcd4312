"""Whole KV blocks in and out of the paged cache, as bytes (peer KV pull, issue 29).

Contract: a block's payload is its K and V for every layer, stacked as ``[num_layers, 2,
block_size, num_kv_heads, head_size]`` in the cache dtype, C order (the layout
:mod:`kvfleet.runtime.kv_transfer.wire` frames). :func:`read_blocks` copies blocks out;
:func:`write_blocks` copies payloads into blocks **in place** (the fused CPU decode path and
compiled graphs hold the cache tensors themselves). Both run in the engine thread, between
steps. One rank's cache only: tensor parallelism is refused before (``EngineConfig``).
"""

from __future__ import annotations

import torch

from kvfleet.runtime.kv_transfer.wire import BlockLayout


def block_layout(runner, model: str, quantization: str | None) -> BlockLayout:
    """The :class:`BlockLayout` of ``runner``'s cache (a :class:`~.model_runner.ModelRunner`)."""
    dtype = runner.kv_cache_dtype  # the cache's, not the activations' (--kv-cache-dtype)
    return BlockLayout(model=model, dtype=str(dtype).removeprefix("torch."), quantization=quantization or "none",
                       num_layers=runner.num_layers, num_kv_heads=runner.num_kv_heads, head_size=runner.head_size,
                       block_size=runner.block_size, elem_size=torch.empty((), dtype=dtype).element_size())


def read_blocks(kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_ids: list[int]) -> list[bytes]:
    """Each block's payload (host bytes)."""
    if not block_ids:
        return []
    index = torch.tensor(block_ids, dtype=torch.long, device=kv_caches[0][0].device)
    # [layers, 2, n, block_size, heads, head_size] -> [n, layers, 2, block_size, heads, head_size]
    stacked = torch.stack([torch.stack([k.index_select(0, index), v.index_select(0, index)]) for k, v in kv_caches])
    per_block = stacked.permute(2, 0, 1, 3, 4, 5).contiguous().cpu()
    raw = per_block.view(torch.uint8).reshape(len(block_ids), -1)
    return [raw[i].numpy().tobytes() for i in range(len(block_ids))]


def write_blocks(kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_ids: list[int],
                 payloads: list[bytes]) -> None:
    """Copy each payload into its block (every layer's K and V), in place.

    Raises:
        ValueError: a payload's length is not one block's."""
    if not block_ids:
        return
    k0 = kv_caches[0][0]
    per_block = (len(kv_caches), 2, *k0.shape[1:])
    nbytes = k0.element_size() * 2 * len(kv_caches) * k0[0].numel()
    if any(len(p) != nbytes for p in payloads) or len(payloads) != len(block_ids):
        raise ValueError(f"write_blocks: {len(payloads)} payloads for {len(block_ids)} blocks of {nbytes} bytes")
    host = torch.frombuffer(bytearray(b"".join(payloads)), dtype=torch.uint8)
    data = host.view(k0.dtype).reshape(len(block_ids), *per_block).to(k0.device)
    index = torch.tensor(block_ids, dtype=torch.long, device=k0.device)
    for layer, (k, v) in enumerate(kv_caches):
        k.index_copy_(0, index, data[:, layer, 0])
        v.index_copy_(0, index, data[:, layer, 1])
