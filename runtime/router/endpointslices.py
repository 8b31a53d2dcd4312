"""Endpoints from Kubernetes: watch the EndpointSlices of the runtime Service, ready addresses only.

:func:`slice_urls` (pure) turns EndpointSlice objects (dicts, as the API serves them) into
replica base URLs: for each slice, the port named ``port`` (or numbered so), and for each of its
endpoints whose ``conditions.ready`` is not false (the API's rule: unset means ready; a terminating
pod is not ready) its first address (the addresses of one endpoint are fungible, discovery/v1).
:func:`watch_endpoint_slices` lists and then watches the slices labelled
``kubernetes.io/service-name=SERVICE`` (the kubernetes client, in its own daemon thread; a failed or
expired watch relists after a second) and hands every change to the pool on the event loop.
Credentials: the pod's service account (RBAC: get/list/watch endpointslices in its namespace),
else ``$KUBECONFIG``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from kvfleet.runtime.router.endpoints import EndpointPool

logger = logging.getLogger("kvfleet.router")

SERVICE_LABEL = "kubernetes.io/service-name"
NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


def slice_urls(slices: Iterable[Mapping[str, Any]], port: str, service: str | None = None) -> list[str]:
    """Base URLs (``http://ADDRESS:PORT``, sorted, unique) of the ready endpoints of ``slices``.

    ``port``: a port name, or a number as a string. Slices of another service (when ``service``
    is given), of an address type other than IPv4/IPv6, or without that port, contribute nothing.
    """
    urls: set[str] = set()
    for s in slices:
        labels = (s.get("metadata") or {}).get("labels") or {}
        if service is not None and labels.get(SERVICE_LABEL) != service:
            continue
        if s.get("addressType", "IPv4") not in ("IPv4", "IPv6"):
            continue
        number = next((p.get("port") for p in s.get("ports") or []
                       if p.get("name") == port or str(p.get("port")) == port), None)
        if number is None:
            continue
        for ep in s.get("endpoints") or []:
            if (ep.get("conditions") or {}).get("ready") is False or not ep.get("addresses"):
                continue
            address = ep["addresses"][0]
            host = f"[{address}]" if ":" in address else address
            urls.add(f"http://{host}:{number}")
    return sorted(urls)


def default_namespace() -> str:
    try:
        with open(NAMESPACE_FILE) as fh:
            return fh.read().strip() or "default"
    except OSError:
        return "default"


def _api_client():
    import kubernetes

    try:
        kubernetes.config.load_incluster_config()
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config(config_file=os.environ.get("KUBECONFIG") or None)
    return kubernetes.client.ApiClient()


def _watch_thread(service: str, namespace: str, push: Callable[[list[dict]], None], stop: threading.Event) -> None:
    import kubernetes

    api_client = _api_client()
    api = kubernetes.client.DiscoveryV1Api(api_client)
    selector = f"{SERVICE_LABEL}={service}"
    to_dict = api_client.sanitize_for_serialization
    while not stop.is_set():
        try:
            listed = api.list_namespaced_endpoint_slice(namespace, label_selector=selector)
            slices = {s.metadata.name: to_dict(s) for s in listed.items}
            push(list(slices.values()))
            watch = kubernetes.watch.Watch()
            for event in watch.stream(api.list_namespaced_endpoint_slice, namespace, label_selector=selector,
                                      resource_version=listed.metadata.resource_version, timeout_seconds=30):
                if stop.is_set():
                    watch.stop()
                    break
                obj = event["object"]
                if event["type"] == "ERROR" or not hasattr(obj, "metadata"):
                    break  # e.g. 410 Gone: relist
                if event["type"] == "DELETED":
                    slices.pop(obj.metadata.name, None)
                else:
                    slices[obj.metadata.name] = to_dict(obj)
                push(list(slices.values()))
        except Exception as exc:  # API server away, RBAC, expired watch: relist after a pause
            logger.warning("EndpointSlice watch of %s/%s failed (%s); relisting", namespace, service, exc)
            stop.wait(1.0)


async def watch_endpoint_slices(pool: EndpointPool, service: str, namespace: str | None, port: str, *,
                                on_synced: Callable[[], None] = lambda: None) -> None:
    """Keep ``pool`` equal to the ready endpoints of ``service``'s EndpointSlices until cancelled.

    ``on_synced()`` is called after the first list (the router's ``/ready`` waits for it).
    """
    loop = asyncio.get_running_loop()
    namespace = namespace or default_namespace()
    stop = threading.Event()
    synced = False

    def apply(slices: list[dict]) -> None:
        nonlocal synced
        pool.set_urls(slice_urls(slices, port, service))
        if not synced:
            synced = True
            on_synced()

    def push(slices: list[dict]) -> None:
        loop.call_soon_threadsafe(apply, slices)

    thread = threading.Thread(target=_watch_thread, args=(service, namespace, push, stop), daemon=True,
                              name="endpointslice-watch")
    thread.start()
    try:
        while True:
            await asyncio.sleep(3600)
    finally:
        stop.set()
