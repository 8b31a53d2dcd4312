"""One reconcile of one InferenceService: read, build (pure), apply what differs, prune, write status.

Synchronous and framework-free (the kopf handlers call :func:`reconcile` from kopf's thread
pool), so tests run it against any API server. Every child of
:func:`kvfleet.operator.builders.desired_children` is server-side applied whole, and only when
it is missing, its ``kvfleet.io/desired-hash`` annotation differs from the hash of the desired
object, or a desired field differs in the live object (a hand edit); optional children no
longer desired (:data:`PRUNABLE_KINDS`) are deleted; the status subresource is merge-patched
with only the keys that changed. So reconciling an unchanged resource writes nothing.
With ``spec.parallelism.nodes > 1`` the runtime child is a LeaderWorkerSet (:mod:`kvfleet.operator.lws`;
without its API in the cluster, ``LeaderWorkerSetMissing`` and nothing applied) and the status
counts its groups (:mod:`kvfleet.operator.lws_status`).
"""

from __future__ import annotations

import copy
import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvfleet.operator import (
    adapters,
    builders,
    crd,
    fleet_secret,
    gie,
    hpa,
    lws,
    lws_status,
    router,
    service_spec,
    spec_view,
)
from kvfleet.operator.crd import InvalidSpec
from kvfleet.operator.kube import ApiError, Kube
from kvfleet.operator.status import desired_status, set_condition, status_patch
from kvfleet.operator.status import event as status_event
from kvfleet.operator.times import rfc3339
from kvfleet.runtime import env

log = logging.getLogger(__name__)

ANNOTATION_DESIRED_HASH = "kvfleet.io/desired-hash"
"""Child annotation: hash of what the operator last applied (detects removed fields)."""

PRUNABLE_KINDS = ("PodDisruptionBudget", "HorizontalPodAutoscaler")
"""Optional children: deleted when no longer desired (only when this InferenceService is
their controller owner)."""

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


def _keyed(items: list[Any]) -> bool:
    return bool(items) and all(isinstance(i, dict) and "name" in i for i in items)


def is_subset(desired: Any, live: Any) -> bool:
    """True when every field of ``desired`` has the same value in ``live``: the fields the
    operator owns, as server-side apply sees them. Dicts may carry extra keys (server defaults,
    other managers' fields); lists of named objects (containers, env, volumes, volumeMounts,
    ports, ...) are maps keyed by ``name``, so entries another manager added (a sidecar or an
    env var from a mutating webhook) are not drift; other lists are atomic (same length, item
    by item)."""
    if isinstance(desired, dict):
        return isinstance(live, dict) and all(k in live and is_subset(v, live[k]) for k, v in desired.items())
    if isinstance(desired, list) and _keyed(desired) and isinstance(live, list):
        by_name = {i.get("name"): i for i in live if isinstance(i, dict)}
        return all(d["name"] in by_name and is_subset(d, by_name[d["name"]]) for d in desired)
    if isinstance(desired, list):
        return isinstance(live, list) and len(desired) == len(live) and all(
            is_subset(d, v) for d, v in zip(desired, live))
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
    events: list[tuple[str, str]] = field(default_factory=list)
    """``(reason, message)`` of the Warning Events posted (a pod-level reason newly Degraded)."""

    @property
    def wrote(self) -> bool:
        return bool(self.applied or self.deleted or self.status_patch)


RUNTIME_IMAGE_ENV = env.RUNTIME_IMAGE.name
"""The operator's default runtime image (the chart's ``runtimeImage``), for InferenceServices
that set no ``spec.runtime.image``."""


def prepared(isvc: Mapping[str, Any]) -> dict[str, Any]:
    """``isvc`` (a copy) with the operator's own defaults: ``$KVFLEET_RUNTIME_IMAGE`` and
    ``$KVFLEET_ROUTER_IMAGE`` as the images, the InferencePool's metric names."""
    isvc = gie.with_pool_metrics(service_spec.with_default_image(isvc, env.RUNTIME_IMAGE.get()))
    return router.with_default_image(isvc, env.ROUTER_IMAGE.get())


