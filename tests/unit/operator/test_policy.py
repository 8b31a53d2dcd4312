"""Pure scaling decisions (kvfleet.operator.policy.decide_scale): table-driven runs over
metric histories, the way the autoscaler timer calls it, with a simulated clock."""

from __future__ import annotations

import math

import pytest

from kvfleet.operator.pod_metrics import MetricsAggregate, PodMetrics, aggregate, counter_increase
from kvfleet.operator.policy import AutoscalingConfig, Recommendation, decide_scale, raw_recommendation


def cfg(**kw) -> AutoscalingConfig:
    spec = {"mode": "operator", "minReplicas": 1, "maxReplicas": 8, "targetQueueDepth": 4,
            "targetKVCacheUsage": 0.8}
    spec.update(kw)
    return AutoscalingConfig.from_spec(spec)


def fleet(t: float, queue: float, n: int, *, running: float = 0.0, kv: float = 0.1,
          failed: int = 0, not_ready: int = 0) -> MetricsAggregate:
    """``n`` readable pods sharing ``queue`` waiting and ``running`` running requests."""
    if n == 0:
        return aggregate(t, [], failed=[(f"f{i}", "timeout") for i in range(failed)])
    pods = [PodMetrics(f"p{i}", num_requests_waiting=queue / n, num_requests_running=running / n,
                       kv_cache_usage=kv) for i in range(n)]
    return aggregate(t, pods, failed=[(f"f{i}", "timeout") for i in range(failed)],
                     not_ready=[f"s{i}" for i in range(not_ready)])


def simulate(config, steps, *, start=1, interval=15.0, ready_lag=0, max_num_seqs=None):
    """Drive decide_scale like the timer does. ``steps``: one callable per poll taking
    (t, current replicas) and returning a MetricsAggregate (or None). Pods become ready
    ``ready_lag`` polls after a scale-up. Returns the decisions."""
    current, history, decisions = start, (), []
    ready_at: list[int] = []  # poll index at which each pending pod becomes ready
    ready = start
    for i, step in enumerate(steps):
        t = 1_000_000.0 + i * interval
        ready = min(current, ready + sum(1 for r in ready_at if r == i))
        d = decide_scale(config, now=t, current=current, ready=ready, metrics=step(t, current, ready),
                         history=history, max_num_seqs=max_num_seqs)
        history = d.history
        if d.replicas > current:
            if ready_lag == 0:
                ready = d.replicas
            else:
                ready_at += [i + ready_lag] * (d.replicas - current)
        elif d.replicas < current:
            ready = min(ready, d.replicas)
        current = d.replicas
        decisions.append(d)
    return decisions


def replicas(decisions):
    return [d.replicas for d in decisions]


def load(queue, **kw):
    """A step whose total queue is ``queue`` spread over the ready pods."""
    def step(t, current, ready):
        return fleet(t, queue, ready, **kw) if ready else aggregate(t, [])
    return step


# ---- single decisions: table ---------------------------------------------------------

@pytest.mark.parametrize(
    "queue, n, kv, running, max_num_seqs, current, expected",
    [
        (0, 1, 0.1, 0, None, 1, 1),       # idle -> min 1
        (4, 1, 0.1, 0, None, 1, 1),       # exactly at target
        (5, 1, 0.1, 0, None, 1, 2),       # ceil(5/4)
        (9, 1, 0.1, 0, None, 1, 3),       # ceil(9/4)
        (100, 2, 0.1, 0, None, 2, 6),     # rate limit max(2*2, 2+4) before max 8
        (100, 5, 0.1, 0, None, 5, 8),     # bounded by max 8
        (0, 2, 0.95, 0, None, 2, 3),      # KV above target raises: ceil(2*0.95/0.8)
        (0, 2, 0.79, 0, None, 2, 1),      # KV below target: queue rules (down to min 1)
        (0, 2, 0.1, 4, 2, 2, 2),          # busy floor: 4 running at 2 seqs per pod
        (0, 2, 0.1, 2, 2, 2, 1),          # 2 running fit in one pod
        (30, 1, 0.1, 0, None, 1, 5),      # HPA rate limit: max(2*1, 1+4) = 5
    ],
)
def test_single_decision(queue, n, kv, running, max_num_seqs, current, expected):
    c = cfg(scaleDown={"stabilizationWindowSeconds": 0})
    d = decide_scale(c, now=100.0, current=current, ready=current,
                     metrics=fleet(100.0, queue, n, kv=kv, running=running), max_num_seqs=max_num_seqs)
    assert d.replicas == expected, d
    assert d.inputs["current"] == current
    if expected != current:
        assert d.reason in ("ScaledUp", "ScaledDown") and str(expected) in d.message


