"""The Deployment of an InferenceService's runtime pods: a pure function of its dict.

The pod runs ``kvfleet serve --config`` on the ConfigMap's file, with the startup, readiness
and liveness probes sized from the model (:mod:`kvfleet.operator.weights`), a preStop sleep
before the drain, and the model volume of its URI scheme: an ``hf://`` model is fetched by an
init container (``python -m kvfleet.operator.fetch``) into an emptyDir or a claim, a ``pvc://``
one is mounted read-only. The pod template carries the ConfigMap's hash, so a config change
rolls the pods.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from typing import Any

from kvfleet.operator import adapters, fleet_secret, kv_tiers, router, spec_view
from kvfleet.operator.service_spec import (
    ANNOTATION_CONFIG_HASH,
    CACHE_DIR,
    CONFIG_DIR,
    CONFIG_FILE,
    PORT,
    PRESTOP_SECONDS,
    RUNTIME_UID,
    child_meta,
    gpu_count,
    labels,
    names,
    selector_labels,
    shm_size,
    termination_grace_seconds,
)
from kvfleet.operator.spec_enums import RolloutStrategy
from kvfleet.operator.weights import (
    MODELS_DIR,
    model_path_in_pod,
    model_size_bytes,
    parse_model_uri,
    progress_deadline_seconds,
    startup_seconds,
)
from kvfleet.runtime import env as kvenv


def _plain(value: Any) -> Any:
    """A view's tuple back as the list a child carries."""
    return list(value) if isinstance(value, tuple) else value


def _container_security() -> dict[str, Any]:
    return {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "runAsNonRoot": True,
            "capabilities": {"drop": ["ALL"]}}


def _literal_pattern(path: str) -> str:
    """``path`` (a file's path in the repository, maybe in a subfolder) as an fnmatch pattern that
    matches it alone (``snapshot_download``'s allow patterns are fnmatch: ``*``, ``?``, ``[`` bracketed)."""
    return "".join(f"[{c}]" if c in "*?[" else c for c in path)


def _download_container(spec: spec_view.Spec, model: Mapping[str, Any]) -> dict[str, Any]:
    dl = spec.model.download
    env = [{"name": "HF_HOME", "value": f"{CACHE_DIR}/huggingface"}, {"name": "HOME", "value": "/tmp"}]
    token = spec.model.hf_token_secret_ref
    if token:
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": token.name, "key": token.key}}})
    dest = model_path_in_pod({**model, "file": None})
    args = ["-m", "kvfleet.operator.fetch", "--repo", str(model["repo"]), "--dest", dest,
            "--timeout", str(dl.timeout_seconds), "--retries", str(dl.retries)]
    if model["revision"]:
        args += ["--revision", str(model["revision"])]
    for pattern in [_literal_pattern(str(model["file"]))] if model.get("file") else dl.allow_patterns or []:
        args += ["--allow-pattern", str(pattern)]   # a GGUF file: that file alone (config and tokenizer are in it)
    return {
        "name": "fetch-model",
        "image": spec.runtime.image,
        "imagePullPolicy": spec.runtime.image_pull_policy,
        "command": ["python"],
        "args": args,
        "env": env,
        "securityContext": _container_security(),
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "volumeMounts": [{"name": "models", "mountPath": MODELS_DIR},
                         {"name": "cache", "mountPath": CACHE_DIR},
                         {"name": "tmp", "mountPath": "/tmp"}],
    }


def _resources(spec: spec_view.Spec) -> dict[str, Any]:
    """The runtime container's requests and limits (memory and GPUs limited to what is requested)."""
    res = spec.runtime.resources
    gpus = gpu_count(spec)
    requests: dict[str, Any] = {}
    limits: dict[str, Any] = {}
    if res.cpu is not None:
        requests["cpu"] = str(res.cpu)
    if res.memory is not None:
        requests["memory"] = limits["memory"] = str(res.memory)
    if gpus:
        requests["nvidia.com/gpu"] = limits["nvidia.com/gpu"] = str(gpus)
    resources: dict[str, Any] = {}
    if requests:
        resources["requests"] = requests
    if limits:
        resources["limits"] = limits
    return resources


