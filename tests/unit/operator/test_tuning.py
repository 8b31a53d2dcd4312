"""Pure tuning decisions (kvfleet.operator.tuning.tune): gpuMemoryUtilization from
preemption pressure and out-of-memory restarts, blockSize from the length distribution."""

from __future__ import annotations

import pytest

from kvfleet.operator import crd_schema, spec_view
from kvfleet.operator.pod_metrics import MetricsAggregate, PodMetrics, aggregate
from kvfleet.operator.times import rfc3339
from kvfleet.operator.tuning import TuningConfig, TuningState, choose_block_size, oom_restarts, rollout_hold, tune

T0 = 1_800_000_000.0
ENGINE = spec_view.section(crd_schema.ENGINE, {"gpuMemoryUtilization": 0.8, "blockSize": 16})


def config(**kw) -> TuningConfig:
    spec = {"enabled": True, "gpuMemoryUtilization": {"min": 0.6, "max": 0.9, "step": 0.05},
            "blockSizes": [8, 16, 32, 64, 128], "minIntervalSeconds": 600, "oomCooldownSeconds": 3600}
    spec.update(kw)
    return TuningConfig.from_spec(spec)


def pressure(t: float, rate: float = 1.0, kv: float = 0.99, *, prompt: float = 0, gen: float = 0,
             n: int = 0) -> MetricsAggregate:
    """One pod at ``kv`` usage preempting ``rate`` times a second, with ``n`` finished
    requests of mean ``prompt`` + ``gen`` tokens."""
    pod = PodMetrics("p", kv_cache_usage=kv, request_prompt_tokens_sum=prompt * n, request_prompt_tokens_count=n,
                     request_generation_tokens_sum=gen * n, request_generation_tokens_count=n)
    return MetricsAggregate(time=t, pods=(pod,), preemption_rate=rate)


def pod(name: str, reason: str, finished: float, message: str = "") -> dict:
    term = {"reason": reason, "exitCode": 137 if reason == "OOMKilled" else 1, "finishedAt": rfc3339(finished)}
    if message:
        term["message"] = message
    return {"metadata": {"name": name},
            "status": {"containerStatuses": [{"name": "runtime", "restartCount": 1,
                                              "lastState": {"terminated": term}, "state": {"running": {}}}]}}


def run(cfg, steps, state=TuningState(), interval=30.0):
    """``steps``: per poll, (metrics factory of t, pods). Returns the decisions."""
    out = []
    for i, (metrics, pods) in enumerate(steps):
        t = T0 + i * interval
        d = tune(cfg, state, now=t, spec_engine=ENGINE, metrics=metrics(t) if metrics else None, pods=pods)
        state = d.state
        out.append(d)
    return out


def gmus(ds):
    return [d.state.gpu_memory_utilization for d in ds]


def test_disabled_does_nothing():
    d = tune(TuningConfig.from_spec({"enabled": False}), TuningState(), now=T0, spec_engine=ENGINE,
             metrics=pressure(T0), pods=[pod("a", "OOMKilled", T0 - 1)])
    assert not d.changed and d.state == TuningState()


def test_sustained_pressure_raises_one_step_then_waits_the_min_interval():
    # 30 s polls, sustain 120 s: raise at the 5th poll (t=120), then not before 600 s later.
    ds = run(config(), [(pressure, [])] * 50)
    g = gmus(ds)
    assert g[:4] == [None] * 4
    assert g[4] == 0.85 and ds[4].changes[0][0] == "GpuMemoryRaised"
    assert "preemptions/s" in ds[4].changes[0][1]
    # next raise needs 600 s since the change and 120 s of renewed pressure
    assert g[5:24] == [0.85] * 19
    assert g[24] == 0.9
    assert g[25:] == [0.9] * 25  # at max: no further raise
    assert any("at max" in n for n in ds[-1].notes)


def test_flapping_pressure_never_raises():
    # Pressure every other poll: it never holds for 120 s without a break.
    steps = [((pressure if i % 2 == 0 else (lambda t: pressure(t, rate=0.0))), []) for i in range(60)]
    assert set(gmus(run(config(), steps))) == {None}


@pytest.mark.parametrize("rate, kv", [(0.0, 0.99), (1.0, 0.5), (None, 0.99)])
def test_no_pressure_no_raise(rate, kv):
    steps = [(lambda t: pressure(t, rate=rate, kv=kv), [])] * 20
    assert set(gmus(run(config(), steps))) == {None}


