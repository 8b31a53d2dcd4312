"""Triton kernel: write this step's keys and values into the paged KV cache.

Layout (see ``kvfleet.kernels``): caches ``[num_blocks, block_size, num_kv_heads,
head_size]``, contiguous, so slot ``s`` starts at element ``s * num_kv_heads *
head_size``. One program per token copies its ``[num_kv_heads, head_size]`` keys and
values (a few hundred bytes each, fully coalesced); a negative slot makes the program
write nothing. Same contract as vLLM's ``reshape_and_cache_flash``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["reshape_and_cache_triton"]


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_PAD: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    h = tl.arange(0, HEADS_PAD)
    d = tl.arange(0, HEAD_PAD)
    mask = (h[:, None] < NUM_KV_HEADS) & (d[None, :] < HEAD_SIZE)
    k = tl.load(key_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(value_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    dst = slot * (NUM_KV_HEADS * HEAD_SIZE) + h[:, None] * HEAD_SIZE + d[None, :]
    tl.store(key_cache_ptr + dst, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(value_cache_ptr + dst, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Triton version of :func:`kvfleet.kernels.reference.reshape_and_cache_torch`
    (same arguments, same contract: ``key``/``value`` ``[num_tokens, num_kv_heads,
    head_size]`` with unit stride on the last dim, contiguous caches ``[num_blocks,
    block_size, num_kv_heads, head_size]``, ``slot_mapping [num_tokens]`` int32/int64,
    ``-1`` skips). Raises ValueError on shape/layout mismatch. Out-of-range slots are
    not checked (undefined behaviour, as in vLLM)."""
    from kvfleet.kernels.checks import check_reshape_and_cache_args

    num_tokens, num_kv_heads, head_size = check_reshape_and_cache_args(key, value, key_cache, value_cache, slot_mapping)
    if key.stride(2) != 1:
        key = key.contiguous()
    if value.stride(2) != 1:
        value = value.contiguous()
    if num_tokens == 0:
        return
    slot_mapping = slot_mapping.contiguous()
    _reshape_and_cache_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_SIZE=head_size,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_PAD=triton.next_power_of_2(head_size),
    )
