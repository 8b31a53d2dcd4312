"""kopf handlers that scale and tune InferenceServices from the pods' live metrics.

Registered by importing this module (:mod:`kvfleet.operator.handlers` does). Thin: read the
cluster, call the pure functions of :mod:`kvfleet.operator.policy`, write the result.

One kopf daemon per InferenceService that is autoscaled (``mode: operator``) or tuned
(:func:`autoscale`, filter :func:`wants_daemon`) loops every
``spec.autoscaling.metrics.intervalSeconds`` (default 15 s; the environment variable
``KVFLEET_AUTOSCALER_INTERVAL``, in seconds, fractions allowed, overrides it, e.g. in tests):

``spec.autoscaling.mode: operator``
    reads the ready pods' metrics (:mod:`kvfleet.operator.metrics_source`), decides with
    :func:`policy.decide_scale`, and when the replica count changes writes it through the
    InferenceService's **scale subresource** (``PATCH .../inferenceservices/NAME/scale``), so
    only ``spec.replicas`` changes (GitOps tools: ignore ``/spec/replicas``) and the normal
    reconcile moves the Deployment. Each change is a ``Normal`` Event (``ScaledUp`` /
    ``ScaledDown`` / ``ScaledToZero``) whose message carries the decision's inputs; holds
    (``MetricsUnavailable`` as a Warning, ``PodsStarting``, stabilized) are Events when the
    reason changes. ``status.metrics`` holds the latest aggregate; the condition
    ``ScalingActive`` says whether the autoscaler acts. When another HorizontalPodAutoscaler
    targets the same InferenceService, the operator does not scale: ``ScalingActive=False``,
    reason ``ConflictingAutoscaler``, and a Warning Event.
``spec.autoscaling.mode: hpa``
    the HPA from :func:`policy.build_hpa` becomes a child (registered in
    :data:`kvfleet.operator.reconcile.EXTRA_CHILDREN`; pruned when the mode changes). No
    daemon: the HPA scales, and reports in its own status.
``spec.tuning.enabled``
    :func:`policy.tune` over the same metrics and the pods' container statuses (OOM
    restarts); the applied values and the tuner's bookkeeping go to ``status.engine``; the
    builders overlay them on ``spec.engine`` (:func:`builders.effective_engine`), and a
    reconcile is run at once so the ConfigMap (and with it the pods, by the config hash)
    follow. Each change is an Event (``GpuMemoryRaised``, ``GpuMemoryLowered``,
    ``BlockSizeChanged``).

Other InferenceServices get no daemon, hence no finalizer and no writes. When one stops
being autoscaled, its daemon sets ``ScalingActive=False`` (reason ``OperatorAutoscalerOff``)
and exits; kopf removes the finalizer it added for the daemon.

The recommendation history lives in the daemon (like the HPA controller's, in memory). After
an operator restart it is seeded with the current replica count, so the scale-down window
starts over instead of allowing an immediate scale-down.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

import httpx
import kopf

from kvfleet.operator import builders, crd, policy, reconcile
from kvfleet.operator.metrics_source import MetricsSourceError, make_source, pod_is_ready

INTERVAL_ENV = "KVFLEET_AUTOSCALER_INTERVAL"
DEFAULT_INTERVAL = 15.0
CONDITION = "ScalingActive"
DEFAULT_MAX_NUM_SEQS = 128
"""The runtime's default ``max_num_seqs`` (kvfleet.runtime.config.EngineConfig), for the busy floor."""


def interval_seconds(spec: Mapping[str, Any]) -> float:
    """Seconds between two reads: ``$KVFLEET_AUTOSCALER_INTERVAL``, else
    ``spec.autoscaling.metrics.intervalSeconds``, else 15."""
    env = os.environ.get(INTERVAL_ENV)
    if env:
        return max(0.1, float(env))
    return float((((spec.get("autoscaling") or {}).get("metrics") or {}).get("intervalSeconds")) or DEFAULT_INTERVAL)


# ---------------------------------------------------------------------------------
# mode hpa: the HPA as a child of the reconcile


