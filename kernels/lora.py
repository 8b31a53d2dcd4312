"""Batched LoRA for a packed multi-adapter batch: every token adds its own adapter's delta.

The adapters of a step sit in stacked *slots* (Punica, Chen et al. 2023, "Punica: Multi-Tenant
LoRA Serving"; S-LoRA, Sheng et al. 2023): per adapted layer ``lora_a [L, R, in_features]`` and
``lora_b [L, R, out_features]`` (``B`` transposed, the adapter's scaling folded in, ranks below
``R`` zero-padded), ``L = max_loras`` slots of width ``R = max_lora_rank``. Each token of the
packed batch carries a slot index (``token_slots [T]``, ``-1``: the base model, no delta) and
gets ``y[t] += (x[t] @ lora_a[s].T) @ lora_b[s]``, the *shrink* (to rank R) then the *expand*
(back to out_features) of Punica's BGMV/SGMV kernels. The base weights are never touched.

Implementations, same contract (``y`` updated in place, fp32 accumulation where the kernel
accumulates):

- :func:`lora_bgmv_torch`: the oracle, literally per token (gather each token's A and B, two
  batched matmuls): Punica's BGMV written in torch. Memory ``T * R * (in + out)``: tests only.
- :func:`lora_stacked_torch`: the CPU path. One shrink matmul of every token against the first
  ``k`` slots at once (``x @ lora_a[:k].view(k*R, in).T``, ``[T, k*R]``), a mask that keeps
  each token's own slot's ``R`` columns (built once per step, :func:`slot_mask`), one expand
  matmul (``[T, k*R] @ lora_b[:k].view(k*R, out)``): three dense ops per layer whatever the
  number of adapters or how their tokens interleave, at ``k``-fold the (small) shrink/expand
  FLOPs; ``k`` is the highest slot of the step plus one.
- ``kvfleet.kernels.triton_lora.lora_bgmv_triton``: CUDA (Triton), BGMV shrink and expand
  kernels, one program per token (and output block); tested under the Triton interpreter.
"""

from __future__ import annotations

import torch

__all__ = ["lora_bgmv_torch", "lora_stacked_torch", "slot_mask", "add_lora", "check_lora_args"]


def check_lora_args(x: torch.Tensor, y: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                    token_slots: torch.Tensor) -> None:
    """Shapes: ``x [T, in]``, ``y [T, out]``, ``lora_a [L, R, in]``, ``lora_b [L, R, out]``,
    ``token_slots [T]`` integer. Raises ValueError naming the mismatch."""
    if x.dim() != 2 or y.dim() != 2 or x.shape[0] != y.shape[0]:
        raise ValueError(f"x [T, in] and y [T, out] expected, got {tuple(x.shape)} and {tuple(y.shape)}")
    if lora_a.dim() != 3 or lora_b.dim() != 3 or lora_a.shape[:2] != lora_b.shape[:2]:
        raise ValueError(f"lora_a [L, R, in] and lora_b [L, R, out] expected, got {tuple(lora_a.shape)}, "
                         f"{tuple(lora_b.shape)}")
    if lora_a.shape[2] != x.shape[1] or lora_b.shape[2] != y.shape[1]:
        raise ValueError(f"lora_a {tuple(lora_a.shape)} / lora_b {tuple(lora_b.shape)} do not match x "
                         f"{tuple(x.shape)} / y {tuple(y.shape)}")
    if token_slots.shape != (x.shape[0],) or token_slots.is_floating_point():
        raise ValueError(f"token_slots must be an integer [T={x.shape[0]}] tensor, got {tuple(token_slots.shape)}")


def lora_bgmv_torch(x: torch.Tensor, y: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                    token_slots: torch.Tensor) -> torch.Tensor:
    """The per-token oracle (see the module docstring); returns ``y``."""
    check_lora_args(x, y, lora_a, lora_b, token_slots)
    use = token_slots >= 0
    if not bool(use.any()):
        return y
    rows = use.nonzero().squeeze(1)
    slots = token_slots[rows].long()
    a = lora_a[slots].float()  # [n, R, in]
    b = lora_b[slots].float()  # [n, R, out]
    shrink = torch.bmm(a, x[rows].float().unsqueeze(2))  # [n, R, 1]
    delta = torch.bmm(b.transpose(1, 2), shrink).squeeze(2)  # [n, out]
    y.index_add_(0, rows, delta.to(y.dtype))
    return y


def slot_mask(token_slots: torch.Tensor, num_slots: int, rank: int, dtype: torch.dtype) -> torch.Tensor:
    """``[T, num_slots * rank]`` in ``dtype``: 1 in the ``rank`` columns of each token's slot,
    0 elsewhere (a whole row of 0 for a base-model token, slot -1)."""
    cols = torch.arange(num_slots * rank, device=token_slots.device) // rank
    return (cols.unsqueeze(0) == token_slots.unsqueeze(1)).to(dtype)


def lora_stacked_torch(x: torch.Tensor, y: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                       mask: torch.Tensor) -> torch.Tensor:
    """The CPU path (see the module docstring): ``mask`` from :func:`slot_mask` with
    ``num_slots = k <= L``; only slots ``[0, k)`` are read. Returns ``y``."""
    k_r = mask.shape[1]
    rank = lora_a.shape[1]
    k = k_r // rank
    a = lora_a[:k].reshape(k_r, lora_a.shape[2])
    b = lora_b[:k].reshape(k_r, lora_b.shape[2])
    shrink = torch.matmul(x, a.t())
    shrink.mul_(mask)
    y.addmm_(shrink, b)
    return y


def add_lora(x: torch.Tensor, y: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
             token_slots: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """``y += `` each token's adapter delta, dispatched like the attention kernels
    (``KVFLEET_ATTENTION_BACKEND``, :func:`kvfleet.kernels.select_backend`): Triton on CUDA,
    else :func:`lora_stacked_torch` with ``mask`` (built here when not given). Returns ``y``."""
    from kvfleet.kernels import select_backend

    if select_backend(x.device) == "triton":
        from kvfleet.kernels.triton_lora import lora_bgmv_triton

        return lora_bgmv_triton(x, y, lora_a, lora_b, token_slots)
    if mask is None:
        k = int(token_slots.max()) + 1 if token_slots.numel() else 0
        if k <= 0:
            return y
        mask = slot_mask(token_slots, k, lora_a.shape[1], x.dtype)
    return lora_stacked_torch(x, y, lora_a, lora_b, mask)
