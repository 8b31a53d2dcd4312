"""A multi-node replica as a LeaderWorkerSet (``leaderworkerset.x-k8s.io/v1``): pure builders.

With ``spec.parallelism.nodes > 1`` (:func:`kvfleet.operator.parallelism.parallelism`, the one
reader of the spec's split) every replica is a group of ``nodes`` pods, and the InferenceService's
runtime child is :func:`build_leader_worker_set` instead of the Deployment:

- ``size = nodes``, ``restartPolicy: RecreateGroupOnPodRestart`` (one pod's restart recreates
  the group: a lost rank fails the whole replica), ``startupPolicy: LeaderCreated``;
- the leader template is the Deployment's pod template (probes, preStop, ports, the config
  hash) running ``kvfleet serve ... --nnodes N --node-rank 0 --master-addr $(LWS_LEADER_ADDRESS)
  --master-port 29500``: it serves HTTP, schedules and samples;
- the worker template runs ``kvfleet serve --config FILE --headless --nnodes N --node-rank
  $(LWS_WORKER_INDEX) --master-addr $(LWS_LEADER_ADDRESS) --master-port 29500``, with no HTTP
  port, probes, preStop or scrape annotations (vLLM's multi-node launch without Ray; the LWS
  controller sets the ``LWS_*`` variables in every container);
- both templates carry :data:`ANNOTATION_TEMPLATE_HASH` (the hash of the group template), so
  a pod says which template it runs; ``replicas`` is the group count (left out when an HPA
  scales the LWS through its ``/scale`` subresource: :func:`hpa_target`).

The Service and the router target leaders only (:func:`leaders_only`, :func:`pod_selector`).
The group conditions are :mod:`kvfleet.operator.lws_status`. Without the LWS API in the cluster
:func:`require_api` raises ``LeaderWorkerSetMissing`` (the chart's prerequisites).
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Mapping
from typing import Any

from kvfleet.operator import spec_view
from kvfleet.operator.crd import InvalidSpec
from kvfleet.operator.deployment import build_deployment
from kvfleet.operator.parallelism import Parallelism, parallelism
from kvfleet.operator.service_spec import CONFIG_DIR, CONFIG_FILE, child_meta, names, selector_labels
from kvfleet.operator.spec_enums import AutoscalingMode

GROUP = "leaderworkerset.x-k8s.io"
API_VERSION = f"{GROUP}/v1"
KIND = "LeaderWorkerSet"
PLURAL = "leaderworkersets"
LABEL_NAME = "leaderworkerset.sigs.k8s.io/name"
LABEL_GROUP_INDEX = "leaderworkerset.sigs.k8s.io/group-index"
LABEL_WORKER_INDEX = "leaderworkerset.sigs.k8s.io/worker-index"
"""Set by the LWS controller on every pod: ``"0"`` on a group's leader."""
ANNOTATION_TEMPLATE_HASH = "kvfleet.io/template-hash"
"""Pod-template annotation: the hash of the group's templates (which template a pod runs)."""
MASTER_PORT = 29500
"""The leader's rendezvous port (``--master-port``; torch.distributed's customary one)."""
LWS_ENV = ("LWS_LEADER_ADDRESS", "LWS_GROUP_SIZE", "LWS_WORKER_INDEX", "LWS_NAME")
"""The variables the LWS controller gives every container (the flags read two of them)."""


def split(isvc: Mapping[str, Any]) -> Parallelism:
    """The replica's split (:func:`~kvfleet.operator.parallelism.parallelism` of the spec's view).

    Raises:
        InvalidSpec: see :func:`~kvfleet.operator.parallelism.parallelism`."""
    return parallelism(spec_view.of(isvc))


def enabled(isvc: Mapping[str, Any]) -> bool:
    """Whether the InferenceService runs as a LeaderWorkerSet (``nodes > 1``); False for a spec
    that cannot be split (the reconcile reports that one)."""
    try:
        return split(isvc).multi_node
    except (InvalidSpec, TypeError, ValueError):
        return False


def node_args(nodes: int, rank: str) -> list[str]:
    """``--nnodes N --node-rank RANK --master-addr $(LWS_LEADER_ADDRESS) --master-port 29500``."""
    return ["--nnodes", str(nodes), "--node-rank", rank, "--master-addr", "$(LWS_LEADER_ADDRESS)",
            "--master-port", str(MASTER_PORT)]


def _leader_template(template: Mapping[str, Any], nodes: int) -> dict[str, Any]:
    leader = copy.deepcopy(dict(template))
    container = leader["spec"]["containers"][0]
    container["args"] = [*container["args"], *node_args(nodes, "0")]
    container["ports"] = [*container.get("ports", []), {"name": "dist", "containerPort": MASTER_PORT,
                                                        "protocol": "TCP"}]
    return leader


def _worker_template(template: Mapping[str, Any], nodes: int) -> dict[str, Any]:
    worker = copy.deepcopy(dict(template))
    container = worker["spec"]["containers"][0]
    container["args"] = ["serve", "--config", f"{CONFIG_DIR}/{CONFIG_FILE}", "--headless",
                         *node_args(nodes, "$(LWS_WORKER_INDEX)")]
    for key in ("ports", "startupProbe", "readinessProbe", "livenessProbe", "lifecycle"):
        container.pop(key, None)  # no HTTP server on a worker: nothing to probe, scrape or drain
    annotations = worker["metadata"].get("annotations") or {}
    worker["metadata"]["annotations"] = {k: v for k, v in annotations.items() if not k.startswith("prometheus.io/")}
    return worker


