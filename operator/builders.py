"""Pure builders: an InferenceService dict in, its children (Kubernetes object dicts) out.

No API calls, no clocks, no randomness: the same input gives the same output, so the
children are tested exhaustively without a cluster (``tests/golden/``).
:func:`desired_children` gives every child of InferenceService ``NAME`` (namespace ``NS``),
each with a controller ownerReference to it and the labels of :func:`labels`:

- ConfigMap ``NAME-config``: ``config.yaml``, the runtime's engine config
  (:class:`kvfleet.runtime.config.EngineConfig` field names), and ``lora_modules`` when LoRA
  adapters are declared (:mod:`kvfleet.operator.adapters`; not in the config hash);
- Service ``NAME`` (port 8000, ``http``) and Deployment ``NAME`` (the runtime pods; the pod
  template carries the config hash, so a config change rolls them);
- PodDisruptionBudget ``NAME`` when ``spec.disruption`` sets a field, and
  HorizontalPodAutoscaler ``NAME`` in ``spec.autoscaling.mode: hpa``.

A spec that cannot be built raises :class:`InvalidSpec`. The status is :mod:`kvfleet.operator.status`.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
from collections.abc import Iterable, Mapping
from typing import Any

import yaml

from kvfleet.operator import adapters, crd, crd_schema, hpa
from kvfleet.operator.crd import InvalidSpec
from kvfleet.operator.weights import (
    MODELS_DIR,
    model_path_in_pod,
    model_size_bytes,
    parse_model_uri,
    progress_deadline_seconds,
    startup_seconds,
)

FIELD_MANAGER = "kvfleet-operator"
"""The one server-side-apply field manager of every write the operator makes."""

LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_ISVC = "kvfleet.io/inferenceservice"
APP_NAME = "kvfleet"
COMPONENT = "inference-server"

ANNOTATION_CONFIG_HASH = "kvfleet.io/config-hash"
"""Pod-template annotation: hash of the ConfigMap data; a change rolls the pods."""

PORT = 8000
CONFIG_DIR = "/etc/kvfleet"
CONFIG_FILE = "config.yaml"
CACHE_DIR = "/cache"
RUNTIME_UID = 1000

PRESTOP_SECONDS = 10
"""The runtime container's preStop sleep: time for the endpoint controllers, kube-proxy and
ingresses to stop sending new requests before SIGTERM starts the drain, seconds."""
DEFAULT_SHUTDOWN_TIMEOUT = 30.0
"""``kvfleet serve --shutdown-timeout``'s default, seconds."""
SHUTDOWN_MARGIN_SECONDS = 10
"""Grace after the drain: the server's short listener grace and the engine's exit, seconds."""

# spec.engine (camelCase) -> runtime EngineConfig field (snake_case)
ENGINE_KEYS = {
    "blockSize": "block_size",
    "gpuMemoryUtilization": "gpu_memory_utilization",
    "maxNumSeqs": "max_num_seqs",
    "maxNumBatchedTokens": "max_num_batched_tokens",
    "maxModelLen": "max_model_len",
    "enablePrefixCaching": "enable_prefix_caching",
    "schedulingPolicy": "scheduling_policy",
    "dtype": "dtype",
    "tensorParallelSize": "tensor_parallel_size",
    "quantization": "quantization",
    "enforceEager": "enforce_eager",
}

SERVER_CONFIG_KEYS = ("engine_iteration_timeout", "log_level", "max_queue_len", "max_request_body_size",
                      "metrics_compat", "shutdown_timeout", "termination_log", "tool_call_parser",
                      "enable_auto_tool_choice", "allow_runtime_lora_updating")
"""``kvfleet serve`` server options (``ServerSettings``) that ``engine.extraArgs`` may set in the
config file: all but ``host``, ``port`` (the pod's) and ``api_key`` (``apiKeySecretRef``)."""

TUNABLE_ENGINE_KEYS = ("blockSize", "gpuMemoryUtilization")
"""``status.engine`` keys the tuner (spec.tuning) may set; they override spec.engine."""


