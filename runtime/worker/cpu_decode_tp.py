"""The fused CPU decode path under tensor parallelism (``--tensor-parallel-size N`` on the CPU): each
rank runs the fused C step (:mod:`kvfleet.runtime.worker.cpu_decode`) on its own shard, and the step
sums o's and down's partial outputs over the ranks before each residual add
(:mod:`kvfleet.kernels.cpu_tp`, ``kernels/cpu_tp.h``).

The shards are the ones transformers' tensor-parallel plan loaded (``model.tp_plan``,
:mod:`kvfleet.runtime.worker.executor`): the path reads each sharded parameter's local tensor. It
follows a plan (:func:`unsupported` says why not otherwise) where, for the recipe's modules of
every layer:

- q, k, v (each of them; not a stored ``qkv_proj``) and gate, up are ``colwise``: the rank's output
  rows, its query and KV heads (its KV cache holds those) and its MLP channels;
- o and down are ``rowwise``: the matching input columns, the rank's products partial sums;
- q/k norms, if planned at all, ``replicated_with_grad_allreduce`` (per-head norms: Qwen3, Gemma 3),
  and no other entry names a layer's module; outside the layers only the embedding and the LM
  head may be planned. The path calls the embedding module (its partial lookups summed as
  transformers does); the C step runs the LM head on the rank's vocabulary rows
  (``colwise_gather_output``) and :class:`HeadGather` gathers the logits, so every step stays
  bitwise batch-invariant (a torch head's GEMM is not: its blocking follows the row count).

Llama, Mistral, Qwen2, Qwen3, Gemma, Gemma 3 and Granite plans qualify; GLM and GLM-4 (gate_up
gathered) and the mixture-of-experts families keep transformers' modules with the reason logged
(Phi-3's and OLMo 2's plans, which gather q/k/v, are refused with tensor parallelism at all:
:func:`~kvfleet.runtime.worker.executor.check_tensor_parallel`). A bias of o or down is added once, on rank 0's
matrix (transformers adds it after the reduce). LoRA with tensor parallelism is refused by the
engine's config (``--enable-lora``). Weights stay float32 as loaded (no bf16 storage or bf16
matmuls under tensor parallelism: :mod:`kvfleet.runtime.worker.cpu_plan`).

Every rank builds its path at the same point of start-up; :func:`agree` then keeps it on only if
it is on at every rank (an all-reduce over the group), so every rank steps fused or none does. A
step runs fused on every rank alike: whether it applies depends on the step's plain data, which
every rank shares.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from kvfleet.kernels.cpu_decoder import Linear
from kvfleet.kernels.cpu_tp import AllReduce
from kvfleet.runtime.worker.recipes import Recipe

logger = logging.getLogger(__name__)

COLWISE, ROWWISE = "colwise", "rowwise"
QK_NORM_STYLES = ("replicated_with_grad_allreduce",)
"""Plan styles of a per-head q/k norm the path follows (the norm's weights are whole on every rank)."""
_LAYER_KEY = re.compile(r"^(?:.*\.)?layers\.\*\.(.+)$")


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter: a DTensor's local shard (or whole tensor, replicated), else ``t``."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _expected(recipe: Recipe) -> dict[str, str]:
    fam = recipe.layer
    plan = {f"self_attn.{n}": COLWISE for n in fam.qkv} | {f"self_attn.{fam.o}": ROWWISE}
    return plan | {f"mlp.{n}": COLWISE for n in fam.gate_up} | {f"mlp.{fam.down}": ROWWISE}


def plan_unsupported(tp_plan: dict[str, str] | None, recipe: Recipe, embed: str, head: str) -> str | None:
    """Why the fused path cannot follow ``tp_plan`` (the model's, ``model.tp_plan``) for ``recipe``
    (None: it can). ``embed`` / ``head``: the embedding's and LM head's module names in the plan's
    keys (those may carry any style: the path calls the modules)."""
    if not tp_plan:
        return "the model has no tensor-parallel plan"
    if recipe.layer.moe:
        return f"{recipe.family}'s mixture-of-experts layers under tensor parallelism"
    if len(recipe.layer.qkv) != 3 or len(recipe.layer.gate_up) != 2:
        return f"{recipe.family} stores q|k|v or gate|up as one matrix, whose shards mix heads or channels"
    expected = _expected(recipe)
    planned: dict[str, str] = {}
    for key, style in tp_plan.items():
        m = _LAYER_KEY.match(key)
        if m is None:
            if key not in (embed, head):
                return f"its tensor-parallel plan shards {key} ({style!r}), which the fused step does not follow"
            continue
        name = m.group(1)
        if name.endswith(("q_norm", "k_norm")) and style in QK_NORM_STYLES and name not in expected:
            continue
        planned[name] = style
    for name, style in expected.items():
        if planned.get(name) != style:
            return (f"its tensor-parallel plan has layers.*.{name} {planned.get(name, 'replicated')!r}, "
                    f"the fused step follows {style!r}")
    extra = sorted(set(planned) - set(expected))
    if extra:
        return f"its tensor-parallel plan also shards layers.*.{extra[0]} ({planned[extra[0]]!r})"
    return None


def unsupported(runner: Any, recipe: Recipe) -> str | None:
    """Why ``runner``'s tensor-parallel shard cannot take the fused path (None: it can)."""
    if not dist.is_initialized():
        return "tensor parallelism without an initialised process group"
    if dist.get_world_size() != runner.tp_size:
        return f"{dist.get_world_size()} ranks in the process group, tensor_parallel_size {runner.tp_size}"
    model = runner.model
    names = {id(m): n for n, m in model.named_modules()}
    embed = names.get(id(model.get_input_embeddings()), "")
    head = names.get(id(model.get_output_embeddings()), "")
    return plan_unsupported(getattr(model, "tp_plan", None), recipe, embed, head)


def bias_once(o: Linear | None, down: Linear | None) -> tuple[Linear | None, Linear | None]:
    """o and down of this rank: a row-parallel bias is added once, by rank 0's matrices."""
    return (o, down) if rank() == 0 else tuple(m and replace(m, bias=None) for m in (o, down))


class HeadGather:
    """The LM head's logits of every rank's vocabulary rows, gathered in rank order: rank ``r``
    holds rows ``torch.chunk(range(vocab), world)[r]`` (transformers' ``colwise_gather_output``,
    the last rank's slice the shorter when ``world`` does not divide ``vocab``)."""

    def __init__(self, vocab: int, local_rows: int) -> None:
        world = dist.get_world_size()
        sizes = [len(c) for c in torch.arange(vocab).chunk(world)]
        self.sizes = sizes + [0] * (world - len(sizes))
        if self.sizes[rank()] != local_rows:
            raise ValueError(f"rank {rank()} holds {local_rows} LM head rows, torch.chunk's split gives "
                             f"{self.sizes[rank()]} of {vocab}")
        self.width = max(self.sizes)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """``[L, local rows]`` -> ``[L, vocab]`` (a collective: every rank calls it with the same L)."""
        rows = logits.shape[0]
        if rows == 0:
            return logits.new_empty((0, sum(self.sizes)))
        mine = torch.nn.functional.pad(logits, (0, self.width - logits.shape[1])).contiguous()
        parts = [torch.empty_like(mine) for _ in self.sizes]
        dist.all_gather(parts, mine)
        return torch.cat([p[:, :n] for p, n in zip(parts, self.sizes)], 1)


def head(runner: Any, linear: Callable[[torch.nn.Module], Linear | None]) -> tuple[Linear | None, HeadGather | None]:
    """The LM head the C step runs on this rank and the gather of its logits: the rank's vocabulary
    rows where the plan shards it ``colwise_gather_output`` (or ``colwise_rep``), all of it where the
    plan leaves it whole (no gather); ``(None, None)`` otherwise (the head then runs in torch)."""
    model = runner.model
    module = model.get_output_embeddings()
    names = {id(m): n for n, m in model.named_modules()}
    style = (getattr(model, "tp_plan", None) or {}).get(names.get(id(module), ""))
    m = linear(module) if module is not None else None
    if m is None or style is None:
        return m, None
    if style not in ("colwise_gather_output", "colwise_rep"):
        return None, None
    try:
        return m, HeadGather(int(module.weight.shape[0]), m.shape[0])
    except ValueError as exc:
        logger.info("fused CPU decode: the LM head runs in torch (%s)", exc)
        return None, None


def rank() -> int:
    """This process's rank in the default group."""
    return dist.get_rank()


def all_reduce() -> AllReduce:
    """The C step's all-reduce over the default group (the tensor-parallel ranks)."""
    return AllReduce()


def agree(on: bool) -> bool:
    """Whether every rank's fused path is on (each rank calls this once, with its own ``on``)."""
    flag = torch.tensor([1 if on else 0], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    if on and not flag.item():
        logger.info("fused CPU decode: off (it is off on another tensor-parallel rank)")
    return bool(flag.item())
