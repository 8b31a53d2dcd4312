"""One autoscaler iteration for one InferenceService (:func:`step`): read it, its pods and
their metrics, call the pure :mod:`kvfleet.operator.policy` and :mod:`kvfleet.operator.tuning`,
write the result.

It scales through the InferenceService's scale subresource (and, for a multi-node one, its
LeaderWorkerSet's, whose leaders are the pods it reads: :mod:`kvfleet.operator.lws`), tunes through ``status.engine``
(then reconciles), posts Events, writes ``status.metrics`` and the ``ScalingActive`` condition.
:class:`ServiceState` is what the loop (:mod:`kvfleet.operator.autoscaler`) keeps between two
iterations; :func:`tracked` says which objects it visits (:func:`wants_autoscaler`, or once more
to retire the condition, :func:`needs_retire`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvfleet.operator import (
    builders,
    crd,
    hpa,
    lws,
    lws_status,
    pod_metrics,
    policy,
    reconcile,
    router,
    service_spec,
    spec_view,
    tuning,
)
from kvfleet.operator.kube import ApiError, Kube
from kvfleet.operator.metrics_source import MetricsSourceError, make_source, pod_is_ready
from kvfleet.operator.router_load import read_router_load
from kvfleet.operator.spec_enums import AutoscalingMode
from kvfleet.operator.status import autoscaler_off_message, set_condition
from kvfleet.operator.status import event as status_event
from kvfleet.operator.times import rfc3339
from kvfleet.runtime import env

log = logging.getLogger(__name__)


INTERVAL_ENV = env.AUTOSCALER_INTERVAL.name
DEFAULT_INTERVAL = 15.0
CONDITION = "ScalingActive"
DEFAULT_MAX_NUM_SEQS = 128
"""The runtime's default ``max_num_seqs`` (kvfleet.runtime.config.EngineConfig), for the busy floor."""


def interval_seconds(spec: spec_view.Spec | None) -> float:
    """Seconds between two reads: ``$KVFLEET_AUTOSCALER_INTERVAL``, else
    ``spec.autoscaling.metrics.intervalSeconds`` (the CRD's default 15), else (no spec yet) 15."""
    interval = env.AUTOSCALER_INTERVAL.get()
    if interval is not None:
        return max(0.1, interval)
    return float((spec.autoscaling.metrics.interval_seconds if spec is not None else None) or DEFAULT_INTERVAL)


@dataclass
class ServiceState:
    """What the loop remembers about one InferenceService between iterations (in memory,
    like the HPA controller's recommendations; forgotten when the object leaves the loop,
    when the operator pauses, and on restart)."""

    history: tuple[policy.Recommendation, ...] | None = None
    previous: pod_metrics.MetricsAggregate | None = None
    last_reason: str | None = None
    tuning_held: str | None = None
    """The last :func:`tuning.rollout_hold` reason (an Event when it changes to one that is not
    ``RollingOut``)."""
    http: httpx.AsyncClient | None = None
    """The client for the pods' /metrics (the loop's shared one; None: one per read)."""
    changes: list[tuple[float, int, int]] = field(default_factory=list)
    """``(time, from, to)`` of the scale changes made for this object (for logs and tests)."""
    due: float = 0.0
    """``time.monotonic()`` at which the next iteration is due."""
    interval: float = DEFAULT_INTERVAL
    """Seconds between iterations, as the last one found (``interval_seconds``)."""


async def _event(kube: Kube, body: Mapping[str, Any], type_: str, reason: str, message: str,
                 inputs: Mapping[str, Any] | None = None) -> None:
    """Post a ``core/v1`` Event about ``body`` (``reportingComponent`` ``kvfleet-operator``).

    kopf's ``kopf.event`` only works inside kopf's per-object handlers (it needs their
    context), so the loop posts through the API itself. A failed post is logged, not raised:
    an Event is never worth a missed scaling step."""
    if inputs:
        message = f"{message}; inputs {json.dumps(inputs, sort_keys=True, separators=(',', ':'))}"
    meta = body.get("metadata") or {}
    namespace = meta.get("namespace") or "default"
    event = status_event(body, type_, reason, message, rfc3339(), service_spec.FIELD_MANAGER)
    try:
        await asyncio.to_thread(kube.create, event)
    except ApiError as e:
        log.warning("could not post Event %s about %s/%s: %s", reason, namespace, meta.get("name"), e)


def _condition_patch(isvc: Mapping[str, Any], status: str, reason: str, message: str) -> dict[str, Any]:
    """The status patch that sets ``ScalingActive`` ({} when it is already so)."""
    st = isvc.get("status") or {}
    old = st.get("conditions") or []
    current = next((c for c in old if c.get("type") == CONDITION), None)
    if current and (current.get("status"), current.get("reason"), current.get("message")) == (status, reason, message):
        return {}
    conds = set_condition(old, type=CONDITION, status=status, reason=reason, message=message,
                                   now=rfc3339(time.time()),
                                   observed_generation=(isvc.get("metadata") or {}).get("generation"))
    return {"conditions": conds}


