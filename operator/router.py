"""The router's children of an InferenceService (``spec.router``): pure builders.

With ``spec.router.enabled`` the operator runs ``kvfleet router`` in front of the runtime pods:
a ServiceAccount, a Role that may only ``get``/``list``/``watch`` EndpointSlices in the
namespace (what the router's watch needs, nothing else), a RoleBinding, the router Deployment
(``kvfleet router --kube-service <runtime Service>``, from the runtime image), its ClusterIP
Service ``<name>-router`` on port 8000 and a PodDisruptionBudget; ``status.url`` then points at
that Service. All are owned by the InferenceService (ownerReferences).

No single router: ``spec.router.replicas`` pods (default 2, spread over nodes where the scheduler
can), a PodDisruptionBudget of ``maxUnavailable: 1`` (a node drain takes one router at a time;
with one replica it still lets the drain proceed), a rolling update that adds a ready router before
taking one away (``maxSurge: 1``, ``maxUnavailable: 0``, readiness on ``/ready``), and a pod
that, after the runtime's preStop sleep (endpoints removed first), drains on SIGTERM
(``--shutdown-timeout``, ``spec.router.shutdownTimeoutSeconds``) within its
``terminationGracePeriodSeconds``. :func:`scale_from_zero_condition` is the
``ScaleFromZero`` status condition that makes ``minReplicas: 0`` without a router an explicit,
visible choice. Routing itself: docs/routing.md.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from kvfleet.operator import disagg, fleet_secret, kv_tiers, service_spec, spec_view
from kvfleet.operator.spec_enums import AutoscalingMode, KVTierType
from kvfleet.runtime import env as kvenv
from kvfleet.runtime.router import routing

COMPONENT = "router"
PORT = 8000
"""The router's container port and Service port (the same as the runtime's: only the host of
the OpenAI base URL changes when the router is turned on)."""
KINDS = ("ServiceAccount", "Role", "RoleBinding", "Deployment", "Service", "PodDisruptionBudget")
"""Every kind of router child, all named :func:`name` (pruned together when the router is turned off)."""
DEFAULT_RESOURCES = {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"memory": "512Mi"}}
TERMINATION_MARGIN = 5
"""Seconds of ``terminationGracePeriodSeconds`` beyond the preStop sleep and the router's
``--shutdown-timeout`` (its listener grace and exit)."""


IMAGE_ENV = kvenv.ROUTER_IMAGE.name
"""The operator's default router image (the chart's ``router.image``); unset: the runtime image."""


def with_default_image(isvc: Mapping[str, Any], image: str | None) -> dict[str, Any]:
    """``isvc`` (a copy) with ``spec.router.image`` set to ``image`` when the router is enabled
    (as by default, ``spec.router`` absent) and sets none."""
    out = copy.deepcopy(dict(isvc))
    if image and (view := spec_view.of(out)).router.enabled and not view.router.image:
        spec = out.setdefault("spec", {})
        spec["router"] = {**(spec.get("router") or {}), "image": image}  # on by default: absent counts
    return out


def enabled(isvc: Mapping[str, Any], spec: spec_view.Spec | None = None) -> bool:
    """``spec.router.enabled`` (on by default)."""
    return bool((spec_view.of(isvc) if spec is None else spec).router.enabled)


def name(isvc: Mapping[str, Any]) -> str:
    """Name of every router child: ``<InferenceService>-router``."""
    return f"{isvc['metadata']['name']}-router"


def selector_labels(isvc: Mapping[str, Any]) -> dict[str, str]:
    return {service_spec.LABEL_NAME: service_spec.APP_NAME, service_spec.LABEL_INSTANCE: isvc["metadata"]["name"],
            service_spec.LABEL_COMPONENT: COMPONENT}


def _meta(isvc: Mapping[str, Any]) -> dict[str, Any]:
    labels = {**service_spec.labels(isvc), service_spec.LABEL_COMPONENT: COMPONENT}
    return {"name": name(isvc), "namespace": isvc["metadata"].get("namespace") or "default",
            "labels": labels, "ownerReferences": [service_spec.owner_reference(isvc)]}


def url(isvc: Mapping[str, Any]) -> str:
    """``http://<name>-router.<ns>.svc.cluster.local:8000/v1``."""
    ns = isvc["metadata"].get("namespace") or "default"
    return f"http://{name(isvc)}.{ns}.svc.cluster.local:{PORT}/v1"


