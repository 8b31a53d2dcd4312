"""Per-pool autoscaling (operator/pool_autoscale.py, issue 43): the prefill pool of a
disaggregated InferenceService is scaled on its own pods' waiting prompt tokens, between its own
bounds, through its Deployment's scale subresource; the decode pool by spec.autoscaling as before;
status.pools shows both. Pure parts first, then one loop iteration against the API emulator with
runtime pods serving a real stat logger's exposition."""

from __future__ import annotations

import copy

import pytest
import support.autoscaler_cluster as autoscaler_cluster
from support.autoscaler_cluster import NAME, NS, OPERATOR, T0, Runtime, add_pod, run
from support.kube_emulator import ISVC

from kvfleet.operator import autoscale_step, builders, crd, disagg, policy, pool_autoscale, reconcile, service_spec
from kvfleet.operator.pod_metrics import PodMetrics, aggregate
from kvfleet.runtime.core.sched.output import SchedulerStats

cluster = autoscaler_cluster.cluster  # the emulator fixture

PREFILL = {"replicas": 1, "minReplicas": 1, "maxReplicas": 4, "targetWaitingPromptTokens": 1000}


def isvc(prefill=None, autoscaling=OPERATOR) -> dict:
    obj = {"apiVersion": crd.API_VERSION, "kind": crd.KIND, "metadata": {"name": NAME, "namespace": NS, "uid": "u"},
           "spec": {"model": {"uri": "file:///models/m.gguf"}, "autoscaling": autoscaling,
                    "disaggregation": {"prefill": prefill or PREFILL, "decode": {"replicas": 1}}}}
    return crd.apply_defaults(copy.deepcopy(obj))


BASE = policy.AutoscalingConfig.from_spec(OPERATOR)


def test_prefill_config_takes_the_pools_bounds_and_target_and_the_services_windows():
    config = pool_autoscale.prefill_config(isvc(), BASE)
    assert (config.min_replicas, config.max_replicas, config.target_waiting_prompt_tokens) == (1, 4, 1000)
    assert (config.scale_down_window, config.target_queue_depth) == (BASE.scale_down_window, BASE.target_queue_depth)
    default = pool_autoscale.prefill_config(isvc({"replicas": 2, "maxReplicas": 3}), BASE)
    assert (default.min_replicas, default.target_waiting_prompt_tokens) == (1, 4096)  # the CRD's default


def test_without_max_replicas_or_mode_operator_the_prefill_pool_keeps_its_replicas():
    fixed = isvc({"replicas": 2})
    assert pool_autoscale.prefill_config(fixed, BASE) is None and not disagg.prefill_autoscaled(fixed)
    assert not disagg.prefill_autoscaled(isvc(autoscaling={"mode": "none"}))
    deployments = {c["metadata"]["name"]: c for c in builders.desired_children(fixed) if c["kind"] == "Deployment"}
    assert deployments["svc-prefill"]["spec"]["replicas"] == 2
    auto = {c["metadata"]["name"]: c for c in builders.desired_children(isvc()) if c["kind"] == "Deployment"}
    assert "replicas" not in auto["svc-prefill"]["spec"]  # the autoscaler owns it through /scale
    assert auto["svc"]["spec"]["replicas"] == 1


def test_bad_prefill_bounds_are_refused():
    with pytest.raises(ValueError, match="minReplicas <= maxReplicas"):
        pool_autoscale.prefill_config(isvc({"replicas": 1, "minReplicas": 5, "maxReplicas": 2}), BASE)


def test_waiting_prompt_tokens_size_the_pool_and_only_when_targeted():
    config = pool_autoscale.prefill_config(isvc(), BASE)
    metrics = aggregate(T0, [PodMetrics("p0", num_requests_waiting=1, num_waiting_prompt_tokens=3500)])
    assert policy.raw_recommendation(config, metrics, 1) == (4, "promptTokens")
    assert policy.raw_recommendation(BASE, metrics, 1) == (1, "queue")  # the decode pool ignores it
    decision = policy.decide_scale(config, now=T0, current=1, ready=1, metrics=metrics)
    assert (decision.reason, decision.replicas) == ("ScaledUp", 4) and "waiting prompt tokens 3500" in decision.message


