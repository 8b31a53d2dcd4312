"""Scaling and tuning decisions for InferenceServices: pure functions of plain data.

Nothing here calls the Kubernetes API, reads a clock or does I/O: the time comes in as an
argument (``now``, seconds since the epoch) and every piece of state that must survive
between two decisions (the recommendation history, the last tuning change) goes in and
comes back out as a value. :mod:`kvfleet.operator.autoscaler` is the thin kopf layer that
reads the cluster, calls these functions and writes their results.

Scaling (``spec.autoscaling.mode: operator``) follows the Kubernetes
HorizontalPodAutoscaler algorithm
(https://kubernetes.io/docs/tasks/run-application/horizontal-pod-autoscale/#algorithm-details
and ``pkg/controller/podautoscaler/horizontal.go``):

* raw recommendation = ``ceil(total queue depth / targetQueueDepth)`` over the pods whose
  metrics were read, raised to ``ceil(pods * mean KV usage / targetKVCacheUsage)`` when the
  mean KV cache usage exceeds its target, and raised to ``ceil(running / maxNumSeqs)`` so
  that replicas whose batch slots are all busy are not taken away (running requests do not
  show as queue depth until the remaining pods overflow);
* pods that are ready but whose scrape failed count, like the HPA's missing metrics, as
  sitting exactly at the target when the raw recommendation would scale down (so a broken
  scrape never drives a scale-down, let alone to zero); when *no* pod could be read the
  replicas are held;
* bounded by ``minReplicas`` / ``maxReplicas`` (``minReplicas: 0`` allowed);
* stabilization: the recommendations of the last ``scaleDownStabilizationWindowSeconds``
  (default 300 s) are remembered and a scale-down goes only to their *maximum*; a
  scale-up goes only to the *minimum* of those within ``scaleUpStabilizationWindowSeconds``
  (default 0 s);
* the HPA's default scale-up rate limit: at most ``max(2 * current, current + 4)``;
* no further scale-up while pods of the previous scale-up are still starting (fewer ready
  pods than replicas).

Tuning (``spec.tuning``) chooses ``gpuMemoryUtilization`` and ``blockSize``; see
:func:`tune`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from typing import Any

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


def rfc3339(t: float) -> str:
    """Seconds since the epoch -> ``2026-01-02T03:04:05Z`` (Kubernetes' time format)."""
    return datetime.fromtimestamp(t, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(value: str | None) -> float | None:
    """Kubernetes RFC 3339 time -> seconds since the epoch; None for None or ''.

    Raises ValueError for a malformed string.
    """
    if not value:
        return None
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


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
    ``ScaledToZero``, ``Bounded``."""
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


def decide_scale(
    config: AutoscalingConfig,
    *,
    now: float,
    current: int,
    ready: int,
    metrics: MetricsAggregate | None,
    history: Sequence[Recommendation] = (),
    max_num_seqs: int | None = None,
) -> ScaleDecision:
    """Decide the replica count of one InferenceService (mode ``operator``).

    ``now``: seconds since the epoch. ``current``: the scale subresource's
    ``spec.replicas``. ``ready``: pods that are ready (their number below ``current``
    means the last scale-up is still starting). ``metrics``: this round's read (None: the
    source failed as a whole). ``history``: the ``history`` of the previous decision (empty
    after an operator restart: seed it with ``Recommendation(now, current)`` to keep the
    scale-down window honest). Raises nothing for any input that ``AutoscalingConfig``
    accepted.
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


def build_hpa(isvc: Mapping[str, Any], labels: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The ``autoscaling/v2`` HorizontalPodAutoscaler for an InferenceService in mode ``hpa``.

    It targets the InferenceService's own scale subresource (``kvfleet.io/v1alpha1``,
    kind ``InferenceService``), with a Pods metric on the queue depth
    (:data:`HPA_METRIC`, average value ``targetQueueDepth``) and the spec's
    stabilization windows as ``behavior``. The ownerReference points at the
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
    target = cfg.target_queue_depth
    avg = str(int(target)) if float(target).is_integer() else f"{int(round(target * 1000))}m"
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
            "metrics": [{
                "type": "Pods",
                "pods": {
                    "metric": {"name": HPA_METRIC},
                    "target": {"type": "AverageValue", "averageValue": avg},
                },
            }],
            "behavior": {
                "scaleUp": {"stabilizationWindowSeconds": int(cfg.scale_up_window)},
                "scaleDown": {"stabilizationWindowSeconds": int(cfg.scale_down_window)},
            },
        },
    }


