"""Triton kernels of batched LoRA (Punica's BGMV shrink and expand), CUDA.

Same contract as :func:`kvfleet.kernels.lora.lora_bgmv_torch`: ``x [T, in]``, ``y [T, out]``
(updated in place), stacked slots ``lora_a [L, R, in]`` and ``lora_b [L, R, out]`` (contiguous),
``token_slots [T]`` (``-1``: no adapter). Shrink: one program per token computes ``x[t] @
lora_a[s].T`` (``[R]``, fp32, looping over ``in`` in blocks of ``BLOCK_K``) into a ``[T, R]``
fp32 buffer. Expand: one program per (token, block of ``BLOCK_N`` outputs) adds ``shrink[t] @
lora_b[s][:, block]`` to ``y``. A token with slot -1 returns at once (no loads). This is BGMV
(one adapter gathered per token, Chen et al. 2023, Punica); it serves decode batches and
mixed prefill alike, and is exact under the Triton interpreter (tests/unit/kernels/test_lora.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["lora_bgmv_triton"]


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, slots_ptr, out_ptr, stride_xt, IN: tl.constexpr, R: tl.constexpr,
                   R_PAD: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    s = tl.load(slots_ptr + t).to(tl.int64)
    if s < 0:
        return
    r = tl.arange(0, R_PAD)
    acc = tl.zeros((R_PAD,), dtype=tl.float32)
    for k0 in range(0, IN, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        xk = tl.load(x_ptr + t * stride_xt + k, mask=k < IN, other=0.0).to(tl.float32)
        a = tl.load(a_ptr + s * (R * IN) + r[:, None] * IN + k[None, :],
                    mask=(r[:, None] < R) & (k[None, :] < IN), other=0.0).to(tl.float32)
        acc += tl.sum(a * xk[None, :], axis=1)
    tl.store(out_ptr + t * R + r, acc, mask=r < R)


@triton.jit
def _expand_kernel(shrink_ptr, b_ptr, slots_ptr, y_ptr, stride_yt, OUT: tl.constexpr, R: tl.constexpr,
                   R_PAD: tl.constexpr, BLOCK_N: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    nb = tl.program_id(1)
    s = tl.load(slots_ptr + t).to(tl.int64)
    if s < 0:
        return
    r = tl.arange(0, R_PAD)
    n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    h = tl.load(shrink_ptr + t * R + r, mask=r < R, other=0.0)
    b = tl.load(b_ptr + s * (R * OUT) + r[:, None] * OUT + n[None, :],
                mask=(r[:, None] < R) & (n[None, :] < OUT), other=0.0).to(tl.float32)
    delta = tl.sum(b * h[:, None], axis=0)
    y = tl.load(y_ptr + t * stride_yt + n, mask=n < OUT, other=0.0).to(tl.float32)
    tl.store(y_ptr + t * stride_yt + n, (y + delta).to(y_ptr.dtype.element_ty), mask=n < OUT)


def lora_bgmv_triton(x: torch.Tensor, y: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                     token_slots: torch.Tensor, *, block_k: int = 64, block_n: int = 64) -> torch.Tensor:
    """``y += `` each token's adapter delta (see the module docstring); returns ``y``.

    Raises:
        ValueError: shapes that do not match (as :func:`kvfleet.kernels.lora.check_lora_args`), or
            ``y`` / the slot tensors without unit stride on their last dimension."""
    if (x.dim() != 2 or y.dim() != 2 or lora_a.dim() != 3 or lora_b.dim() != 3 or x.shape[0] != y.shape[0]
            or lora_a.shape[:2] != lora_b.shape[:2] or lora_a.shape[2] != x.shape[1] or lora_b.shape[2] != y.shape[1]
            or token_slots.shape != (x.shape[0],)):
        raise ValueError(f"lora_bgmv_triton: x {tuple(x.shape)}, y {tuple(y.shape)}, lora_a {tuple(lora_a.shape)}, "
                         f"lora_b {tuple(lora_b.shape)}, token_slots {tuple(token_slots.shape)} do not match "
                         "(see kvfleet.kernels.lora.check_lora_args)")
    num_tokens, in_f = x.shape
    out_f = y.shape[1]
    rank = lora_a.shape[1]
    if num_tokens == 0:
        return y
    if y.stride(1) != 1 or not lora_a.is_contiguous() or not lora_b.is_contiguous():
        raise ValueError("lora_bgmv_triton: y needs unit stride on its last dim, lora_a / lora_b contiguous")
    if x.stride(1) != 1:
        x = x.contiguous()
    slots = token_slots.contiguous()
    shrink = torch.empty((num_tokens, rank), dtype=torch.float32, device=x.device)
    r_pad = max(triton.next_power_of_2(rank), 2)
    _shrink_kernel[(num_tokens,)](x, lora_a, slots, shrink, x.stride(0), IN=in_f, R=rank, R_PAD=r_pad,
                                  BLOCK_K=block_k)
    _expand_kernel[(num_tokens, triton.cdiv(out_f, block_n))](shrink, lora_b, slots, y, y.stride(0), OUT=out_f,
                                                              R=rank, R_PAD=r_pad, BLOCK_N=block_n)
    return y
