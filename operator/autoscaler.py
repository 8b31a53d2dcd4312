"""The operator's autoscaler: one operator-wide loop that scales and tunes InferenceServices
from the pods' live metrics. Thin: read the cluster, call the pure :mod:`kvfleet.operator.policy`
and :mod:`kvfleet.operator.tuning`, write the result.

- :func:`autoscaled_index` (a kopf index, no finalizer) holds the InferenceServices in mode
  ``operator`` or with ``spec.tuning.enabled`` (and, once more, those to retire, :func:`needs_retire`);
- :class:`AutoscalerLoop` (started and stopped by kopf startup/cleanup handlers) runs
  :func:`step` for each every ``intervalSeconds`` (``$KVFLEET_AUTOSCALER_INTERVAL`` overrides);
  one object's failure is logged and retried, the others go on;
- :func:`step` scales through the InferenceService's scale subresource, tunes through
  ``status.engine`` (then reconciles), posts Events, writes ``status.metrics`` and the
  ``ScalingActive`` condition;
- while kopf peering pauses this operator (:func:`pause_reason`) the loop acts on nothing.

Mode ``hpa`` is not in the loop (the HPA is a child: :func:`builders.build_hpa`). See docs/autoscaling.md.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import logging
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx
import kopf

from kvfleet.operator import builders, crd, hpa, pod_metrics, policy, reconcile, router, service_spec, tuning
from kvfleet.operator.kube import ApiError, Kube, make_kube
from kvfleet.operator.metrics_source import MetricsSourceError, make_source, pod_is_ready
from kvfleet.operator.router_load import read_router_load
from kvfleet.operator.status import autoscaler_off_message, set_condition
from kvfleet.operator.status import event as status_event
from kvfleet.operator.times import parse_datetime, rfc3339

log = logging.getLogger(__name__)

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
# the per-object iteration


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
    return (spec.get("autoscaling") or {}).get("mode") == "operator" or bool((spec.get("tuning") or {}).get("enabled"))


def needs_retire(body: Mapping[str, Any]) -> bool:
    """Whether the InferenceService is not autoscaled or tuned but still carries a
    ``ScalingActive`` condition that does not say so (it just stopped being autoscaled, or
    it was switched while the operator was down): the loop visits it once more to set
    ``ScalingActive=False``, reason ``OperatorAutoscalerOff``."""
    try:
        mode = service_spec.effective_spec(body)["autoscaling"].get("mode", "none")
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
    spec = service_spec.effective_spec(isvc)
    interval = interval_seconds(spec)
    auto, tuning_spec = spec["autoscaling"], spec["tuning"]
    mode = auto.get("mode", "none")
    tuning_on = bool(tuning_spec.get("enabled"))
    status_patch: dict[str, Any] = {}

    if mode != "operator" and not tuning_on:  # leaving the loop (see wants_autoscaler)
        await _retire(kube, isvc, mode)
        state.history, state.previous, state.last_reason = None, None, None
        return interval

    try:
        config = policy.AutoscalingConfig.from_spec(auto) if mode == "operator" else None
        tconfig = tuning.TuningConfig.from_spec(tuning_spec) if tuning_on else None
        source = make_source(auto, namespace, client=state.http)
    except ValueError as e:  # the schema's CEL rules should have caught it
        status_patch.update(_condition_patch(isvc, "False", "InvalidAutoscaling", str(e)))
        if status_patch:
            await asyncio.to_thread(kube.patch_status, crd.KIND, namespace, name, status_patch)
        return interval

    now = time.time() if now is None else now
    pods = await asyncio.to_thread(kube.list_objects, "Pod", namespace, service_spec.selector_labels(isvc))
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

    if mode == "operator":
        foreign = await asyncio.to_thread(reconcile.foreign_scalers, kube, isvc)
        if foreign:
            message = hpa.conflict_message(foreign, mode)
            patch = _condition_patch(isvc, "False", "ConflictingAutoscaler", message)
            if patch:
                await _event(kube, isvc, "Warning", "ConflictingAutoscaler", message)
            status_patch.update(patch)
            state.last_reason = "ConflictingAutoscaler"
        else:
            current = int((isvc.get("spec") or {}).get("replicas", spec.get("replicas", 1)))
            ready = sum(1 for p in pods if pod_is_ready(p))
            if state.history is None:  # first look since (re)start: the down window starts now
                state.history = (policy.Recommendation(now, current),)
            max_num_seqs = builders.effective_engine(isvc).get("maxNumSeqs") or DEFAULT_MAX_NUM_SEQS
            routers = None
            if router.enabled(isvc):  # wake from zero on held requests; never 0 with requests in flight
                router_pods = await asyncio.to_thread(kube.list_objects, "Pod", namespace,
                                                      router.selector_labels(isvc))
                routers = await read_router_load(state.http, router_pods)
            decision = policy.decide_scale(config, now=now, current=current, ready=ready, metrics=metrics,
                                           history=state.history, max_num_seqs=int(max_num_seqs),
                                           router=routers)
            state.history = decision.history
            if decision.changed:
                await asyncio.to_thread(kube.scale, crd.KIND, namespace, name, decision.replicas)
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
    else:
        status_patch.update(_retire_patch(isvc, mode))

    rollout = False
    if tconfig is not None:
        tstate = tuning.TuningState.from_status((isvc.get("status") or {}).get("engine"))
        deployment = await asyncio.to_thread(kube.get, "Deployment", namespace, service_spec.names(isvc)["deployment"])
        decision = tuning.tune(tconfig, tstate, now=now, spec_engine=spec["engine"], metrics=metrics, pods=pods,
                               hold=tuning.rollout_hold(deployment))
        if decision.state != tstate:
            status_patch["engine"] = decision.state.to_status()
        held = decision.held[0] if decision.held else None
        if held != state.tuning_held and decision.held and held != "RollingOut":
            logger.info("%s/%s: tuning held: %s", namespace, name, decision.held[1])
            await _event(kube, isvc, "Normal", "TuningHeld", decision.held[1])
        state.tuning_held = held
        for reason, message in decision.changes:
            logger.info("%s/%s: %s", namespace, name, message)
            await _event(kube, isvc, "Normal", reason, message)
        rollout = decision.changed

    if status_patch:
        await asyncio.to_thread(kube.patch_status, crd.KIND, namespace, name, status_patch)
    if rollout:  # status.engine changed: rebuild the ConfigMap now (the pods roll by its hash)
        await asyncio.to_thread(reconcile.reconcile, kube, namespace, name)
    return interval


# ---------------------------------------------------------------------------------
# peering: is this operator paused?


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


# ---------------------------------------------------------------------------------
# the operator-wide loop


INDEX = "autoscaled"
"""The kopf index of the InferenceServices the loop works on: ``{(namespace, name): uid}``
(kopf passes it to handlers as the keyword argument of that name)."""
TICK = 1.0
"""Longest sleep of the loop (seconds): how soon a newly indexed InferenceService is visited."""
PEERING_TTL = TICK
"""Seconds a "not paused" answer of :func:`pause_reason` is reused: the peering object is
read at most once per this time, however many objects fall due in it (their due times
spread out, so without it every object's iteration would cost one more API read). With
one object, or intervals longer than this, every iteration still checks first."""
MAX_CONCURRENT = 8
"""Iterations run at the same time (each waits on API calls and metrics scrapes)."""


@kopf.index(crd.GROUP, crd.VERSION, crd.PLURAL, id=INDEX, when=tracked)
def autoscaled_index(namespace: str, name: str, uid: str, **_: Any) -> dict[tuple[str, str], str]:
    """Index the InferenceServices the loop works on (filter :func:`tracked`). kopf keeps
    the index from its watch, drops an object when it is deleted or stops matching, and
    needs no finalizer for indices."""
    return {(namespace, name): uid}


class AutoscalerLoop:
    """One loop for the whole operator: every InferenceService in ``index`` gets
    :func:`step` every ``interval`` seconds, with its own :class:`ServiceState`.

    - Objects are visited concurrently (at most :data:`MAX_CONCURRENT` at once), each as
      its own task: a slow or failing one (API error, bad metrics, a bug) is logged and
      retried after the interval; the others go on.
    - Per iteration of one object: a GET of it, a LIST of its pods, a scrape of each ready
      pod (or one Prometheus query), and for mode ``operator`` a LIST of the namespace's
      HPAs; writes only on a change. Per pass: at most one read of the peering object per
      :data:`PEERING_TTL` (one per namespace for a namespaced operator).
    - State is dropped for objects that leave the index (deleted, no longer autoscaled or
      tuned; :func:`step` has set ``ScalingActive=False`` before that).
    - Before starting iterations it asks :func:`pause_reason`; while the operator is
      paused by peering it starts none, cancels those in flight and forgets all state (as a
      restart would: the history is seeded afresh on resume).

    Args:
        kube: the API client.
        index: kopf's index :data:`INDEX` (a live, read-only mapping ``(namespace, name) -> uids``).
        settings: kopf's settings (peering name, priority, mode).
        identity: this operator's kopf peering identity (None: unknown, see :func:`peers_ahead`).
        logger: where to log.
    """

    def __init__(self, kube: Kube, index: Mapping[tuple[str, str], Any], settings: kopf.OperatorSettings,
                 identity: str | None, logger: logging.Logger):
        self.kube, self.index, self.settings, self.identity, self.logger = kube, index, settings, identity, logger
        self.states: dict[tuple[str, str], ServiceState] = {}
        self.running: dict[tuple[str, str], asyncio.Task[None]] = {}
        self.paused: str | None = None
        self.recheck_at = 0.0
        """``time.monotonic()`` before which :func:`pause_reason` is not asked again (paused:
        the shortest interval; not paused: :data:`PEERING_TTL`)."""
        self.http = httpx.AsyncClient()
        self._limit = asyncio.Semaphore(MAX_CONCURRENT)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self.run(), name="kvfleet autoscaler loop")

    async def stop(self) -> None:
        """Stop the loop and the iterations in flight; close the HTTP client."""
        tasks = [t for t in [self._task, *self.running.values()] if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.running.clear()
        await self.http.aclose()

    async def run(self) -> None:
        while True:
            try:
                await self.tick()
            except Exception:
                self.logger.exception("autoscaler loop")
            await asyncio.sleep(self._sleep())

    def _sleep(self) -> float:
        now = time.monotonic()
        waits = [st.due - now for key, st in self.states.items() if key not in self.running]
        if self.paused:
            waits.append(self.recheck_at - now)
        return max(0.05, min([TICK, *waits]))

    def _forget(self, key: tuple[str, str]) -> None:
        self.states.pop(key, None)
        task = self.running.pop(key, None)
        if task is not None:
            task.cancel()

    async def tick(self) -> None:
        """One pass: drop what left the index, check peering, start the due iterations."""
        keys = set(self.index)
        for key in [k for k in self.states if k not in keys]:
            self._forget(key)
        now = time.monotonic()
        due = [k for k in sorted(keys) if k not in self.running
               and (k not in self.states or self.states[k].due <= now)]
        if not due:
            return
        if now >= self.recheck_at:
            try:
                reason = await asyncio.to_thread(pause_reason, self.kube, self.settings, self.identity,
                                                 {ns for ns, _ in keys})
            except ApiError as e:
                reason = f"the peering object could not be read: {e}"
            if reason:
                if reason != self.paused:
                    self.logger.info("autoscaler paused: %s", reason)
                recheck = min([st.interval for st in self.states.values()] or [_default_interval()])
                for key in list(self.states):
                    self._forget(key)
                self.paused, self.recheck_at = reason, now + recheck
                return
            if self.paused:
                self.logger.info("autoscaler resumed")
                self.paused = None
            self.recheck_at = now + PEERING_TTL
        elif self.paused:
            return
        for key in due:
            state = self.states.setdefault(key, ServiceState(http=self.http, interval=_default_interval()))
            self.running[key] = asyncio.create_task(self._iterate(key, state), name=f"autoscaler {key[0]}/{key[1]}")

    async def _iterate(self, key: tuple[str, str], state: ServiceState) -> None:
        namespace, name = key
        try:
            async with self._limit:
                try:
                    delay = await step(self.kube, namespace, name, state, self.logger)
                except (ApiError, httpx.HTTPError, OSError) as e:
                    self.logger.warning("autoscaler of %s/%s: %s", namespace, name, e)
                    delay = state.interval
                except Exception:
                    self.logger.exception("autoscaler of %s/%s", namespace, name)
                    delay = state.interval
            state.interval = delay
            state.due = time.monotonic() + delay
        finally:
            if self.running.get(key) is asyncio.current_task():
                del self.running[key]


def _default_interval() -> float:
    """The interval before an object's spec is known: ``$KVFLEET_AUTOSCALER_INTERVAL``, else 15 s."""
    return interval_seconds({})


@kopf.on.startup(id="autoscaler-start")
async def start_autoscaler(memo: Any, settings: kopf.OperatorSettings, logger: logging.Logger,
                           **kwargs: Any) -> None:
    """Start the loop (after :func:`kvfleet.operator.handlers.configure`, which made ``memo.kube``).

    The peering identity comes from ``memo.peering_identity`` (``kvfleet operator`` passes
    the same value to ``kopf.run(identity=...)``), else ``$POD_ID`` (what kopf itself uses)."""
    kube = getattr(memo, "kube", None)
    if kube is None:
        kube = memo.kube = make_kube()
    identity = getattr(memo, "peering_identity", None) or os.environ.get("POD_ID")
    loop = memo.autoscaler = AutoscalerLoop(kube, kwargs[INDEX], settings, identity, log)
    loop.start()
    logger.info("autoscaler loop started (peering identity %s)", identity or "unknown")


@kopf.on.cleanup(id="autoscaler-stop")
async def stop_autoscaler(memo: Any, **_: Any) -> None:
    """Stop the loop when the operator stops."""
    loop = getattr(memo, "autoscaler", None)
    if loop is not None:
        await loop.stop()
