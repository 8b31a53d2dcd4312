"""The CRD schema of ``spec.parallelism`` (how one replica is split), a plain dict that
:mod:`kvfleet.operator.crd_schema` puts in the spec; read by :mod:`kvfleet.operator.parallelism`."""

from __future__ import annotations

from typing import Any


def _size(desc: str) -> dict[str, Any]:
    return {"type": "integer", "description": desc, "minimum": 1, "maximum": 64}


PARALLELISM: dict[str, Any] = {
    "type": "object",
    "description": "How one replica is split (vLLM's tensor/pipeline parallel sizes and --nnodes): tensor x "
                   "pipeline ranks over `nodes` pods, tensor x pipeline / nodes in each. nodes > 1 runs every "
                   "replica as a LeaderWorkerSet group (leaderworkerset.x-k8s.io, a prerequisite). Unset: "
                   "engine.tensorParallelSize on one node.",
    "properties": {
        "tensor": _size("Tensor-parallel size; engine.tensorParallelSize (its one-node form) must agree."),
        "pipeline": _size("Pipeline-parallel size: stages the layers are split into."),
        "nodes": _size("Pods one replica spans (a LeaderWorkerSet group's size when above 1)."),
    },
    "x-kubernetes-validations": [{
        "rule": "((has(self.tensor) ? self.tensor : 1) * (has(self.pipeline) ? self.pipeline : 1)) % "
                "(has(self.nodes) ? self.nodes : 1) == 0",
        "message": "nodes must divide tensor x pipeline"}],
}