# ---------------------------------------------------------------------------------
# spec helpers


def effective_spec(isvc: Mapping[str, Any]) -> dict[str, Any]:
    """``spec`` with every optional section present and the CRD's defaults applied.

    Unlike the API server (which defaults only present objects), absent sections
    (engine, runtime, autoscaling, ...) are created first, so callers never test for them.
    """
    spec = copy.deepcopy(dict(isvc.get("spec") or {}))
    for section in ("model", "runtime", "engine", "autoscaling", "tuning", "rollout", "disruption"):
        spec.setdefault(section, {})
    spec["model"].setdefault("download", {})
    spec["runtime"].setdefault("resources", {})
    spec["autoscaling"].setdefault("scaleUp", {})
    spec["autoscaling"].setdefault("scaleDown", {})
    spec["autoscaling"].setdefault("metrics", {})
    spec["tuning"].setdefault("gpuMemoryUtilization", {})
    spec = crd.apply_defaults(spec, crd_schema.SPEC)
    spec["runtime"].setdefault("image", crd_schema.DEFAULT_IMAGE)
    return spec


def with_default_image(isvc: Mapping[str, Any], image: str | None) -> dict[str, Any]:
    """``isvc`` with ``spec.runtime.image`` set to ``image`` when it sets none (the operator's
    default runtime image); a copy, unchanged when ``image`` is None or an image is set."""
    out = copy.deepcopy(dict(isvc))
    if image and not ((out.get("spec") or {}).get("runtime") or {}).get("image"):
        out.setdefault("spec", {}).setdefault("runtime", {})["image"] = image
    return out


def effective_engine(isvc: Mapping[str, Any]) -> dict[str, Any]:
    """``spec.engine`` (defaulted) overlaid with the tuner's ``status.engine`` values for
    :data:`TUNABLE_ENGINE_KEYS` when ``spec.tuning.enabled`` (camelCase keys)."""
    spec = effective_spec(isvc)
    engine = dict(spec["engine"])
    if spec["tuning"].get("enabled"):
        tuned = (isvc.get("status") or {}).get("engine") or {}
        for key in TUNABLE_ENGINE_KEYS:
            if tuned.get(key) is not None:
                engine[key] = tuned[key]
    return engine


def names(isvc: Mapping[str, Any]) -> dict[str, str]:
    """Names of the children: ``{"deployment", "service", "configmap", "pdb", "hpa"}``."""
    name = isvc["metadata"]["name"]
    return {"deployment": name, "service": name, "configmap": f"{name}-config",
            "pdb": name, "hpa": name}


def selector_labels(isvc: Mapping[str, Any]) -> dict[str, str]:
    """The Deployment's (immutable) pod selector and the Service's selector."""
    return {LABEL_NAME: APP_NAME, LABEL_INSTANCE: isvc["metadata"]["name"], LABEL_COMPONENT: COMPONENT}


def selector_string(isvc: Mapping[str, Any]) -> str:
    """The pod selector as a string (``status.selector``, read by the scale subresource)."""
    return ",".join(f"{k}={v}" for k, v in sorted(selector_labels(isvc).items()))


def labels(isvc: Mapping[str, Any]) -> dict[str, str]:
    """Labels of every child and of the pods."""
    return {**selector_labels(isvc), LABEL_MANAGED_BY: FIELD_MANAGER,
            LABEL_ISVC: isvc["metadata"]["name"]}


def owner_reference(isvc: Mapping[str, Any]) -> dict[str, Any]:
    """The controller ownerReference to the InferenceService (needs ``metadata.uid``).

    Raises:
        InvalidSpec: the object has no uid (it was never stored by an API server).
    """
    meta = isvc["metadata"]
    if not meta.get("uid"):
        raise InvalidSpec("MissingUID", "the InferenceService has no metadata.uid")
    return {"apiVersion": crd.API_VERSION, "kind": crd.KIND, "name": meta["name"],
            "uid": meta["uid"], "controller": True, "blockOwnerDeletion": True}


