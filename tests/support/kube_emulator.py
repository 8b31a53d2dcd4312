"""A Kubernetes API emulator for end-to-end tests: kmock's ``KubernetesEmulator`` plus the
API-server behaviour that kopf and the kvfleet operator rely on.

kmock 0.8 keeps objects in memory and serves list/watch/get/create/patch/delete over real
HTTP, but it merges every patch naively and assigns no server-side metadata. This module adds,
as a real API server does:

- ``metadata.uid``, ``resourceVersion`` (bumped on every change), ``generation`` (bumped when
  ``spec`` changes), ``creationTimestamp``, ``generateName``;
- status subresources: ``PATCH .../status`` changes only ``status``; a main-resource write
  of a resource with a status subresource leaves ``status`` alone;
- the scale subresource of InferenceServices and Deployments (``GET``/``PATCH .../scale``
  as an ``autoscaling/v1`` Scale; the updater then co-owns ``spec.replicas``);
- server-side apply (``application/apply-patch+yaml``): per-field-manager ownership of the
  applied fields, so a field the manager stops applying is removed (lists are atomic);
  an apply to a missing object creates it;
- no-op writes change nothing and send no watch event;
- garbage collection: deleting an object deletes its dependents (``ownerReferences``);
- ``GET /api/v1/namespaces`` (list and watch), which kmock cannot parse.

Use it from synchronous tests through :class:`EmulatorThread` (a server on a loopback port
in a background thread, a kubeconfig file, and small sync helpers that go over HTTP).
Everything is reusable: the autoscaling tests run a "kubelet" on top of it.
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import itertools
import json
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import aiohttp.web
import attrs
import httpx
import kmock
import yaml
from kmock._internal import enums, rendering

ISVC = "kvfleet.io/v1alpha1/inferenceservices"

# resource -> (kind, namespaced, subresources, short names)
RESOURCES: dict[str, tuple[str, bool, set[str], set[str]]] = {
    ISVC: ("InferenceService", True, {"status", "scale"}, {"kis"}),
    "v1/namespaces": ("Namespace", False, {"status"}, {"ns"}),
    "apiextensions.k8s.io/v1/customresourcedefinitions": ("CustomResourceDefinition", False, {"status"}, {"crd"}),
    "v1/configmaps": ("ConfigMap", True, set(), {"cm"}),
    "v1/services": ("Service", True, {"status"}, {"svc"}),
    "v1/secrets": ("Secret", True, set(), set()),
    "v1/pods": ("Pod", True, {"status"}, {"po"}),
    "v1/persistentvolumeclaims": ("PersistentVolumeClaim", True, {"status"}, {"pvc"}),
    "v1/events": ("Event", True, set(), {"ev"}),
    "apps/v1/deployments": ("Deployment", True, {"status", "scale"}, {"deploy"}),
    "policy/v1/poddisruptionbudgets": ("PodDisruptionBudget", True, {"status"}, {"pdb"}),
    "autoscaling/v2/horizontalpodautoscalers": ("HorizontalPodAutoscaler", True, {"status"}, {"hpa"}),
    "keda.sh/v1alpha1/scaledobjects": ("ScaledObject", True, {"status"}, {"so"}),
    "coordination.k8s.io/v1/leases": ("Lease", True, set(), set()),
    "discovery.k8s.io/v1/endpointslices": ("EndpointSlice", True, set(), set()),
    "v1/serviceaccounts": ("ServiceAccount", True, set(), {"sa"}),
    "rbac.authorization.k8s.io/v1/roles": ("Role", True, set(), set()),
    "rbac.authorization.k8s.io/v1/rolebindings": ("RoleBinding", True, set(), set()),
    "kopf.dev/v1/kopfpeerings": ("KopfPeering", True, set(), set()),
    "kopf.dev/v1/clusterkopfpeerings": ("ClusterKopfPeering", False, set(), set()),
}
VERBS = {"get", "list", "watch", "create", "update", "patch", "delete"}
APPLY = "application/apply-patch+yaml"


class Write(NamedTuple):
    """One request that changed the emulator's state."""

    method: str
    path: str
    field_manager: str | None
    user_agent: str


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _merge(base: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch (None deletes; lists and scalars replace)."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = copy.deepcopy(base) if isinstance(base, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = _merge(out.get(k), v)
    return out


def _diff(old: Any, new: Any) -> Any:
    """The JSON merge patch that turns ``old`` into ``new`` (None entries delete)."""
    out: dict[str, Any] = {}
    for k in old:
        if k not in new:
            out[k] = None
    for k, v in new.items():
        if k not in old:
            out[k] = copy.deepcopy(v)
        elif isinstance(v, dict) and isinstance(old[k], dict):
            sub = _diff(old[k], v)
            if sub:
                out[k] = sub
        elif v != old[k]:
            out[k] = copy.deepcopy(v)
    return out


def _leaf_paths(obj: Any, prefix: tuple = ()) -> set[tuple]:
    """Field paths of an applied configuration: dicts are walked, lists and scalars are leaves."""
    if isinstance(obj, dict) and obj:
        out: set[tuple] = set()
        for k, v in obj.items():
            out |= _leaf_paths(v, prefix + (k,))
        return out
    return {prefix}


def _remove_path(obj: dict[str, Any], path: tuple) -> None:
    node: Any = obj
    for key in path[:-1]:
        if not isinstance(node, dict) or key not in node:
            return
        node = node[key]
    if isinstance(node, dict):
        node.pop(path[-1], None)
    # drop parents left empty by the removal
    for depth in range(len(path) - 1, 0, -1):
        parent: Any = obj
        for key in path[:depth - 1]:
            parent = parent.get(key, {})
        if isinstance(parent, dict) and parent.get(path[depth - 1]) == {}:
            del parent[path[depth - 1]]


@attrs.define(kw_only=True)
class KubeEmulator(kmock.KubernetesEmulator):
    """``kmock.KubernetesEmulator`` with API-server semantics (see the module docstring).

    ``ownership[(resource, namespace, name)][manager]`` is the set of field paths each
    server-side-apply field manager owns. ``write_log`` records every request that changed
    an object (:class:`Write`); ``generation`` counts ``spec`` changes.
    """

    ownership: dict[tuple, dict[str, set[tuple]]] = attrs.field(factory=dict, init=False)
    write_log: list[Write] = attrs.field(factory=list, init=False)
    _counter: Any = attrs.field(factory=lambda: itertools.count(1), init=False)
    _mutation_lock: asyncio.Lock = attrs.field(factory=asyncio.Lock, init=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        for res, (kind, namespaced, subresources, short) in RESOURCES.items():
            self.resources[res] = kmock.ResourceInfo(kind=kind, namespaced=namespaced, verbs=VERBS,
                                                     subresources=subresources, shortnames=short,
                                                     singular=kind.lower())

    # ------------------------------------------------------------------ entry point

    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        if raw_request.path.rstrip("/") == "/api/v1/namespaces":
            return await self._serve_namespaces(raw_request)
        return await super().__call__(raw_request)

    async def _serve_namespaces(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        names = {"default"} | {ns for (_, ns, _), obj in list(self.objects.items()) if ns and not obj.deleted}
        items = [{"apiVersion": "v1", "kind": "Namespace",
                  "metadata": {"name": n, "uid": f"ns-{n}", "resourceVersion": "1"},
                  "status": {"phase": "Active"}} for n in sorted(names)]
        if raw_request.query.get("watch") != "true":
            return aiohttp.web.json_response({"apiVersion": "v1", "kind": "NamespaceList",
                                              "metadata": {"resourceVersion": "1"}, "items": items})
        resp = aiohttp.web.StreamResponse()
        resp.content_type = "application/json"
        await resp.prepare(raw_request)
        for item in items:
            await resp.write(json.dumps({"type": "ADDED", "object": item}).encode() + b"\n")
        try:
            await asyncio.sleep(float(raw_request.query.get("timeoutSeconds", 300)))
        except asyncio.CancelledError:
            pass
        return resp

    async def _handle(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        if request.resource is None or request.action not in (enums.action.CREATE, enums.action.UPDATE,
                                                                enums.action.DELETE, enums.action.FETCH):
            return await super()._handle(request)
        if request.action == enums.action.FETCH:
            if request.subresource == "scale":
                obj = self._live(request.resource, request.namespace, request.name)
                if obj is None:
                    raise kmock.KubernetesObjectNotFoundError()
                return aiohttp.web.json_response(self._scale_of(obj))
            return await super()._handle(request)
        async with self._mutation_lock:
            if request.action == enums.action.CREATE:
                return await self._create(request)
            if request.action == enums.action.UPDATE:
                return await self._update(request)
            response = await super()._handle(request)
            if response.status < 300:
                self._log_write(request, "DELETE")
                await self._collect_garbage()
            return response

    # ------------------------------------------------------------------ helpers

    def _substitute(self, request: rendering.Request, **changes: Any) -> rendering.Request:
        """A changed copy of ``request`` that kmock's filters see in place of the original
        (they match requests by identity among the recorded ones)."""
        new = attrs.evolve(request, **changes)
        for i in range(len(self._requests) - 1, -1, -1):
            if self._requests[i] is request:
                self._requests[i] = new
                break
        else:
            self._requests.append(new)
        return new

    def _log_write(self, request: rendering.Request, method: str) -> None:
        self.write_log.append(Write(method, request.url.path, request.params.get("fieldManager"),
                                    request.headers.get("User-Agent", "")))

    def _live(self, resource: Any, namespace: str | None, name: str | None) -> dict[str, Any] | None:
        key = (resource, namespace, name)
        if key not in self.objects or self.objects[key].deleted:
            return None
        return copy.deepcopy(self.objects[key].raw)

    def _info(self, resource: Any) -> kmock.ResourceInfo | None:
        for res in list(self.resources):
            if res == resource:
                return self.resources[res]
        return None

    def _has_status(self, resource: Any) -> bool:
        info = self._info(resource)
        return bool(info and "status" in info.subresources)

    @staticmethod
    def _scale_of(obj: dict[str, Any]) -> dict[str, Any]:
        meta = obj["metadata"]
        st = obj.get("status") or {}
        selector = st.get("selector")
        if selector is None:  # Deployments: from the label selector
            labels = ((obj.get("spec") or {}).get("selector") or {}).get("matchLabels") or {}
            selector = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
        return {"apiVersion": "autoscaling/v1", "kind": "Scale",
                "metadata": {"name": meta["name"], "namespace": meta.get("namespace"), "uid": meta.get("uid"),
                             "resourceVersion": meta.get("resourceVersion")},
                "spec": {"replicas": (obj.get("spec") or {}).get("replicas", 0)},
                "status": {"replicas": st.get("replicas", 0), "selector": selector}}

    def _stamp_new(self, obj: dict[str, Any], request: rendering.Request) -> dict[str, Any]:
        meta = obj.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        if request.namespace:
            meta["namespace"] = request.namespace
        info = self._info(request.resource)
        if info is not None and info.kind and "kind" not in obj:
            obj["kind"] = info.kind
        meta.update(uid=str(uuid.uuid4()), resourceVersion=str(next(self._counter)), generation=1,
                    creationTimestamp=_now())
        if self._has_status(request.resource) and request.resource != "v1/pods":
            obj.pop("status", None)
        return obj

    async def _create(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        obj = self._stamp_new(copy.deepcopy(request.data or {}), request)
        manager = request.params.get("fieldManager")
        key = (request.resource, request.namespace or obj["metadata"].get("namespace"), obj["metadata"]["name"])
        if manager and key not in self.ownership:
            self.ownership[key] = {manager: _leaf_paths(request.data or {})}
        response = await super()._handle(self._substitute(request, data=obj))
        if response.status < 300:
            self._log_write(request, "POST")
        return response

    async def _update(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        key = (request.resource, request.namespace, request.name)
        old = self._live(*key)
        content_type = request.headers.get("Content-Type", "").split(";")[0].strip()
        body: Any = request.data
        if body is None and request.text:
            body = yaml.safe_load(request.text)  # a YAML apply patch
        if old is None:
            if content_type == APPLY and request.subresource is None:  # apply creates
                created = self._substitute(request, action=enums.action.CREATE, name=None, data=body)
                return await self._create(created)
            raise kmock.KubernetesObjectNotFoundError()

        if request.subresource == "scale":
            replicas = ((body or {}).get("spec") or {}).get("replicas")
            new = copy.deepcopy(old)
            if replicas is not None:
                new.setdefault("spec", {})["replicas"] = replicas
                # like a real server: the updater co-owns spec.replicas (an applier that drops it keeps it)
                manager = request.params.get("fieldManager") or request.headers.get("User-Agent", "scale")
                self.ownership.setdefault(key, {}).setdefault(f"update:{manager}", set()).add(("spec", "replicas"))
        elif isinstance(body, list):  # JSON patch
            import jsonpatch

            new = jsonpatch.apply_patch(old, body)
        elif content_type == APPLY:
            manager = request.params.get("fieldManager", "unknown")
            owned = self.ownership.setdefault(key, {})
            applied = _leaf_paths(body)
            new = copy.deepcopy(old)
            others = set().union(*[paths for m, paths in owned.items() if m != manager]) if owned else set()
            for path in owned.get(manager, set()) - applied - others:
                _remove_path(new, path)
            new = _merge(new, body)
            owned[manager] = applied
        else:
            new = _merge(old, body or {})

        # subresource isolation
        if request.subresource == "status":
            new = {**old, "status": new.get("status", {})} if "status" in new else {k: v for k, v in old.items()
                                                                                  if k != "status"}
        elif request.subresource is None and self._has_status(request.resource):
            if "status" in old:
                new["status"] = old["status"]
            else:
                new.pop("status", None)
        # server-owned metadata stays
        for field in ("uid", "creationTimestamp", "generation", "resourceVersion", "namespace", "name"):
            if field in old.get("metadata", {}):
                new.setdefault("metadata", {})[field] = old["metadata"][field]

        if new == old:  # a no-op write: nothing changes, no event
            return aiohttp.web.json_response(old)
        new = copy.deepcopy(new)  # unshare from ``old`` before stamping
        if new.get("spec") != old.get("spec"):
            new["metadata"]["generation"] = int(old["metadata"].get("generation", 1)) + 1
        new["metadata"]["resourceVersion"] = str(next(self._counter))
        patch = _diff(old, new)
        response = await super()._handle(self._substitute(request, data=patch))
        if response.status < 300:
            self._log_write(request, "PATCH")
            await self._collect_garbage()  # a released finalizer may have deleted an owner
        if request.subresource == "scale":
            return aiohttp.web.json_response(self._scale_of(self._live(*key) or new))
        return response

    async def _collect_garbage(self) -> None:
        """Delete (background propagation) every object whose owners are all gone."""
        while True:
            alive = {obj.raw["metadata"].get("uid") for obj in list(self.objects.values()) if not obj.deleted}
            orphans = []
            for key, obj in list(self.objects.items()):
                if obj.deleted:
                    continue
                refs = obj.raw.get("metadata", {}).get("ownerReferences") or []
                if refs and not any(ref.get("uid") in alive for ref in refs):
                    orphans.append(key)
            if not orphans:
                return
            async with self._lock:
                for key in orphans:
                    raw = self.objects[key].raw
                    self.objects[key].delete()
                    self.ownership.pop(key, None)
                    await self._buses[key[0]].put({"type": "DELETED", "object": raw})


class EmulatorThread:
    """Run a :class:`KubeEmulator` on a loopback port in a background thread.

    ``with EmulatorThread() as kube:`` starts it; ``kube.url`` is its base URL,
    ``kube.write_kubeconfig(path)`` writes a kubeconfig for ``kvfleet operator --kubeconfig``,
    and the helpers (:meth:`get`, :meth:`create`, :meth:`patch`, :meth:`delete`) are
    synchronous HTTP calls (so what a test does is what a client does).
    """

    def __init__(self, emulator_factory: Callable[[], KubeEmulator] = KubeEmulator):
        self._factory = emulator_factory
        self.emulator: KubeEmulator | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.url = ""
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="kube-emulator", daemon=True)
        self.http: httpx.Client | None = None
        self._error: BaseException | None = None

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as e:  # pragma: no cover - surfaced by __enter__
            self._error = e
            self._ready.set()

    async def _main(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self.emulator = self._factory()
        async with self.emulator, kmock.Server(self.emulator) as server:
            self.url = str(server.url).rstrip("/")
            self._ready.set()
            await self._stop.wait()

    def __enter__(self) -> EmulatorThread:
        self._thread.start()
        if not self._ready.wait(30) or self._error:
            raise RuntimeError(f"the emulator did not start: {self._error!r}")
        self.http = httpx.Client(base_url=self.url, timeout=10)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.http is not None:
            self.http.close()
        if self.loop is not None and self._stop is not None:
            self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(15)

    def call(self, coro_fn: Callable[[], Any]) -> Any:
        """Run ``coro_fn()`` (a coroutine function) on the emulator's loop and return its result."""
        assert self.loop is not None

        async def wrapper() -> Any:
            return await coro_fn()

        return asyncio.run_coroutine_threadsafe(wrapper(), self.loop).result(15)

    # ------------------------------------------------------------------ kubeconfig

    def write_kubeconfig(self, path: str | Path, namespace: str = "default") -> Path:
        """A kubeconfig pointing at the emulator (token auth, plain HTTP)."""
        path = Path(path)
        path.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "emulator",
            "clusters": [{"name": "emulator", "cluster": {"server": self.url}}],
            "users": [{"name": "tester", "user": {"token": "emulator-token"}}],
            "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": "tester",
                                                          "namespace": namespace}}],
        }))
        return path

    # ------------------------------------------------------------------ sync helpers over HTTP

    @staticmethod
    def path(resource: str, namespace: str | None, name: str | None = None, subresource: str | None = None) -> str:
        """URL path of a resource (``"apps/v1/deployments"``, ``"v1/configmaps"``)."""
        group_version, plural = resource.rsplit("/", 1)
        base = "/api/v1" if group_version == "v1" else f"/apis/{group_version}"
        out = base + (f"/namespaces/{namespace}" if namespace else "") + f"/{plural}"
        if name:
            out += f"/{name}"
        if subresource:
            out += f"/{subresource}"
        return out

    def get(self, resource: str, namespace: str | None, name: str, subresource: str | None = None) -> dict | None:
        assert self.http is not None
        r = self.http.get(self.path(resource, namespace, name, subresource))
        if r.status_code == 404:
            return None
        r.raise_for_status()
        return r.json()

    def list(self, resource: str, namespace: str | None = None) -> list[dict]:
        assert self.http is not None
        r = self.http.get(self.path(resource, namespace))
        r.raise_for_status()
        return r.json()["items"]

    def create(self, resource: str, obj: dict[str, Any]) -> dict:
        assert self.http is not None
        ns = obj.get("metadata", {}).get("namespace")
        r = self.http.post(self.path(resource, ns), json=obj)
        r.raise_for_status()
        return r.json()

    def patch(self, resource: str, namespace: str | None, name: str, patch: Any,
              subresource: str | None = None, content_type: str = "application/merge-patch+json") -> dict:
        assert self.http is not None
        r = self.http.patch(self.path(resource, namespace, name, subresource),
                            content=json.dumps(patch), headers={"Content-Type": content_type})
        r.raise_for_status()
        return r.json()

    def delete(self, resource: str, namespace: str | None, name: str) -> None:
        assert self.http is not None
        r = self.http.delete(self.path(resource, namespace, name))
        if r.status_code != 404:
            r.raise_for_status()

    def writes(self) -> list[Write]:
        """A copy of the emulator's write log."""
        assert self.emulator is not None
        return list(self.emulator.write_log)

    def wait_for(self, predicate: Callable[[], Any], timeout: float = 30, interval: float = 0.2,
                 message: str = "condition") -> Any:
        """Poll ``predicate`` until it returns a truthy value (returned), or fail after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            last = predicate()
            if last:
                return last
            time.sleep(interval)
        raise AssertionError(f"timed out after {timeout} s waiting for {message} (last: {last!r})")