def hpas_targeting(hpas: Iterable[Mapping[str, Any]], name: str, *, own: str | None = None) -> list[str]:
    """Names of the HPAs (``autoscaling/v2`` dicts, one namespace) whose scaleTargetRef is
    the InferenceService ``name``; ``own`` (an HPA this operator manages) is left out."""
    out = []
    for hpa in hpas:
        ref = (hpa.get("spec") or {}).get("scaleTargetRef") or {}
        hpa_name = (hpa.get("metadata") or {}).get("name")
        if (ref.get("kind") == "InferenceService" and ref.get("name") == name
                and str(ref.get("apiVersion", "kvfleet.io/")).startswith("kvfleet.io/") and hpa_name != own):
            out.append(hpa_name)
    return sorted(out)


# --------------------------------------------------------------------------------------
# Tuning
# --------------------------------------------------------------------------------------

BLOCK_SIZES = (8, 16, 32, 64, 128)


@dataclass(frozen=True)
class TuningConfig:
    """``spec.tuning`` with its defaults."""

    enabled: bool = False
    min_gpu_memory_utilization: float = 0.5
    max_gpu_memory_utilization: float = 0.95
    step: float = 0.05
    """One raise or lower of gpuMemoryUtilization (fraction of GPU memory)."""
    block_sizes: tuple[int, ...] = (16, 32)
    """Block sizes the tuner may choose from, tokens (the CRD's default)."""
    min_interval: float = 600.0
    """Minimum seconds between two changes (each one rolls the pods)."""
    oom_cooldown: float = 3600.0
    """Seconds after an out-of-memory restart during which utilisation is not raised."""
    preemption_rate_threshold: float = 0.05
    """Preemptions per second (fleet-wide) that count as "frequent"."""
    kv_usage_threshold: float = 0.95
    """Mean KV usage (0-1) that counts as "near 1"."""
    sustain: float = 120.0
    """Seconds the raise condition must hold without a break (hysteresis)."""
    min_requests: int = 100
    """Finished requests the length distribution needs before block size is chosen."""
    block_size_hysteresis: float = 0.25
    """Relative band around the observed length within which the current block size is kept."""
    tokens_per_block: float = 16.0
    """Block size is chosen as the largest allowed value <= mean sequence length / this."""

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any] | None) -> TuningConfig:
        """Read ``spec.tuning`` (None or {} means disabled). Raises ValueError when
        min > max utilisation or a bound is outside (0, 1], or no block size is allowed."""
        t = dict(spec or {})
        gmu = t.get("gpuMemoryUtilization") or {}
        lo = float(gmu.get("min", t.get("minGpuMemoryUtilization", cls.min_gpu_memory_utilization)))
        hi = float(gmu.get("max", t.get("maxGpuMemoryUtilization", cls.max_gpu_memory_utilization)))
        step = float(gmu.get("step", t.get("gpuMemoryUtilizationStep", cls.step)))
        if not (0 < lo <= hi <= 1) or step <= 0:
            raise ValueError(f"need 0 < min <= max <= 1 and step > 0 for gpuMemoryUtilization, got {lo}, {hi}, {step}")
        sizes = t.get("blockSizes", (t.get("blockSize") or {}).get("allowed") if isinstance(t.get("blockSize"), Mapping) else None)
        sizes = tuple(sorted({int(s) for s in (sizes or cls.block_sizes)}))
        if not sizes or min(sizes) < 1:
            raise ValueError(f"blockSizes must be positive integers, got {sizes}")

        def num(key: str, default: float) -> float:
            value = t.get(key, default)
            if float(value) < 0:
                raise ValueError(f"tuning.{key} must be >= 0, got {value}")
            return float(value)

        return cls(
            enabled=bool(t.get("enabled", bool(t))),
            min_gpu_memory_utilization=lo,
            max_gpu_memory_utilization=hi,
            step=step,
            block_sizes=sizes,
            min_interval=num("minIntervalSeconds", cls.min_interval),
            oom_cooldown=num("oomCooldownSeconds", cls.oom_cooldown),
            preemption_rate_threshold=num("preemptionRateThreshold", cls.preemption_rate_threshold),
            kv_usage_threshold=num("kvCacheUsageThreshold", cls.kv_usage_threshold),
            sustain=num("sustainSeconds", cls.sustain),
            min_requests=int(num("minRequests", cls.min_requests)),
        )


