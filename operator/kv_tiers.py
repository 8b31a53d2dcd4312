"""Pure: ``spec.engine.kvCache.tiers`` (docs/routing.md, "Peer KV pull" and "Disk tier") into the
runtime's config keys, the runtime pod's disk-tier volume and the router's flag. With no
``tiers`` the peer tier is on (:data:`DEFAULT_TIERS`, issue 42); ``tiers: []`` turns every tier
off, and the runtime's own defaults with them: the config then says ``kv_transfer_config: null``
(and ``kv_events_config: null`` unless the router reads events), never left to the runtime.

- ``peer``: ``kv_transfer_config`` with ``kv_role: kv_both`` (and the tier's ``minPullBlocks`` /
  ``maxConcurrentPulls``), the replicas' KV events (below), and the router's peer hints (on by
  default; ``--no-kv-peer-hint`` without the tier), signed with the service's fleet Secret;
- KV events, for the peer tier and for ``spec.router.algorithm: precise-prefix-cache`` (the caller
  says which: ``kv_events``): ``kv_events_config`` publishing block hashes (no prompt token ids:
  ``include_token_ids: false``) on ``tcp://*:5557`` (port
  ``kv-events`` of the runtime container); the router finds the port in each replica's
  ``/kv_events/snapshot`` and gets ``--kv-events-topic`` when ``extraArgs`` sets a topic. An
  ``extraArgs.kv_events_config`` that turns events off or publishes nothing is refused
  (``ConflictingEngineArg``): the router would silently fall back to the char-prefix ring;
- ``disk``: ``disk_path`` (the tier's ``path``, default :data:`DEFAULT_DISK_PATH`) and
  ``disk_max_bytes`` (its ``size``), on a volume ``kv-disk``: an ``emptyDir`` whose
  ``sizeLimit`` is that size (a restarted container starts warm), the node's ``hostPath`` (a pod
  restarted on the same node does) or a shared ``claimName`` (a scaled-up replica does: the
  replicas write to one folder, renames are atomic; a file another replica's bound deleted is a
  miss, counted and recomputed).

Keys the user sets in ``engine.extraArgs`` are not overridden (the builder refuses duplicates).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvfleet.operator import crd_schema, spec_view
from kvfleet.operator.crd import InvalidSpec
from kvfleet.operator.spec_enums import KVTierType

DEFAULT_DISK_PATH = "/var/cache/kvfleet/kv"
KV_EVENTS_ENDPOINT = "tcp://*:5557"
VOLUME = "kv-disk"
DEFAULT_TIERS = spec_view.section(crd_schema.KV_CACHE, {}).tiers
"""The tiers of a service whose ``kvCache`` is absent: the CRD's default (the peer tier)."""


def tiers(engine: spec_view.Engine) -> dict[str, Any]:
    """The tiers of a view's ``spec.engine``, by type (views of ``kvCache.tiers`` items; absent:
    :data:`DEFAULT_TIERS`, but none with ``tensorParallelSize`` > 1, where each rank caches only a
    share of the heads).

    Raises:
        InvalidSpec: tiers listed with ``tensorParallelSize`` > 1 (the runtime would refuse them)."""
    listed = engine.kv_cache.tiers if engine.kv_cache is not None else None
    tensor_parallel = int(engine.tensor_parallel_size or 1) > 1
    if listed and tensor_parallel:
        raise InvalidSpec("InvalidKVCacheTier", "engine.kvCache.tiers: not with tensorParallelSize > 1 (each rank "
                                                "caches only its share of the KV heads)")
    if listed is None:
        listed = () if tensor_parallel else DEFAULT_TIERS
    return {t.type: t for t in listed}


def _bytes(size: Any) -> int:
    from kubernetes.utils import parse_quantity

    try:
        value = int(parse_quantity(size))
    except ValueError as e:
        raise InvalidSpec("InvalidKVCacheTier", f"engine.kvCache.tiers: disk size {size!r}: {e}") from None
    if value < 1:
        raise InvalidSpec("InvalidKVCacheTier", f"engine.kvCache.tiers: disk size {size!r} must be positive")
    return value


