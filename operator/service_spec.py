"""What every child of an InferenceService is built from: pure functions of its dict.

- the identity of its children: :func:`names`, :func:`labels`, :func:`selector_labels`,
  :func:`owner_reference`, :func:`child_meta`, :data:`FIELD_MANAGER`;
- the runtime pod's contract: :data:`PORT`, the config and cache paths, the user id, the
  shutdown timings (:func:`termination_grace_seconds`), :func:`gpu_count`, :func:`shm_size`.

The spec itself reaches the builders as :mod:`kvfleet.operator.spec_view`'s typed view. The
children themselves are built in :mod:`kvfleet.operator.builders` and
:mod:`kvfleet.operator.deployment`.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from typing import Any

from kvfleet.operator import crd, spec_view
from kvfleet.operator.crd import InvalidSpec
from kvfleet.operator.parallelism import parallelism

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


def with_default_image(isvc: Mapping[str, Any], image: str | None) -> dict[str, Any]:
    """``isvc`` with ``spec.runtime.image`` set to ``image`` when it sets none (the operator's
    default runtime image); a copy, unchanged when ``image`` is None or an image is set."""
    out = copy.deepcopy(dict(isvc))
    if image and not ((out.get("spec") or {}).get("runtime") or {}).get("image"):
        out.setdefault("spec", {}).setdefault("runtime", {})["image"] = image
    return out


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


def shutdown_timeout_seconds(spec: spec_view.Spec) -> float:
    """The runtime's ``shutdown_timeout`` (``engine.extraArgs.shutdown_timeout``, else its
    default :data:`DEFAULT_SHUTDOWN_TIMEOUT`): how long a SIGTERM waits for requests in flight."""
    value = (spec.engine.extra_args or {}).get("shutdown_timeout")
    try:
        return float(DEFAULT_SHUTDOWN_TIMEOUT if value is None else value)
    except (TypeError, ValueError):
        raise InvalidSpec("InvalidEngineArg", f"engine.extraArgs.shutdown_timeout must be seconds, "
                                              f"got {value!r}") from None


def termination_grace_seconds(spec: spec_view.Spec) -> int:
    """The pod's ``terminationGracePeriodSeconds``: the preStop sleep, then the runtime's drain
    (``shutdown_timeout``), then :data:`SHUTDOWN_MARGIN_SECONDS` for the listener's grace and
    the engine's exit; the kubelet's SIGKILL never cuts a drain short."""
    return int(PRESTOP_SECONDS + math.ceil(shutdown_timeout_seconds(spec)) + SHUTDOWN_MARGIN_SECONDS)


def gpu_count(spec: spec_view.Spec) -> int:
    """GPUs of one runtime pod: ``runtime.resources.gpus``, else the ranks each pod runs when a
    replica has several (:func:`~kvfleet.operator.parallelism.parallelism`: ``tensor x pipeline /
    nodes``; ``engine.tensorParallelSize`` on one node), else 0.

    Raises:
        InvalidSpec: fewer GPUs than the pod's ranks (reason ``NotEnoughGPUs``), or a
            parallelism that cannot be split.
    """
    par = parallelism(spec)
    tp = par.ranks_per_node if par.world > 1 else 0
    gpus = spec.runtime.resources.gpus
    if gpus is None:
        return tp
    if tp and int(gpus) < tp:
        raise InvalidSpec("NotEnoughGPUs", f"runtime.resources.gpus={gpus} is below the {tp} ranks of each pod "
                                           "(engine.tensorParallelSize, or parallelism)")
    return int(gpus)


def shm_size(spec: spec_view.Spec) -> str:
    """Size limit of the ``/dev/shm`` memory volume: ``runtime.shmSize``, else ``1Gi``, or
    ``4Gi`` per GPU with tensor parallelism (NCCL's shared-memory transport)."""
    if spec.runtime.shm_size is not None:
        return str(spec.runtime.shm_size)
    par = parallelism(spec)
    return "1Gi" if par.world <= 1 else f"{4 * par.ranks_per_node}Gi"


def child_meta(isvc: Mapping[str, Any], name: str) -> dict[str, Any]:
    """A child's ``metadata``: its name, the namespace, :func:`labels` and the controller ownerReference."""
    return {"name": name, "namespace": isvc["metadata"].get("namespace") or "default",
            "labels": labels(isvc), "ownerReferences": [owner_reference(isvc)]}
