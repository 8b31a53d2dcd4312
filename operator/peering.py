"""Whether kopf peering pauses this operator: :func:`pause_reason` reads the peering object
kopf decides it from and judges it with :func:`peers_ahead` (kopf's own rule, pure).

kopf does not expose its paused state, so the autoscaler loop (:mod:`kvfleet.operator.autoscaler`)
asks here before it acts on anything.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Mapping
from typing import Any

import kopf

from kvfleet.operator.kube import Kube
from kvfleet.operator.times import parse_datetime


def peers_ahead(status: Mapping[str, Any] | None, *, identity: str | None, priority: int,
                now: datetime.datetime, same_priority_pauses: bool = True) -> list[str]:
    """The live peers in a kopf peering object's ``status`` for which this operator pauses.

    kopf's rule (``process_peering_event`` in kopf/_core/engines/peering.py, kopf 1.45): a
    peer is an entry ``identity: {priority, lifetime (s), lastseen (ISO 8601)}``; it is dead
    when ``lastseen + lifetime <= now`` (no ``lastseen``: alive). This operator pauses while
    a live peer other than itself has a higher priority, or the same priority (kopf pauses
    both then) unless the operator shards by label selectors (``same_priority_pauses``
    False). With ``identity`` None (unknown) an entry of the same priority may be this
    operator itself, so only higher priorities count.

    Args:
        status: the peering object's ``status`` (None or {}: no peers).
        identity: this operator's peering identity (``kopf.run(identity=...)``).
        priority: this operator's priority (``settings.peering.priority``).
        now: the current time (timezone-aware).
    """
    out = []
    for peer, info in (status or {}).items():
        if peer == identity or not isinstance(info, Mapping):
            continue
        try:
            lastseen = parse_datetime(info.get("lastseen")) or now
        except ValueError:
            lastseen = now
        if lastseen + datetime.timedelta(seconds=int(info.get("lifetime", 60))) <= now:
            continue
        p = int(info.get("priority", 0))
        if p > priority or (p == priority and same_priority_pauses and identity is not None):
            out.append(peer)
    return sorted(out)


def pause_reason(kube: Kube, settings: kopf.OperatorSettings, identity: str | None,
                 namespaces: Iterable[str]) -> str | None:
    """Why this operator is paused by kopf peering, or None when it may act.

    kopf does not expose its paused state (an internal ``ToggleSet``), so this reads what
    kopf decides it from: the peering object ``settings.peering.name`` (a
    ``ClusterKopfPeering`` for a cluster-wide operator; for a namespaced one the
    ``KopfPeering`` in each of ``namespaces``, the namespaces the loop works in), judged with
    :func:`peers_ahead`. Like kopf: ``--standalone`` never pauses; a missing peering object
    (or peering CRD) pauses only when peering is mandatory (``--peering NAME``).

    Raises:
        ApiError: the peering object could not be read (the loop then does not act).
    """
    peering = settings.peering
    if peering.standalone:
        return None
    if peering.clusterwide:
        targets = [("ClusterKopfPeering", None)]
    else:
        targets = [("KopfPeering", ns) for ns in sorted(set(namespaces))]
    now = datetime.datetime.now(datetime.UTC)
    for kind, namespace in targets:
        obj = kube.get(kind, namespace, peering.name)  # type: ignore[arg-type]  # None: cluster-scoped
        where = f"{kind} {namespace + '/' if namespace else ''}{peering.name}"
        if obj is None:
            if peering.mandatory:
                return f"{where} does not exist (peering is mandatory)"
            continue
        ahead = peers_ahead(obj.get("status"), identity=identity, priority=int(peering.priority), now=now,
                            same_priority_pauses=not settings.watching.shard_selectors)
        if ahead:
            return f"{where}: paused in favour of {', '.join(ahead)}"
    return None