def test_config_defaults_and_errors():
    c = AutoscalingConfig.from_spec({"mode": "operator", "minReplicas": 0, "maxReplicas": 3})
    assert (c.scale_up_window, c.scale_down_window) == (0.0, 300.0)  # HPA defaults
    assert c.min_replicas == 0
    assert AutoscalingConfig.from_spec(None).mode == "none"
    windowed = {"mode": "operator", "scaleDown": {"stabilizationWindowSeconds": 20}}
    assert AutoscalingConfig.from_spec(windowed).scale_down_window == 20
    for bad in ({"mode": "keda"}, {"minReplicas": 3, "maxReplicas": 2}, {"targetQueueDepth": 0},
                {"targetKVCacheUsage": 1.5}, {"scaleDown": {"stabilizationWindowSeconds": -1}}):
        with pytest.raises(ValueError):
            AutoscalingConfig.from_spec(bad)


# ---- histories ------------------------------------------------------------------------

def test_scale_down_waits_for_the_window_then_follows_the_max():
    c = cfg(scaleDown={"stabilizationWindowSeconds": 300})
    steps = [load(12)] + [load(0)] * 30  # 15 s polls
    ds = simulate(c, steps)
    r = replicas(ds)
    assert r[0] == 3
    # The 3-replica recommendation at t=0 is remembered for 300 s: 20 polls later it expires.
    assert r[1:20] == [3] * 19 and {d.reason for d in ds[1:20]} == {"ScaleDownStabilized"}
    assert r[20] == 1 and ds[20].reason == "ScaledDown"
    assert r[21:] == [1] * 10


def test_flapping_queue_does_not_oscillate():
    c = cfg(scaleDown={"stabilizationWindowSeconds": 300})
    # A bursty queue: 12 waiting, then 0, every other poll, for 30 minutes.
    steps = [load(12) if i % 2 == 0 else load(0) for i in range(120)]
    r = replicas(simulate(c, steps))
    assert r[0] == 3
    changes = sum(1 for a, b in zip(r, r[1:]) if a != b)
    assert changes == 0, r