def test_oom_lowers_at_once_and_blocks_raising_for_the_cooldown():
    oom = [pod("a", "OOMKilled", T0 - 5)]
    ds = run(config(), [(pressure, oom)] + [(pressure, oom)] * 150)  # 75 min of 30 s polls
    g = gmus(ds)
    assert g[0] == 0.75 and ds[0].changes[0][0] == "GpuMemoryLowered" and "OOMKilled" in ds[0].changes[0][1]
    # The same termination (still in lastState) is not counted twice.
    assert ds[1].changes == ()
    # Pressure all along, but no raise during the 3600 s cool-down...
    cooldown_end = next(i for i in range(len(ds)) if T0 + i * 30 - (T0 - 5) >= 3600)
    assert set(g[:cooldown_end]) == {0.75}
    assert any("cool-down" in n for d in ds[20:cooldown_end] for n in d.notes)
    # ...and a raise right after it.
    assert g[cooldown_end] == 0.8


def test_cuda_oom_in_the_termination_message_counts():
    p = pod("a", "Error", T0 - 5, message="torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB")
    assert [o.pod for o in oom_restarts([p])] == ["a"]
    assert oom_restarts([pod("a", "Error", T0, message="ValueError: bad config")]) == []
    assert oom_restarts([pod("a", "Completed", T0)]) == []
    d = tune(config(), TuningState(), now=T0, spec_engine=ENGINE, metrics=None, pods=[p])
    assert d.state.gpu_memory_utilization == 0.75


def test_oom_lowering_ignores_the_min_interval_but_not_the_floor():
    state = TuningState(gpu_memory_utilization=0.65, last_change=T0 - 10)
    d = tune(config(), state, now=T0, spec_engine=ENGINE, metrics=None, pods=[pod("a", "OOMKilled", T0 - 1)])
    assert d.state.gpu_memory_utilization == 0.6
    d = tune(config(), d.state, now=T0 + 1, spec_engine=ENGINE, metrics=None, pods=[pod("b", "OOMKilled", T0)])
    assert d.state.gpu_memory_utilization == 0.6 and not d.changed
    assert "already at min" in d.notes[0]


def test_a_new_oom_after_the_first_lowers_again():
    d1 = tune(config(), TuningState(), now=T0, spec_engine=ENGINE, metrics=None, pods=[pod("a", "OOMKilled", T0 - 5)])
    d2 = tune(config(), d1.state, now=T0 + 60, spec_engine=ENGINE, metrics=None,
              pods=[pod("a", "OOMKilled", T0 - 5), pod("b", "OOMKilled", T0 + 50)])
    assert (d1.state.gpu_memory_utilization, d2.state.gpu_memory_utilization) == (0.75, 0.7)


@pytest.mark.parametrize("mean_len, expected", [
    (50, 8), (200, 8), (300, 16), (600, 32), (1500, 64), (4000, 128), (100000, 128)])
def test_choose_block_size(mean_len, expected):
    assert choose_block_size(mean_len, [8, 16, 32, 64, 128]) == expected


def test_block_size_follows_the_length_distribution_with_hysteresis():
    cfg = config(minIntervalSeconds=0)
    short = lambda t: pressure(t, rate=0, prompt=60, gen=40, n=500)      # 100 tokens -> 8
    d = tune(cfg, TuningState(), now=T0, spec_engine=ENGINE, metrics=short(T0))
    assert d.state.block_size == 8 and d.changes[0][0] == "BlockSizeChanged"
    long_ = lambda t: pressure(t, rate=0, prompt=1500, gen=500, n=500)   # 2000 -> 64 (2000/16 = 125)
    d = tune(cfg, d.state, now=T0 + 1, spec_engine=ENGINE, metrics=long_(T0))
    assert d.state.block_size == 64
    # Near a boundary (1024 tokens -> 64 exactly, 1000 -> 32): the current size is kept
    # while the length wanders within +-25 %.
    state = TuningState(block_size=32)
    for length in (1000, 1030, 980, 1100, 900):
        d = tune(cfg, state, now=T0, spec_engine=ENGINE, metrics=pressure(T0, rate=0, prompt=length, n=500))
        assert not d.changed and d.state.block_size is None or d.state.block_size == 32


def test_block_size_needs_enough_requests_and_only_allowed_sizes():
    cfg = config(minIntervalSeconds=0, blockSizes=[16, 32])
    d = tune(cfg, TuningState(), now=T0, spec_engine=ENGINE, metrics=pressure(T0, rate=0, prompt=60, n=50))
    assert not d.changed and "finished requests" in d.notes[-1]
    d = tune(cfg, TuningState(), now=T0, spec_engine=ENGINE, metrics=pressure(T0, rate=0, prompt=60, n=500))
    assert not d.changed  # 8 would fit better, but only 16 and 32 are allowed: 16 stays
    d = tune(cfg, TuningState(), now=T0, spec_engine=ENGINE, metrics=pressure(T0, rate=0, prompt=5000, n=500))
    assert d.state.block_size == 32