@dataclass(frozen=True)
class TuningState:
    """What the tuner remembers; persisted in ``status.engine`` (see :meth:`to_status`)."""

    gpu_memory_utilization: float | None = None
    """Applied value; None: not tuned yet (the spec's value applies)."""
    block_size: int | None = None
    last_change: float | None = None
    """Seconds since the epoch of the last applied change."""
    last_oom: float | None = None
    """finishedAt of the newest out-of-memory termination already acted on."""
    pressure_since: float | None = None
    """Since when the preemption pressure has held without a break."""

    @classmethod
    def from_status(cls, engine: Mapping[str, Any] | None) -> TuningState:
        """Read ``status.engine`` back (missing or malformed fields become None)."""
        e = dict(engine or {})

        def t(key: str) -> float | None:
            try:
                return parse_time(e.get(key))
            except (TypeError, ValueError):
                return None

        gmu = e.get("gpuMemoryUtilization")
        bs = e.get("blockSize")
        return cls(
            gpu_memory_utilization=float(gmu) if isinstance(gmu, (int, float)) else None,
            block_size=int(bs) if isinstance(bs, int) else None,
            last_change=t("lastChangeTime"),
            last_oom=t("lastOOMTime"),
            pressure_since=t("preemptionPressureSince"),
        )

    def to_status(self) -> dict[str, Any]:
        """``status.engine``: ``gpuMemoryUtilization`` and ``blockSize`` are the applied
        values the ConfigMap is built with; the times are bookkeeping (None clears)."""
        return {
            "gpuMemoryUtilization": self.gpu_memory_utilization,
            "blockSize": self.block_size,
            "lastChangeTime": None if self.last_change is None else rfc3339(self.last_change),
            "lastOOMTime": None if self.last_oom is None else rfc3339(self.last_oom),
            "preemptionPressureSince": None if self.pressure_since is None else rfc3339(self.pressure_since),
        }

    def overrides(self) -> dict[str, Any]:
        """The engine fields (spec.engine spelling) to apply over the user's spec.engine."""
        out: dict[str, Any] = {}
        if self.gpu_memory_utilization is not None:
            out["gpuMemoryUtilization"] = self.gpu_memory_utilization
        if self.block_size is not None:
            out["blockSize"] = self.block_size
        return out


@dataclass(frozen=True)
class OOMRestart:
    """A container termination for lack of memory, read from a pod's containerStatuses."""

    pod: str
    container: str
    finished_at: float
    """Seconds since the epoch."""
    reason: str


_CUDA_OOM = re.compile(r"out of memory|OutOfMemoryError", re.IGNORECASE)