def hpa_children(isvc: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The HPA child in mode ``hpa`` (none otherwise). Raises builders.InvalidSpec on an
    invalid ``spec.autoscaling`` (the reconcile turns that into ``Degraded``)."""
    spec = builders.effective_spec(isvc)
    if spec["autoscaling"].get("mode") != "hpa":
        return []
    try:
        hpa = policy.build_hpa({**isvc, "spec": spec}, labels=builders.labels(isvc))
    except ValueError as e:
        raise builders.InvalidSpec("InvalidAutoscaling", str(e)) from None
    hpa["metadata"]["namespace"] = isvc["metadata"].get("namespace") or "default"
    hpa["metadata"]["name"] = builders.names(isvc)["hpa"]
    hpa["metadata"]["ownerReferences"] = [builders.owner_reference(isvc)]
    return [hpa]


if hpa_children not in reconcile.EXTRA_CHILDREN:
    reconcile.EXTRA_CHILDREN.append(hpa_children)


# ---------------------------------------------------------------------------------
# API helpers (the reconcile's Kube, called from threads)


def _list(kube: reconcile.Kube, api_version: str, plural: str, namespace: str,
          selector: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
    """List objects; the label selector is sent and also checked here (an emulator may
    ignore it)."""
    query = [("labelSelector", ",".join(f"{k}={v}" for k, v in sorted(selector.items())))] if selector else []
    items = (kube._call("GET", kube.path(api_version, plural, namespace), query=query) or {}).get("items") or []
    if selector:
        items = [o for o in items
                 if all(((o.get("metadata") or {}).get("labels") or {}).get(k) == v for k, v in selector.items())]
    return items


def _scale(kube: reconcile.Kube, namespace: str, name: str, replicas: int) -> None:
    """Write ``spec.replicas`` through the scale subresource (merge patch of a Scale)."""
    kube._call("PATCH", kube.path(crd.API_VERSION, crd.PLURAL, namespace, name, "scale"),
               body={"spec": {"replicas": int(replicas)}}, content_type="application/merge-patch+json")


# ---------------------------------------------------------------------------------
# the daemon


@dataclass
class DaemonState:
    """What one InferenceService's daemon remembers between iterations."""

    history: tuple[policy.Recommendation, ...] | None = None
    previous: policy.MetricsAggregate | None = None
    last_reason: str | None = None
    http: httpx.AsyncClient | None = None
    changes: list[tuple[float, int, int]] = field(default_factory=list)
    """``(time, from, to)`` of this daemon's scale changes (for logs and tests)."""


def _event(body: Mapping[str, Any], type_: str, reason: str, message: str, inputs: Mapping[str, Any] | None = None) -> None:
    if inputs:
        message = f"{message}; inputs {json.dumps(inputs, sort_keys=True, separators=(',', ':'))}"
    kopf.event(dict(body), type=type_, reason=reason, message=message[:1024])


def _condition_patch(isvc: Mapping[str, Any], status: str, reason: str, message: str) -> dict[str, Any]:
    """The status patch that sets ``ScalingActive`` ({} when it is already so)."""
    st = isvc.get("status") or {}
    old = st.get("conditions") or []
    current = next((c for c in old if c.get("type") == CONDITION), None)
    if current and (current.get("status"), current.get("reason"), current.get("message")) == (status, reason, message):
        return {}
    conds = builders.set_condition(old, type=CONDITION, status=status, reason=reason, message=message,
                                   now=policy.rfc3339(time.time()),
                                   observed_generation=(isvc.get("metadata") or {}).get("generation"))
    return {"conditions": conds}


def _retire_patch(isvc: Mapping[str, Any], mode: str) -> dict[str, Any]:
    """``ScalingActive=False`` when the operator's autoscaler is off and the condition is
    there from before ({} otherwise: nothing to write)."""
    if not any(c.get("type") == CONDITION for c in (isvc.get("status") or {}).get("conditions") or []):
        return {}
    message = f"autoscaling.mode is {mode}: the operator's autoscaler does not scale this InferenceService"
    if mode == "hpa":
        message += f" (HorizontalPodAutoscaler {builders.names(isvc)['hpa']} does)"
    return _condition_patch(isvc, "False", "OperatorAutoscalerOff", message)


async def _retire(kube: reconcile.Kube, isvc: Mapping[str, Any], mode: str) -> None:
    patch = _retire_patch(isvc, mode)
    if patch:
        meta = isvc["metadata"]
        await asyncio.to_thread(kube.patch_status, crd.KIND, meta["namespace"], meta["name"], patch)


def wants_daemon(spec: Mapping[str, Any], **_: Any) -> bool:
    """The daemon's filter: only InferenceServices the operator scales (mode ``operator``)
    or tunes get one, and with it kopf's finalizer (kopf holds deletion until a daemon has
    stopped). Others (mode ``none``, mode ``hpa`` where the HPA scales) have neither."""
    return (spec.get("autoscaling") or {}).get("mode") == "operator" or bool((spec.get("tuning") or {}).get("enabled"))


async def step(kube: reconcile.Kube, namespace: str, name: str, state: DaemonState,
               logger: logging.Logger, now: float | None = None) -> float:
    """One iteration for one InferenceService; returns the seconds to sleep."""
    isvc = await asyncio.to_thread(kube.get, crd.KIND, namespace, name)
    if isvc is None or (isvc.get("metadata") or {}).get("deletionTimestamp"):
        return DEFAULT_INTERVAL
    spec = builders.effective_spec(isvc)
    interval = interval_seconds(spec)
    auto, tuning = spec["autoscaling"], spec["tuning"]
    mode = auto.get("mode", "none")
    tuning_on = bool(tuning.get("enabled"))
    status_patch: dict[str, Any] = {}

    if mode != "operator" and not tuning_on:  # the daemon is about to stop (see wants_daemon)
        await _retire(kube, isvc, mode)
        state.history, state.previous, state.last_reason = None, None, None
        return interval

    try:
        config = policy.AutoscalingConfig.from_spec(auto) if mode == "operator" else None
        tconfig = policy.TuningConfig.from_spec(tuning) if tuning_on else None
        source = make_source(auto, namespace, client=state.http)
    except ValueError as e:  # the schema's CEL rules should have caught it
        status_patch.update(_condition_patch(isvc, "False", "InvalidAutoscaling", str(e)))
        if status_patch:
            await asyncio.to_thread(kube.patch_status, crd.KIND, namespace, name, status_patch)
        return interval

    now = time.time() if now is None else now
    pods = await asyncio.to_thread(_list, kube, "v1", "pods", namespace, builders.selector_labels(isvc))
    metrics: policy.MetricsAggregate | None
    try:
        metrics = await source.read(pods, now=now, previous=state.previous)
    except MetricsSourceError as e:
        logger.warning("metrics of %s/%s unavailable: %s", namespace, name, e)
        metrics = None
    if metrics is not None:
        state.previous = metrics
        status_patch["metrics"] = {"failedPods": None, "notReadyPods": None, **metrics.to_status()}

    if mode == "operator":
        hpas = await asyncio.to_thread(_list, kube, "autoscaling/v2", "horizontalpodautoscalers", namespace)
        foreign = policy.hpas_targeting([h for h in hpas if not reconcile.owned_by(h, isvc)], name)
        if foreign:
            message = (f"HorizontalPodAutoscaler {', '.join(foreign)} also targets this InferenceService; "
                       "the operator does not scale it while autoscaling.mode is operator (delete the HPA, "
                       "or use autoscaling.mode: hpa)")
            patch = _condition_patch(isvc, "False", "ConflictingAutoscaler", message)
            if patch:
                _event(isvc, "Warning", "ConflictingAutoscaler", message)
            status_patch.update(patch)
            state.last_reason = "ConflictingAutoscaler"
        else:
            current = int((isvc.get("spec") or {}).get("replicas", spec.get("replicas", 1)))
            ready = sum(1 for p in pods if pod_is_ready(p))
            if state.history is None:  # first look since (re)start: the down window starts now
                state.history = (policy.Recommendation(now, current),)
            max_num_seqs = builders.effective_engine(isvc).get("maxNumSeqs") or DEFAULT_MAX_NUM_SEQS
            decision = policy.decide_scale(config, now=now, current=current, ready=ready, metrics=metrics,
                                           history=state.history, max_num_seqs=int(max_num_seqs))
            state.history = decision.history
            if decision.changed:
                await asyncio.to_thread(_scale, kube, namespace, name, decision.replicas)
                state.changes.append((now, decision.current, decision.replicas))
                logger.info("%s/%s: %s", namespace, name, decision.message)
                _event(isvc, "Normal", decision.reason, decision.message, decision.inputs)
                status_patch["lastScaleTime"] = policy.rfc3339(now)
            elif decision.reason != state.last_reason and decision.reason not in ("Stable",):
                _event(isvc, "Warning" if decision.reason == "MetricsUnavailable" else "Normal",
                       decision.reason, decision.message, decision.inputs)
            state.last_reason = decision.reason
            if decision.reason == "MetricsUnavailable":
                cond = ("False", "MetricsUnavailable", decision.message)
            else:
                cond = ("True", "OperatorAutoscaler",
                        f"scaling on queue depth (target {config.target_queue_depth:g} per replica) and KV "
                        f"cache usage (target {config.target_kv_cache_usage:g}) between {config.min_replicas} "
                        f"and {config.max_replicas} replicas")
            status_patch.update(_condition_patch(isvc, *cond))
    else:
        status_patch.update(_retire_patch(isvc, mode))

    rollout = False
    if tconfig is not None:
        tstate = policy.TuningState.from_status((isvc.get("status") or {}).get("engine"))
        decision = policy.tune(tconfig, tstate, now=now, spec_engine=spec["engine"], metrics=metrics, pods=pods)
        if decision.state != tstate:
            status_patch["engine"] = decision.state.to_status()
        for reason, message in decision.changes:
            logger.info("%s/%s: %s", namespace, name, message)
            _event(isvc, "Normal", reason, message)
        rollout = decision.changed

    if status_patch:
        await asyncio.to_thread(kube.patch_status, crd.KIND, namespace, name, status_patch)
    if rollout:  # status.engine changed: rebuild the ConfigMap now (the pods roll by its hash)
        await asyncio.to_thread(reconcile.reconcile, kube, namespace, name)
    return interval


@kopf.daemon(crd.GROUP, crd.VERSION, crd.PLURAL, id="autoscaler", when=wants_daemon,
             cancellation_backoff=5.0, cancellation_timeout=10.0)
async def autoscale(namespace: str, name: str, memo: Any, logger: logging.Logger, stopped: Any, **_: Any) -> None:
    """Scale and tune one InferenceService until it is deleted, no longer autoscaled or
    tuned (then ``ScalingActive`` turns False), or the operator stops or pauses (peering)."""
    kube = getattr(memo, "kube", None)
    if kube is None:
        from kvfleet.operator.handlers import make_kube

        kube = memo.kube = make_kube()
    state = DaemonState(http=httpx.AsyncClient())
    try:
        while not stopped:
            try:
                delay = await step(kube, namespace, name, state, logger)
            except (reconcile.ApiError, httpx.HTTPError, OSError) as e:
                logger.warning("autoscaler of %s/%s: %s", namespace, name, e)
                delay = float(os.environ.get(INTERVAL_ENV) or DEFAULT_INTERVAL)
            await stopped.wait(delay)
        if stopped.reason and stopped.reason & kopf.DaemonStoppingReason.FILTERS_MISMATCH:
            isvc = await asyncio.to_thread(kube.get, crd.KIND, namespace, name)
            if isvc is not None:
                spec = builders.effective_spec(isvc)
                await _retire(kube, isvc, spec["autoscaling"].get("mode", "none"))
    except (reconcile.ApiError, OSError) as e:
        logger.warning("autoscaler of %s/%s stopping: %s", namespace, name, e)
    finally:
        await state.http.aclose()
