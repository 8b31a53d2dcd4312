"""Mode ``hpa`` and the autoscalers kvfleet does not own: pure functions of plain dicts.

- :func:`build_hpa`: the ``autoscaling/v2`` HorizontalPodAutoscaler child of an InferenceService in
  mode ``hpa``, on the Pods metrics :data:`HPA_METRIC` and :data:`HPA_KV_METRIC` (the chart's
  prometheus-adapter rules expose them);
- :func:`scalers_targeting` / :func:`hpas_targeting`: the HPAs and KEDA ScaledObjects of a namespace
  that act on an InferenceService or its Deployment, and :func:`conflict_message`, the condition's
  words when they fight the operator.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from kvfleet.operator import spec_view
from kvfleet.operator.policy import AutoscalingConfig

HPA_METRIC = "kvfleet_num_requests_waiting"
"""Name of the Pods metric (as the prometheus-adapter rule exposes it) the HPA scales on."""
HPA_KV_METRIC = "kvfleet_kv_cache_usage_perc"
"""The second Pods metric: KV cache usage (0-1) per pod, against ``targetKVCacheUsage``."""


def _quantity(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{int(round(x * 1000))}m"


def build_hpa(isvc: Mapping[str, Any], labels: Mapping[str, str] | None = None, *,
              spec: spec_view.Spec | None = None) -> dict[str, Any]:
    """The ``autoscaling/v2`` HorizontalPodAutoscaler for an InferenceService in mode ``hpa``.

    It targets the InferenceService's own scale subresource (``kvfleet.io/v1alpha1``,
    kind ``InferenceService``), with two Pods metrics, the queue depth (:data:`HPA_METRIC`,
    average value ``targetQueueDepth``) and the KV cache usage (:data:`HPA_KV_METRIC`, average
    value ``targetKVCacheUsage``; the HPA takes the larger recommendation), and the spec's
    stabilization windows as ``behavior``. ``minReplicas`` is at least 1: an HPA cannot scale
    to zero without the HPAScaleToZero feature gate. The ownerReference points at the
    InferenceService (its uid when it has one). Raises ValueError on an invalid
    ``spec.autoscaling`` (see :meth:`AutoscalingConfig.from_view`). ``spec``: the view of
    ``isvc``'s spec (default: built here).
    """
    meta = isvc.get("metadata", {})
    cfg = AutoscalingConfig.from_view((spec_view.of(isvc) if spec is None else spec).autoscaling)
    name = meta["name"]
    owner = {
        "apiVersion": "kvfleet.io/v1alpha1",
        "kind": "InferenceService",
        "name": name,
        "controller": True,
        "blockOwnerDeletion": True,
    }
    if meta.get("uid"):
        owner["uid"] = meta["uid"]
    hpa_meta: dict[str, Any] = {"name": name, "ownerReferences": [owner]}
    if meta.get("namespace"):
        hpa_meta["namespace"] = meta["namespace"]
    if labels:
        hpa_meta["labels"] = dict(labels)
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": hpa_meta,
        "spec": {
            "scaleTargetRef": {"apiVersion": "kvfleet.io/v1alpha1", "kind": "InferenceService", "name": name},
            # An HPA cannot go below 1 replica unless the HPAScaleToZero feature gate is on.
            "minReplicas": max(cfg.min_replicas, 1),
            "maxReplicas": cfg.max_replicas,
            "metrics": [{"type": "Pods", "pods": {"metric": {"name": metric},
                                                  "target": {"type": "AverageValue", "averageValue": _quantity(t)}}}
                        for metric, t in ((HPA_METRIC, cfg.target_queue_depth),
                                          (HPA_KV_METRIC, cfg.target_kv_cache_usage))],
            "behavior": {
                "scaleUp": {"stabilizationWindowSeconds": int(cfg.scale_up_window)},
                "scaleDown": {"stabilizationWindowSeconds": int(cfg.scale_down_window)},
            },
        },
    }


def _target(ref: Mapping[str, Any], name: str, deployment: str | None) -> str | None:
    """``"InferenceService"`` / ``"Deployment"`` when a ``scaleTargetRef`` points at the
    InferenceService ``name`` or at its Deployment ``deployment``, else None. (A KEDA
    ScaledObject's ref defaults to ``apps/v1`` ``Deployment``.)"""
    kind = ref.get("kind") or "Deployment"
    api = str(ref.get("apiVersion") or ("apps/v1" if kind == "Deployment" else "kvfleet.io/"))
    if kind == "InferenceService" and ref.get("name") == name and api.startswith("kvfleet.io/"):
        return "InferenceService"
    if deployment and kind == "Deployment" and ref.get("name") == deployment and api.startswith("apps/"):
        return "Deployment"
    return None


def hpas_targeting(hpas: Iterable[Mapping[str, Any]], name: str, *, own: str | None = None) -> list[str]:
    """Names of the HPAs (``autoscaling/v2`` dicts, one namespace) whose scaleTargetRef is
    the InferenceService ``name``; ``own`` (an HPA this operator manages) is left out."""
    found = (label.split(" ", 1)[1] for label, _ in scalers_targeting(hpas, (), name))
    return sorted(n for n in found if n != own)


def scalers_targeting(hpas: Iterable[Mapping[str, Any]], scaled_objects: Iterable[Mapping[str, Any]],
                      name: str, *, deployment: str | None = None) -> list[tuple[str, str]]:
    """The autoscalers of one namespace that act on InferenceService ``name`` or (with
    ``deployment``) on its Deployment directly: ``(f"{Kind} {name}", target kind)`` pairs,
    sorted, for HorizontalPodAutoscalers and KEDA ScaledObjects (``keda.sh/v1alpha1``)."""
    out = []
    for kind, items in (("HorizontalPodAutoscaler", hpas), ("ScaledObject", scaled_objects)):
        for obj in items:
            target = _target((obj.get("spec") or {}).get("scaleTargetRef") or {}, name, deployment)
            if target:
                out.append((f"{kind} {(obj.get('metadata') or {}).get('name')}", target))
    return sorted(out)


def conflict_message(scalers: Iterable[tuple[str, str]], mode: str) -> str:
    """The ``ScalingActive=False`` / ``ConflictingAutoscaler`` message for foreign
    :func:`scalers_targeting` results."""
    scalers = list(scalers)
    names = ", ".join(f"{s} (targets the {t})" for s, t in scalers)
    if any(t == "Deployment" for _, t in scalers):
        return (f"{names}: an autoscaler on the Deployment fights the operator over its replicas, so the "
                "operator stopped writing them; point it at the InferenceService (its scale subresource) "
                "or delete it")
    return (f"{names} also scales this InferenceService; the operator does not scale it while "
            f"autoscaling.mode is {mode} (delete it, or use autoscaling.mode: hpa)")