def service_url(isvc: Mapping[str, Any]) -> str:
    """``http://<svc>.<ns>.svc.cluster.local:8000/v1``: the OpenAI base URL in the cluster."""
    ns = isvc["metadata"].get("namespace") or "default"
    return f"http://{names(isvc)['service']}.{ns}.svc.cluster.local:{PORT}/v1"


def shutdown_timeout_seconds(spec: Mapping[str, Any]) -> float:
    """The runtime's ``shutdown_timeout`` (``engine.extraArgs.shutdown_timeout``, else its
    default :data:`DEFAULT_SHUTDOWN_TIMEOUT`): how long a SIGTERM waits for requests in flight."""
    value = (spec.get("engine", {}).get("extraArgs") or {}).get("shutdown_timeout")
    try:
        return float(DEFAULT_SHUTDOWN_TIMEOUT if value is None else value)
    except (TypeError, ValueError):
        raise InvalidSpec("InvalidEngineArg", f"engine.extraArgs.shutdown_timeout must be seconds, "
                                              f"got {value!r}") from None


def termination_grace_seconds(spec: Mapping[str, Any]) -> int:
    """The pod's ``terminationGracePeriodSeconds``: the preStop sleep, then the runtime's drain
    (``shutdown_timeout``), then :data:`SHUTDOWN_MARGIN_SECONDS` for the listener's grace and
    the engine's exit; the kubelet's SIGKILL never cuts a drain short."""
    return int(PRESTOP_SECONDS + math.ceil(shutdown_timeout_seconds(spec)) + SHUTDOWN_MARGIN_SECONDS)


def gpu_count(spec: Mapping[str, Any]) -> int:
    """``runtime.resources.gpus``, else ``engine.tensorParallelSize`` when above 1, else 0.

    Raises:
        InvalidSpec: fewer GPUs than the tensor-parallel size (reason ``NotEnoughGPUs``).
    """
    tp = int(spec.get("engine", {}).get("tensorParallelSize") or 1)
    gpus = spec.get("runtime", {}).get("resources", {}).get("gpus")
    if gpus is None:
        return tp if tp > 1 else 0
    if tp > 1 and int(gpus) < tp:
        raise InvalidSpec("NotEnoughGPUs",
                          f"runtime.resources.gpus={gpus} is below engine.tensorParallelSize={tp}")
    return int(gpus)


def shm_size(spec: Mapping[str, Any]) -> str:
    """Size limit of the ``/dev/shm`` memory volume: ``runtime.shmSize``, else ``1Gi``, or
    ``4Gi`` per GPU with tensor parallelism (NCCL's shared-memory transport)."""
    override = spec.get("runtime", {}).get("shmSize")
    if override is not None:
        return str(override)
    tp = int(spec.get("engine", {}).get("tensorParallelSize") or 1)
    return "1Gi" if tp <= 1 else f"{4 * tp}Gi"


# ---------------------------------------------------------------------------------
# the engine config (ConfigMap)