def desired_objects(isvc: Mapping[str, Any], *, scaled_externally: bool = False,
                    spec: spec_view.Spec | None = None) -> list[dict[str, Any]]:
    """Every desired child (:func:`builders.desired_children`, with the :func:`prepared`
    defaults), stamped. ``spec``: the view of the :func:`prepared` resource (default: built here;
    the builders read the spec from it alone, ``isvc`` for its metadata and status)."""
    if spec is None:
        isvc = prepared(isvc)
        spec = spec_view.of(isvc)
    children = builders.desired_children(isvc, scaled_externally=scaled_externally, spec=spec)
    children += router.desired_children(isvc, spec)  # spec.router: the router's RBAC, Deployment, Service
    pool = gie.build_inference_pool(isvc, spec)
    if pool is not None and lws.enabled(isvc):  # a multi-node replica: its leader serves
        pool = lws.leaders_only(pool)
    return [stamped(c) for c in (children + ([pool] if pool else []))]


def ensure_fleet_secret(kube: Kube, isvc: Mapping[str, Any]) -> str | None:
    """Create the InferenceService's fleet Secret (:mod:`~kvfleet.operator.fleet_secret`) when it
    is missing, never rewriting one that exists (its key is the running pods'); ``"Secret/<name>"``
    when created."""
    ns = isvc["metadata"].get("namespace") or "default"
    secret_name = fleet_secret.name(isvc)
    if kube.get("Secret", ns, secret_name) is not None:
        return None
    try:
        kube.create(fleet_secret.build(isvc))
    except ApiError as e:
        if e.status == 409:  # another reconcile created it meanwhile: that one stands
            return None
        raise
    return f"Secret/{secret_name}"


def prune_request_path(kube: Kube, isvc: Mapping[str, Any], desired: list[Mapping[str, Any]],
                       spec: spec_view.Spec | None = None) -> list[str]:
    """Delete the router's children (router turned off) and the InferencePool (pool turned off)
    that this InferenceService owns; ``["Kind/name", ...]`` deleted. One GET each while off."""
    ns = isvc["metadata"].get("namespace") or "default"
    wanted = {(c["kind"], c["metadata"]["name"]) for c in desired}
    deleted: list[str] = []
    spec = spec_view.of(prepared(isvc)) if spec is None else spec
    candidates = [] if spec.router.enabled else [(k, router.name(isvc)) for k in ("Deployment",)]
    if not spec.router.inference_pool.enabled:
        candidates.append((gie.KIND, isvc["metadata"]["name"]))
    for kind, child in candidates:
        if (kind, child) in wanted:
            continue
        try:
            live = kube.get(kind, ns, child)
        except ApiError as e:
            if e.status in (403, 404):  # no InferencePool CRD in this cluster: nothing to prune
                continue
            raise
        if live is None or not owned_by(live, isvc):
            continue
        kinds = router.KINDS if kind == "Deployment" else (kind,)
        for k in kinds:  # the router's Deployment stands for all its children
            kube.delete(k, ns, child)
            deleted.append(f"{k}/{child}")
    return deleted


