"""LoRA-aware linear layers and the step's LoRA forward context.

:class:`LoRALinear` replaces a decoder ``nn.Linear`` (``q/k/v/o_proj``, ``gate/up/down_proj``
of a Llama-style model) and keeps the original module as ``base_layer``: its output is the base
layer's, plus, when the step has adapter tokens, each token's adapter delta from the layer's
stacked slot tensors ``lora_a [max_loras, max_lora_rank, in_features]`` and ``lora_b
[max_loras, max_lora_rank, out_features]`` (:mod:`kvfleet.kernels.lora`). The base weights are
never merged into, copied or changed (a quantized ``base_layer`` stays quantized).

The per-token slot indices come from :func:`lora_context` (set by the model runner around the
forward pass, like the attention metadata's forward context in
:mod:`kvfleet.runtime.worker.attention`): outside one, or in a step without adapter tokens, a
:class:`LoRALinear` costs one ``threading.local`` lookup.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from kvfleet.kernels.lora import add_lora


@dataclass
class LoRAStepContext:
    """One step's adapter layout.

    Attributes:
        token_slots: ``[T]`` int64 on the model device, the slot of each packed token (-1: base).
        mask: ``[T, k * max_lora_rank]`` in the model dtype (:func:`kvfleet.kernels.lora.slot_mask`,
            ``k`` = highest slot of the step + 1) for the CPU path; None on CUDA (Triton).
    """

    token_slots: torch.Tensor
    mask: torch.Tensor | None


_context = threading.local()


@contextmanager
def lora_context(ctx: LoRAStepContext | None) -> Iterator[LoRAStepContext | None]:
    """Make ``ctx`` the step's adapter layout for :class:`LoRALinear` s in this thread."""
    prev = getattr(_context, "ctx", None)
    _context.ctx = ctx
    try:
        yield ctx
    finally:
        _context.ctx = prev


def get_lora_context() -> LoRAStepContext | None:
    """The layout set by :func:`lora_context`, or None (no adapter tokens: base model only)."""
    return getattr(_context, "ctx", None)


class LoRALinear(torch.nn.Module):
    """A linear layer plus per-token LoRA deltas from stacked slots.

    Args:
        base_layer: the model's ``nn.Linear`` (its weight may be a torchao quantized tensor, or it is an
            ``Int8Linear`` / ``Int4Linear`` of :mod:`kvfleet.runtime.worker.woq_linear`).
        max_loras: slots (adapters one step may use).
        max_rank: slot width (``max_lora_rank``).

    Buffers ``lora_a [max_loras, max_rank, in_features]`` and ``lora_b [max_loras, max_rank,
    out_features]`` start at zero, in the layer's activation dtype, on its device; the manager
    writes adapters into them (:mod:`kvfleet.runtime.worker.lora_manager`).
    """

    def __init__(self, base_layer: torch.nn.Linear, max_loras: int, max_rank: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.in_features = base_layer.in_features
        self.out_features = base_layer.out_features
        device = base_layer.weight.device
        self.register_buffer("lora_a", torch.zeros((max_loras, max_rank, self.in_features), dtype=dtype,
                                                   device=device), persistent=False)
        self.register_buffer("lora_b", torch.zeros((max_loras, max_rank, self.out_features), dtype=dtype,
                                                   device=device), persistent=False)
        # [max_loras * max_rank, in / out] views of the slots (set_slot writes through them).
        self._a_flat = self.lora_a.view(max_loras * max_rank, self.in_features)
        self._b_flat = self.lora_b.view(max_loras * max_rank, self.out_features)

    @property
    def weight(self) -> torch.Tensor:
        """The base layer's weight (code that reads ``q_proj.weight`` keeps working)."""
        return self.base_layer.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.base_layer.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base_layer(x)
        ctx = get_lora_context()
        if ctx is None:
            return y
        if not y.is_contiguous():
            y = y.contiguous()
        # The deltas are added in place into a [T, out] view of the base output.
        x2, y2 = x.reshape(-1, self.in_features), y.view(-1, self.out_features)
        if ctx.mask is None:  # CUDA: the Triton kernels (kvfleet.kernels.lora.add_lora dispatches)
            add_lora(x2, y2, self.lora_a, self.lora_b, ctx.token_slots, None)
            return y
        # CPU: kvfleet.kernels.lora.lora_stacked_torch inlined over the flat views (a step runs this
        # once per adapted layer, so every Python call saved counts on small decode batches).
        kr = ctx.mask.shape[1]
        shrink = torch.mm(x2, self._a_flat[:kr].t())
        shrink.mul_(ctx.mask)
        y2.addmm_(shrink, self._b_flat[:kr])
        return y

    def set_slot(self, slot: int, a: torch.Tensor | None, b: torch.Tensor | None) -> None:
        """Write one adapter's ``A [r, in]`` and (scaled) ``B [out, r]`` into ``slot``, zero-padding
        the rank; None: clear the slot (this adapter does not adapt this layer)."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        if a is None or b is None:
            return
        r = a.shape[0]
        self.lora_a[slot, :r].copy_(a)
        self.lora_b[slot, :r].copy_(b.t())

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, slots={tuple(self.lora_a.shape[:2])}"
