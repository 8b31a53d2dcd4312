"""The autoscaler writes nothing it need not and fights no one (against the emulator, as
tests/unit/operator/test_autoscaler.py): a KEDA ScaledObject on the Deployment stops it; an idle
service gets no status writes; a tuning roll waits for the last one and never stops every pod.
"""

from __future__ import annotations

import support.autoscaler_cluster as autoscaler_cluster
from support.autoscaler_cluster import (
    NAME,
    NS,
    OPERATOR,
    T0,
    Runtime,
    add_pod,
    condition,
    create_isvc,
    long_sequences,
    rolled_out,
    run,
)
from support.kube_emulator import ISVC

from kvfleet.operator import autoscale_step, pod_metrics, reconcile

cluster = autoscaler_cluster.cluster  # the emulator fixture

def test_a_keda_scaled_object_on_the_deployment_stops_the_operator_autoscaler(cluster):
    kube, client, events, runtimes = cluster
    create_isvc(kube, client, autoscaling=OPERATOR)
    add_pod(kube, runtimes, "p0", Runtime(waiting=9))
    kube.create("keda.sh/v1alpha1/scaledobjects", {
        "apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject", "metadata": {"name": "keda-so", "namespace": NS},
        "spec": {"scaleTargetRef": {"name": NAME}, "triggers": [{"type": "cpu"}]}})  # kind defaults to Deployment
    state = autoscale_step.ServiceState()
    run(client, state)
    assert kube.get(ISVC, NS, NAME)["spec"]["replicas"] == 1
    cond = condition(kube)
    assert (cond["status"], cond["reason"]) == ("False", "ConflictingAutoscaler")
    assert "ScaledObject keda-so (targets the Deployment)" in cond["message"]
    reconcile.reconcile(client, NS, NAME)  # the reconcile says the same: no ping-pong of the condition
    mark = len(kube.writes())
    run(client, state, now=T0 + 1)
    assert not reconcile.reconcile(client, NS, NAME).wrote and len(kube.writes()) == mark


def test_an_idle_service_gets_no_status_writes(cluster):
    kube, client, events, runtimes = cluster
    create_isvc(kube, client, autoscaling=OPERATOR)
    rt = Runtime(waiting=0)
    rt.set(waiting=0, kv=0.0)
    add_pod(kube, runtimes, "p0", rt)
    state = autoscale_step.ServiceState()
    run(client, state, now=T0)
    first = kube.get(ISVC, NS, NAME)["status"]["metrics"]
    mark = len(kube.writes())
    for i in range(1, 6):  # idle, then KV usage wandering within the noise
        rt.set(waiting=0, kv=0.01 * i)
        run(client, state, now=T0 + i)
    assert [w for w in kube.writes()[mark:] if "/status" in w.path] == []
    assert kube.get(ISVC, NS, NAME)["status"]["metrics"] == first
    rt.set(waiting=3)  # a real change is written
    run(client, state, now=T0 + 10)
    assert kube.get(ISVC, NS, NAME)["status"]["metrics"]["queueDepth"] == 3


def test_metrics_changed_ignores_time_and_noise():
    old = {"time": "a", "podsRead": 1, "queueDepth": 0, "running": 0, "kvCacheUsage": 0.1, "preemptionRate": 0.0}
    assert not pod_metrics.metrics_changed(old, {**old, "time": "b", "kvCacheUsage": 0.14, "preemptionRate": 0.005})
    assert pod_metrics.metrics_changed(old, {**old, "kvCacheUsage": 0.2})
    assert pod_metrics.metrics_changed(old, {**old, "queueDepth": 1})
    assert pod_metrics.metrics_changed(old, {**old, "failedPods": ["p: timeout"]})
    assert pod_metrics.metrics_changed(None, old) and not pod_metrics.metrics_changed(old, {**old, "preemptionRate": None})


def test_a_tuning_roll_waits_for_the_last_and_never_takes_the_only_pod_down(cluster):
    kube, client, events, runtimes = cluster
    create_isvc(kube, client, tuning={"enabled": True, "blockSizes": [16, 64], "minIntervalSeconds": 0},
                engine={"blockSize": 16, "maxNumSeqs": 4})
    kube.patch(ISVC, NS, NAME, {"spec": {"rollout": {"strategy": "ResourceAware"}}})  # maxSurge 0, 1 replica
    reconcile.reconcile(client, NS, NAME)
    add_pod(kube, runtimes, "p0", long_sequences())
    state = autoscale_step.ServiceState()
    run(client, state, now=T0)                        # the Deployment has not rolled out: wait, quietly
    assert "blockSize" not in (kube.get(ISVC, NS, NAME)["status"].get("engine") or {}) and list(events) == []
    rolled_out(kube)
    for t in (T0 + 1, T0 + 2):                        # rolled out, but a roll would stop the only pod
        run(client, state, now=t)
    assert "blockSize" not in (kube.get(ISVC, NS, NAME)["status"].get("engine") or {})
    (ev,) = events
    assert ev[1] == "TuningHeld" and "maxSurge 0" in ev[2]
    kube.patch(ISVC, NS, NAME, {"spec": {"rollout": {"strategy": "Availability"}}})  # a surge pod first
    reconcile.reconcile(client, NS, NAME)
    rolled_out(kube)
    run(client, state, now=T0 + 3)
    assert kube.get(ISVC, NS, NAME)["status"]["engine"]["blockSize"] == 64