def foreign_scalers(kube: Kube, isvc: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The HPAs and KEDA ScaledObjects (not the operator's own HPA) that target the
    InferenceService or its Deployment (:func:`hpa.scalers_targeting`). A cluster without
    KEDA (or without the right to list ScaledObjects) has none."""
    ns = isvc["metadata"].get("namespace") or "default"
    hpas = [h for h in kube.list_objects("HorizontalPodAutoscaler", ns) if not owned_by(h, isvc)]
    try:
        scaled = kube.list_objects("ScaledObject", ns)
    except ApiError as e:
        if e.status not in (403, 404):
            raise
        scaled = []
    return hpa.scalers_targeting(hpas, scaled, isvc["metadata"]["name"],
                                    deployment=service_spec.names(isvc)["deployment"])


_locks: dict[tuple[str, str], threading.Lock] = {}
_locks_guard = threading.Lock()


def lock_for(namespace: str, name: str) -> threading.Lock:
    """The per-InferenceService lock: one reconcile of a resource at a time in this process."""
    with _locks_guard:
        return _locks.setdefault((namespace, name), threading.Lock())


_waiting: set[tuple[str, str]] = set()
"""Resources a :func:`reconcile_coalesced` call is waiting to reconcile (guarded by ``_locks_guard``)."""


def reconcile_coalesced(kube: Kube, namespace: str, name: str) -> Outcome | None:
    """:func:`reconcile` for watch events; None (skipped) while another call for the same resource
    waits for its lock: that one starts after the reconcile running now and reads everything
    fresh, so a burst of child events (an apply of N children makes N) costs at most two
    reconciles, not N."""
    key = (namespace, name)
    with _locks_guard:
        if key in _waiting:
            return None
        _waiting.add(key)

    def started() -> None:
        with _locks_guard:
            _waiting.discard(key)

    return reconcile(kube, namespace, name, on_locked=started)


def locked_count() -> int:
    """How many InferenceServices this process has taken a reconcile lock for so far."""
    with _locks_guard:
        return len(_locks)


def reconcile(kube: Kube, namespace: str, name: str, *, now: str | None = None,
              on_locked: Callable[[], None] | None = None) -> Outcome:
    """Bring the children and status of InferenceService ``namespace/name`` in line.

    Reads the InferenceService fresh (so a stale trigger does no harm); does nothing when
    it is gone or being deleted (children go by ownerReference garbage collection). On an
    invalid spec (:class:`InvalidSpec`) the existing children are left as they are (pods
    keep serving) and the status says ``Degraded``; the error is returned in the outcome.

    Args:
        on_locked: called once the resource's lock is held, before anything is read.

    Raises:
        kube.ApiError: an API call failed (the caller retries).
    """
    with lock_for(namespace, name):
        if on_locked is not None:
            on_locked()
        isvc = kube.get(crd.KIND, namespace, name)
        out = Outcome()
        if isvc is None or (isvc.get("metadata") or {}).get("deletionTimestamp"):
            out.found = False
            return out
        now = now or rfc3339()
        spec = spec_view.of(prepared(isvc))  # the typed view, once per reconcile
        live_deployment = None
        desired_deployment = None
        scalers = foreign_scalers(kube, isvc)
        on_deployment = any(target == "Deployment" for _, target in scalers)
        conflict = None
        if on_deployment:
            conflict = hpa.conflict_message(scalers, spec.autoscaling.mode)
        live_lws = desired_lws = None
        multi_node = lws.enabled(isvc)  # parallelism.nodes > 1: a LeaderWorkerSet, not a Deployment
        try:
            desired = desired_objects(isvc, scaled_externally=on_deployment, spec=spec)
            if multi_node:
                lws.require_api(kube)  # no LWS API in the cluster: LeaderWorkerSetMissing, nothing applied
        except InvalidSpec as e:
            out.error = e
            live_deployment = kube.get("Deployment", namespace, service_spec.names(isvc)["deployment"])
        else:
            if (created := ensure_fleet_secret(kube, isvc)) is not None:  # before the pods that mount it
                out.applied.append(created)
            wanted = set()
            runtime_deployment = service_spec.names(isvc)["deployment"]
            for child in desired:
                wanted.add((child["kind"], child["metadata"]["name"]))
                live = kube.get(child["kind"], namespace, child["metadata"]["name"])
                if needs_apply(child, live):
                    live = kube.apply(child)
                    out.applied.append(f"{child['kind']}/{child['metadata']['name']}")
                if child["kind"] == "Deployment" and child["metadata"]["name"] == runtime_deployment:
                    live_deployment, desired_deployment = live, child  # the runtime's (not the router's)
                if child["kind"] == lws.KIND:
                    live_lws, desired_lws = live, child
            names = service_spec.names(isvc)
            for kind in PRUNABLE_KINDS:  # by kind and name: the router's PDB is not the runtime's
                child_name = names["pdb" if kind == "PodDisruptionBudget" else "hpa"]
                if (kind, child_name) in wanted:
                    continue
                live = kube.get(kind, namespace, child_name)
                if live is not None and owned_by(live, isvc):
                    kube.delete(kind, namespace, child_name)
                    out.deleted.append(f"{kind}/{child_name}")
            out.deleted += prune_request_path(kube, isvc, desired, spec)
            stale_kind, stale_name = lws.stale_runtime(isvc)  # the split changed: Deployment <-> LWS
            stale = kube.get(stale_kind, namespace, stale_name)
            if stale is not None and owned_by(stale, isvc):
                kube.delete(stale_kind, namespace, stale_name)
                out.deleted.append(f"{stale_kind}/{stale_name}")
        pods = kube.list_objects("Pod", namespace, service_spec.selector_labels(isvc)) if (
            live_deployment or live_lws) else []
        if multi_node and out.error is None:  # the groups stand in for the Deployment's replicas
            live_deployment, desired_deployment = lws_status.progress_views(desired_lws, live_lws, pods)
        claim_name = builders.model_claim(isvc, spec) if live_deployment else None
        claim = kube.get("PersistentVolumeClaim", namespace, claim_name) if claim_name else None
        wanted = desired_status(isvc, deployment=live_deployment, desired_deployment=desired_deployment, now=now,
                                error=out.error, pods=pods, claim=claim, scaling_conflict=conflict, spec=spec)
        if multi_node:
            wanted = lws_status.group_status(isvc, wanted, desired=desired_lws, live=live_lws, pods=pods, now=now)
            pods = [p for p in pods if ((p.get("metadata") or {}).get("labels") or {}).get(
                lws.LABEL_WORKER_INDEX) == "0"]  # only the leaders serve HTTP (LoRA adapters below)
        if out.error is None and adapters.declared(spec):  # LoRA adapters onto the running ready pods
            synced = adapters.sync_pods(spec, pods)
            wanted["adapters"] = synced["adapters"]
            status_, reason, message = synced["condition"]
            wanted["conditions"] = set_condition(wanted["conditions"], type=adapters.CONDITION, status=status_,
                                                 reason=reason, message=message, now=now,
                                                 observed_generation=(isvc.get("metadata") or {}).get("generation"))
        patch = status_patch(isvc.get("status"), wanted)
        if patch:
            kube.patch_status(crd.KIND, namespace, name, patch)
            out.status_patch = patch
            problem = new_pod_problem(isvc.get("status"), wanted) if out.error is None else None
            if problem is not None:
                out.events.append(problem)
                try:
                    kube.create(status_event(isvc, "Warning", problem[0], problem[1], now, service_spec.FIELD_MANAGER))
                except ApiError as e:
                    log.warning("could not post Event %s about %s/%s: %s", problem[0], namespace, name, e)
        return out


def new_pod_problem(old: Mapping[str, Any] | None, new: Mapping[str, Any]) -> tuple[str, str] | None:
    """``(reason, message)`` of ``new``'s Degraded condition when it became True or changed
    reason since ``old`` (then worth one Warning Event), else None."""
    def degraded(st: Mapping[str, Any] | None) -> Mapping[str, Any]:
        return next((c for c in (st or {}).get("conditions") or [] if c.get("type") == "Degraded"), {})
    was, now = degraded(old), degraded(new)
    if now.get("status") != "True" or (was.get("status"), was.get("reason")) == ("True", now.get("reason")):
        return None
    return str(now.get("reason")), str(now.get("message") or "")