def status_url(isvc: Mapping[str, Any], spec: spec_view.Spec | None = None) -> str:
    """The OpenAI base URL clients should use: the router's when enabled, else the runtime Service's."""
    return url(isvc) if enabled(isvc, spec) else service_spec.service_url(isvc)


def precise(spec: spec_view.Spec) -> bool:
    """The router routes on the replicas' KV events (enabled, an algorithm that reads them:
    ``precise-prefix-cache``): the replicas must publish them (:func:`kv_tiers.engine_keys` with
    ``kv_events``)."""
    return bool(spec.router.enabled) and routing.reads_kv_events(spec.router.algorithm)


def reads_kv_events(spec: spec_view.Spec) -> bool:
    """The router follows the replicas' KV events: precise routing, or the peer tier's hints."""
    return precise(spec) or KVTierType.PEER in kv_tiers.tiers(spec.engine)


def router_env(isvc: Mapping[str, Any], spec: spec_view.Spec) -> list[dict[str, Any]]:
    """The fleet secret (:mod:`~kvfleet.operator.fleet_secret`: the router signs its peer hints
    with it), and ``KVFLEET_ROUTER_API_KEY`` from ``runtime.apiKeySecretRef`` when the router reads
    the replicas' KV events: it sends the key on its own ``/kv_events/snapshot`` reads (which the
    replicas' key guards) and then also checks it on ``/v1``, as the replicas do anyway."""
    env = [fleet_secret.env_entry(isvc)]
    key_ref = spec.runtime.api_key_secret_ref
    if not key_ref or not reads_kv_events(spec):
        return env
    return [*env, {"name": kvenv.ROUTER_OPTION.name("api_key"), "valueFrom": {"secretKeyRef": {
        "name": key_ref.name, "key": key_ref.key}}}]


def router_args(isvc: Mapping[str, Any], spec: spec_view.Spec | None = None) -> list[str]:
    """``kvfleet router`` arguments for the Deployment."""
    spec = spec_view.of(isvc) if spec is None else spec
    r = spec.router
    return ["router", "--host", "0.0.0.0", "--port", str(PORT),
            "--kube-service", service_spec.names(isvc)["service"],
            "--kube-namespace", isvc["metadata"].get("namespace") or "default", "--kube-port", "http",
            "--routing-algorithm", r.algorithm, "--prefix-chars", str(r.prefix_chars),
            "--load-factor", f"{r.load_factor:g}", "--max-pending", str(r.max_pending),
            "--pending-timeout", str(r.pending_timeout_seconds),
            "--shutdown-timeout", str(r.shutdown_timeout_seconds),
            *kv_tiers.router_args(spec.engine, kv_events=precise(spec)), *disagg.router_args(isvc)]


def build_service_account(isvc: Mapping[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(isvc)}


def build_role(isvc: Mapping[str, Any]) -> dict[str, Any]:
    """Least privilege for the router's watch: EndpointSlices, read only, this namespace."""
    return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": _meta(isvc),
            "rules": [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                       "verbs": ["get", "list", "watch"]}]}


def build_role_binding(isvc: Mapping[str, Any]) -> dict[str, Any]:
    meta = _meta(isvc)
    return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": meta,
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": meta["name"]},
            "subjects": [{"kind": "ServiceAccount", "name": meta["name"], "namespace": meta["namespace"]}]}


def termination_grace_seconds(spec: spec_view.Spec) -> int:
    """The router pod's grace: the preStop sleep, the drain (``shutdownTimeoutSeconds``), a margin."""
    return service_spec.PRESTOP_SECONDS + int(spec.router.shutdown_timeout_seconds) + TERMINATION_MARGIN