def test_pools_status():
    assert pool_autoscale.pools_status((3, 2), (1, 1)) == {
        "prefill": {"replicas": 3, "readyReplicas": 2}, "decode": {"replicas": 1, "readyReplicas": 1}}
    assert pool_autoscale.pools_status(None, (2, 0)) == {"decode": {"replicas": 2, "readyReplicas": 0}}


def _prefill_runtime(tokens: int) -> Runtime:
    rt = Runtime(waiting=0)
    rt.logger.record(SchedulerStats(num_running_reqs=1, num_waiting_reqs=1, num_waiting_prompt_tokens=tokens,
                                    kv_cache_usage=0.2), None)
    return rt


def test_the_loop_scales_the_prefill_pool_on_its_prompt_tokens_and_the_decode_pool_on_its_own(cluster):
    kube, client, _events, runtimes = cluster
    kube.create(ISVC, isvc())
    reconcile.reconcile(client, NS, NAME)
    add_pod(kube, runtimes, "svc-0", Runtime(waiting=0))  # decode: idle
    prefill_rt = _prefill_runtime(3500)
    add_pod(kube, runtimes, "svc-prefill-0", prefill_rt)
    prefill_labels = service_spec.labels(disagg.pool_isvc(kube.get(ISVC, NS, NAME), "prefill"))
    kube.patch("v1/pods", NS, "svc-prefill-0", {"metadata": {"labels": prefill_labels}})
    state = autoscale_step.ServiceState()

    run(client, state)
    assert kube.get("apps/v1/deployments", NS, "svc-prefill")["spec"]["replicas"] == 4  # ceil(3500 / 1000)
    got = kube.get(ISVC, NS, NAME)
    assert got["spec"]["replicas"] == 1  # the decode pool: its own idle pod
    assert got["status"]["pools"] == {"prefill": {"replicas": 4, "readyReplicas": 1},
                                      "decode": {"replicas": 1, "readyReplicas": 1}}
    assert got["status"]["metrics"]["podsRead"] == 1  # the decode pool's metrics read its pod alone
    reconcile.reconcile(client, NS, NAME)  # the reconcile leaves the autoscaler's count alone
    assert kube.get("apps/v1/deployments", NS, "svc-prefill")["spec"]["replicas"] == 4

    prefill_rt.logger.record(SchedulerStats(num_running_reqs=0, num_waiting_prompt_tokens=0), None)
    run(client, state, now=T0 + 30)  # inside the 60 s scale-down window
    assert kube.get("apps/v1/deployments", NS, "svc-prefill")["spec"]["replicas"] == 4
    run(client, state, now=T0 + 120)
    assert kube.get("apps/v1/deployments", NS, "svc-prefill")["spec"]["replicas"] == 1  # prefill.minReplicas
    assert state.prefill.changes == [(T0, 1, 4), (T0 + 120, 4, 1)]
    assert kube.get(ISVC, NS, NAME)["status"]["pools"]["prefill"]["replicas"] == 1


def test_the_runtimes_gauge_reaches_the_pods_metrics():
    from kvfleet.operator.metrics_source import parse_metrics
    from kvfleet.runtime.metrics import exposition

    rt = _prefill_runtime(1234)
    try:
        pod = parse_metrics("p", exposition(rt.logger.registry).decode())
    finally:
        rt.close()
    assert pod.num_waiting_prompt_tokens == 1234 and aggregate(T0, [pod, pod]).waiting_prompt_tokens == 2468


def test_status_pools_shows_this_iterations_decode_decision(cluster):
    kube, client, _events, runtimes = cluster
    kube.create(ISVC, isvc({"replicas": 2}))  # the prefill pool not autoscaled: it keeps 2
    reconcile.reconcile(client, NS, NAME)
    add_pod(kube, runtimes, "svc-0", Runtime(waiting=9))  # decode: 9 waiting, target 2 per pod
    run(client, autoscale_step.ServiceState())
    got = kube.get(ISVC, NS, NAME)
    assert got["spec"]["replicas"] == 4  # maxReplicas
    assert got["status"]["pools"] == {"decode": {"replicas": 4, "readyReplicas": 1},
                                      "prefill": {"replicas": 2, "readyReplicas": 0}}  # its Deployment's counts
    assert kube.get("apps/v1/deployments", NS, "svc-prefill")["spec"]["replicas"] == 2