def engine_config(isvc: Mapping[str, Any], *, known_keys: Iterable[str] | None = None) -> dict[str, Any]:
    """The runtime's config-file content: EngineConfig field names -> values.

    Only keys the user set (or the CRD defaults) are written; the runtime's own defaults
    cover the rest. ``tensor_parallel_size`` is written only when above 1 and when the
    runtime knows the key.

    Args:
        known_keys: the runtime's accepted keys (default: ``EngineConfig.model_fields`` and
            :data:`SERVER_CONFIG_KEYS`); extraArgs keys outside it raise.

    Raises:
        InvalidSpec: an ``engine.extraArgs`` key the runtime does not know
            (reason ``UnknownEngineArg``), or an extraArgs key that shadows a typed field.
    """
    spec = effective_spec(isvc)
    engine = effective_engine(isvc)
    known = set(_engine_config_fields() if known_keys is None else known_keys)
    model = parse_model_uri(spec["model"]["uri"])
    config: dict[str, Any] = {"model": model_path_in_pod(model)}
    served = spec["model"].get("servedModelName") or (model["repo"] if model["scheme"] == "hf"
                                                      else isvc["metadata"]["name"])
    config["served_model_name"] = served
    config.update(adapters.engine_keys(isvc))  # LoRA adapters: see kvfleet.operator.adapters
    for camel, snake in ENGINE_KEYS.items():
        if engine.get(camel) is None:
            continue
        if snake == "tensor_parallel_size" and (int(engine[camel]) <= 1 or snake not in known):
            continue  # GPUs and /dev/shm still follow it; the runtime may not take the key yet
        config[snake] = engine[camel]
    for key, value in sorted((engine.get("extraArgs") or {}).items()):
        if key in config:
            raise InvalidSpec("ConflictingEngineArg",
                              f"engine.extraArgs.{key} duplicates a typed engine field; set that field instead")
        if key not in known:
            raise InvalidSpec("UnknownEngineArg", f"engine.extraArgs.{key} is not a runtime config key "
                                                  f"(known: {', '.join(sorted(known))})")
        config[key] = value
    for key in list(config):
        if key not in known:
            raise InvalidSpec("UnknownEngineArg", f"the runtime does not accept {key!r}")
    return config


def _engine_config_fields() -> list[str]:
    """Every key ``kvfleet serve --config`` accepts that the operator does not set itself."""
    from kvfleet.runtime.config import EngineConfig  # pydantic only, no torch

    return [*EngineConfig.model_fields, *SERVER_CONFIG_KEYS]


def config_text(config: Mapping[str, Any]) -> str:
    """The config file as YAML (keys sorted, so the hash is stable)."""
    return yaml.safe_dump(dict(config), sort_keys=True, default_flow_style=False)


def content_hash(data: Any) -> str:
    """First 16 hex digits of the SHA-256 of the canonical JSON of ``data``."""
    return hashlib.sha256(json.dumps(data, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


def _meta(isvc: Mapping[str, Any], name: str) -> dict[str, Any]:
    return {"name": name, "namespace": isvc["metadata"].get("namespace") or "default",
            "labels": labels(isvc), "ownerReferences": [owner_reference(isvc)]}


def build_configmap(isvc: Mapping[str, Any]) -> dict[str, Any]:
    """The ConfigMap holding ``config.yaml`` (and, with LoRA adapters declared, their list under
    ``lora_modules``: :mod:`kvfleet.operator.adapters`)."""
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": _meta(isvc, names(isvc)["configmap"]),
            "data": {CONFIG_FILE: config_text(engine_config(isvc)), **adapters.configmap_data(isvc)}}


# ---------------------------------------------------------------------------------
# Deployment


def _container_security() -> dict[str, Any]:
    return {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "runAsNonRoot": True,
            "capabilities": {"drop": ["ALL"]}}


def _download_container(spec: Mapping[str, Any], model: Mapping[str, Any]) -> dict[str, Any]:
    dl = spec["model"]["download"]
    env = [{"name": "HF_HOME", "value": f"{CACHE_DIR}/huggingface"}, {"name": "HOME", "value": "/tmp"}]
    token = spec["model"].get("hfTokenSecretRef")
    if token:
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {
            "name": token["name"], "key": token.get("key") or "token"}}})
    args = ["-m", "kvfleet.operator.fetch", "--repo", str(model["repo"]), "--dest", model_path_in_pod(model),
            "--timeout", str(dl["timeoutSeconds"]), "--retries", str(dl["retries"])]
    if model["revision"]:
        args += ["--revision", str(model["revision"])]
    for pattern in dl.get("allowPatterns") or []:
        args += ["--allow-pattern", str(pattern)]
    return {
        "name": "fetch-model",
        "image": spec["runtime"]["image"],
        "imagePullPolicy": spec["runtime"]["imagePullPolicy"],
        "command": ["python"],
        "args": args,
        "env": env,
        "securityContext": _container_security(),
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "volumeMounts": [{"name": "models", "mountPath": MODELS_DIR},
                         {"name": "cache", "mountPath": CACHE_DIR},
                         {"name": "tmp", "mountPath": "/tmp"}],
    }


