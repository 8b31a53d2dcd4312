"""One reconcile of one InferenceService: read, build (pure), apply what differs, write status.

Synchronous and framework-free (the kopf handlers in :mod:`kvfleet.operator.handlers` call
:func:`reconcile` from kopf's thread pool), so tests can run it against any API server.

Writes follow server-side apply (https://kubernetes.io/docs/reference/using-api/server-side-apply/):
every child is sent whole as ``PATCH`` with ``Content-Type: application/apply-patch+yaml``,
``fieldManager=kvfleet-operator`` and ``force=true``; the API server then removes the fields
the operator applied before and no longer applies (a field removed from the spec disappears
from the child), and keeps fields other managers own. A child is written only when

- it does not exist, or
- its ``kvfleet.io/desired-hash`` annotation differs from the hash of the desired object
  (the desired object changed, including fields that were removed), or
- a desired field differs in the live object (someone edited it by hand);

so reconciling an unchanged resource writes nothing. The status subresource is patched
(JSON merge patch) only with the keys whose value changed.
"""

from __future__ import annotations

import copy
import datetime
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import urllib3

from kvfleet.operator import builders, crd
from kvfleet.operator.builders import FIELD_MANAGER, InvalidSpec

log = logging.getLogger(__name__)

ANNOTATION_DESIRED_HASH = "kvfleet.io/desired-hash"
"""Child annotation: hash of what the operator last applied (detects removed fields)."""

# kind -> (apiVersion, plural)
KINDS: dict[str, tuple[str, str]] = {
    "ConfigMap": ("v1", "configmaps"),
    "Service": ("v1", "services"),
    "Secret": ("v1", "secrets"),
    "Deployment": ("apps/v1", "deployments"),
    "PodDisruptionBudget": ("policy/v1", "poddisruptionbudgets"),
    "HorizontalPodAutoscaler": ("autoscaling/v2", "horizontalpodautoscalers"),
    "Pod": ("v1", "pods"),
    "Event": ("v1", "events"),
    "ClusterKopfPeering": ("kopf.dev/v1", "clusterkopfpeerings"),
    "KopfPeering": ("kopf.dev/v1", "kopfpeerings"),
    crd.KIND: (crd.API_VERSION, crd.PLURAL),
}

PRUNABLE_KINDS = ("PodDisruptionBudget", "HorizontalPodAutoscaler")
"""Optional children: deleted when no longer desired (only when this InferenceService is
their controller owner)."""

EXTRA_CHILDREN: list[Callable[[Mapping[str, Any]], list[dict[str, Any]]]] = []
"""Further child builders ``fn(isvc) -> [objects]`` (pure), e.g. the autoscaler's HPA in
mode ``hpa``. Register by appending at import time; each object must carry the
InferenceService's ownerReference (:func:`builders.owner_reference`). A builder may raise
:class:`InvalidSpec`."""


class ApiError(Exception):
    """An API call failed (``status``: HTTP status, 0 for a connection error)."""

    def __init__(self, status: int, message: str):
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


