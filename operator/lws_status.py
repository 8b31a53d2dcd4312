"""The status of a multi-node InferenceService from its LeaderWorkerSet's pods (pure).

A replica is a group of ``size`` pods (:mod:`kvfleet.operator.lws`), labelled by the LWS
controller with ``leaderworkerset.sigs.k8s.io/group-index`` and ``worker-index``. A group is
**whole** when all its ``size`` pods exist and are ready, **updated** when all of them carry the
desired template hash. :func:`progress_views` turns the groups into the replica counts the
Deployment path reads (:func:`kvfleet.operator.status.deployment_progress`: replicas = groups,
ready = whole groups, updated / available = updated groups / updated whole groups), so
``Ready`` / ``Progressing`` (and the tuner's rollout check, :func:`live_view`) mean the same thing for
both; :func:`group_status` adds the
``GroupsWhole`` condition (``False``, reason ``GroupNotWhole``, naming the group and the pods
that are missing or not ready) and the leaders-only ``selector``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvfleet.operator.lws import ANNOTATION_TEMPLATE_HASH as TEMPLATE_HASH
from kvfleet.operator.lws import KIND, LABEL_GROUP_INDEX, LABEL_WORKER_INDEX, pod_selector, template_hash
from kvfleet.operator.service_spec import ANNOTATION_CONFIG_HASH, names, selector_labels
from kvfleet.operator.status import set_condition

CONDITION = "GroupsWhole"


def _ready(pod: Mapping[str, Any]) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (pod.get("status") or {}).get("conditions") or [])


def _size(lws: Mapping[str, Any] | None) -> int:
    return int((((lws or {}).get("spec") or {}).get("leaderWorkerTemplate") or {}).get("size") or 1)


def _want(desired: Mapping[str, Any] | None, live: Mapping[str, Any] | None) -> int:
    for obj in (desired, live):
        replicas = ((obj or {}).get("spec") or {}).get("replicas")
        if replicas is not None:
            return int(replicas)
    return 1  # the LWS API's default


def groups(pods: list[Mapping[str, Any]] | None) -> dict[int, list[Mapping[str, Any]]]:
    """The pods (not being deleted) by group index, each group sorted by worker index."""
    out: dict[int, list[Mapping[str, Any]]] = {}
    for pod in pods or []:
        meta = pod.get("metadata") or {}
        index = (meta.get("labels") or {}).get(LABEL_GROUP_INDEX)
        if index is None or meta.get("deletionTimestamp"):
            continue
        out.setdefault(int(index), []).append(pod)
    for members in out.values():
        members.sort(key=lambda p: int(((p.get("metadata") or {}).get("labels") or {}).get(LABEL_WORKER_INDEX, 0)))
    return out


def broken_groups(pods: list[Mapping[str, Any]] | None, size: int, want: int) -> list[str]:
    """One line per group of ``0 .. want-1`` (and any beyond that has pods) that is not whole."""
    found = groups(pods)
    lines = []
    for index in sorted(set(range(want)) | set(found)):
        members = found.get(index, [])
        if len(members) == size and all(_ready(p) for p in members):
            continue
        ready = sum(1 for p in members if _ready(p))
        have = {int(((p.get("metadata") or {}).get("labels") or {}).get(LABEL_WORKER_INDEX, 0)) for p in members}
        why = [f"{'leader' if w == 0 else 'worker'} {w} missing" for w in range(size) if w not in have]
        why += [f"{'leader' if _worker(p) == 0 else 'worker'} {p['metadata'].get('name')} not ready"
                for p in members if not _ready(p)]
        lines.append(f"group {index}: {ready}/{size} pods ready ({', '.join(why)})")
    return lines


def _worker(pod: Mapping[str, Any]) -> int:
    return int(((pod.get("metadata") or {}).get("labels") or {}).get(LABEL_WORKER_INDEX, 0))


def progress_views(desired: Mapping[str, Any] | None, live: Mapping[str, Any] | None,
                   pods: list[Mapping[str, Any]] | None) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """``(live view, desired view)``: the live and desired LWS as the Deployment-shaped dicts
    :func:`kvfleet.operator.status.desired_status` reads, their counts from the groups' pods
    (the template hash standing in for the config hash). ``(None, view)`` when no LWS is live."""
    want = _want(desired, live)

    def view(obj: Mapping[str, Any] | None) -> dict[str, Any]:
        rolling = (((obj or {}).get("spec") or {}).get("rolloutStrategy") or {}).get("rollingUpdateConfiguration")
        return {"spec": {"replicas": want, "strategy": {"rollingUpdate": dict(rolling or {})},
                         "template": {"metadata": {"annotations": {ANNOTATION_CONFIG_HASH: template_hash(obj)}}}}}

    desired_view = view(desired) if desired is not None else None
    if live is None:
        return None, desired_view
    size, digest = _size(desired or live), template_hash(desired or live)
    found = groups(pods)
    whole = {i for i, m in found.items() if len(m) == size and all(_ready(p) for p in m)}
    updated = {i for i, m in found.items() if len(m) == size and all(
        ((p.get("metadata") or {}).get("annotations") or {}).get(TEMPLATE_HASH) == digest for p in m)}
    live_view = view(live)
    live_view["status"] = {"replicas": len(found), "readyReplicas": len(whole), "updatedReplicas": len(updated),
                           "availableReplicas": len(whole & updated)}
    return live_view, desired_view


def group_status(isvc: Mapping[str, Any], status: Mapping[str, Any], *, desired: Mapping[str, Any] | None,
                 live: Mapping[str, Any] | None, pods: list[Mapping[str, Any]] | None, now: str) -> dict[str, Any]:
    """``status`` (a copy) with the leaders' ``selector`` and the ``GroupsWhole`` condition."""
    out = dict(status)
    out["selector"] = ",".join(f"{k}={v}" for k, v in sorted(pod_selector(isvc).items()))
    if live is None:
        return out
    broken = broken_groups(pods, _size(desired or live), _want(desired, live))
    cond = ("False", "GroupNotWhole", "; ".join(broken)[:1024]) if broken else (
        "True", "AllGroupsWhole", f"every group has its {_size(desired or live)} pods ready")
    out["conditions"] = set_condition(out.get("conditions"), type=CONDITION, status=cond[0], reason=cond[1],
                                      message=cond[2], now=now,
                                      observed_generation=(isvc.get("metadata") or {}).get("generation"))
    return out


def live_view(kube: Any, isvc: Mapping[str, Any]) -> dict[str, Any] | None:
    """The live LWS of ``isvc`` as :func:`progress_views` sees it (None without one): what the
    tuner's rollout check (:func:`kvfleet.operator.tuning.rollout_hold`) reads."""
    namespace = isvc["metadata"].get("namespace") or "default"
    live = kube.get(KIND, namespace, names(isvc)["deployment"])
    if live is None:
        return None
    return progress_views(live, live, kube.list_objects("Pod", namespace, selector_labels(isvc)))[0]
