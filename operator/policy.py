"""Scaling decisions for InferenceServices: pure functions of plain data.

No API calls, no clock, no I/O: the time comes in as ``now`` (seconds since the epoch) and the
state that must survive between two decisions (the recommendation history) goes in and comes
back out as a value. :mod:`kvfleet.operator.autoscaler` reads the cluster, calls these and
writes their results.

- :class:`PodMetrics` / :func:`aggregate` -> :class:`MetricsAggregate`: one round of pod reads;
- :class:`AutoscalingConfig` (``spec.autoscaling``) + :func:`decide_scale` -> :class:`ScaleDecision`
  (mode ``operator``), the Kubernetes HPA algorithm on queue depth, KV cache usage and busy
  batch slots, with its stabilization windows and rate limit (docs/autoscaling.md);
- :func:`build_hpa` / :data:`HPA_METRIC` (mode ``hpa``); :func:`scalers_targeting` (HPAs and KEDA
  ScaledObjects on the InferenceService or its Deployment: conflicts).

Tuning (``spec.tuning``) is :mod:`kvfleet.operator.tuning`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvfleet.operator.times import rfc3339

# --------------------------------------------------------------------------------------
# Observed metrics
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PodMetrics:
    """One pod's scrape of the runtime's ``/metrics`` (all series summed over labels).

    Gauges are the values at scrape time; ``*_total`` and histogram ``*_sum``/``*_count``
    are the pod's cumulative counters since it started.
    """

    pod: str
    num_requests_waiting: float = 0.0
    """Requests queued in the scheduler (``kvfleet:num_requests_waiting``)."""
    num_requests_running: float = 0.0
    """Requests in the running batch (``kvfleet:num_requests_running``)."""
    kv_cache_usage: float = 0.0
    """Fraction 0-1 of KV blocks in use (``kvfleet:kv_cache_usage_perc``)."""
    num_preemptions_total: float = 0.0
    """Preemptions since the pod started (``kvfleet:num_preemptions_total``)."""
    prompt_tokens_total: float = 0.0
    generation_tokens_total: float = 0.0
    request_prompt_tokens_sum: float = 0.0
    """Sum of the prompt lengths of finished requests, tokens (histogram ``_sum``)."""
    request_prompt_tokens_count: float = 0.0
    request_generation_tokens_sum: float = 0.0
    """Sum of the output lengths of finished requests, tokens (histogram ``_sum``)."""
    request_generation_tokens_count: float = 0.0


@dataclass(frozen=True)
class MetricsAggregate:
    """The fleet-wide view one autoscaler step decides on (what ``status.metrics`` shows)."""

    time: float
    """When the pods were read, seconds since the epoch."""
    pods: tuple[PodMetrics, ...] = ()
    """Pods whose metrics were read."""
    failed: tuple[tuple[str, str], ...] = ()
    """``(pod, reason)`` of ready pods whose scrape failed: left out of the sums."""
    not_ready: tuple[str, ...] = ()
    """Pods that exist but are not ready (starting, terminating): not scraped."""
    preemption_rate: float | None = None
    """Preemptions per second across the fleet since the previous aggregate (None: no
    previous read to compare with)."""

    @property
    def queue_depth(self) -> float:
        """Total waiting requests over the pods read."""
        return sum(p.num_requests_waiting for p in self.pods)

    @property
    def running(self) -> float:
        """Total running requests over the pods read."""
        return sum(p.num_requests_running for p in self.pods)

    @property
    def kv_cache_usage(self) -> float | None:
        """Mean KV cache usage (0-1) over the pods read; None when none was read."""
        if not self.pods:
            return None
        return sum(p.kv_cache_usage for p in self.pods) / len(self.pods)

    @property
    def mean_prompt_tokens(self) -> float | None:
        """Mean prompt length of finished requests, tokens (None: none finished)."""
        count = sum(p.request_prompt_tokens_count for p in self.pods)
        return sum(p.request_prompt_tokens_sum for p in self.pods) / count if count else None

    @property
    def mean_generation_tokens(self) -> float | None:
        """Mean output length of finished requests, tokens (None: none finished)."""
        count = sum(p.request_generation_tokens_count for p in self.pods)
        return sum(p.request_generation_tokens_sum for p in self.pods) / count if count else None

    @property
    def finished_requests(self) -> float:
        """Finished requests counted by the length histograms, over the pods read."""
        return sum(p.request_prompt_tokens_count for p in self.pods)

    def to_status(self) -> dict[str, Any]:
        """The ``status.metrics`` block: camelCase, numbers rounded for humans."""
        kv = self.kv_cache_usage
        out: dict[str, Any] = {
            "time": rfc3339(self.time),
            "podsRead": len(self.pods),
            "queueDepth": _num(self.queue_depth),
            "running": _num(self.running),
            "kvCacheUsage": None if kv is None else round(kv, 4),
            "preemptionRate": None if self.preemption_rate is None else round(self.preemption_rate, 4),
        }
        if self.failed:
            out["failedPods"] = [f"{pod}: {reason}"[:200] for pod, reason in self.failed]
        if self.not_ready:
            out["notReadyPods"] = list(self.not_ready)
        return out


KV_USAGE_NOISE = 0.05
"""A change of the mean KV cache usage (0-1) below this is noise: not worth a status write."""
PREEMPTION_RATE_NOISE = 0.01
"""Preemptions per second: a change below this (or below 20 %) is noise."""


def metrics_changed(old: Mapping[str, Any] | None, new: Mapping[str, Any]) -> bool:
    """Whether ``status.metrics`` must be rewritten: ``new`` (:meth:`MetricsAggregate.to_status`)
    differs from ``old`` (what is written) in a count or a pod list, or in KV usage or
    preemption rate by more than noise. ``time`` is not compared, so an idle service (and one
    whose load wanders within the noise) gets no writes; ``time`` says when it last changed."""
    if not old:
        return True
    for key in ("podsRead", "queueDepth", "running", "failedPods", "notReadyPods"):
        if old.get(key) != new.get(key):
            return True
    for key, noise, rel in (("kvCacheUsage", KV_USAGE_NOISE, 0.0), ("preemptionRate", PREEMPTION_RATE_NOISE, 0.2)):
        a, b = float(old.get(key) or 0.0), float(new.get(key) or 0.0)  # None: not known yet
        if abs(a - b) > max(noise, rel * max(abs(a), abs(b))):
            return True
    return False


def _num(x: float) -> int | float:
    return int(x) if float(x).is_integer() else round(x, 4)


def counter_increase(previous: float | None, current: float) -> float:
    """Increase of a cumulative counter between two reads, like PromQL's ``increase``:
    a decrease means the pod restarted, so the whole current value is new."""
    if previous is None:
        return 0.0
    return current - previous if current >= previous else current


def aggregate(
    now: float,
    pods: Iterable[PodMetrics],
    failed: Iterable[tuple[str, str]] = (),
    not_ready: Iterable[str] = (),
    previous: MetricsAggregate | None = None,
) -> MetricsAggregate:
    """Combine one round of scrapes into a :class:`MetricsAggregate`.

    ``previous`` (the aggregate of the round before) gives the preemption rate, in
    preemptions per second: per pod counter increases (a pod seen for the first time
    contributes nothing; a counter that went down is a restart) over ``now - previous.time``.
    """
    pods = tuple(sorted(pods, key=lambda p: p.pod))
    rate = None
    if previous is not None and now > previous.time:
        before = {p.pod: p.num_preemptions_total for p in previous.pods}
        inc = sum(counter_increase(before.get(p.pod), p.num_preemptions_total) for p in pods if p.pod in before)
        rate = inc / (now - previous.time)
    return MetricsAggregate(
        time=now,
        pods=pods,
        failed=tuple(sorted(failed)),
        not_ready=tuple(sorted(not_ready)),
        preemption_rate=rate,
    )


# --------------------------------------------------------------------------------------
# Scaling
# --------------------------------------------------------------------------------------

MODES = ("none", "operator", "hpa")


@dataclass(frozen=True)
class AutoscalingConfig:
    """``spec.autoscaling`` with its defaults (see the CRD in :mod:`kvfleet.operator.crd`)."""

    mode: str = "none"
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
        """Read ``spec.autoscaling`` (a dict; None or {} means mode none).

        Raises ValueError on an unknown mode, a non-positive target, or min > max.
        """
        a = dict(spec or {})
        mode = a.get("mode", "none")
        if mode not in MODES:
            raise ValueError(f"autoscaling.mode must be one of {MODES}, got {mode!r}")
        min_r = int(a.get("minReplicas", 1))
        max_r = int(a.get("maxReplicas", max(min_r, 1)))
        if min_r < 0 or max_r < 1 or min_r > max_r:
            raise ValueError(f"need 0 <= minReplicas <= maxReplicas and maxReplicas >= 1, got {min_r}, {max_r}")
        tq = float(a.get("targetQueueDepth", cls.target_queue_depth))
        tkv = float(a.get("targetKVCacheUsage", cls.target_kv_cache_usage))
        if tq <= 0 or not 0 < tkv <= 1:
            raise ValueError(f"need targetQueueDepth > 0 and 0 < targetKVCacheUsage <= 1, got {tq}, {tkv}")
        up = _window(a, "scaleUp", cls.scale_up_window)
        down = _window(a, "scaleDown", cls.scale_down_window)
        return cls(mode, min_r, max_r, tq, tkv, up, down)


def _window(a: Mapping[str, Any], direction: str, default: float) -> float:
    """A stabilization window, seconds: ``scaleUp.stabilizationWindowSeconds`` (the CRD), or
    a flat ``scaleUpStabilizationWindowSeconds`` / HPA-style ``behavior.scaleUp...``."""
    for value in (
        (a.get(direction) or {}).get("stabilizationWindowSeconds"),  # the CRD's spelling
        a.get(f"{direction}StabilizationWindowSeconds"),
        (a.get("behavior") or {}).get(direction, {}).get("stabilizationWindowSeconds"),
        (a.get("stabilizationWindowSeconds") or {}).get(direction[len("scale"):].lower())
        if isinstance(a.get("stabilizationWindowSeconds"), Mapping)
        else None,
    ):
        if value is not None:
            if float(value) < 0:
                raise ValueError(f"{direction} stabilization window must be >= 0 seconds, got {value}")
            return float(value)
    return default


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
    inputs: dict[str, Any] = {"current": current, "ready": ready}
    if metrics is not None:
        kv = metrics.kv_cache_usage
        inputs.update(
            queueDepth=_num(metrics.queue_depth),
            running=_num(metrics.running),
            kvCacheUsage=None if kv is None else round(kv, 3),
            podsRead=len(metrics.pods),
            podsFailed=len(metrics.failed),
            podsNotReady=len(metrics.not_ready),
        )

    def hold(reason: str, message: str, target: int | None = None) -> ScaleDecision:
        return ScaleDecision(current if target is None else target, current, reason, message, None, history, inputs)

    if router is not None:
        inputs.update(routerPending=_num(router.pending), routerInFlight=_num(router.in_flight))
        if router.busy and config.max_replicas >= 1:
            # Work at the router needs one replica: remembered, so that the scale-down window to 0
            # runs from the last moment the routers had a request, not from the last busy scrape.
            history = history + (Recommendation(now, 1),)
        if current == 0 and router.pending > 0 and config.max_replicas >= 1:
            return ScaleDecision(1, 0, "ScaledFromZero",
                                 f"0 -> 1 replicas: the router holds {_num(router.pending)} request(s) "
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

    # HPA stabilizeRecommendationWithBehaviors: up = min over the up window, down = max over
    # the down window; the result is the current count clamped into [up, down].
    up = min((r.replicas for r in history if r.time > now - config.scale_up_window), default=bounded)
    down = max((r.replicas for r in history if r.time > now - config.scale_down_window), default=bounded)
    up, down = min(up, bounded), max(down, bounded)
    stabilized = min(max(current, up), down)
    # Bounds beat stabilization (a lowered maxReplicas acts at once).
    stabilized = min(max(stabilized, config.min_replicas), config.max_replicas)
    if stabilized == 0 and current > 0 and router is not None and router.busy:
        inputs.update(stabilized=stabilized)
        return hold("RequestsInFlight", f"holding {current} replicas: the router has {_num(router.pending)} "
                    f"request(s) pending and {_num(router.in_flight)} in flight; not scaling to 0")
    inputs.update(stabilized=stabilized)

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


# --------------------------------------------------------------------------------------
# mode: hpa
# --------------------------------------------------------------------------------------

HPA_METRIC = "kvfleet_num_requests_waiting"
"""Name of the Pods metric (as the prometheus-adapter rule exposes it) the HPA scales on."""
HPA_KV_METRIC = "kvfleet_kv_cache_usage_perc"
"""The second Pods metric: KV cache usage (0-1) per pod, against ``targetKVCacheUsage``."""


def _quantity(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{int(round(x * 1000))}m"


def build_hpa(isvc: Mapping[str, Any], labels: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The ``autoscaling/v2`` HorizontalPodAutoscaler for an InferenceService in mode ``hpa``.

    It targets the InferenceService's own scale subresource (``kvfleet.io/v1alpha1``,
    kind ``InferenceService``), with two Pods metrics, the queue depth (:data:`HPA_METRIC`,
    average value ``targetQueueDepth``) and the KV cache usage (:data:`HPA_KV_METRIC`, average
    value ``targetKVCacheUsage``; the HPA takes the larger recommendation), and the spec's
    stabilization windows as ``behavior``. ``minReplicas`` is at least 1: an HPA cannot scale
    to zero without the HPAScaleToZero feature gate. The ownerReference points at the
    InferenceService (its uid when it has one). Raises ValueError on an invalid
    ``spec.autoscaling`` (see :meth:`AutoscalingConfig.from_spec`).
    """
    meta = isvc.get("metadata", {})
    cfg = AutoscalingConfig.from_spec((isvc.get("spec") or {}).get("autoscaling"))
    name = meta["name"]
    owner = {
        "apiVersion": "kvfleet.io/v1alpha1",
        "kind": "InferenceService",
        "name": name,
        "controller": True,
        "blockOwnerDeletion": True,
    }
    if meta.get("uid"):
        owner["uid"] = meta["uid"]
    hpa_meta: dict[str, Any] = {"name": name, "ownerReferences": [owner]}
    if meta.get("namespace"):
        hpa_meta["namespace"] = meta["namespace"]
    if labels:
        hpa_meta["labels"] = dict(labels)
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": hpa_meta,
        "spec": {
            "scaleTargetRef": {"apiVersion": "kvfleet.io/v1alpha1", "kind": "InferenceService", "name": name},
            # An HPA cannot go below 1 replica unless the HPAScaleToZero feature gate is on.
            "minReplicas": max(cfg.min_replicas, 1),
            "maxReplicas": cfg.max_replicas,
            "metrics": [{"type": "Pods", "pods": {"metric": {"name": metric},
                                                  "target": {"type": "AverageValue", "averageValue": _quantity(t)}}}
                        for metric, t in ((HPA_METRIC, cfg.target_queue_depth),
                                          (HPA_KV_METRIC, cfg.target_kv_cache_usage))],
            "behavior": {
                "scaleUp": {"stabilizationWindowSeconds": int(cfg.scale_up_window)},
                "scaleDown": {"stabilizationWindowSeconds": int(cfg.scale_down_window)},
            },
        },
    }