def build_deployment(isvc: Mapping[str, Any], *, config_hash: str, replicas: int | None = None,
                     scaled_externally: bool = False) -> dict[str, Any]:
    """The Deployment of runtime pods.

    Args:
        config_hash: :func:`content_hash` of the ConfigMap data (pod-template annotation).
        replicas: override of ``spec.replicas`` (the autoscaler's decision), pods.
        scaled_externally: an autoscaler targets the Deployment itself: leave ``replicas`` out
            (the operator stops writing it, so the two do not fight).

    Raises:
        InvalidSpec: see :func:`gpu_count`, :func:`parse_model_uri`.
    """
    spec = effective_spec(isvc)
    model = parse_model_uri(spec["model"]["uri"])
    rt = spec["runtime"]
    res = rt["resources"]
    gpus = gpu_count(spec)
    startup = startup_seconds(spec)
    probe_period = 10

    requests: dict[str, Any] = {}
    limits: dict[str, Any] = {}
    if res.get("cpu") is not None:
        requests["cpu"] = str(res["cpu"])
    if res.get("memory") is not None:
        requests["memory"] = limits["memory"] = str(res["memory"])
    if gpus:
        requests["nvidia.com/gpu"] = limits["nvidia.com/gpu"] = str(gpus)
    resources: dict[str, Any] = {}
    if requests:
        resources["requests"] = requests
    if limits:
        resources["limits"] = limits

    env: list[dict[str, Any]] = [
        {"name": "HOME", "value": "/tmp"},
        {"name": "KVFLEET_CACHE_DIR", "value": f"{CACHE_DIR}/kvfleet"},
        {"name": "HF_HOME", "value": f"{CACHE_DIR}/huggingface"},
        {"name": "HF_HUB_OFFLINE", "value": "1"},
        {"name": "TRITON_CACHE_DIR", "value": f"{CACHE_DIR}/triton"},
    ]
    key_ref = rt.get("apiKeySecretRef")
    if key_ref:
        env.append({"name": "KVFLEET_API_KEY", "valueFrom": {"secretKeyRef": {
            "name": key_ref["name"], "key": key_ref.get("key") or "api-key"}}})
    env += adapters.pod_env(isvc, names(isvc)["configmap"])
    env += copy.deepcopy(rt.get("env") or [])

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
        claim = spec["model"]["download"].get("claimName")
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

    container: dict[str, Any] = {
        "name": "runtime",
        "image": rt["image"],
        "imagePullPolicy": rt["imagePullPolicy"],
        "command": ["kvfleet"],
        "args": ["serve", "--config", f"{CONFIG_DIR}/{CONFIG_FILE}", "--host", "0.0.0.0", "--port", str(PORT)],
        "ports": [{"name": "http", "containerPort": PORT, "protocol": "TCP"}],
        "env": env,
        "startupProbe": {"httpGet": {"path": "/ready", "port": "http"}, "periodSeconds": probe_period,
                         "timeoutSeconds": 5, "failureThreshold": max(1, math.ceil(startup / probe_period))},
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

    pod_annotations = {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(PORT),
        "prometheus.io/path": "/metrics",
        **dict(rt.get("podAnnotations") or {}),
        ANNOTATION_CONFIG_HASH: config_hash,
    }
    pod_spec: dict[str, Any] = {
        "securityContext": {"runAsNonRoot": True, "runAsUser": RUNTIME_UID, "runAsGroup": RUNTIME_UID,
                            "fsGroup": RUNTIME_UID, "seccompProfile": {"type": "RuntimeDefault"}},
        "terminationGracePeriodSeconds": termination_grace_seconds(spec),
        "containers": [container],
        "volumes": volumes,
    }
    if init_containers:
        pod_spec["initContainers"] = init_containers
    for key in ("nodeSelector", "tolerations", "affinity", "serviceAccountName", "imagePullSecrets"):
        if rt.get(key):
            pod_spec[key] = copy.deepcopy(rt[key])

    strategy = spec["rollout"]["strategy"]
    surge, unavailable = (1, 0) if strategy == "Availability" else (0, 1)
    count = {} if scaled_externally else {"replicas": int(spec["replicas"] if replicas is None else replicas)}
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": _meta(isvc, names(isvc)["deployment"]),
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


def build_service(isvc: Mapping[str, Any]) -> dict[str, Any]:
    """The ClusterIP Service in front of the runtime pods (port 8000, ``http``)."""
    return {"apiVersion": "v1", "kind": "Service", "metadata": _meta(isvc, names(isvc)["service"]),
            "spec": {"type": "ClusterIP", "selector": selector_labels(isvc),
                     "ports": [{"name": "http", "port": PORT, "targetPort": "http", "protocol": "TCP",
                                "appProtocol": "http"}]}}


def build_pdb(isvc: Mapping[str, Any]) -> dict[str, Any] | None:
    """The PodDisruptionBudget, or None when ``spec.disruption`` sets neither field."""
    dis = effective_spec(isvc)["disruption"]
    body: dict[str, Any] = {"selector": {"matchLabels": selector_labels(isvc)}}
    if dis.get("minAvailable") is not None:
        body["minAvailable"] = dis["minAvailable"]
    elif dis.get("maxUnavailable") is not None:
        body["maxUnavailable"] = dis["maxUnavailable"]
    else:
        return None
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": _meta(isvc, names(isvc)["pdb"]), "spec": body}


def build_hpa(isvc: Mapping[str, Any]) -> dict[str, Any] | None:
    """The HorizontalPodAutoscaler (:func:`hpa.build_hpa`'s spec) in mode ``hpa``, else None.

    Raises:
        InvalidSpec: an invalid ``spec.autoscaling`` (reason ``InvalidAutoscaling``).
    """
    spec = effective_spec(isvc)
    if spec["autoscaling"].get("mode") != "hpa":
        return None
    try:
        built = hpa.build_hpa({**isvc, "spec": spec})
    except ValueError as e:
        raise InvalidSpec("InvalidAutoscaling", str(e)) from None
    return {"apiVersion": built["apiVersion"], "kind": built["kind"], "metadata": _meta(isvc, names(isvc)["hpa"]),
            "spec": built["spec"]}


def desired_children(isvc: Mapping[str, Any], *, replicas: int | None = None,
                     scaled_externally: bool = False) -> list[dict[str, Any]]:
    """Every child the InferenceService should have, in apply order: ConfigMap, Service,
    Deployment, then the PodDisruptionBudget and the HorizontalPodAutoscaler when asked.

    Args:
        isvc: the InferenceService as a dict (``metadata.name``, ``metadata.uid`` required).
        replicas: override of ``spec.replicas`` for the Deployment, pods.
        scaled_externally: see :func:`build_deployment`.

    Raises:
        InvalidSpec: the spec cannot be built (reason and message for a Degraded condition).
    """
    cm = build_configmap(isvc)
    config_hash = content_hash(adapters.hashed_data(cm["data"]))  # the LoRA adapter list never rolls pods
    children = [cm, build_service(isvc), build_deployment(isvc, config_hash=config_hash,
                                                          replicas=replicas, scaled_externally=scaled_externally)]
    children += [c for c in (build_pdb(isvc), build_hpa(isvc)) if c is not None]
    return children


def model_claim(isvc: Mapping[str, Any]) -> str | None:
    """The PersistentVolumeClaim the model volume mounts (``download.claimName`` of an
    ``hf://`` model, the claim of a ``pvc://`` one), or None."""
    try:
        spec = effective_spec(isvc)
        model = parse_model_uri(spec["model"]["uri"])
    except (InvalidSpec, KeyError, TypeError):
        return None
    if model["scheme"] == "pvc":
        return model["claim"]
    return spec["model"]["download"].get("claimName") if model["scheme"] == "hf" else None