def build_leader_worker_set(isvc: Mapping[str, Any], *, config_hash: str, replicas: int | None = None,
                            scaled_externally: bool = False, spec: spec_view.Spec | None = None) -> dict[str, Any]:
    """The LeaderWorkerSet of the InferenceService's groups (see the module docstring).

    Args:
        config_hash: the ConfigMap's hash (the templates' annotation, as the Deployment's).
        replicas: override of ``spec.replicas`` (groups).
        scaled_externally: an autoscaler scales the LWS itself (mode ``hpa``, or a foreign one):
            ``replicas`` left out.
        spec: the reconcile's view of ``isvc``'s spec (default: built here).

    Raises:
        InvalidSpec: see :func:`split` and :func:`~kvfleet.operator.deployment.build_deployment`.
    """
    spec = spec_view.of(isvc) if spec is None else spec
    par = parallelism(spec)
    deployment = build_deployment(isvc, config_hash=config_hash, replicas=replicas, scaled_externally=True, spec=spec)
    template = deployment["spec"]["template"]
    group = {"size": par.nodes, "restartPolicy": "RecreateGroupOnPodRestart",
             "leaderTemplate": _leader_template(template, par.nodes),
             "workerTemplate": _worker_template(template, par.nodes)}
    digest = hashlib.sha256(json.dumps(group, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]
    for key in ("leaderTemplate", "workerTemplate"):
        group[key]["metadata"].setdefault("annotations", {})[ANNOTATION_TEMPLATE_HASH] = digest
    rolling = deployment["spec"]["strategy"]["rollingUpdate"]
    hpa_scaled = scaled_externally or spec.autoscaling.mode == AutoscalingMode.HPA
    count = {} if hpa_scaled else {"replicas": int(spec.replicas if replicas is None else replicas)}
    return {
        "apiVersion": API_VERSION, "kind": KIND,
        "metadata": child_meta(isvc, names(isvc)["deployment"]),
        "spec": {
            **count,
            "startupPolicy": "LeaderCreated",
            "rolloutStrategy": {"type": "RollingUpdate", "rollingUpdateConfiguration": {
                "maxSurge": rolling["maxSurge"], "maxUnavailable": rolling["maxUnavailable"]}},
            "leaderWorkerTemplate": group,
        },
    }


def template_hash(lws: Mapping[str, Any] | None) -> str | None:
    """The :data:`ANNOTATION_TEMPLATE_HASH` of an LWS's leader template (None without one)."""
    tmpl = (((lws or {}).get("spec") or {}).get("leaderWorkerTemplate") or {}).get("leaderTemplate") or {}
    return ((tmpl.get("metadata") or {}).get("annotations") or {}).get(ANNOTATION_TEMPLATE_HASH)


def pod_selector(isvc: Mapping[str, Any]) -> dict[str, str]:
    """The pods that serve HTTP: the runtime pods, only the groups' leaders with ``nodes > 1``."""
    out = selector_labels(isvc)
    return {**out, LABEL_WORKER_INDEX: "0"} if enabled(isvc) else out


def leaders_only(child: Mapping[str, Any]) -> dict[str, Any]:
    """The runtime Service or the InferencePool (a copy) selecting only the leaders: the router,
    a gateway and clients reach the one pod of each group that serves HTTP."""
    out = copy.deepcopy(dict(child))
    selector = out["spec"]["selector"]
    labels = selector["matchLabels"] if "matchLabels" in selector else selector  # InferencePool | Service
    labels[LABEL_WORKER_INDEX] = "0"
    return out


def hpa_target(hpa: Mapping[str, Any]) -> dict[str, Any]:
    """The HPA child (a copy) scaling the LWS through its ``/scale`` subresource (whose selector,
    ``status.hpaPodSelector``, picks the leaders, the pods with metrics) instead of the
    InferenceService."""
    out = copy.deepcopy(dict(hpa))
    out["spec"]["scaleTargetRef"] = {"apiVersion": API_VERSION, "kind": KIND, "name": hpa["metadata"]["name"]}
    return out


def require_api(kube: Any) -> None:
    """Raise ``LeaderWorkerSetMissing`` when the cluster does not serve the LWS API.

    Raises:
        InvalidSpec: no ``leaderworkerset.x-k8s.io/v1`` ``leaderworkersets`` in the cluster.
        kube.ApiError: the discovery call failed otherwise."""
    if not kube.served(API_VERSION, PLURAL):
        raise InvalidSpec("LeaderWorkerSetMissing",
                          f"parallelism.nodes > 1 runs each replica as a LeaderWorkerSet, but this cluster has no "
                          f"{PLURAL}.{GROUP} API: install LeaderWorkerSet (https://lws.sigs.k8s.io, see the "
                          "chart's prerequisites), or set parallelism.nodes to 1")


def scale(kube: Any, isvc: Mapping[str, Any], replicas: int) -> dict[str, Any] | None:
    """Scale the LWS of a multi-node InferenceService through its ``/scale`` subresource (the
    Scale); None (nothing written) for a one-node one."""
    if not enabled(isvc):
        return None
    meta = isvc["metadata"]
    return kube.scale(KIND, meta.get("namespace") or "default", names(isvc)["deployment"], replicas)


def stale_runtime(isvc: Mapping[str, Any]) -> tuple[str, str]:
    """``(kind, name)`` of the runtime child the current split no longer wants: the Deployment
    with ``nodes > 1``, the LWS otherwise (pruned when the InferenceService owns it)."""
    return ("Deployment" if enabled(isvc) else KIND), names(isvc)["deployment"]