def test_a_deployment_scaler_in_mode_none_is_reported_once_and_cleared_once(cluster):
    """The reconcile (ConflictingAutoscaler) and the loop (OperatorAutoscalerOff) never take
    turns rewriting ScalingActive."""
    kube, client, events, runtimes = cluster
    create_isvc(kube, client)  # mode none
    kube.create("autoscaling/v2/horizontalpodautoscalers", {
        "apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler", "metadata": {"name": "hpa", "namespace": NS},
        "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": NAME},
                 "minReplicas": 1, "maxReplicas": 3}})
    reconcile.reconcile(client, NS, NAME)
    assert condition(kube)["reason"] == "ConflictingAutoscaler"
    assert autoscale_step.tracked(kube.get(ISVC, NS, NAME)["spec"], kube.get(ISVC, NS, NAME)) is False
    mark = len(kube.writes())
    for t in range(3):
        run(client, autoscale_step.ServiceState(), now=T0 + t)
        reconcile.reconcile(client, NS, NAME)
    assert len(kube.writes()) == mark
    kube.delete("autoscaling/v2/horizontalpodautoscalers", NS, "hpa")
    reconcile.reconcile(client, NS, NAME)
    assert condition(kube)["reason"] == "OperatorAutoscalerOff"
    mark = len(kube.writes())
    assert not autoscale_step.needs_retire(kube.get(ISVC, NS, NAME))
    run(client, autoscale_step.ServiceState(), now=T0 + 5)
    assert not reconcile.reconcile(client, NS, NAME).wrote and len(kube.writes()) == mark


def test_a_multi_node_service_scales_its_leader_worker_set_on_its_leaders_metrics(cluster):
    """parallelism.nodes 2: the loop reads only the leaders (workers serve no HTTP) and scales the
    InferenceService, then the LeaderWorkerSet through its /scale; the reconcile then agrees."""
    from support.fake_lws import LWS, install_lws_api

    from kvfleet.operator import lws

    kube, client, events, runtimes = cluster
    install_lws_api(kube)
    kube.create(ISVC, {"apiVersion": "kvfleet.io/v1alpha1", "kind": "InferenceService",
                       "metadata": {"name": NAME, "namespace": NS},
                       "spec": {"model": {"uri": "file:///models/m.gguf"}, "autoscaling": OPERATOR,
                                "parallelism": {"tensor": 2, "nodes": 2}, "router": {"enabled": False}}})
    reconcile.reconcile(client, NS, NAME)
    assert kube.get(LWS, NS, NAME)["spec"]["replicas"] == 1
    for pod, worker, runtime in (("svc-0", "0", Runtime(waiting=9)), ("svc-0-1", "1", None)):
        add_pod(kube, runtimes, pod, runtime)  # the worker's metrics port answers nothing
        kube.patch("v1/pods", NS, pod, {"metadata": {"labels": {lws.LABEL_WORKER_INDEX: worker,
                                                                  lws.LABEL_GROUP_INDEX: "0"}}})
    run(client, autoscale_step.ServiceState())
    wanted = kube.get(ISVC, NS, NAME)["spec"]["replicas"]
    assert wanted > 1 and kube.get(LWS, NS, NAME)["spec"]["replicas"] == wanted
    metrics = kube.get(ISVC, NS, NAME)["status"]["metrics"]
    assert metrics["podsRead"] == 1 and not metrics.get("failedPods")  # the leader alone
    reconcile.reconcile(client, NS, NAME)  # renders spec.replicas: the same count, no ping-pong
    assert kube.get(LWS, NS, NAME)["spec"]["replicas"] == wanted
    assert not reconcile.reconcile(client, NS, NAME).applied


def test_tuning_a_multi_node_service_waits_for_whole_groups(cluster):
    """The tuner's rollout check reads the LWS's groups: it waits while the group is not whole,
    then changes status.engine (which rolls the groups through the template hash)."""
    from support.fake_lws import LWS, install_lws_api

    from kvfleet.operator import lws

    kube, client, events, runtimes = cluster
    install_lws_api(kube)
    kube.create(ISVC, {"apiVersion": "kvfleet.io/v1alpha1", "kind": "InferenceService",
                       "metadata": {"name": NAME, "namespace": NS},
                       "spec": {"model": {"uri": "file:///models/m.gguf"}, "router": {"enabled": False},
                                "parallelism": {"tensor": 2, "nodes": 2}, "engine": {"blockSize": 16, "maxNumSeqs": 4},
                                "tuning": {"enabled": True, "blockSizes": [16, 64], "minIntervalSeconds": 0}}})
    reconcile.reconcile(client, NS, NAME)
    digest = lws.template_hash(kube.get(LWS, NS, NAME))
    for pod, worker, runtime in (("svc-0", "0", long_sequences()), ("svc-0-1", "1", None)):
        add_pod(kube, runtimes, pod, runtime, ready=worker == "0")  # the worker is not ready yet
        kube.patch("v1/pods", NS, pod, {"metadata": {"labels": {lws.LABEL_WORKER_INDEX: worker,
                                                                  lws.LABEL_GROUP_INDEX: "0"},
                                                       "annotations": {lws.ANNOTATION_TEMPLATE_HASH: digest}}})
    state = autoscale_step.ServiceState()
    run(client, state, now=T0)
    assert "blockSize" not in (kube.get(ISVC, NS, NAME)["status"].get("engine") or {})
    kube.patch("v1/pods", NS, "svc-0-1", {"status": {"conditions": [{"type": "Ready", "status": "True"}]}},
               subresource="status")
    run(client, state, now=T0 + 1)
    assert kube.get(ISVC, NS, NAME)["status"]["engine"]["blockSize"] == 64
    assert lws.template_hash(kube.get(LWS, NS, NAME)) != digest  # the groups roll onto it