class Kube:
    """Raw-dict access to the Kubernetes API over ``kubernetes.client.ApiClient``.

    Args:
        api_client: a configured ``kubernetes.client.ApiClient`` (kubeconfig or in-cluster).
    """

    def __init__(self, api_client: Any):
        self.api = api_client

    @staticmethod
    def path(api_version: str, plural: str, namespace: str | None, name: str | None = None,
             subresource: str | None = None) -> str:
        base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
        out = base + (f"/namespaces/{namespace}" if namespace else "") + f"/{plural}"
        if name:
            out += f"/{name}"
        if subresource:
            out += f"/{subresource}"
        return out

    def _call(self, method: str, path: str, *, body: Any = None, query: list | None = None,
              content_type: str | None = None) -> Any:
        from kubernetes.client.exceptions import ApiException

        headers = {"Accept": "application/json"}
        if content_type:
            headers["Content-Type"] = content_type
        try:
            request = self.api.param_serialize(method, path, query_params=query or [], header_params=headers,
                                               body=body, auth_settings=["BearerToken"])
            response = self.api.call_api(*request, _request_timeout=30)
            response.read()
            return self.api.response_deserialize(response, {"2XX": "object"}).data
        except ApiException as e:
            raise ApiError(e.status or 0, str(e.reason or e.body)) from None
        except (OSError, urllib3.exceptions.HTTPError) as e:  # connection refused, timeouts, retries
            raise ApiError(0, repr(e)) from None

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        """The live object, or None when it does not exist."""
        api_version, plural = KINDS[kind]
        try:
            return self._call("GET", self.path(api_version, plural, namespace, name))
        except ApiError as e:
            if e.status == 404:
                return None
            raise

    def list_objects(self, kind: str, namespace: str | None,
                     selector: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
        """The objects of ``kind`` in ``namespace`` (all namespaces for None) whose labels
        match ``selector`` (equality only). The selector is sent as ``labelSelector`` and
        also checked here, so a server that ignores it gives the same answer."""
        api_version, plural = KINDS[kind]
        query = [("labelSelector", ",".join(f"{k}={v}" for k, v in sorted(selector.items())))] if selector else []
        items = (self._call("GET", self.path(api_version, plural, namespace), query=query) or {}).get("items") or []
        if selector:
            items = [o for o in items
                     if all(((o.get("metadata") or {}).get("labels") or {}).get(k) == v for k, v in selector.items())]
        return items

    def scale(self, kind: str, namespace: str, name: str, replicas: int) -> dict[str, Any]:
        """Set ``spec.replicas`` through the scale subresource (JSON merge patch of the
        ``autoscaling/v1`` Scale, so nothing else of the object changes); the Scale."""
        api_version, plural = KINDS[kind]
        return self._call("PATCH", self.path(api_version, plural, namespace, name, "scale"),
                          body={"spec": {"replicas": int(replicas)}}, content_type="application/merge-patch+json")

    def apply(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        """Server-side apply ``obj`` (force, field manager ``kvfleet-operator``); the live result.

        An API server creates a missing object on apply; an emulator that answers 404
        instead gets a create (``POST``) with the same field manager.
        """
        api_version, plural = KINDS[obj["kind"]]
        ns, name = obj["metadata"].get("namespace"), obj["metadata"]["name"]
        query = [("fieldManager", FIELD_MANAGER), ("force", "true")]
        try:
            return self._call("PATCH", self.path(api_version, plural, ns, name), body=dict(obj), query=query,
                              content_type="application/apply-patch+yaml")
        except ApiError as e:
            if e.status != 404:
                raise
        return self.create(obj)

    def create(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        """Create ``obj`` (``POST``; ``metadata.generateName`` works); the stored object."""
        api_version, plural = KINDS[obj["kind"]]
        return self._call("POST", self.path(api_version, plural, obj["metadata"].get("namespace")), body=dict(obj),
                          query=[("fieldManager", FIELD_MANAGER)], content_type="application/json")

    def delete(self, kind: str, namespace: str, name: str) -> None:
        api_version, plural = KINDS[kind]
        try:
            self._call("DELETE", self.path(api_version, plural, namespace, name))
        except ApiError as e:
            if e.status != 404:
                raise

    def patch_status(self, kind: str, namespace: str, name: str, patch: Mapping[str, Any]) -> dict[str, Any]:
        """JSON-merge-patch the status subresource with ``{"status": patch}``."""
        api_version, plural = KINDS[kind]
        return self._call("PATCH", self.path(api_version, plural, namespace, name, "status"),
                          body={"status": dict(patch)}, content_type="application/merge-patch+json")


# ---------------------------------------------------------------------------------
# pure comparison


def stamped(child: Mapping[str, Any]) -> dict[str, Any]:
    """``child`` with the :data:`ANNOTATION_DESIRED_HASH` annotation (hash of the rest)."""
    out = copy.deepcopy(dict(child))
    meta = out.setdefault("metadata", {})
    annotations = dict(meta.get("annotations") or {})
    annotations.pop(ANNOTATION_DESIRED_HASH, None)
    meta["annotations"] = annotations
    if not annotations:
        del meta["annotations"]
    h = builders.content_hash(out)
    meta.setdefault("annotations", {})[ANNOTATION_DESIRED_HASH] = h
    return out


def is_subset(desired: Any, live: Any) -> bool:
    """True when every field of ``desired`` has the same value in ``live`` (dicts may carry
    extra keys, e.g. server defaults; lists must have the same length, item by item)."""
    if isinstance(desired, dict):
        return isinstance(live, dict) and all(k in live and is_subset(v, live[k]) for k, v in desired.items())
    if isinstance(desired, list):
        return isinstance(live, list) and len(desired) == len(live) and all(
            is_subset(d, l) for d, l in zip(desired, live))
    if isinstance(desired, bool) or isinstance(live, bool):
        return desired is live
    if isinstance(desired, (int, float)) and isinstance(live, (int, float)):
        return desired == live
    return desired == live


def needs_apply(desired: Mapping[str, Any], live: Mapping[str, Any] | None) -> bool:
    """Whether ``desired`` (already :func:`stamped`) must be applied over ``live``."""
    if live is None:
        return True
    want = desired["metadata"]["annotations"][ANNOTATION_DESIRED_HASH]
    have = ((live.get("metadata") or {}).get("annotations") or {}).get(ANNOTATION_DESIRED_HASH)
    return want != have or not is_subset(desired, live)


def owned_by(obj: Mapping[str, Any], isvc: Mapping[str, Any]) -> bool:
    uid = isvc["metadata"].get("uid")
    return any(ref.get("controller") and ref.get("uid") == uid
               for ref in (obj.get("metadata") or {}).get("ownerReferences") or [])


def now_rfc3339() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# ---------------------------------------------------------------------------------
# one reconcile


@dataclass
class Outcome:
    """What one :func:`reconcile` did."""

    found: bool = True
    applied: list[str] = field(default_factory=list)  # "Kind/name"
    deleted: list[str] = field(default_factory=list)
    status_patch: dict[str, Any] = field(default_factory=dict)
    error: InvalidSpec | None = None

    @property
    def wrote(self) -> bool:
        return bool(self.applied or self.deleted or self.status_patch)


def check_secrets(kube: Kube, isvc: Mapping[str, Any]) -> None:
    """Raise :class:`InvalidSpec` (``SecretNotFound`` / ``SecretKeyNotFound``) when a Secret
    the pods need is missing: the pods would otherwise sit in CreateContainerConfigError."""
    ns = isvc["metadata"].get("namespace") or "default"
    for name, key in builders.required_secrets(isvc):
        secret = kube.get("Secret", ns, name)
        if secret is None:
            raise InvalidSpec("SecretNotFound", f"Secret {ns}/{name} does not exist")
        if key not in (secret.get("data") or {}) and key not in (secret.get("stringData") or {}):
            raise InvalidSpec("SecretKeyNotFound", f"Secret {ns}/{name} has no key {key!r}")


def desired_objects(isvc: Mapping[str, Any]) -> list[dict[str, Any]]:
    """All desired children, stamped (builders + :data:`EXTRA_CHILDREN`)."""
    children = builders.desired_children(isvc)
    for extra in EXTRA_CHILDREN:
        children += extra(isvc)
    return [stamped(c) for c in children]


_locks: dict[tuple[str, str], threading.Lock] = {}
_locks_guard = threading.Lock()


def lock_for(namespace: str, name: str) -> threading.Lock:
    """The per-InferenceService lock: one reconcile of a resource at a time in this process."""
    with _locks_guard:
        return _locks.setdefault((namespace, name), threading.Lock())


def reconcile(kube: Kube, namespace: str, name: str, *, now: str | None = None) -> Outcome:
    """Bring the children and status of InferenceService ``namespace/name`` in line.

    Reads the InferenceService fresh (so a stale trigger does no harm); does nothing when
    it is gone or being deleted (children go by ownerReference garbage collection). On an
    invalid spec (:class:`InvalidSpec`) the existing children are left as they are (pods
    keep serving) and the status says ``Degraded``; the error is returned in the outcome.

    Raises:
        ApiError: an API call failed (the caller retries).
    """
    with lock_for(namespace, name):
        isvc = kube.get(crd.KIND, namespace, name)
        out = Outcome()
        if isvc is None or (isvc.get("metadata") or {}).get("deletionTimestamp"):
            out.found = False
            return out
        now = now or now_rfc3339()
        live_deployment = None
        desired_deployment = None
        try:
            desired = desired_objects(isvc)
            check_secrets(kube, isvc)
        except InvalidSpec as e:
            out.error = e
            live_deployment = kube.get("Deployment", namespace, builders.names(isvc)["deployment"])
        else:
            kinds = set()
            for child in desired:
                kinds.add(child["kind"])
                live = kube.get(child["kind"], namespace, child["metadata"]["name"])
                if needs_apply(child, live):
                    live = kube.apply(child)
                    out.applied.append(f"{child['kind']}/{child['metadata']['name']}")
                if child["kind"] == "Deployment":
                    live_deployment, desired_deployment = live, child
            names = builders.names(isvc)
            for kind in PRUNABLE_KINDS:
                if kind in kinds:
                    continue
                child_name = names["pdb" if kind == "PodDisruptionBudget" else "hpa"]
                live = kube.get(kind, namespace, child_name)
                if live is not None and owned_by(live, isvc):
                    kube.delete(kind, namespace, child_name)
                    out.deleted.append(f"{kind}/{child_name}")
        status = builders.desired_status(isvc, deployment=live_deployment,
                                         desired_deployment=desired_deployment, now=now, error=out.error)
        patch = builders.status_patch(isvc.get("status"), status)
        if patch:
            kube.patch_status(crd.KIND, namespace, name, patch)
            out.status_patch = patch
        return out
