"""How one replica of an InferenceService is split: ``spec.parallelism`` read in one place (pure).

:func:`parallelism` is the one function that reads ``spec.parallelism`` (``tensor``,
``pipeline``, ``nodes``; vLLM's ``tensor_parallel_size``, ``pipeline_parallel_size`` and
``--nnodes``) and today's ``spec.engine.tensorParallelSize``, the one-node case: unset, the
replica is ``engine.tensorParallelSize`` ranks on one node. A replica is ``tensor x pipeline``
ranks over ``nodes`` pods, ``tensor x pipeline / nodes`` ranks (GPUs) in each; ``nodes > 1``
renders a LeaderWorkerSet instead of a Deployment (:mod:`kvfleet.operator.lws`).
:func:`engine_keys` is what the runtime's config file gets from it. A spec that cannot be
split raises :class:`~kvfleet.operator.crd.InvalidSpec` (``ConflictingParallelism``,
``InvalidParallelism``, ``PipelineParallelUnsupported``).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from kvfleet.operator.crd import InvalidSpec


@dataclass(frozen=True)
class Parallelism:
    """One replica's split: ``tensor x pipeline`` ranks over ``nodes`` pods."""

    tensor: int = 1
    pipeline: int = 1
    nodes: int = 1

    @property
    def world(self) -> int:
        """Ranks (processes, GPUs) of one replica."""
        return self.tensor * self.pipeline

    @property
    def ranks_per_node(self) -> int:
        """Ranks in each pod of the replica."""
        return self.world // self.nodes

    @property
    def multi_node(self) -> bool:
        """Whether one replica spans several pods (a LeaderWorkerSet group)."""
        return self.nodes > 1


def _fields(spec: Any) -> tuple[Any, Any, Any, int]:
    """``(tensor, pipeline, nodes, engine.tensorParallelSize)`` of a spec dict, or of the typed
    spec view (snake_case attributes; None for an absent section or field)."""
    if isinstance(spec, Mapping):
        par = dict(spec.get("parallelism") or {})
        engine_tp = (spec.get("engine") or {}).get("tensorParallelSize")
        return par.get("tensor"), par.get("pipeline"), par.get("nodes"), int(engine_tp or 1)
    par = getattr(spec, "parallelism", None)
    engine_tp = getattr(getattr(spec, "engine", None), "tensor_parallel_size", None)
    return (getattr(par, "tensor", None), getattr(par, "pipeline", None), getattr(par, "nodes", None),
            int(engine_tp or 1))


def parallelism(spec: Any) -> Parallelism:
    """``spec.parallelism`` of a spec (a dict, raw or effective, or the typed spec view), with
    ``engine.tensorParallelSize`` as the one-node case.

    Raises:
        InvalidSpec: ``parallelism.tensor`` and ``engine.tensorParallelSize`` (above 1) disagree
            (``ConflictingParallelism``); ``nodes`` does not divide ``tensor x pipeline``
            (``InvalidParallelism``).
    """
    tensor, pipeline, nodes, engine_tp = _fields(spec)
    if tensor is not None and engine_tp > 1 and int(tensor) != engine_tp:
        raise InvalidSpec("ConflictingParallelism",
                          f"parallelism.tensor={tensor} and engine.tensorParallelSize={engine_tp} disagree: "
                          "set parallelism.tensor alone (engine.tensorParallelSize is its one-node form)")
    out = Parallelism(tensor=int(tensor if tensor is not None else engine_tp),
                      pipeline=int(pipeline or 1), nodes=int(nodes or 1))
    if min(out.tensor, out.pipeline, out.nodes) < 1:
        raise InvalidSpec("InvalidParallelism", f"parallelism sizes must be at least 1, got {out}")
    if out.world % out.nodes:
        raise InvalidSpec("InvalidParallelism",
                          f"parallelism.nodes={out.nodes} must divide tensor x pipeline = {out.world} "
                          "(every pod of a replica runs the same number of ranks)")
    return out


def engine_keys(spec: Any, known: Collection[str]) -> dict[str, Any]:
    """The runtime config's ``tensor_parallel_size`` / ``pipeline_parallel_size`` (each only above
    1; ``tensor_parallel_size`` only when the runtime knows it, as before). The node options
    (``--nnodes``, ``--node-rank``, ...) differ per pod and go on the command line
    (:mod:`kvfleet.operator.lws`).

    Raises:
        InvalidSpec: see :func:`parallelism`; ``pipeline > 1`` for a runtime without
            ``pipeline_parallel_size`` (``PipelineParallelUnsupported``).
    """
    par = parallelism(spec)
    out: dict[str, Any] = {}
    if par.tensor > 1 and "tensor_parallel_size" in known:
        out["tensor_parallel_size"] = par.tensor
    if par.pipeline > 1:
        if "pipeline_parallel_size" not in known:
            raise InvalidSpec("PipelineParallelUnsupported",
                              f"parallelism.pipeline={par.pipeline}: this runtime has no pipeline_parallel_size")
        out["pipeline_parallel_size"] = par.pipeline
    return out