def test_min_interval_between_changes():
    cfg = config(minIntervalSeconds=600)
    state = TuningState(gpu_memory_utilization=0.8, block_size=16, last_change=T0 - 100)
    d = tune(cfg, state, now=T0, spec_engine=ENGINE, metrics=pressure(T0, rate=0, prompt=5000, n=500))
    assert not d.changed and "min interval" in d.notes[0]
    d = tune(cfg, state, now=T0 + 500, spec_engine=ENGINE, metrics=pressure(T0, rate=0, prompt=5000, n=500))
    assert d.state.block_size == 128


def test_bounds_changed_are_applied():
    state = TuningState(gpu_memory_utilization=0.95)
    d = tune(config(), state, now=T0, spec_engine=ENGINE, metrics=None)
    assert d.state.gpu_memory_utilization == 0.9 and d.changes[0][0] == "GpuMemoryBounded"


def test_state_round_trips_through_status():
    s = TuningState(gpu_memory_utilization=0.85, block_size=32, last_change=T0, last_oom=T0 - 60, pressure_since=None)
    status = s.to_status()
    assert status["gpuMemoryUtilization"] == 0.85 and status["blockSize"] == 32
    assert TuningState.from_status(status) == s
    assert s.overrides() == {"gpuMemoryUtilization": 0.85, "blockSize": 32}
    assert TuningState().overrides() == {}
    assert TuningState.from_status({"lastChangeTime": "garbage"}) == TuningState()


def test_config_from_the_crd_defaults():
    c = TuningConfig.from_spec({"enabled": True})
    assert (c.min_gpu_memory_utilization, c.max_gpu_memory_utilization, c.step) == (0.5, 0.95, 0.05)
    assert c.block_sizes == (16, 32) and c.min_interval == 600 and c.oom_cooldown == 3600
    with pytest.raises(ValueError):
        TuningConfig.from_spec({"enabled": True, "gpuMemoryUtilization": {"min": 0.9, "max": 0.5}})


def test_pressure_uses_the_fleet_rate():
    a = aggregate(T0, [PodMetrics("a", num_preemptions_total=0, kv_cache_usage=1.0)])
    b = aggregate(T0 + 10, [PodMetrics("a", num_preemptions_total=10, kv_cache_usage=1.0)], previous=a)
    assert b.preemption_rate == 1.0


def deployment(replicas: int, surge, unavailable, *, updated=None, available=None, gen=2, observed=2) -> dict:
    n = replicas
    return {"metadata": {"generation": gen},
            "spec": {"replicas": replicas, "strategy": {"rollingUpdate": {"maxSurge": surge,
                                                                          "maxUnavailable": unavailable}}},
            "status": {"observedGeneration": observed, "replicas": n, "updatedReplicas": n if updated is None
                       else updated, "availableReplicas": n if available is None else available}}


def test_rollout_hold_one_roll_at_a_time_and_never_every_pod_at_once():
    assert rollout_hold(deployment(1, 1, 0)) is None                    # Availability: a surge pod first
    assert rollout_hold(deployment(2, 0, 1)) is None                    # ResourceAware, 2 pods: one stays
    assert rollout_hold(deployment(1, 0, 1))[0] == "RollWouldTakeAllPods"   # ResourceAware, 1 pod
    assert rollout_hold(deployment(4, 0, "50%")) is None
    assert rollout_hold(deployment(2, "0%", "100%"))[0] == "RollWouldTakeAllPods"
    assert rollout_hold(deployment(2, 1, 0, updated=1))[0] == "RollingOut"  # the last roll has not landed
    assert rollout_hold(deployment(2, 1, 0, available=1))[0] == "RollingOut"
    assert rollout_hold(deployment(2, 1, 0, observed=1))[0] == "RollingOut"
    assert rollout_hold(None)[0] == "RollingOut"


def test_a_held_roll_waits_but_an_oom_is_acted_on_at_once():
    cfg = config(minIntervalSeconds=0)
    long_ = pressure(T0, rate=0, prompt=1500, gen=500, n=500)
    hold = rollout_hold(deployment(1, 0, 1))
    d = tune(cfg, TuningState(), now=T0, spec_engine=ENGINE, metrics=long_, hold=hold)
    assert not d.changed and d.held == hold and d.state.block_size is None
    d = tune(cfg, TuningState(), now=T0, spec_engine=ENGINE, metrics=long_, hold=None)
    assert d.changed and d.state.block_size == 64 and d.held is None
    d = tune(cfg, TuningState(), now=T0, spec_engine=ENGINE, metrics=None, hold=hold,
             pods=[pod("p", "OOMKilled", T0 - 5)])
    assert d.changes[0][0] == "GpuMemoryLowered"