def _target(ref: Mapping[str, Any], name: str, deployment: str | None) -> str | None:
    """``"InferenceService"`` / ``"Deployment"`` when a ``scaleTargetRef`` points at the
    InferenceService ``name`` or at its Deployment ``deployment``, else None. (A KEDA
    ScaledObject's ref defaults to ``apps/v1`` ``Deployment``.)"""
    kind = ref.get("kind") or "Deployment"
    api = str(ref.get("apiVersion") or ("apps/v1" if kind == "Deployment" else "kvfleet.io/"))
    if kind == "InferenceService" and ref.get("name") == name and api.startswith("kvfleet.io/"):
        return "InferenceService"
    if deployment and kind == "Deployment" and ref.get("name") == deployment and api.startswith("apps/"):
        return "Deployment"
    return None


def hpas_targeting(hpas: Iterable[Mapping[str, Any]], name: str, *, own: str | None = None) -> list[str]:
    """Names of the HPAs (``autoscaling/v2`` dicts, one namespace) whose scaleTargetRef is
    the InferenceService ``name``; ``own`` (an HPA this operator manages) is left out."""
    found = (label.split(" ", 1)[1] for label, _ in scalers_targeting(hpas, (), name))
    return sorted(n for n in found if n != own)


def scalers_targeting(hpas: Iterable[Mapping[str, Any]], scaled_objects: Iterable[Mapping[str, Any]],
                      name: str, *, deployment: str | None = None) -> list[tuple[str, str]]:
    """The autoscalers of one namespace that act on InferenceService ``name`` or (with
    ``deployment``) on its Deployment directly: ``(f"{Kind} {name}", target kind)`` pairs,
    sorted, for HorizontalPodAutoscalers and KEDA ScaledObjects (``keda.sh/v1alpha1``)."""
    out = []
    for kind, items in (("HorizontalPodAutoscaler", hpas), ("ScaledObject", scaled_objects)):
        for obj in items:
            target = _target((obj.get("spec") or {}).get("scaleTargetRef") or {}, name, deployment)
            if target:
                out.append((f"{kind} {(obj.get('metadata') or {}).get('name')}", target))
    return sorted(out)


def conflict_message(scalers: Iterable[tuple[str, str]], mode: str) -> str:
    """The ``ScalingActive=False`` / ``ConflictingAutoscaler`` message for foreign
    :func:`scalers_targeting` results."""
    scalers = list(scalers)
    names = ", ".join(f"{s} (targets the {t})" for s, t in scalers)
    if any(t == "Deployment" for _, t in scalers):
        return (f"{names}: an autoscaler on the Deployment fights the operator over its replicas, so the "
                "operator stopped writing them; point it at the InferenceService (its scale subresource) "
                "or delete it")
    return (f"{names} also scales this InferenceService; the operator does not scale it while "
            f"autoscaling.mode is {mode} (delete it, or use autoscaling.mode: hpa)")
