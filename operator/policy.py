"""Scaling decisions for InferenceServices: pure functions of plain data.

No API calls, no clock, no I/O: the time comes in as ``now`` (seconds since the epoch) and the
state that must survive between two decisions (the recommendation history) goes in and comes
back out as a value. :mod:`kvfleet.operator.autoscaler` reads the cluster, calls these and
writes their results.

- :class:`AutoscalingConfig` (``spec.autoscaling``) + :func:`decide_scale` -> :class:`ScaleDecision`
  (mode ``operator``), the Kubernetes HPA algorithm on queue depth, KV cache usage and busy
  batch slots, with its stabilization windows and rate limit (docs/autoscaling.md);
- :class:`RouterLoad`: the routers' held and in-flight requests, which wake a service from zero.

What it decides on (:class:`~kvfleet.operator.pod_metrics.MetricsAggregate`) is built in
:mod:`kvfleet.operator.pod_metrics`; mode ``hpa`` (the HPA child) and foreign autoscalers are
:mod:`kvfleet.operator.hpa`; tuning (``spec.tuning``) is :mod:`kvfleet.operator.tuning`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvfleet.operator import crd_schema, spec_view
from kvfleet.operator.pod_metrics import MetricsAggregate, status_number
from kvfleet.operator.spec_enums import AutoscalingMode

MODES = tuple(AutoscalingMode)


@dataclass(frozen=True)
class AutoscalingConfig:
    """``spec.autoscaling`` with its defaults (see the CRD in :mod:`kvfleet.operator.crd`)."""

    mode: str = AutoscalingMode.NONE.value
    min_replicas: int = 1
    max_replicas: int = 1
    target_queue_depth: float = 4.0
    """Waiting requests per replica the fleet is sized for (> 0)."""
    target_kv_cache_usage: float = 0.8
    """Mean KV cache usage (0-1] above which replicas are added."""
    scale_up_window: float = 0.0
    """Scale-up stabilization window, seconds (HPA default 0)."""
    scale_down_window: float = 300.0
    """Scale-down stabilization window, seconds (HPA default 300)."""

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any] | None) -> AutoscalingConfig:
        """``spec.autoscaling`` given as a dict in the CRD's spelling (None or {}: mode none):
        :meth:`from_view` of its view. Raises ValueError as :meth:`checked`."""
        return cls.from_view(spec_view.section(crd_schema.AUTOSCALING, spec))

    @classmethod
    def from_view(cls, a: spec_view.Autoscaling) -> AutoscalingConfig:
        """The typed view's ``spec.autoscaling`` (the CRD's defaults already in it).

        Raises ValueError as :meth:`from_spec`."""
        min_r = int(a.min_replicas)
        up, down = a.scale_up.stabilization_window_seconds, a.scale_down.stabilization_window_seconds
        return cls.checked(a.mode, min_r, int(a.max_replicas if a.max_replicas is not None else max(min_r, 1)),
                           float(a.target_queue_depth), float(a.target_kv_cache_usage), float(up), float(down))

    @classmethod
    def checked(cls, mode: str, min_r: int, max_r: int, tq: float, tkv: float, up: float,
                down: float) -> AutoscalingConfig:
        """The config of these values. Raises ValueError on an unknown mode, a non-positive
        target, a negative window, or min > max."""
        if mode not in MODES:
            raise ValueError(f"autoscaling.mode must be one of {MODES}, got {mode!r}")
        if min_r < 0 or max_r < 1 or min_r > max_r:
            raise ValueError(f"need 0 <= minReplicas <= maxReplicas and maxReplicas >= 1, got {min_r}, {max_r}")
        if tq <= 0 or not 0 < tkv <= 1:
            raise ValueError(f"need targetQueueDepth > 0 and 0 < targetKVCacheUsage <= 1, got {tq}, {tkv}")
        for direction, value in (("scaleUp", up), ("scaleDown", down)):
            if value < 0:
                raise ValueError(f"{direction} stabilization window must be >= 0 seconds, got {value}")
        return cls(str(mode), min_r, max_r, tq, tkv, up, down)


@dataclass(frozen=True)
class Recommendation:
    """One remembered raw recommendation (HPA's ``timestampedRecommendation``)."""

    time: float
    replicas: int


@dataclass(frozen=True)
class ScaleDecision:
    """What :func:`decide_scale` concluded."""

    replicas: int
    """Replicas to set (equal to ``current`` when nothing changes)."""
    current: int
    reason: str
    """CamelCase reason for the Event: ``ScaledUp``, ``ScaledDown``, ``Stable``,
    ``MetricsUnavailable``, ``PodsStarting``, ``ScaleUpStabilized``, ``ScaleDownStabilized``,
    ``ScaledToZero``, ``Bounded``, ``ScaledFromZero``, ``RequestsInFlight``."""
    message: str
    recommendation: int | None
    """This round's raw recommendation (after bounds), None when metrics were unusable."""
    history: tuple[Recommendation, ...]
    """The history to pass to the next call."""
    inputs: Mapping[str, Any] = field(default_factory=dict)
    """The numbers the decision was made from (for the Event and logs)."""

    @property
    def changed(self) -> bool:
        return self.replicas != self.current


def raw_recommendation(
    config: AutoscalingConfig,
    metrics: MetricsAggregate,
    current: int,
    max_num_seqs: int | None = None,
) -> tuple[int, str]:
    """The unstabilized, unbounded replica count for one metrics read, and why.

    Precondition: ``metrics.pods`` is not empty. ``max_num_seqs`` (the engine's
    per-replica batch cap) enables the busy floor ``ceil(running / max_num_seqs)``.
    """
    n = len(metrics.pods)
    queue = metrics.queue_depth
    candidates = {"queue": math.ceil(queue / config.target_queue_depth - 1e-9)}
    kv = metrics.kv_cache_usage or 0.0
    if kv > config.target_kv_cache_usage:
        candidates["kvCache"] = math.ceil(n * kv / config.target_kv_cache_usage - 1e-9)
    if max_num_seqs:
        candidates["running"] = math.ceil(metrics.running / max_num_seqs - 1e-9)
    why = max(candidates, key=lambda k: candidates[k])
    rec = candidates[why]
    missing = len(metrics.failed)
    if missing and rec < current:
        # HPA: pods whose metrics are missing count as exactly at the target when scaling
        # down; if that reverses the direction, do not scale at all.
        conservative = math.ceil((queue + missing * config.target_queue_depth) / config.target_queue_depth - 1e-9)
        if conservative >= current:
            return current, "missingMetrics"
        rec, why = max(rec, conservative), "missingMetrics"
    return rec, why


@dataclass(frozen=True)
class RouterLoad:
    """What the InferenceService's routers report (``kvfleet:router_pending_requests`` and
    ``kvfleet:router_in_flight_requests``, summed over the router pods read)."""

    pending: float
    """Requests held because no runtime replica is ready."""
    in_flight: float
    """Requests sent to a replica and not finished."""

    @property
    def busy(self) -> bool:
        return self.pending > 0 or self.in_flight > 0


def decide_scale(
    config: AutoscalingConfig,
    *,
    now: float,
    current: int,
    ready: int,
    metrics: MetricsAggregate | None,
    history: Sequence[Recommendation] = (),
    max_num_seqs: int | None = None,
    router: RouterLoad | None = None,
) -> ScaleDecision:
    """Decide the replica count of one InferenceService (mode ``operator``).

    ``now``: seconds since the epoch. ``current``: the scale subresource's
    ``spec.replicas``. ``ready``: pods that are ready (their number below ``current``
    means the last scale-up is still starting). ``metrics``: this round's read (None: the
    source failed as a whole). ``history``: the ``history`` of the previous decision (empty
    after an operator restart: seed it with ``Recommendation(now, current)`` to keep the
    scale-down window honest). ``router``: the routers' pending and in-flight requests (None:
    no router, or none could be read): at 0 replicas with requests pending the service scales to
    1 at once (``ScaledFromZero``, no window: a client is waiting), and it is never scaled to 0
    while the routers have requests pending or in flight (``RequestsInFlight``). Raises nothing
    for any input that ``AutoscalingConfig`` accepted.
    """
    horizon = now - max(config.scale_up_window, config.scale_down_window)
    history = tuple(r for r in history if r.time >= horizon)
    inputs = _inputs(current, ready, metrics)

    def hold(reason: str, message: str, target: int | None = None) -> ScaleDecision:
        return ScaleDecision(current if target is None else target, current, reason, message, None, history, inputs)

    if router is not None:
        inputs.update(routerPending=status_number(router.pending), routerInFlight=status_number(router.in_flight))
        if router.busy and config.max_replicas >= 1:
            # Work at the router needs one replica: remembered, so that the scale-down window to 0
            # runs from the last moment the routers had a request, not from the last busy scrape.
            history = history + (Recommendation(now, 1),)
        if current == 0 and router.pending > 0 and config.max_replicas >= 1:
            return ScaleDecision(1, 0, "ScaledFromZero",
                                 f"0 -> 1 replicas: the router holds {status_number(router.pending)} request(s) "
                                 "and no replica is running", 1, history, inputs)

    if metrics is None or not metrics.pods:
        if current > 0:
            # Pods should exist but none could be read (source down, scrapes failing, pods
            # still starting or not created yet): never act on that, least of all scale to
            # zero. Only the bounds apply (e.g. a lowered maxReplicas).
            if metrics is None:
                why = "the metrics source failed"
            else:
                why = (f"no pod could be read ({len(metrics.failed)} failed, "
                       f"{len(metrics.not_ready)} not ready)")
            bounded = min(max(current, config.min_replicas), config.max_replicas)
            reason = "PodsStarting" if metrics is not None and not metrics.failed else "MetricsUnavailable"
            return hold(reason, f"holding {bounded} replicas: {why}", bounded)
        # Scaled to zero: no pods to read and nothing to act on but the bounds. A request
        # arriving at a zero-replica Service is not seen here (see docs/autoscaling.md).
        rec, why = 0, "noPods"
    else:
        rec, why = raw_recommendation(config, metrics, current, max_num_seqs)
    bounded = min(max(rec, config.min_replicas), config.max_replicas)
    inputs.update(recommendation=rec, basis=why, bounded=bounded)
    history = history + (Recommendation(now, bounded),)

    stabilized = _stabilized(config, history, now=now, current=current, bounded=bounded)
    if stabilized == 0 and current > 0 and router is not None and router.busy:
        inputs.update(stabilized=stabilized)
        return hold("RequestsInFlight", f"holding {current} replicas: the router has {status_number(router.pending)} "
                    f"request(s) pending and {status_number(router.in_flight)} in flight; not scaling to 0")
    inputs.update(stabilized=stabilized)
    return _act(config, current=current, ready=ready, stabilized=stabilized, bounded=bounded, why=why,
                metrics=metrics, history=history, inputs=inputs)


def _inputs(current: int, ready: int, metrics: MetricsAggregate | None) -> dict[str, Any]:
    """The decision's ``inputs`` (its Event's numbers), before the recommendation."""
    inputs: dict[str, Any] = {"current": current, "ready": ready}
    if metrics is not None:
        kv = metrics.kv_cache_usage
        inputs.update(
            queueDepth=status_number(metrics.queue_depth),
            running=status_number(metrics.running),
            kvCacheUsage=None if kv is None else round(kv, 3),
            podsRead=len(metrics.pods),
            podsFailed=len(metrics.failed),
            podsNotReady=len(metrics.not_ready),
        )
    return inputs


def _stabilized(config: AutoscalingConfig, history: Sequence[Recommendation], *, now: float, current: int,
                bounded: int) -> int:
    """HPA stabilizeRecommendationWithBehaviors: up = min over the up window, down = max over
    the down window; the result is the current count clamped into [up, down], then into the
    bounds (bounds beat stabilization: a lowered maxReplicas acts at once)."""
    up = min((r.replicas for r in history if r.time > now - config.scale_up_window), default=bounded)
    down = max((r.replicas for r in history if r.time > now - config.scale_down_window), default=bounded)
    up, down = min(up, bounded), max(down, bounded)
    stabilized = min(max(current, up), down)
    return min(max(stabilized, config.min_replicas), config.max_replicas)


def _act(config: AutoscalingConfig, *, current: int, ready: int, stabilized: int, bounded: int, why: str,
         metrics: MetricsAggregate | None, history: tuple[Recommendation, ...],
         inputs: dict[str, Any]) -> ScaleDecision:
    """The decision for a ``stabilized`` count: scale up (rate-limited, not while the last
    scale-up's pods are starting), scale down, or hold (saying which window holds it)."""
    if stabilized > current:
        limit = max(2 * current, current + 4)
        target = min(stabilized, limit)
        if ready < current and current >= config.min_replicas:
            return ScaleDecision(current, current, "PodsStarting",
                                 f"recommend {target} replicas, but only {ready} of {current} are ready: "
                                 "waiting for the last scale-up", bounded, history, inputs)
        return ScaleDecision(target, current, "ScaledUp",
                             f"{current} -> {target} replicas ({_explain(why, metrics, config)})",
                             bounded, history, inputs)
    if stabilized < current:
        reason = "ScaledToZero" if stabilized == 0 else "ScaledDown"
        return ScaleDecision(stabilized, current, reason,
                             f"{current} -> {stabilized} replicas ({_explain(why, metrics, config)})",
                             bounded, history, inputs)
    if bounded > current:
        reason, message = "ScaleUpStabilized", f"recommend {bounded}, held at {current} by the scale-up window"
    elif bounded < current:
        reason, message = "ScaleDownStabilized", (
            f"recommend {bounded}, held at {current} by the {config.scale_down_window:g} s scale-down window")
    else:
        reason, message = "Stable", f"{current} replicas ({_explain(why, metrics, config)})"
    return ScaleDecision(current, current, reason, message, bounded, history, inputs)


def _explain(why: str, metrics: MetricsAggregate | None, config: AutoscalingConfig) -> str:
    if metrics is None or not metrics.pods:
        return "no pods to read"
    kv = metrics.kv_cache_usage or 0.0
    text = (f"queue depth {metrics.queue_depth:g} over {len(metrics.pods)} pods, target "
            f"{config.target_queue_depth:g} per replica; mean KV usage {kv:.2f}, target "
            f"{config.target_kv_cache_usage:g}; running {metrics.running:g}")
    if why == "missingMetrics":
        text += f"; {len(metrics.failed)} pods unread count as at target"
    elif why != "queue":
        text += f"; sized by {why}"
    return text