def _runtime_env(isvc: Mapping[str, Any], spec: spec_view.Spec) -> list[dict[str, Any]]:
    """The runtime container's environment: cache paths, offline hub, the API key, LoRA, the user's."""
    env: list[dict[str, Any]] = [
        {"name": "HOME", "value": "/tmp"},
        {"name": kvenv.CACHE_DIR.name, "value": f"{CACHE_DIR}/kvfleet"},
        {"name": "HF_HOME", "value": f"{CACHE_DIR}/huggingface"},
        {"name": "HF_HUB_OFFLINE", "value": "1"},
        {"name": "TRITON_CACHE_DIR", "value": f"{CACHE_DIR}/triton"},
    ]
    rt = spec.runtime
    if rt.api_key_secret_ref:
        env.append({"name": kvenv.SERVE_OPTION.name("api_key"), "valueFrom": {"secretKeyRef": {
            "name": rt.api_key_secret_ref.name, "key": rt.api_key_secret_ref.key}}})
    env.append(fleet_secret.env_entry(isvc))  # peer hints, /kv_blocks, pulls: this service's fleet only
    env += adapters.pod_env(spec, names(isvc)["configmap"])
    env += copy.deepcopy(list(rt.env or []))
    return env


def _storage(isvc: Mapping[str, Any], spec: spec_view.Spec,
             model: Mapping[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """``(runtime mounts, pod volumes, init containers)``: config, caches, /dev/shm, the
    model volume of the URI's scheme (fetched by an init container for ``hf://``) and the KV
    disk tier's volume, if any."""
    mounts = [
        {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
        {"name": "cache", "mountPath": CACHE_DIR},
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "dshm", "mountPath": "/dev/shm"},
    ]
    volumes: list[dict[str, Any]] = [
        {"name": "config", "configMap": {"name": names(isvc)["configmap"]}},
        {"name": "cache", "emptyDir": {}},
        {"name": "tmp", "emptyDir": {}},
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": shm_size(spec)}},
    ]
    init_containers: list[dict[str, Any]] = []
    if model["scheme"] == "hf":
        claim = spec.model.download.claim_name
        if claim:
            volumes.append({"name": "models", "persistentVolumeClaim": {"claimName": claim}})
        else:
            size = model_size_bytes(spec)
            empty: dict[str, Any] = {}
            if size is not None:  # room for the weights plus 10 % (tokenizer, config, temp files)
                empty["sizeLimit"] = f"{int(math.ceil(size * 1.1 / 2**20))}Mi"
            volumes.append({"name": "models", "emptyDir": empty})
        mounts.append({"name": "models", "mountPath": MODELS_DIR, "readOnly": True})
        init_containers.append(_download_container(spec, model))
    elif model["scheme"] == "pvc":
        volumes.append({"name": "models", "persistentVolumeClaim": {"claimName": model["claim"], "readOnly": True}})
        mounts.append({"name": "models", "mountPath": MODELS_DIR, "readOnly": True})
    disk_mounts, disk_volumes = kv_tiers.disk_volume(spec.engine)  # spec.engine.kvCache.tiers
    return mounts + disk_mounts, volumes + disk_volumes, init_containers


def _runtime_container(isvc: Mapping[str, Any], spec: spec_view.Spec, resources: dict[str, Any],
                       mounts: list[dict[str, Any]]) -> dict[str, Any]:
    """The ``runtime`` container: ``kvfleet serve`` on the config file, its probes (the startup
    probe's budget from :func:`~kvfleet.operator.weights.startup_seconds`), the preStop sleep."""
    rt = spec.runtime
    probe_period = 10
    container: dict[str, Any] = {
        "name": "runtime",
        "image": rt.image,
        "imagePullPolicy": rt.image_pull_policy,
        "command": ["kvfleet"],
        "args": ["serve", "--config", f"{CONFIG_DIR}/{CONFIG_FILE}", "--host", "0.0.0.0", "--port", str(PORT)],
        "ports": [{"name": "http", "containerPort": PORT, "protocol": "TCP"},
                  *kv_tiers.events_ports(spec.engine, kv_events=router.precise(spec))],
        "env": _runtime_env(isvc, spec),
        "startupProbe": {"httpGet": {"path": "/ready", "port": "http"}, "periodSeconds": probe_period,
                         "timeoutSeconds": 5,
                         "failureThreshold": max(1, math.ceil(startup_seconds(spec) / probe_period))},
        "readinessProbe": {"httpGet": {"path": "/ready", "port": "http"}, "periodSeconds": 5,
                           "timeoutSeconds": 5, "failureThreshold": 3},
        "livenessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 10,
                          "timeoutSeconds": 5, "failureThreshold": 6},
        "securityContext": _container_security(),
        "volumeMounts": mounts,
        # Endpoints are removed while the pod sleeps; only then does SIGTERM start the drain.
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(PRESTOP_SECONDS)]}}},
        # The runtime writes a fatal reason (OOM) there; else the log tail is the message.
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    if resources:
        container["resources"] = resources
    return container