def _retire_patch(isvc: Mapping[str, Any], mode: str) -> dict[str, Any]:
    """``ScalingActive=False`` when the operator's autoscaler is off and the condition is
    there from before ({} otherwise: nothing to write; a ``ConflictingAutoscaler`` there is the
    reconcile's, about a scaler on the Deployment, and it clears that one)."""
    current = next((c for c in (isvc.get("status") or {}).get("conditions") or [] if c.get("type") == CONDITION), None)
    if current is None or current.get("reason") == "ConflictingAutoscaler":  # the reconcile's (a Deployment scaler)
        return {}
    return _condition_patch(isvc, "False", "OperatorAutoscalerOff", autoscaler_off_message(isvc, mode))


async def _retire(kube: Kube, isvc: Mapping[str, Any], mode: str) -> None:
    patch = _retire_patch(isvc, mode)
    if patch:
        meta = isvc["metadata"]
        await asyncio.to_thread(kube.patch_status, crd.KIND, meta["namespace"], meta["name"], patch)


def wants_autoscaler(spec: Mapping[str, Any], **_: Any) -> bool:
    """Whether the loop works on an InferenceService: the operator scales it (mode
    ``operator``) or tunes it. Others (mode ``none``; mode ``hpa``, where the HPA scales)
    get no reads and no writes."""
    view = spec_view.of({"spec": spec})
    return view.autoscaling.mode == AutoscalingMode.OPERATOR or bool(view.tuning.enabled)


def needs_retire(body: Mapping[str, Any]) -> bool:
    """Whether the InferenceService is not autoscaled or tuned but still carries a
    ``ScalingActive`` condition that does not say so (it just stopped being autoscaled, or
    it was switched while the operator was down): the loop visits it once more to set
    ``ScalingActive=False``, reason ``OperatorAutoscalerOff``."""
    try:
        mode = spec_view.of(body).autoscaling.mode
    except (TypeError, AttributeError, KeyError, ValueError):  # a malformed spec: the reconcile reports it
        return False
    return bool(_retire_patch(body, mode))


def tracked(spec: Mapping[str, Any], body: Mapping[str, Any], **_: Any) -> bool:
    """The index's filter (:func:`autoscaled_index`): :func:`wants_autoscaler` or
    :func:`needs_retire`, and not being deleted."""
    if (body.get("metadata") or {}).get("deletionTimestamp"):
        return False
    return wants_autoscaler(spec) or needs_retire(body)


async def step(kube: Kube, namespace: str, name: str, state: ServiceState,
               logger: logging.Logger, now: float | None = None) -> float:
    """One iteration for one InferenceService: read it, its pods and their metrics, decide,
    write. ``now`` (Unix seconds, default the clock) is the decisions' time. Returns the
    seconds until the next iteration.

    Raises:
        ApiError, httpx.HTTPError, OSError: an API call failed (the loop logs it
            and tries again after the interval).
    """
    isvc = await asyncio.to_thread(kube.get, crd.KIND, namespace, name)
    if isvc is None or (isvc.get("metadata") or {}).get("deletionTimestamp"):
        return DEFAULT_INTERVAL
    spec = spec_view.of(isvc)
    interval = interval_seconds(spec)
    mode, tuning_on = spec.autoscaling.mode, bool(spec.tuning.enabled)
    status_patch: dict[str, Any] = {}

    if mode != AutoscalingMode.OPERATOR and not tuning_on:  # leaving the loop (see wants_autoscaler)
        await _retire(kube, isvc, mode)
        state.history, state.previous, state.last_reason = None, None, None
        return interval

    try:
        config = policy.AutoscalingConfig.from_view(spec.autoscaling) if mode == AutoscalingMode.OPERATOR else None
        tconfig = tuning.TuningConfig.from_view(spec.tuning) if tuning_on else None
        source = make_source(spec.autoscaling, namespace, client=state.http)
    except ValueError as e:  # the schema's CEL rules should have caught it
        status_patch.update(_condition_patch(isvc, "False", "InvalidAutoscaling", str(e)))
        if status_patch:
            await asyncio.to_thread(kube.patch_status, crd.KIND, namespace, name, status_patch)
        return interval

    now = time.time() if now is None else now
    pods = await asyncio.to_thread(kube.list_objects, "Pod", namespace, lws.pod_selector(isvc))  # leaders only
    metrics: pod_metrics.MetricsAggregate | None
    try:
        metrics = await source.read(pods, now=now, previous=state.previous)
    except MetricsSourceError as e:
        logger.warning("metrics of %s/%s unavailable: %s", namespace, name, e)
        metrics = None
    if metrics is not None:
        state.previous = metrics
        new_metrics = {"failedPods": None, "notReadyPods": None, **metrics.to_status()}
        if pod_metrics.metrics_changed((isvc.get("status") or {}).get("metrics"), new_metrics):
            status_patch["metrics"] = new_metrics

    if config is not None:
        status_patch.update(await _scale(kube, isvc, spec, config, state, logger, now=now, pods=pods, metrics=metrics))
    else:
        status_patch.update(_retire_patch(isvc, mode))
    rollout = False
    if tconfig is not None:
        engine_patch, rollout = await _tune(kube, isvc, spec, tconfig, state, logger, now=now, pods=pods,
                                            metrics=metrics)
        status_patch.update(engine_patch)

    if status_patch:
        await asyncio.to_thread(kube.patch_status, crd.KIND, namespace, name, status_patch)
    if rollout:  # status.engine changed: rebuild the ConfigMap now (the pods roll by its hash)
        await asyncio.to_thread(reconcile.reconcile, kube, namespace, name)
    return interval


