"""The Gateway API Inference Extension's ``InferencePool`` over the runtime pods (pure builder).

GIE (kubernetes-sigs/gateway-api-inference-extension, API group
``inference.networking.k8s.io``, version ``v1``, checked against release v1.6.0) lets a Gateway
route to model-server pods through an endpoint picker (EPP) that reads each pod's
``vllm:`` metrics. With ``spec.router.inferencePool.enabled`` the operator emits an
``InferencePool`` that selects the runtime pods (their selector labels) on port 8000, optionally
naming the cluster's endpoint picker Service (``endpointPickerRef``); the runtime then also exports
the vLLM metric names (``metrics_compat: vllm``, put into ``engine.extraArgs`` by :func:`with_pool_metrics`)
that the GIE model-server protocol reads (``vllm:num_requests_waiting``,
``vllm:kv_cache_usage_perc``). tests/data/golden/ holds the published CRD the object is validated against.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from kvfleet.operator import service_spec, spec_view

GROUP = "inference.networking.k8s.io"
VERSION = "v1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "InferencePool"


def enabled(isvc: Mapping[str, Any], view: spec_view.Spec | None = None) -> bool:
    """``spec.router.inferencePool.enabled``."""
    return bool((spec_view.of(isvc) if view is None else view).router.inference_pool.enabled)


def build_inference_pool(isvc: Mapping[str, Any], view: spec_view.Spec | None = None) -> dict[str, Any] | None:
    """The ``InferencePool`` named like the InferenceService, or None when not enabled."""
    view = spec_view.of(isvc) if view is None else view
    if not enabled(isvc, view):
        return None
    spec: dict[str, Any] = {"selector": {"matchLabels": service_spec.selector_labels(isvc)},
                            "targetPorts": [{"number": service_spec.PORT}]}
    epp = view.router.inference_pool.endpoint_picker_ref
    if epp:
        ref: dict[str, Any] = {"name": epp.name, "port": {"number": int(epp.port)}}
        if epp.failure_mode:
            ref["failureMode"] = epp.failure_mode
        spec["endpointPickerRef"] = ref
    meta = {"name": isvc["metadata"]["name"], "namespace": isvc["metadata"].get("namespace") or "default",
            "labels": service_spec.labels(isvc), "ownerReferences": [service_spec.owner_reference(isvc)]}
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": meta, "spec": spec}


def with_pool_metrics(isvc: Mapping[str, Any]) -> dict[str, Any]:
    """``isvc`` (a copy) whose runtime also exports the ``vllm:`` names when the pool is enabled
    (``engine.extraArgs.metrics_compat: vllm``, unless the user set ``metrics_compat``)."""
    out = copy.deepcopy(dict(isvc))
    if enabled(out):
        extra = out.setdefault("spec", {}).setdefault("engine", {}).setdefault("extraArgs", {})
        extra.setdefault("metrics_compat", "vllm")
    return out