def _events_keys(engine: spec_view.Engine) -> dict[str, Any]:
    """``{"kv_events_config": ...}`` publishing on :data:`KV_EVENTS_ENDPOINT`, or ``{}`` when
    ``extraArgs`` sets its own (checked: it must publish over ZMQ).

    Raises:
        InvalidSpec: ``extraArgs.kv_events_config`` with events off or ``publisher: null``.
    """
    own = (engine.extra_args or {}).get("kv_events_config")
    if own is None:
        return {"kv_events_config": {"enable_kv_cache_events": True, "publisher": "zmq",
                                     "endpoint": KV_EVENTS_ENDPOINT, "include_token_ids": False}}
    if not isinstance(own, Mapping) or not own.get("enable_kv_cache_events") or own.get("publisher") == "null":
        raise InvalidSpec("ConflictingEngineArg",
                          "engine.extraArgs.kv_events_config must publish KV events over ZMQ "
                          "(enable_kv_cache_events: true) for the peer tier and precise-prefix-cache routing")
    return {}


def engine_keys(engine: spec_view.Engine, *, kv_events: bool = False) -> dict[str, Any]:
    """The runtime config keys of the tiers and of the replicas' KV events (empty with neither).

    Args:
        kv_events: the router routes on the replicas' KV events (``precise-prefix-cache``); the
            peer tier turns them on either way.

    Raises:
        InvalidSpec: a disk size that is not a positive quantity; an ``extraArgs.kv_events_config``
            that publishes nothing while events are needed.
    """
    by_type = tiers(engine)
    extra = engine.extra_args or {}
    keys: dict[str, Any] = _events_keys(engine) if kv_events or KVTierType.PEER in by_type else {}
    if not (kv_events or KVTierType.PEER in by_type) and "kv_events_config" not in extra:
        keys["kv_events_config"] = None  # off, not the runtime's default
    if not by_type:
        if "kv_transfer_config" not in extra:
            keys["kv_transfer_config"] = None
        return keys
    transfer: dict[str, Any] = {"kv_connector": "PeerPullConnector",
                                "kv_role": "kv_both" if KVTierType.PEER in by_type else "kv_producer"}
    peer = by_type.get(KVTierType.PEER)
    if peer is not None:
        for name in ("min_pull_blocks", "max_concurrent_pulls"):
            if getattr(peer, name) is not None:
                transfer[name] = getattr(peer, name)
    disk = by_type.get(KVTierType.DISK)
    if disk is not None:
        transfer["disk_path"] = disk.path or DEFAULT_DISK_PATH
        transfer["disk_max_bytes"] = _bytes(disk.size)
    if "kv_transfer_config" not in extra:
        keys["kv_transfer_config"] = transfer
    return keys


def events_ports(engine: spec_view.Engine, *, kv_events: bool = False) -> list[dict[str, Any]]:
    """The runtime container's ``kv-events`` port when the operator writes ``kv_events_config``."""
    wanted = kv_events or KVTierType.PEER in tiers(engine)
    if not wanted or "kv_events_config" in (engine.extra_args or {}):
        return []
    return [{"name": "kv-events", "containerPort": int(KV_EVENTS_ENDPOINT.rsplit(":", 1)[1]), "protocol": "TCP"}]


def disk_volume(engine: spec_view.Engine) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(runtime mounts, pod volumes)`` of the disk tier (both empty without one)."""
    disk = tiers(engine).get(KVTierType.DISK)
    if disk is None:
        return [], []
    mount = {"name": VOLUME, "mountPath": disk.path or DEFAULT_DISK_PATH}
    if disk.host_path:
        volume = {"name": VOLUME, "hostPath": {"path": disk.host_path, "type": "DirectoryOrCreate"}}
    elif disk.claim_name:
        volume = {"name": VOLUME, "persistentVolumeClaim": {"claimName": disk.claim_name}}
    else:
        volume = {"name": VOLUME, "emptyDir": {"sizeLimit": str(disk.size)}}
    return [mount], [volume]


def router_args(engine: spec_view.Engine, *, kv_events: bool = False) -> list[str]:
    """``--no-kv-peer-hint`` without a peer tier (the router names peers by default), and
    ``--kv-events-topic`` when the router reads the replicas' events and ``extraArgs`` sets a topic."""
    peer = KVTierType.PEER in tiers(engine)
    args = [] if peer else ["--no-kv-peer-hint"]
    own = (engine.extra_args or {}).get("kv_events_config")
    topic = own.get("topic") if isinstance(own, Mapping) else None
    if (peer or kv_events) and topic:
        args += ["--kv-events-topic", str(topic)]
    return args
