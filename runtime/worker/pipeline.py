"""Pipeline parallelism (vLLM's ``--pipeline-parallel-size``): the decoder's layers split into
``pp`` stages, each stage a group of ``tensor_parallel_size`` ranks.

Contract:

- **Rank layout** (vLLM's): ``world = pp * tp`` ranks, global rank ``r`` is tensor-parallel rank
  ``r % tp`` of stage ``r // tp``; a stage's ranks are contiguous, so ``--nnodes`` cuts the world
  into nodes that hold whole stages when ``nnodes`` divides ``pp`` (see
  :mod:`kvfleet.runtime.worker.multinode`). Rank 0 (stage 0) serves, schedules and samples.
- **Layer split** (:func:`get_pp_indices`, vLLM's): ``num_layers // pp`` layers per stage, the
  remainder one layer each to the stages before the last, from the second-to-last backwards (the
  last stage also runs the final norm and the LM head); ``$KVFLEET_PP_LAYER_PARTITION`` (vLLM's
  ``VLLM_PP_LAYER_PARTITION``: comma-separated layer counts, one per stage, summing to the
  model's layers) overrides it.
- **Loading**: transformers' own pipeline split (``DistributedConfig(pp_size=...)``,
  :func:`distributed_kwargs`) builds the model with every module outside the stage replaced by
  an identity before any weight is read, so a stage holds only its layers' weights (the embedding
  on stage 0, norm and LM head on the last; a tied embedding on both); its layer range is made
  :func:`get_pp_indices`'s, and its naive forward (logits broadcast to every stage) is not used.
- **A step** (:meth:`PipelineStage.execute`, every rank runs the same plain step): stage 0
  embeds and runs its layers; each stage sends its output hidden state ``[T, hidden]`` (the
  activation dtype; transformers' decoder layers add the residual inside, so the hidden state is
  the whole carry) to the same tensor-parallel rank of the next stage, which runs its layers from
  it; the last stage runs the norm and the LM head on the sampling rows and its rank ``(pp-1)*tp``
  sends the float32 logits ``[S, vocab]`` to rank 0, which samples. Point-to-point over the
  default process group (gloo on the CPU; NCCL on CUDA, not yet run on GPUs). Each stage caches only its layers' KV
  (:attr:`ModelRunner.layer_range <kvfleet.runtime.worker.model_runner.ModelRunner>`).
- **Limits**: the torch path only (the fused C decoder embeds, runs every layer and the LM head
  in one call, with no hidden state in or out: a layer slice is a kernel change); no prompt
  logprobs (the last stage's hidden states stay there), no compiled forward. Sends do not wait
  (``isend``) and rank 0 takes a step's logits only when the engine completes it
  (:class:`PendingLogits`), so up to ``pp`` micro-batches are in flight
  (:mod:`kvfleet.runtime.engine.micro_batches`).
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from kvfleet.runtime import env

logger = logging.getLogger(__name__)

PARTITION_ENV = env.PP_LAYER_PARTITION.name
"""vLLM's ``VLLM_PP_LAYER_PARTITION``: the layers of each stage, e.g. ``"3,1"``."""
PROMPT_LOGPROBS_REASON = "prompt logprobs are not supported with pipeline_parallel_size > 1"