def oom_restarts(pods: Iterable[Mapping[str, Any]]) -> list[OOMRestart]:
    """Out-of-memory terminations in pods' ``status.containerStatuses[].lastState.terminated``
    (and ``state.terminated``): reason ``OOMKilled`` (the kernel's OOM killer, i.e. host
    memory) or a termination message mentioning CUDA out of memory (the runtime writes its
    fatal error to the termination log; ``torch.OutOfMemoryError``). Oldest first."""
    found = []
    for pod in pods:
        name = (pod.get("metadata") or {}).get("name", "?")
        for cs in (pod.get("status") or {}).get("containerStatuses") or ():
            for state in (cs.get("lastState") or {}, cs.get("state") or {}):
                term = state.get("terminated")
                if not term:
                    continue
                reason = term.get("reason") or ""
                if reason == "OOMKilled" or _CUDA_OOM.search(term.get("message") or ""):
                    try:
                        t = parse_time(term.get("finishedAt"))
                    except ValueError:
                        t = None
                    if t is not None:
                        found.append(OOMRestart(name, cs.get("name", "?"), t, reason or "Error"))
    return sorted(set(found), key=lambda o: (o.finished_at, o.pod))


def choose_block_size(mean_len: float, allowed: Sequence[int], tokens_per_block: float = 16.0) -> int:
    """Largest allowed block size <= ``mean_len / tokens_per_block`` (the smallest allowed
    when none fits): a sequence then wastes on average half a block, i.e. at most
    ``1 / (2 * tokens_per_block)`` of its KV cache, to internal fragmentation, while long
    sequences get big blocks (shorter block tables, fewer kernel iterations)."""
    allowed = sorted(allowed)
    fit = [b for b in allowed if b <= mean_len / tokens_per_block]
    return fit[-1] if fit else allowed[0]


@dataclass(frozen=True)
class TuningDecision:
    state: TuningState
    """New state (write it to status.engine even when nothing changed: bookkeeping)."""
    changes: tuple[tuple[str, str], ...] = ()
    """``(reason, message)`` per applied change, one Event each: ``GpuMemoryRaised``,
    ``GpuMemoryLowered``, ``BlockSizeChanged``."""
    notes: tuple[str, ...] = ()
    """Why nothing changed, for logs."""

    @property
    def changed(self) -> bool:
        return bool(self.changes)