async def _scale(kube: Kube, isvc: Mapping[str, Any], spec: spec_view.Spec, config: policy.AutoscalingConfig,
                 state: ServiceState, logger: logging.Logger, *, now: float, pods: list[dict[str, Any]],
                 metrics: pod_metrics.MetricsAggregate | None) -> dict[str, Any]:
    """Mode ``operator``: decide the replica count (unless a foreign autoscaler targets the
    service), scale through the scale subresource, post Events. Returns the status patch."""
    namespace, name = isvc["metadata"]["namespace"], isvc["metadata"]["name"]
    foreign = await asyncio.to_thread(reconcile.foreign_scalers, kube, isvc)
    if foreign:
        message = hpa.conflict_message(foreign, AutoscalingMode.OPERATOR.value)
        patch = _condition_patch(isvc, "False", "ConflictingAutoscaler", message)
        if patch:
            await _event(kube, isvc, "Warning", "ConflictingAutoscaler", message)
        state.last_reason = "ConflictingAutoscaler"
        return patch
    status_patch: dict[str, Any] = {}
    current = int(spec.replicas)  # the CRD's default 1 when unset
    ready = sum(1 for p in pods if pod_is_ready(p))
    if state.history is None:  # first look since (re)start: the down window starts now
        state.history = (policy.Recommendation(now, current),)
    max_num_seqs = builders.effective_engine(isvc, spec).max_num_seqs or DEFAULT_MAX_NUM_SEQS
    routers = None
    if spec.router.enabled:  # wake from zero on held requests; never 0 with requests in flight
        router_pods = await asyncio.to_thread(kube.list_objects, "Pod", namespace, router.selector_labels(isvc))
        routers = await read_router_load(state.http, router_pods)
    decision = policy.decide_scale(config, now=now, current=current, ready=ready, metrics=metrics,
                                   history=state.history, max_num_seqs=int(max_num_seqs), router=routers)
    state.history = decision.history
    if decision.changed:
        await asyncio.to_thread(kube.scale, crd.KIND, namespace, name, decision.replicas)
        await asyncio.to_thread(lws.scale, kube, isvc, decision.replicas)  # nodes > 1: the LWS's /scale too
        state.changes.append((now, decision.current, decision.replicas))
        logger.info("%s/%s: %s", namespace, name, decision.message)
        await _event(kube, isvc, "Normal", decision.reason, decision.message, decision.inputs)
        status_patch["lastScaleTime"] = rfc3339(now)
    elif decision.reason != state.last_reason and decision.reason not in ("Stable",):
        await _event(kube, isvc, "Warning" if decision.reason == "MetricsUnavailable" else "Normal",
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
    return status_patch


async def _tune(kube: Kube, isvc: Mapping[str, Any], spec: spec_view.Spec, tconfig: tuning.TuningConfig,
                state: ServiceState, logger: logging.Logger, *, now: float, pods: list[dict[str, Any]],
                metrics: pod_metrics.MetricsAggregate | None) -> tuple[dict[str, Any], bool]:
    """``spec.tuning``: the tuner's decision, its Events. Returns ``(status patch, whether
    status.engine changed)``."""
    namespace, name = isvc["metadata"]["namespace"], isvc["metadata"]["name"]
    tstate = tuning.TuningState.from_status((isvc.get("status") or {}).get("engine"))
    deployment = await asyncio.to_thread(kube.get, "Deployment", namespace, service_spec.names(isvc)["deployment"])
    if lws.enabled(isvc):  # a multi-node service: its groups, as the rollout check reads a Deployment
        deployment = await asyncio.to_thread(lws_status.live_view, kube, isvc)
    decision = tuning.tune(tconfig, tstate, now=now, spec_engine=spec.engine, metrics=metrics, pods=pods,
                           hold=tuning.rollout_hold(deployment))
    patch = {"engine": decision.state.to_status()} if decision.state != tstate else {}
    held = decision.held[0] if decision.held else None
    if held != state.tuning_held and decision.held and held != "RollingOut":
        logger.info("%s/%s: tuning held: %s", namespace, name, decision.held[1])
        await _event(kube, isvc, "Normal", "TuningHeld", decision.held[1])
    state.tuning_held = held
    for reason, message in decision.changes:
        logger.info("%s/%s: %s", namespace, name, message)
        await _event(kube, isvc, "Normal", reason, message)
    return patch, decision.changed
