"""Mixture-of-experts layers on the CPU: transformers' fused expert tensors as one linear layer
per expert, and the fused decoder's :class:`~kvfleet.kernels.cpu_decoder.MoeLayer` built from a
model's MoE block.

transformers (5.x) stores a layer's experts as two 3-D parameters, ``gate_up_proj [E, 2 I, H]``
(each expert's gate rows, then its up rows) and ``down_proj [E, H, I]`` (``MixtralExperts``,
``Qwen3MoeExperts``), which kvfleet's quantized and bf16 formats cannot hold. Where the experts must
change format -- ``--quantization int8/int4`` on kvfleet's CPU kernels
(:func:`~kvfleet.runtime.worker.quantization.quantize_model`) and bf16 storage
(:func:`~kvfleet.runtime.worker.woq_linear.to_bf16_weights`) -- :func:`split_experts` first replaces
each such module by a :class:`LinearExperts`: the same computation over ``E`` ``nn.Linear`` pairs
whose weights are views of the 3-D parameters (nothing is copied), which those conversions then
treat exactly as the dense layers; the fused decoder reads them through ``cpu_decode._linear``. A
float32 model keeps transformers' module (its own experts implementation on the torch path), and the
fused decoder reads its 3-D float32 parameters as per-expert views. The router (``gate.weight
[E, H]``, a parameter, not a linear) stays float32 either way.

:func:`moe_layer` reads a layer's MoE block (``mlp`` with ``gate`` and ``experts``) into a
``MoeLayer``: the router's softmax / top-k / renormalisation as the config says (Mixtral: always
renormalised; Qwen3-MoE: ``norm_topk_prob``), see :data:`kvfleet.kernels.cpu_decoder.MOE_SCORINGS`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from kvfleet.kernels.cpu_decoder import Linear, MoeLayer

logger = logging.getLogger(__name__)

_ROUTERS = {"MixtralTopKRouter": "mixtral", "Qwen3MoeTopKRouter": "qwen3_moe"}
"""Router classes whose routing :func:`moe_layer` knows (softmax over all experts, top-k, then
renormalised always (Mixtral) or if ``norm_topk_prob`` (Qwen3-MoE))."""


class LinearExperts(torch.nn.Module):
    """A layer's experts as ``E`` ``nn.Linear`` pairs: ``gate_up[e]`` ``[2 I, H]`` (gate rows, then
    up rows) and ``down[e]`` ``[H, I]``; :meth:`forward` is transformers' eager experts loop
    (``MixtralExperts.forward``): each expert with tokens runs once over its tokens, their outputs
    weighted and added in ascending expert id."""

    def __init__(self, gate_up: list[torch.nn.Linear], down: list[torch.nn.Linear], act: Callable) -> None:
        super().__init__()
        self.num_experts = len(gate_up)
        self.gate_up = torch.nn.ModuleList(gate_up)
        self.down = torch.nn.ModuleList(down)
        self.act_fn = act

    @classmethod
    def from_fused(cls, experts: torch.nn.Module) -> LinearExperts:
        """From a transformers experts module with ``gate_up_proj [E, 2 I, H]`` and ``down_proj
        [E, H, I]``; the linears' weights are views of those parameters."""
        def linear(w: torch.Tensor) -> torch.nn.Linear:
            lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta")
            lin.weight = torch.nn.Parameter(w, requires_grad=False)
            return lin

        gu, down = experts.gate_up_proj.detach(), experts.down_proj.detach()
        return cls([linear(gu[e]) for e in range(gu.shape[0])], [linear(down[e]) for e in range(down.shape[0])],
                   experts.act_fn)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
                ) -> torch.Tensor:
        final = torch.zeros_like(hidden_states)
        with torch.no_grad():
            mask = torch.nn.functional.one_hot(top_k_index, num_classes=self.num_experts).permute(2, 1, 0)
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for e in hit[:, 0].tolist():
            top_k_pos, token_idx = torch.where(mask[e])
            gate, up = self.gate_up[e](hidden_states[token_idx]).chunk(2, dim=-1)
            out = self.down[e](self.act_fn(gate) * up) * top_k_weights[token_idx, top_k_pos, None]
            final.index_add_(0, token_idx, out.to(final.dtype))
        return final