def tune(
    config: TuningConfig,
    state: TuningState,
    *,
    now: float,
    spec_engine: Mapping[str, Any],
    metrics: MetricsAggregate | None,
    pods: Iterable[Mapping[str, Any]] = (),
) -> TuningDecision:
    """Choose ``gpuMemoryUtilization`` and ``blockSize`` for the next rollout.

    Rules, in order:

    1. An out-of-memory restart newer than ``state.last_oom`` (``OOMKilled``, or CUDA out
       of memory in the termination message) lowers utilisation one ``step`` (not below
       ``min``) at once, minimum interval or not, and starts the ``oom_cooldown``.
    2. Otherwise, at most one change per ``min_interval`` seconds.
    3. Raise utilisation one step (not above ``max``) when preemptions are frequent
       (fleet rate >= ``preemption_rate_threshold`` per second) with mean KV usage
       >= ``kv_usage_threshold``, continuously for ``sustain`` seconds, and no OOM restart in
       the last ``oom_cooldown`` seconds.
    4. Block size from the mean prompt + output length of finished requests (at least
       ``min_requests`` of them): :func:`choose_block_size`, kept while the current size is
       what the length +- ``block_size_hysteresis`` would also choose.

    ``spec_engine`` gives the starting values (``gpuMemoryUtilization`` default 0.9,
    ``blockSize`` default 16) until the tuner has applied its own. ``now`` is seconds
    since the epoch; ``pods`` are the pod dicts (their containerStatuses).
    """
    if not config.enabled:
        return TuningDecision(state, notes=("tuning disabled",))
    lo, hi = config.min_gpu_memory_utilization, config.max_gpu_memory_utilization
    gmu = state.gpu_memory_utilization
    if gmu is None:
        gmu = float(spec_engine.get("gpuMemoryUtilization", 0.9))
    gmu_clamped = round(min(max(gmu, lo), hi), 4)
    bs = state.block_size if state.block_size is not None else int(spec_engine.get("blockSize", 16))
    changes: list[tuple[str, str]] = []
    notes: list[str] = []

    ooms = [o for o in oom_restarts(pods) if state.last_oom is None or o.finished_at > state.last_oom]
    if ooms:
        newest = ooms[-1]
        new = round(max(gmu_clamped - config.step, lo), 4)
        state = replace(state, last_oom=newest.finished_at, pressure_since=None)
        if new != gmu:
            changes.append(("GpuMemoryLowered",
                            f"gpuMemoryUtilization {gmu:g} -> {new:g}: {newest.reason} restart of "
                            f"{newest.pod}/{newest.container} at {rfc3339(newest.finished_at)}; "
                            f"no raise for {config.oom_cooldown:g} s"))
            state = replace(state, gpu_memory_utilization=new, last_change=now)
        else:
            notes.append(f"{newest.reason} restart of {newest.pod}, but utilisation is already at min {lo:g}")
        return TuningDecision(state, tuple(changes), tuple(notes))

    if gmu != gmu_clamped:  # bounds changed under us: apply them now.
        changes.append(("GpuMemoryBounded", f"gpuMemoryUtilization {gmu:g} -> {gmu_clamped:g} (bounds [{lo:g}, {hi:g}])"))
        return TuningDecision(replace(state, gpu_memory_utilization=gmu_clamped, last_change=now), tuple(changes))

    # Hysteresis for the raise: track how long the pressure has held.
    pressure = (
        metrics is not None and metrics.preemption_rate is not None and metrics.pods
        and metrics.preemption_rate >= config.preemption_rate_threshold
        and (metrics.kv_cache_usage or 0.0) >= config.kv_usage_threshold
    )
    state = replace(state, pressure_since=(state.pressure_since or now) if pressure else None)

    if state.last_change is not None and now - state.last_change < config.min_interval:
        notes.append(f"last change {now - state.last_change:.0f} s ago < min interval {config.min_interval:g} s")
        return TuningDecision(state, notes=tuple(notes))

    new_gmu = gmu
    if pressure and now - state.pressure_since >= config.sustain:
        if state.last_oom is not None and now - state.last_oom < config.oom_cooldown:
            notes.append(f"preemption pressure, but an OOM restart {now - state.last_oom:.0f} s ago (cool-down)")
        elif gmu >= hi:
            notes.append(f"preemption pressure, but utilisation is at max {hi:g}")
        else:
            new_gmu = round(min(gmu + config.step, hi), 4)
            changes.append(("GpuMemoryRaised",
                            f"gpuMemoryUtilization {gmu:g} -> {new_gmu:g}: {metrics.preemption_rate:.3f} "
                            f"preemptions/s with mean KV usage {metrics.kv_cache_usage:.2f} for "
                            f"{now - state.pressure_since:.0f} s"))

    new_bs = bs
    if metrics is not None and metrics.finished_requests >= config.min_requests:
        mean_len = (metrics.mean_prompt_tokens or 0.0) + (metrics.mean_generation_tokens or 0.0)
        h = config.block_size_hysteresis
        keep_lo = choose_block_size(mean_len * (1 - h), config.block_sizes, config.tokens_per_block)
        keep_hi = choose_block_size(mean_len * (1 + h), config.block_sizes, config.tokens_per_block)
        if not (keep_lo <= bs <= keep_hi and bs in config.block_sizes):
            new_bs = choose_block_size(mean_len, config.block_sizes, config.tokens_per_block)
            changes.append(("BlockSizeChanged",
                            f"blockSize {bs} -> {new_bs}: mean sequence length {mean_len:.0f} tokens "
                            f"over {metrics.finished_requests:g} requests"))
    elif metrics is not None:
        notes.append(f"{metrics.finished_requests:g} finished requests < {config.min_requests} for block size")

    if changes:
        state = replace(state, gpu_memory_utilization=new_gmu, block_size=new_bs, last_change=now,
                        pressure_since=None)
    return TuningDecision(state, tuple(changes), tuple(notes))