def build_deployment(isvc: Mapping[str, Any], spec: spec_view.Spec) -> dict[str, Any]:
    """The router Deployment (``spec.router.replicas`` pods; the runtime image unless
    ``spec.router.image``)."""
    r, runtime = spec.router, spec.runtime
    probe = lambda path, period: {"httpGet": {"path": path, "port": "http"}, "periodSeconds": period,
                                  "timeoutSeconds": 2, "failureThreshold": 3}
    container: dict[str, Any] = {
        "name": "router",
        "image": r.image or runtime.image,
        "imagePullPolicy": runtime.image_pull_policy,
        "command": ["kvfleet"],
        "args": router_args(isvc, spec),
        "ports": [{"name": "http", "containerPort": PORT, "protocol": "TCP"}],
        "readinessProbe": probe("/ready", 5),
        "livenessProbe": probe("/health", 10),
        "resources": copy.deepcopy(r.resources or DEFAULT_RESOURCES),
        "env": router_env(isvc, spec),
        # as the runtime's: endpoints are removed while the pod sleeps; only then does SIGTERM start the drain
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(service_spec.PRESTOP_SECONDS)]}}},
        "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                            "runAsNonRoot": True, "capabilities": {"drop": ["ALL"]}},
    }
    pod_spec: dict[str, Any] = {
        "serviceAccountName": name(isvc),
        "automountServiceAccountToken": True,
        "securityContext": {"runAsNonRoot": True, "runAsUser": service_spec.RUNTIME_UID,
                            "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [container],
        "terminationGracePeriodSeconds": termination_grace_seconds(spec),
        "affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{
            "weight": 100, "podAffinityTerm": {"labelSelector": {"matchLabels": selector_labels(isvc)},
                                               "topologyKey": "kubernetes.io/hostname"}}]}},
    }
    if runtime.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": s.name} for s in runtime.image_pull_secrets]
    meta = _meta(isvc)
    pod_labels = {**meta["labels"]}
    return {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta,
        "spec": {
            "replicas": int(r.replicas),
            "selector": {"matchLabels": selector_labels(isvc)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": {"metadata": {"labels": pod_labels,
                                      "annotations": {"prometheus.io/scrape": "true",
                                                      "prometheus.io/port": str(PORT)}},
                         "spec": pod_spec},
        },
    }


def build_service(isvc: Mapping[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Service", "metadata": _meta(isvc),
            "spec": {"type": "ClusterIP", "selector": selector_labels(isvc),
                     "ports": [{"name": "http", "port": PORT, "targetPort": "http", "protocol": "TCP",
                                "appProtocol": "http"}]}}


def build_pdb(isvc: Mapping[str, Any]) -> dict[str, Any]:
    """At most one router pod down through voluntary disruptions (node drains, evictions)."""
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": _meta(isvc),
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(isvc)}}}


def desired_children(isvc: Mapping[str, Any], spec: spec_view.Spec | None = None) -> list[dict[str, Any]]:
    """The router's children in apply order (RBAC first), or ``[]`` when the router is off.

    Raises:
        InvalidSpec: as :func:`service_spec.owner_reference` (no uid).
    """
    spec = spec_view.of(isvc) if spec is None else spec
    if not spec.router.enabled:
        return []
    return [build_service_account(isvc), build_role(isvc), build_role_binding(isvc), build_deployment(isvc, spec),
            build_service(isvc), build_pdb(isvc)]


def scale_from_zero_condition(isvc: Mapping[str, Any],
                              spec: spec_view.Spec | None = None) -> tuple[str, str, str] | None:
    """``(status, reason, message)`` of the ``ScaleFromZero`` condition, for services the
    operator may scale to zero (autoscaling mode ``operator``, ``minReplicas: 0``); None otherwise.

    With the router: True, ``RouterHoldsRequests``. Without: False, ``NoRouter``: at zero replicas
    nothing receives a request, so nothing can wake the service; a documented, visible choice
    (e.g. for batch services scaled up by hand), not a silent trap.
    """
    spec = spec_view.of(isvc) if spec is None else spec
    if spec.autoscaling.mode != AutoscalingMode.OPERATOR or int(spec.autoscaling.min_replicas) != 0:
        return None
    if spec.router.enabled:
        return ("True", "RouterHoldsRequests",
                "at 0 replicas the router holds requests and the autoscaler scales to 1 on them")
    return ("False", "NoRouter",
            "minReplicas is 0 without spec.router.enabled: once at 0 replicas, requests fail and nothing "
            "scales the service up again; enable the router to wake it on requests")
