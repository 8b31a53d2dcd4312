"""LoRA adapter tables of the fused CPU decoder (:mod:`kvfleet.kernels.cpu_decoder`): their
description (:class:`LoRATable`, a layer's ``{part: table}``), its checks and its ``kv_lora``
struct (``kernels/cpu_lora.h`` adds the deltas inside the C step; :mod:`kvfleet.kernels.cpu_lib`
mirrors the struct).

A layer's adapted projections are keyed by :data:`LORA_PARTS`. Each table holds every adapter
slot of one projection, as :class:`kvfleet.runtime.worker.lora_layers.LoRALinear` keeps them:
``a [S, R, K]`` (each slot's ``A``) and ``b [S, R, n]`` (``B`` transposed, the adapter's scaling
folded in, ranks below ``R`` zero-padded), contiguous float32 CPU tensors read in place at every
step (an adapter written into a slot is used by the next step; the tensors must not move). A row
of a step with slot ``s`` gets ``(x a[s]^T) b[s]`` added to output columns ``n0 .. n0 + n - 1`` of
the layer's matrix; every table of a decoder has the same ``S`` and ``R``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvfleet.kernels import cpu_lib

LORA_PARTS = ("q", "k", "v", "o", "gate", "up", "down")
"""The keys of a layer's tables in ``kv_lora.part``'s order: the projection a table adds to
(``q`` / ``k`` / ``v`` are columns of ``qkv``, ``gate`` / ``up`` of ``gate_up``: :attr:`LoRATable.n0`
says where; a family storing ``qkv`` as one module has one table under ``q`` spanning all of it)."""
LORA_MATRIX = {"q": "qkv", "k": "qkv", "v": "qkv", "o": "o", "gate": "gate_up", "up": "gate_up", "down": "down"}
"""The layer matrix each part's columns belong to."""


@dataclass
class LoRATable:
    """One projection's adapter slots (see the module docstring)."""

    a: torch.Tensor
    b: torch.Tensor
    n0: int = 0

    def check(self, name: str, slots: int, rank: int, k: int, n_max: int) -> None:
        """ValueError unless ``a`` is ``[slots, rank, k]``, ``b`` ``[slots, rank, n]`` with ``n0 + n <= n_max``."""
        for field, t in (("a", self.a), ("b", self.b)):
            if t.dtype != torch.float32 or not t.is_contiguous() or t.device.type != "cpu" or t.dim() != 3:
                raise ValueError(f"{name}: LoRA {field} must be a contiguous float32 CPU [slots, rank, features] "
                                 f"tensor, got {t.dtype} {tuple(t.shape)}")
        if tuple(self.a.shape) != (slots, rank, k) or tuple(self.b.shape[:2]) != (slots, rank) \
                or not 0 <= self.n0 <= self.n0 + self.b.shape[2] <= n_max:
            raise ValueError(f"{name}: LoRA a {tuple(self.a.shape)} / b {tuple(self.b.shape)} at column {self.n0} "
                             f"do not fit {slots} slots of rank {rank}, {k} inputs, {n_max} outputs")


def check_lora(w, H: int, inter: int) -> tuple[int, int]:
    """``(slots, rank)`` of the layers' tables of ``w`` (a :class:`kvfleet.kernels.cpu_decoder.DecoderWeights`;
    hidden size ``H``, MLP width ``inter``), (0, 0) without any.

    Raises:
        ValueError: an unknown part, a table on the MLP of a mixture-of-experts layer, or a table
            whose shape, dtype or columns do not fit (all tables share slots and rank)."""
    tables = [t for layer in w.layers for t in (layer.lora or {}).values()]
    if not tables:
        return 0, 0
    slots, rank = tuple(tables[0].a.shape[:2]) if tables[0].a.dim() == 3 else (0, 0)
    if slots < 1 or rank < 1:
        raise ValueError(f"LoRA tables need at least one slot of rank >= 1, got a {tuple(tables[0].a.shape)}")
    QD, KVD = w.num_heads * w.head_size, w.num_kv_heads * w.head_size
    sizes = {"qkv": (H, QD + 2 * KVD), "o": (QD, H), "gate_up": (H, 2 * inter), "down": (inter, H)}
    for i, layer in enumerate(w.layers):
        for part, table in (layer.lora or {}).items():
            if part not in LORA_MATRIX:
                raise ValueError(f"layer {i}: LoRA part {part!r} is not one of {', '.join(LORA_PARTS)}")
            if layer.moe is not None and LORA_MATRIX[part] in ("gate_up", "down"):
                raise ValueError(f"layer {i}: LoRA on {part!r} of a mixture of experts is not run fused")
            table.check(f"layer {i} {part}", slots, rank, *sizes[LORA_MATRIX[part]])
    return slots, rank


def lora_struct(tables: dict[str, LoRATable]) -> cpu_lib.Lora:
    """A layer's ``kv_lora`` (parts without a table: NULL); the tensors are the caller's to keep alive."""
    lora = cpu_lib.Lora()
    for part, table in tables.items():
        lora.part[LORA_PARTS.index(part)] = cpu_lib.LoraPart(table.a.data_ptr(), table.b.data_ptr(), table.n0,
                                                             table.b.shape[2])
    return lora