def layer_partition(num_layers: int, pp_size: int, override: str | None = None) -> list[int]:
    """The number of layers of each of ``pp_size`` stages (vLLM's ``get_pp_indices`` split).

    Args:
        override: ``$KVFLEET_PP_LAYER_PARTITION``'s value (None: read the variable; empty: none).

    Raises:
        ValueError: naming ``KVFLEET_PP_LAYER_PARTITION`` (not integers, not ``pp_size`` of them,
            a stage without layers, a sum other than ``num_layers``) or ``pipeline_parallel_size``
            (more stages than layers).
    """
    text = env.PP_LAYER_PARTITION.get() if override is None else override
    if text:
        try:
            parts = [int(x) for x in text.split(",")]
        except ValueError:
            raise ValueError(f"{PARTITION_ENV}={text!r}: comma-separated layer counts expected") from None
        if len(parts) != pp_size:
            raise ValueError(f"{PARTITION_ENV}={text!r}: {len(parts)} stages, pipeline_parallel_size is {pp_size}")
        if min(parts) < 1:
            raise ValueError(f"{PARTITION_ENV}={text!r}: every stage needs at least one layer")
        if sum(parts) != num_layers:
            raise ValueError(f"{PARTITION_ENV}={text!r}: {sum(parts)} layers, the model has {num_layers}")
        return parts
    if pp_size > num_layers:
        raise ValueError(f"pipeline_parallel_size ({pp_size}) is more than the model's {num_layers} layers")
    parts = [num_layers // pp_size] * pp_size
    for i in range(2, num_layers % pp_size + 2):  # vLLM: the remainder before the last stage
        parts[-i] += 1
    return parts


def get_pp_indices(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """``[start, end)`` of stage ``pp_rank``'s layers (vLLM's ``get_pp_indices``; see
    :func:`layer_partition`)."""
    parts = layer_partition(num_layers, pp_size)
    start = sum(parts[:pp_rank])
    return start, start + parts[pp_rank]


def _layer_range_for_rank(self, rank: int, num_layers: int) -> tuple[int, int]:
    return get_pp_indices(num_layers, rank, self.pp_size)


def _stage_tp_plan(apply_tp):
    """transformers 5.25 resolves the tensor-parallel plan before its pipeline split replaced the
    other stages' modules by identities; the plan's rules for those are dropped."""
    def apply(model, tp_mesh, tp_plan):
        from transformers.distributed.pipeline_parallel import PipelineIdentityLayer

        modules = {k: m for k, m in model.named_modules() if not isinstance(m, PipelineIdentityLayer)}
        names = set(modules) | {k for k, _ in model.named_parameters() if k.rpartition(".")[0] in modules}
        return apply_tp(model, tp_mesh, {k: v for k, v in tp_plan.items() if k in names})

    apply.kvfleet_stage_plan = True
    return apply


def _patch_transformers() -> None:
    """vLLM's layer split in transformers' pipeline stage, and its TP plan per stage (idempotent)."""
    from transformers.distributed import mixin, pipeline_parallel

    pipeline_parallel.PipelineStage.layer_range_for_rank = _layer_range_for_rank
    if not getattr(mixin.apply_tensor_parallelism, "kvfleet_stage_plan", False):
        mixin.apply_tensor_parallelism = _stage_tp_plan(mixin.apply_tensor_parallelism)


def distributed_kwargs(tensor_parallel_size: int, pp: int) -> dict:
    """``from_pretrained`` keyword arguments of this rank: none on one rank, else
    ``distributed_config`` with transformers' tensor-parallel plan over ``tensor_parallel_size``
    ranks and its pipeline split over ``pp`` stages (layer ranges: :func:`get_pp_indices`).
    torch.distributed must be initialised (the executor) when either is above 1."""
    if tensor_parallel_size == 1 and pp == 1:
        return {}
    from transformers.distributed import DistributedConfig

    if pp > 1:  # transformers' even split -> vLLM's (the loader reads only the stage's weights)
        _patch_transformers()
    tp_plan = "auto" if tensor_parallel_size > 1 else None
    return {"distributed_config": DistributedConfig(tp_plan=tp_plan, tp_size=tensor_parallel_size, pp_size=pp)}


def _decoder_layers(model) -> torch.nn.ModuleList:
    return model.get_decoder().layers


class PipelineStage:
    """This rank's stage of a pipeline-parallel model (see the module docstring).

    Args:
        model: a model loaded with :func:`distributed_kwargs` (transformers' ``_pp_stage`` set).
        tensor_parallel_size: ranks per stage.

    Raises:
        RuntimeError: the model was not loaded split, or transformers' stage disagrees with the
            rank layout.
    """

    def __init__(self, model, tensor_parallel_size: int) -> None:
        hf_stage = getattr(model, "_pp_stage", None)
        if hf_stage is None:
            raise RuntimeError("pipeline parallelism: the model was not loaded with a pipeline split")
        self.tp = tensor_parallel_size
        self.rank = dist.get_rank()
        self.pp_size = dist.get_world_size() // self.tp
        self.pp_rank = self.rank // self.tp
        if hf_stage.pp_rank != self.pp_rank or hf_stage.pp_size != self.pp_size:
            raise RuntimeError(f"pipeline parallelism: rank {self.rank} is stage {self.pp_rank} of {self.pp_size}, "
                               f"transformers' mesh says {hf_stage.pp_rank} of {hf_stage.pp_size}")
        model.__dict__.pop("forward", None)  # transformers' naive forward: the stages talk here instead
        num_layers = model.config.get_text_config().num_hidden_layers
        self.start, self.end = get_pp_indices(num_layers, self.pp_rank, self.pp_size)
        self.is_first, self.is_last = self.pp_rank == 0, self.pp_rank == self.pp_size - 1
        self.model = model
        self.hidden_size = model.config.get_text_config().hidden_size
        self._received: torch.Tensor | None = None
        self._sends: list[tuple[dist.Work, torch.Tensor]] = []
        if not self.is_first:  # the received hidden state replaces the first own layer's input
            _decoder_layers(model)[self.start].register_forward_pre_hook(self._substitute, with_kwargs=True)
        logger.info("pipeline stage %d of %d (rank %d): layers %d..%d", self.pp_rank, self.pp_size, self.rank,
                    self.start, self.end - 1)

    @property
    def layer_range(self) -> range:
        return range(self.start, self.end)

    @property
    def last_stage_rank(self) -> int:
        """The rank that sends the logits to rank 0: tensor-parallel rank 0 of the last stage."""
        return (self.pp_size - 1) * self.tp

    def _substitute(self, _module, args, kwargs):
        hidden = self._received
        self._received = None
        if args:
            return (hidden.view_as(args[0]), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": hidden.view_as(kwargs["hidden_states"])}

    def execute(self, input_ids: torch.Tensor, positions: torch.Tensor, meta_kwargs: dict,
                logits_indices: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        """Run this stage's part of one step (every rank of the world calls it with the same step).

        Returns: on rank 0, the step's :class:`PendingLogits` (``[S, vocab_size]`` float32 from the
        last stage, received when the step completes); elsewhere None."""
        num_tokens = input_ids.shape[1]
        device = input_ids.device
        if self.is_first:
            inputs = {"input_ids": input_ids}
        else:
            dtype = next(_decoder_layers(self.model)[self.start].parameters()).dtype
            hidden = torch.empty((num_tokens, self.hidden_size), dtype=dtype, device=self._comm(device))
            dist.recv(hidden, src=self.rank - self.tp)
            self._received = hidden.to(device)
            inputs = {"inputs_embeds": torch.zeros((1, num_tokens, self.hidden_size), dtype=dtype, device=device)}
        if self.is_last:
            out = self.model(**inputs, position_ids=positions, logits_to_keep=logits_indices, use_cache=False,
                             **meta_kwargs)
            logits = out.logits[0].float()
            if self.rank == self.last_stage_rank and logits.shape[0]:
                self._send(logits, 0)
        else:
            out = self.model.get_decoder()(**inputs, position_ids=positions, use_cache=False, **meta_kwargs)
            self._send(out.last_hidden_state[0], self.rank + self.tp)
        if self.rank != 0:
            return None
        return PendingLogits(self.last_stage_rank, logits_indices.shape[0], vocab_size, device, self._comm(device))

    @staticmethod
    def _comm(device: torch.device) -> torch.device:
        """Where the stages' tensors travel from: the CPU over gloo, the model's device over NCCL."""
        return torch.device("cpu") if dist.get_backend() == "gloo" else device

    def _send(self, tensor: torch.Tensor, dst: int) -> None:
        """Send without waiting (the next micro-batch's step goes on meanwhile); the tensor is kept
        until its send completes."""
        self._sends = [(w, t) for w, t in self._sends if not w.is_completed()]
        tensor = tensor.to(self._comm(tensor.device)).contiguous()
        self._sends.append((dist.isend(tensor, dst=dst), tensor))


class PendingLogits:
    """Rank 0's logits of a step in flight: :meth:`wait` receives them from the last stage
    (in step order: each step's logits are one message)."""

    def __init__(self, src: int, rows: int, vocab_size: int, device: torch.device, comm: torch.device) -> None:
        self.src, self.rows, self.vocab_size, self.device, self.comm = src, rows, vocab_size, device, comm

    def wait(self) -> torch.Tensor:
        logits = torch.empty((self.rows, self.vocab_size), dtype=torch.float32, device=self.comm)
        if self.rows:
            dist.recv(logits, src=self.src)
        return logits.to(self.device)