def _fused_experts(module: torch.nn.Module) -> bool:
    """Whether ``module`` holds transformers' fused 3-D experts in the layout :class:`LinearExperts`
    takes (gate then up rows, not transposed, no biases)."""
    gu, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return (isinstance(gu, torch.nn.Parameter) and isinstance(down, torch.nn.Parameter) and gu.dim() == 3
            and down.dim() == 3 and gu.shape[0] == down.shape[0] and gu.shape[1] == 2 * down.shape[2]
            and gu.shape[2] == down.shape[1] and getattr(module, "is_concatenated", True)
            and not getattr(module, "is_transposed", False) and not getattr(module, "has_bias", False)
            and hasattr(module, "act_fn"))


def split_experts(model: torch.nn.Module) -> int:
    """Replace each fused experts module of ``model`` by a :class:`LinearExperts` over views of its
    weights (logged); returns how many it replaced."""
    names = [name for name, module in model.named_modules() if _fused_experts(module)]
    for name in names:
        parent, _, child = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        setattr(owner, child, LinearExperts.from_fused(getattr(owner, child)))
    if names:
        logger.info("mixture of experts: %d layers' experts as one linear layer each (views, no copy)", len(names))
    return len(names)


def is_moe_block(mlp: torch.nn.Module) -> bool:
    """Whether a decoder layer's ``mlp`` is a mixture of experts (a router ``gate`` and ``experts``)."""
    return hasattr(mlp, "experts") and hasattr(mlp, "gate")


def moe_layer(mlp: torch.nn.Module, to_linear: Callable[[torch.nn.Module], Linear | None]) -> MoeLayer | str:
    """The fused decoder's :class:`MoeLayer` for a MoE block, or why it cannot have one.
    ``to_linear``: a module's weights in a format the C step reads (``cpu_decode._linear``)."""
    gate, experts = mlp.gate, mlp.experts
    family = _ROUTERS.get(type(gate).__name__)
    if family is None:
        return f"its router {type(gate).__name__} is not one the fused path knows ({', '.join(_ROUTERS)})"
    if getattr(mlp, "jitter_noise", 0) and mlp.training:
        return "router jitter is on (training)"
    router = gate.weight.detach()
    if router.dtype != torch.float32 or router.dim() != 2 or not router.is_contiguous():
        return f"its router weight is {router.dtype} {tuple(router.shape)}, not a contiguous float32 matrix"
    if isinstance(experts, LinearExperts):
        gate_up, down = [to_linear(m) for m in experts.gate_up], [to_linear(m) for m in experts.down]
        if any(m is None for m in (*gate_up, *down)):
            return "its experts' linear layers are not float32, kvfleet bf16, int8 or int4"
    elif _fused_experts(experts) and experts.gate_up_proj.dtype == torch.float32:
        gu, dn = experts.gate_up_proj.detach(), experts.down_proj.detach()
        gate_up = [Linear("fp32", gu[e]) for e in range(gu.shape[0])]
        down = [Linear("fp32", dn[e]) for e in range(dn.shape[0])]
    else:
        return f"its experts ({type(experts).__name__}) are in a layout the fused path does not read"
    if getattr(experts, "act_fn", None) is None or type(experts.act_fn).__name__ != "SiLUActivation":
        return f"its experts' activation is {type(getattr(experts, 'act_fn', None)).__name__}, not SiLU"
    norm = True if family == "mixtral" else bool(getattr(gate, "norm_topk_prob", False))
    return MoeLayer(Linear("fp32", router), gate_up, down, int(gate.top_k), norm, "softmax")