def _pod_spec(isvc: Mapping[str, Any], spec: spec_view.Spec) -> dict[str, Any]:
    """The pod template's ``spec``: the runtime container, its volumes and init container, the
    pod security context, the grace period and the user's scheduling fields."""
    rt = spec.runtime
    model = parse_model_uri(spec.model.uri)
    resources = _resources(spec)  # before the storage: the GPU check's error comes first, as it always has
    mounts, volumes, init_containers = _storage(isvc, spec, model)
    pod_spec: dict[str, Any] = {
        "securityContext": {"runAsNonRoot": True, "runAsUser": RUNTIME_UID, "runAsGroup": RUNTIME_UID,
                            "fsGroup": RUNTIME_UID, "seccompProfile": {"type": "RuntimeDefault"}},
        "terminationGracePeriodSeconds": termination_grace_seconds(spec),
        "containers": [_runtime_container(isvc, spec, resources, mounts)],
        "volumes": volumes,
    }
    if init_containers:
        pod_spec["initContainers"] = init_containers
    for key in ("node_selector", "tolerations", "affinity", "service_account_name"):
        if getattr(rt, key):
            pod_spec[rt._keys[key]] = copy.deepcopy(_plain(getattr(rt, key)))
    if rt.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": s.name} for s in rt.image_pull_secrets]
    return pod_spec


def build_deployment(isvc: Mapping[str, Any], *, config_hash: str, replicas: int | None = None,
                     scaled_externally: bool = False, spec: spec_view.Spec | None = None) -> dict[str, Any]:
    """The Deployment of runtime pods.

    Args:
        config_hash: :func:`~kvfleet.operator.builders.content_hash` of the ConfigMap data
            (pod-template annotation).
        replicas: override of ``spec.replicas`` (the autoscaler's decision), pods.
        scaled_externally: an autoscaler targets the Deployment itself: leave ``replicas`` out
            (the operator stops writing it, so the two do not fight).
        spec: the reconcile's view of ``isvc``'s spec (default: built here).

    Raises:
        InvalidSpec: see :func:`~kvfleet.operator.service_spec.gpu_count`,
            :func:`~kvfleet.operator.weights.parse_model_uri`.
    """
    spec = spec_view.of(isvc) if spec is None else spec
    pod_spec = _pod_spec(isvc, spec)  # raises first: an invalid spec builds nothing
    pod_annotations = {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(PORT),
        "prometheus.io/path": "/metrics",
        **dict(spec.runtime.pod_annotations or {}),
        ANNOTATION_CONFIG_HASH: config_hash,
    }
    surge, unavailable = (1, 0) if spec.rollout.strategy == RolloutStrategy.AVAILABILITY else (0, 1)
    count = {} if scaled_externally else {"replicas": int(spec.replicas if replicas is None else replicas)}
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": child_meta(isvc, names(isvc)["deployment"]),
        "spec": {
            **count,
            "selector": {"matchLabels": selector_labels(isvc)},
            "strategy": {"type": "RollingUpdate",
                         "rollingUpdate": {"maxSurge": surge, "maxUnavailable": unavailable}},
            "revisionHistoryLimit": 5,
            # Downloading and loading the model are not lack of progress: leave both their budget.
            "progressDeadlineSeconds": progress_deadline_seconds(spec),
            "template": {"metadata": {"labels": labels(isvc), "annotations": pod_annotations},
                         "spec": pod_spec},
        },
    }
