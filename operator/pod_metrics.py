"""What the runtime pods report, combined into one fleet-wide view: pure functions of plain data.

:class:`PodMetrics` is one pod's scrape (read by :mod:`kvfleet.operator.metrics_source`);
:func:`aggregate` combines one round of them, with the preemption rate since the round before,
into the :class:`MetricsAggregate` the scaling (:mod:`kvfleet.operator.policy`) and tuning
(:mod:`kvfleet.operator.tuning`) decisions read and ``status.metrics`` shows;
:func:`metrics_changed` says whether that status block is worth a write. No API calls, no clock.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kvfleet.operator.times import rfc3339


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
    kv_disk_bytes: float = 0.0
    """Bytes held by the pod's KV disk tier (``kvfleet:kv_disk_usage_bytes``; 0 without one)."""
    num_waiting_prompt_tokens: float = 0.0
    """Prompt tokens of the queued requests (``kvfleet:num_waiting_prompt_tokens``; 0 when absent)."""


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
    def waiting_prompt_tokens(self) -> float:
        """Prompt tokens queued in the pods read."""
        return sum(p.num_waiting_prompt_tokens for p in self.pods)

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
            "queueDepth": status_number(self.queue_depth),
            "running": status_number(self.running),
            "kvCacheUsage": None if kv is None else round(kv, 4),
            "preemptionRate": None if self.preemption_rate is None else round(self.preemption_rate, 4),
        }
        disk = sum(p.kv_disk_bytes for p in self.pods)
        if disk:
            out["kvDiskBytes"] = int(disk)  # spec.engine.kvCache.tiers: the disk tiers' size, all pods
        if self.failed:
            out["failedPods"] = [f"{pod}: {reason}"[:200] for pod, reason in self.failed]
        if self.not_ready:
            out["notReadyPods"] = list(self.not_ready)
        return out


KV_USAGE_NOISE = 0.05
"""A change of the mean KV cache usage (0-1) below this is noise: not worth a status write."""
PREEMPTION_RATE_NOISE = 0.01
"""Preemptions per second: a change below this (or below 20 %) is noise."""
KV_DISK_BYTES_NOISE = 2**20
"""Bytes of the disk tiers: a change below this (or below 10 %) is noise."""


def metrics_changed(old: Mapping[str, Any] | None, new: Mapping[str, Any]) -> bool:
    """Whether ``status.metrics`` must be rewritten: ``new`` (:meth:`MetricsAggregate.to_status`)
    differs from ``old`` (what is written) in a count or a pod list, or in KV usage,
    preemption rate or the disk tiers' bytes by more than noise. ``time`` is not compared, so an idle service (and one
    whose load wanders within the noise) gets no writes; ``time`` says when it last changed."""
    if not old:
        return True
    for key in ("podsRead", "queueDepth", "running", "failedPods", "notReadyPods"):
        if old.get(key) != new.get(key):
            return True
    for key, noise, rel in (("kvCacheUsage", KV_USAGE_NOISE, 0.0), ("preemptionRate", PREEMPTION_RATE_NOISE, 0.2),
                            ("kvDiskBytes", KV_DISK_BYTES_NOISE, 0.1)):
        a, b = float(old.get(key) or 0.0), float(new.get(key) or 0.0)  # None: not known yet
        if abs(a - b) > max(noise, rel * max(abs(a), abs(b))):
            return True
    return False


def status_number(x: float) -> int | float:
    """A count as an int, any other value rounded to 4 places: how ``status`` shows numbers."""
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
