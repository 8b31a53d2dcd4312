"""The operator's Kubernetes API client: raw dicts in and out, one field manager.

- :class:`Kube` reads (``get``, ``list_objects``) and writes (``apply``: server-side apply,
  force, field manager ``kvfleet-operator``; ``create``, ``delete``, ``patch_status``,
  ``scale``) the kinds in :data:`KINDS`, and asks API discovery whether a kind is ``served``,
  over a ``kubernetes.client.ApiClient``;
- every failure is an :class:`ApiError` (HTTP status, 0 for a connection error); a missing
  object is ``None`` from ``get`` and no error from ``delete``;
- :func:`make_kube` builds one from the in-cluster service account, else ``$KUBECONFIG``.

Synchronous (the async autoscaler calls it through ``asyncio.to_thread``); no caching.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import urllib3

from kvfleet.operator import crd
from kvfleet.operator.service_spec import FIELD_MANAGER

# kind -> (apiVersion, plural)
KINDS: dict[str, tuple[str, str]] = {
    "ConfigMap": ("v1", "configmaps"),
    "Secret": ("v1", "secrets"),
    "Service": ("v1", "services"),
    "Deployment": ("apps/v1", "deployments"),
    "PodDisruptionBudget": ("policy/v1", "poddisruptionbudgets"),
    "HorizontalPodAutoscaler": ("autoscaling/v2", "horizontalpodautoscalers"),
    "ScaledObject": ("keda.sh/v1alpha1", "scaledobjects"),
    "Pod": ("v1", "pods"),
    "PersistentVolumeClaim": ("v1", "persistentvolumeclaims"),
    "Event": ("v1", "events"),
    "ServiceAccount": ("v1", "serviceaccounts"),
    "Role": ("rbac.authorization.k8s.io/v1", "roles"),
    "RoleBinding": ("rbac.authorization.k8s.io/v1", "rolebindings"),
    "InferencePool": ("inference.networking.k8s.io/v1", "inferencepools"),
    "ClusterKopfPeering": ("kopf.dev/v1", "clusterkopfpeerings"),
    "KopfPeering": ("kopf.dev/v1", "kopfpeerings"),
    "LeaderWorkerSet": ("leaderworkerset.x-k8s.io/v1", "leaderworkersets"),
    crd.KIND: (crd.API_VERSION, crd.PLURAL),
}


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

    def served(self, api_version: str, plural: str) -> bool:
        """Whether the cluster serves ``plural`` in ``api_version`` (API discovery, which every
        client may read: a CRD's API is there once the CRD is established)."""
        try:
            found = self._call("GET", self.path(api_version, "", None).rstrip("/")) or {}
        except ApiError as e:
            if e.status == 404:
                return False
            raise
        return any(r.get("name") == plural for r in found.get("resources") or [])

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


def make_kube() -> Kube:
    """A :class:`Kube` from the in-cluster service account, else ``$KUBECONFIG``."""
    import kubernetes

    try:
        kubernetes.config.load_incluster_config()
    except kubernetes.config.ConfigException:
        # explicit: the library reads $KUBECONFIG once, when it is first imported
        kubernetes.config.load_kube_config(config_file=os.environ.get("KUBECONFIG") or None)
    return Kube(kubernetes.client.ApiClient())