def test_slow_flapping_settles_with_at_most_one_change_per_window():
    c = cfg(scaleDown={"stabilizationWindowSeconds": 120})
    # 4 polls busy, 4 polls idle: the down window (8 polls) is longer than an idle period.
    steps = [load(8) if (i // 4) % 2 == 0 else load(0) for i in range(80)]
    r = replicas(simulate(c, steps))
    assert set(r) == {2}, r


def test_without_a_down_window_it_would_flap():
    """The control for the two tests above: the window is what stops the oscillation."""
    c = cfg(scaleDown={"stabilizationWindowSeconds": 0})
    steps = [load(12) if i % 2 == 0 else load(0) for i in range(10)]
    r = replicas(simulate(c, steps))
    assert sum(1 for a, b in zip(r, r[1:]) if a != b) >= 8


def test_scale_up_window_takes_the_min():
    c = cfg(scaleUp={"stabilizationWindowSeconds": 60})
    steps = [load(0)] * 2 + [load(12)] * 8
    ds = simulate(c, steps)
    r = replicas(ds)
    # The idle recommendation at poll 1 (t=15) is in the 60 s up window until poll 5 (t=75,
    # where t=15 is no longer after the cut-off, as in the HPA's strict comparison).
    assert r[:5] == [1] * 5 and ds[3].reason == "ScaleUpStabilized"
    assert r[5] == 3


def test_a_short_spike_inside_the_up_window_is_ignored():
    c = cfg(scaleUp={"stabilizationWindowSeconds": 60})
    steps = [load(0)] * 3 + [load(20)] + [load(0)] * 10
    assert set(replicas(simulate(c, steps))) == {1}


def test_no_further_scale_up_while_pods_start():
    c = cfg()
    # Pods take 3 polls to become ready; the queue stays long all along.
    ds = simulate(c, [load(40)] * 8, ready_lag=3)
    r = replicas(ds)
    assert r[0] == 5  # rate limit from 1: max(2, 5)
    assert r[1:3] == [5, 5] and {ds[1].reason, ds[2].reason} == {"PodsStarting"}
    assert r[3] == 8  # pods ready: next step, bounded by max
    assert "ready" in ds[1].message


def test_scrape_failures_never_scale_down_or_to_zero():
    c = cfg(minReplicas=0, scaleDown={"stabilizationWindowSeconds": 0})
    # All pods fail to scrape: hold.
    d = decide_scale(c, now=0.0, current=3, ready=3, metrics=fleet(0.0, 0, 0, failed=3))
    assert (d.replicas, d.reason) == (3, "MetricsUnavailable")
    # The source itself failed: hold.
    d = decide_scale(c, now=0.0, current=3, ready=3, metrics=None)
    assert (d.replicas, d.reason) == (3, "MetricsUnavailable")
    assert d.recommendation is None and d.history == ()  # not remembered
    # One of three unreadable, two idle: without the missing-metrics rule this would go to 0.
    d = decide_scale(c, now=0.0, current=3, ready=3, metrics=fleet(0.0, 0, 2, failed=1))
    assert d.replicas == 1, d  # the unread pod counts as at target: ceil(4/4)
    d = decide_scale(c, now=0.0, current=2, ready=2, metrics=fleet(0.0, 5, 1, failed=1))
    assert d.replicas == 2, d  # rec ceil(5/4)=2 anyway
    # Unreadable pods do not block a scale-up that the readable ones call for.
    d = decide_scale(c, now=0.0, current=2, ready=2, metrics=fleet(0.0, 20, 1, failed=1))
    assert d.replicas == 5


def test_missing_metrics_that_would_reverse_the_direction_hold():
    c = cfg(scaleDown={"stabilizationWindowSeconds": 0})
    # 2 readable pods with 4 queued; 2 unread: 4 + 2*4 = 12 -> 3 >= current 3: hold.
    d = decide_scale(c, now=0.0, current=3, ready=4, metrics=fleet(0.0, 4, 2, failed=2))
    assert d.replicas == 3
    assert raw_recommendation(c, fleet(0.0, 4, 2, failed=2), 3) == (3, "missingMetrics")


def test_pods_not_created_yet_are_not_a_scale_to_zero():
    c = cfg(minReplicas=0, scaleDown={"stabilizationWindowSeconds": 0})
    d = decide_scale(c, now=0.0, current=1, ready=0, metrics=aggregate(0.0, []))
    assert d.replicas == 1
    d = decide_scale(c, now=0.0, current=2, ready=0, metrics=aggregate(0.0, [], not_ready=["a", "b"]))
    assert (d.replicas, d.reason) == (2, "PodsStarting")


def test_min_zero_scales_to_zero_after_the_window_and_stays():
    c = cfg(minReplicas=0, scaleDown={"stabilizationWindowSeconds": 60})
    steps = [load(3)] + [load(0)] * 10
    ds = simulate(c, steps)
    r = replicas(ds)
    assert r[:4] == [1] * 4
    assert r[4] == 0 and ds[4].reason == "ScaledToZero"
    assert r[5:] == [0] * 6 and ds[-1].reason == "Stable"


def test_from_zero_min_raised_scales_up_without_metrics():
    c = cfg(minReplicas=2)
    d = decide_scale(c, now=0.0, current=0, ready=0, metrics=aggregate(0.0, []))
    assert d.replicas == 2 and d.reason == "ScaledUp"


def test_bounds_apply_even_without_metrics():
    c = cfg(maxReplicas=2)
    d = decide_scale(c, now=0.0, current=5, ready=5, metrics=None)
    assert d.replicas == 2
    c = cfg(minReplicas=3)
    d = decide_scale(c, now=0.0, current=1, ready=1, metrics=fleet(0.0, 0, 1))
    assert d.replicas == 3


def test_restart_seeded_history_keeps_the_down_window():
    c = cfg(scaleDown={"stabilizationWindowSeconds": 300})
    seeded = (Recommendation(0.0, 4),)
    d = decide_scale(c, now=10.0, current=4, ready=4, metrics=fleet(10.0, 0, 4), history=seeded)
    assert d.replicas == 4 and d.reason == "ScaleDownStabilized"
    d = decide_scale(c, now=301.0, current=4, ready=4, metrics=fleet(301.0, 0, 4), history=d.history)
    assert d.replicas == 1


def test_history_is_pruned_to_the_longest_window():
    c = cfg(scaleDown={"stabilizationWindowSeconds": 60})
    ds = simulate(c, [load(0)] * 100)
    assert len(ds[-1].history) <= 60 / 15 + 1


def test_decision_inputs_are_reported():
    c = cfg()
    d = decide_scale(c, now=0.0, current=1, ready=1, metrics=fleet(0.0, 9, 1, kv=0.5, running=2))
    assert d.inputs == {"current": 1, "ready": 1, "queueDepth": 9, "running": 2, "kvCacheUsage": 0.5,
                        "podsRead": 1, "podsFailed": 0, "podsNotReady": 0, "recommendation": 3,
                        "basis": "queue", "bounded": 3, "stabilized": 3}


# ---- aggregation --------------------------------------------------------------------

def test_aggregate_and_preemption_rate_with_counter_reset():
    a = aggregate(100.0, [PodMetrics("a", num_preemptions_total=10), PodMetrics("b", num_preemptions_total=5)])
    assert a.preemption_rate is None
    b = aggregate(110.0, [PodMetrics("a", num_preemptions_total=30),   # +20
                          PodMetrics("b", num_preemptions_total=2),    # restarted: +2
                          PodMetrics("c", num_preemptions_total=50)],  # new pod: not counted
                  previous=a)
    assert b.preemption_rate == pytest.approx(2.2)
    assert counter_increase(None, 7) == 0 and counter_increase(3, 7) == 4 and counter_increase(9, 7) == 7


def test_status_block():
    a = aggregate(0.0, [PodMetrics("a", 3, 1, 0.5), PodMetrics("b", 1, 2, 0.25)],
                  failed=[("c", "connect timeout")], not_ready=["d"])
    s = a.to_status()
    assert s == {"time": "1970-01-01T00:00:00Z", "podsRead": 2, "queueDepth": 4, "running": 3,
                 "kvCacheUsage": 0.375, "preemptionRate": None, "failedPods": ["c: connect timeout"],
                 "notReadyPods": ["d"]}
    assert math.isclose(a.kv_cache_usage, 0.375)
