"""The operator's autoscaler against the Kubernetes emulator over real HTTP, with pods whose
/metrics are real HTTP endpoints serving the runtime's exposition (no model needed): one
iteration (kvfleet.operator.autoscaler.step: what it reads, decides and writes, Events
included), the operator-wide loop (AutoscalerLoop: many objects, one failing, objects
leaving, peering pauses), the peering rule, and that no kopf handler needs a finalizer."""

from __future__ import annotations

import asyncio
import datetime

import kopf
import pytest
import support.autoscaler_cluster as autoscaler_cluster
import yaml
from support.autoscaler_cluster import (
    NAME,
    NS,
    OPERATOR,
    T0,
    Runtime,
    add_pod,
    condition,
    create_isvc,
    log,
    long_sequences,
    rolled_out,
    run,
)
from support.kube_emulator import ISVC

from kvfleet.operator import autoscale_step, autoscaler, builders, peering, reconcile, service_spec

cluster = autoscaler_cluster.cluster  # the emulator fixture



def test_scales_through_the_scale_subresource(cluster):
    kube, client, events, runtimes = cluster
    create_isvc(kube, client, autoscaling=OPERATOR)
    add_pod(kube, runtimes, "p0", Runtime(waiting=5))
    add_pod(kube, runtimes, "p1", None, ready=False)  # starting: not read, not a failure
    state = autoscale_step.ServiceState()
    before = kube.writes()
    run(client, state)
    obj = kube.get(ISVC, NS, NAME)
    assert obj["spec"]["replicas"] == 3  # ceil(5 / 2)
    scale_writes = [w for w in kube.writes()[len(before):] if w[1].endswith("/scale")]
    assert len(scale_writes) == 1, kube.writes()[len(before):]
    assert obj["spec"]["autoscaling"] == OPERATOR  # nothing else of the user's spec changed
    assert obj["status"]["metrics"]["queueDepth"] == 5 and obj["status"]["metrics"]["notReadyPods"] == ["p1"]
    assert obj["status"]["lastScaleTime"]
    assert condition(kube)["status"] == "True"
    (ev,) = [e for e in events if e[1] == "ScaledUp"]
    assert ev[0] == "Normal" and "1 -> 3" in ev[2] and '"queueDepth":5' in ev[2]
    # The reconcile moves the Deployment to the new count.
    reconcile.reconcile(client, NS, NAME)
    assert kube.get("apps/v1/deployments", NS, NAME)["spec"]["replicas"] == 3


def test_scale_up_waits_for_starting_pods_and_down_for_the_window(cluster):
    kube, client, events, runtimes = cluster
    create_isvc(kube, client, autoscaling=OPERATOR, replicas=2)
    rt = Runtime(waiting=20)
    add_pod(kube, runtimes, "p0", rt)
    add_pod(kube, runtimes, "p1", None, ready=False)
    state = autoscale_step.ServiceState()
    run(client, state)
    assert kube.get(ISVC, NS, NAME)["spec"]["replicas"] == 2  # p1 still starting
    assert any(e[1] == "PodsStarting" for e in events)
    rt.set(waiting=0, running=0)
    run(client, state, now=T0 + 30)
    assert kube.get(ISVC, NS, NAME)["spec"]["replicas"] == 2  # inside the 60 s down window
    run(client, state, now=T0 + 61)
    assert kube.get(ISVC, NS, NAME)["spec"]["replicas"] == 1
    assert any(e[1] == "ScaledDown" for e in events)


def test_failed_scrapes_hold_and_say_so(cluster):
    kube, client, events, runtimes = cluster
    create_isvc(kube, client, autoscaling={**OPERATOR, "minReplicas": 0,
                                           "scaleDown": {"stabilizationWindowSeconds": 0}}, replicas=2)
    add_pod(kube, runtimes, "p0", None)  # ready, but nothing listens on its port
    add_pod(kube, runtimes, "p1", None)
    state = autoscale_step.ServiceState()
    for i in range(3):
        run(client, state, now=T0 + i * 400)
    obj = kube.get(ISVC, NS, NAME)
    assert obj["spec"]["replicas"] == 2
    assert len(obj["status"]["metrics"]["failedPods"]) == 2 and obj["status"]["metrics"]["podsRead"] == 0
    cond = condition(kube)
    assert (cond["status"], cond["reason"]) == ("False", "MetricsUnavailable")
    assert [e[0] for e in events if e[1] == "MetricsUnavailable"] == ["Warning"]  # once, not per poll


def test_a_foreign_hpa_stops_the_operator_autoscaler(cluster):
    kube, client, events, runtimes = cluster
    create_isvc(kube, client, autoscaling=OPERATOR)
    add_pod(kube, runtimes, "p0", Runtime(waiting=9))
    kube.create("autoscaling/v2/horizontalpodautoscalers", {
        "apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": "by-hand", "namespace": NS},
        "spec": {"scaleTargetRef": {"apiVersion": "kvfleet.io/v1alpha1", "kind": "InferenceService", "name": NAME},
                 "minReplicas": 1, "maxReplicas": 3,
                 "metrics": [{"type": "Pods", "pods": {"metric": {"name": "x"},
                                                       "target": {"type": "AverageValue", "averageValue": "1"}}}]}})
    state = autoscale_step.ServiceState()
    run(client, state)
    run(client, state, now=T0 + 1)
    assert kube.get(ISVC, NS, NAME)["spec"]["replicas"] == 1
    cond = condition(kube)
    assert (cond["status"], cond["reason"]) == ("False", "ConflictingAutoscaler") and "by-hand" in cond["message"]
    assert [e[1] for e in events if e[0] == "Warning"] == ["ConflictingAutoscaler"]
    # Remove the HPA: the operator takes over.
    kube.delete("autoscaling/v2/horizontalpodautoscalers", NS, "by-hand")
    run(client, state, now=T0 + 2)
    assert kube.get(ISVC, NS, NAME)["spec"]["replicas"] == 4  # ceil(9 / 2) = 5, bounded by max 4
    assert condition(kube)["status"] == "True"


def test_only_autoscaled_or_tuned_services_or_stale_conditions_are_indexed():
    assert autoscale_step.wants_autoscaler({"autoscaling": {"mode": "operator"}})
    assert autoscale_step.wants_autoscaler({"autoscaling": {"mode": "none"}, "tuning": {"enabled": True}})
    assert not autoscale_step.wants_autoscaler({"autoscaling": {"mode": "hpa"}})
    assert not autoscale_step.wants_autoscaler({"model": {"uri": "file:///m"}})

    def body(spec, conditions=None, deleting=False):
        meta = {"name": NAME, "namespace": NS, **({"deletionTimestamp": "2027-01-01T00:00:00Z"} if deleting else {})}
        return {"metadata": meta, "spec": spec, "status": {"conditions": conditions or []}}

    def tracked(b):
        return autoscale_step.tracked(spec=b["spec"], body=b)

    assert tracked(body({"autoscaling": {"mode": "operator"}}))
    assert not tracked(body({"autoscaling": {"mode": "operator"}}, deleting=True))
    assert not tracked(body({"autoscaling": {"mode": "none"}}))
    # Switched off while the condition still says the operator scales: visited once more ...
    active = {"type": "ScalingActive", "status": "True", "reason": "OperatorAutoscaler", "message": "scaling"}
    assert tracked(body({"autoscaling": {"mode": "none"}}, [active]))
    # ... until the condition says it is off.
    off = autoscale_step._retire_patch(body({"autoscaling": {"mode": "hpa"}}, [active]), "hpa")["conditions"]
    assert not tracked(body({"autoscaling": {"mode": "hpa"}}, off))
    assert tracked(body({"autoscaling": {"mode": "none"}}, off))  # the message names the mode


def test_switching_to_hpa_then_none_retires_the_condition_then_writes_nothing(cluster):
    kube, client, events, runtimes = cluster
    create_isvc(kube, client, autoscaling=OPERATOR)
    add_pod(kube, runtimes, "p0", Runtime(waiting=0))
    run(client, autoscale_step.ServiceState())
    assert condition(kube)["status"] == "True"
    # mode hpa: the HPA child appears, the operator's autoscaler says it is off.
    kube.patch(ISVC, NS, NAME, {"spec": {"autoscaling": {"mode": "hpa"}}})
    reconcile.reconcile(client, NS, NAME)
    hpa = kube.get("autoscaling/v2/horizontalpodautoscalers", NS, NAME)
    assert hpa["spec"]["scaleTargetRef"]["kind"] == "InferenceService"
    run(client, autoscale_step.ServiceState())
    cond = condition(kube)
    assert (cond["status"], cond["reason"]) == ("False", "OperatorAutoscalerOff") and NAME in cond["message"]
    # mode none: the reconcile prunes the HPA; after one update of the condition, silence.
    kube.patch(ISVC, NS, NAME, {"spec": {"autoscaling": {"mode": "none"}}})
    reconcile.reconcile(client, NS, NAME)
    assert kube.get("autoscaling/v2/horizontalpodautoscalers", NS, NAME) is None
    state = autoscale_step.ServiceState()
    run(client, state)
    assert "mode is none" in condition(kube)["message"]
    before = kube.writes()
    for i in range(3):
        run(client, state, now=T0 + i)
    assert kube.writes() == before


def test_oom_restart_lowers_memory_utilisation_through_status_and_the_configmap(cluster):
    kube, client, events, runtimes = cluster
    create_isvc(kube, client, tuning={"enabled": True, "gpuMemoryUtilization": {"min": 0.5, "max": 0.95, "step": 0.05}},
                engine={"gpuMemoryUtilization": 0.9, "maxNumSeqs": 4})
    cm_before = kube.get("v1/configmaps", NS, f"{NAME}-config")["data"]["config.yaml"]
    assert yaml.safe_load(cm_before)["gpu_memory_utilization"] == 0.9
    add_pod(kube, runtimes, "p0", Runtime(waiting=0), terminated={
        "reason": "OOMKilled", "exitCode": 137, "finishedAt": "2027-01-15T08:00:00Z"})
    run(client, autoscale_step.ServiceState(), now=T0)
    obj = kube.get(ISVC, NS, NAME)
    assert obj["status"]["engine"]["gpuMemoryUtilization"] == 0.85
    assert obj["spec"]["engine"]["gpuMemoryUtilization"] == 0.9  # the user's spec is not rewritten
    cm = yaml.safe_load(kube.get("v1/configmaps", NS, f"{NAME}-config")["data"]["config.yaml"])
    assert cm["gpu_memory_utilization"] == 0.85
    deploy = kube.get("apps/v1/deployments", NS, NAME)
    assert deploy["spec"]["template"]["metadata"]["annotations"][service_spec.ANNOTATION_CONFIG_HASH] == \
        builders.content_hash(kube.get("v1/configmaps", NS, f"{NAME}-config")["data"])
    assert [e[1] for e in events] == ["GpuMemoryLowered"]
    # The same termination seen again: no second lowering.
    run(client, autoscale_step.ServiceState(), now=T0 + 30)
    assert kube.get(ISVC, NS, NAME)["status"]["engine"]["gpuMemoryUtilization"] == 0.85


def test_long_sequences_choose_a_larger_block_size_through_the_configmap(cluster):
    kube, client, events, runtimes = cluster
    create_isvc(kube, client, tuning={"enabled": True, "blockSizes": [16, 64], "minIntervalSeconds": 0},
                engine={"blockSize": 16, "maxNumSeqs": 4})
    add_pod(kube, runtimes, "p0", long_sequences())
    rolled_out(kube)
    run(client, autoscale_step.ServiceState(), now=T0)
    obj = kube.get(ISVC, NS, NAME)
    assert obj["status"]["engine"]["blockSize"] == 64  # mean 2000 tokens / 16 = 125 -> 64
    assert obj["spec"]["engine"]["blockSize"] == 16
    cm = yaml.safe_load(kube.get("v1/configmaps", NS, f"{NAME}-config")["data"]["config.yaml"])
    assert cm["block_size"] == 64
    (ev,) = events
    assert ev[1] == "BlockSizeChanged" and "2000 tokens" in ev[2]


# ---------------------------------------------------------------------------------
# the operator-wide loop


def reindex(kube) -> dict:
    """What kopf's index ``autoscaler`` holds for the emulator's objects: the same filter
    (autoscale_step.tracked) and the same index function as the registered handler."""
    out = {}
    for obj in kube.list(ISVC, NS):
        meta = obj["metadata"]
        if autoscale_step.tracked(spec=obj.get("spec") or {}, body=obj):
            out.update(autoscaler.autoscaled_index(namespace=meta["namespace"], name=meta["name"], uid=meta["uid"]))
    return out


def settings(*, standalone=False, priority=100, mandatory=True):
    s = kopf.OperatorSettings()
    s.peering.standalone = standalone
    s.peering.clusterwide = True
    s.peering.mandatory = mandatory
    s.peering.name = "kvfleet-operator"
    s.peering.priority = priority
    return s


async def passes(loop: autoscaler.AutoscalerLoop, kube, index: dict, n: int = 1) -> None:
    """``n`` passes of the loop, each after kopf's index has caught up, waiting for the
    iterations they start."""
    for _ in range(n):
        index.clear()
        index.update(reindex(kube))
        await loop.tick()
        await asyncio.gather(*list(loop.running.values()), return_exceptions=True)
        await asyncio.sleep(0.12)  # the interval (KVFLEET_AUTOSCALER_INTERVAL=0.1)


def peer(priority: int, seconds_ago: float = 0.0, lifetime: int = 60) -> dict:
    seen = datetime.datetime.now(datetime.UTC) - datetime.timedelta(seconds=seconds_ago)
    return {"priority": priority, "lifetime": lifetime, "lastseen": seen.isoformat()}


@pytest.fixture
def fast(monkeypatch):
    monkeypatch.setenv(autoscale_step.INTERVAL_ENV, "0.1")


def test_the_loop_scales_each_service_and_one_failure_stops_no_other(cluster, fast, caplog):
    kube, client, events, runtimes = cluster
    create_isvc(kube, client, autoscaling=OPERATOR)
    add_pod(kube, runtimes, "p0", Runtime(waiting=5))
    create_isvc(kube, client, autoscaling=OPERATOR, name="other")
    add_pod(kube, runtimes, "q0", Runtime(waiting=7), isvc_name="other")
    # A broken object (replicas not a number; the CRD schema would refuse it, the emulator
    # does not): its iteration raises on every pass.
    kube.create(ISVC, {"apiVersion": "kvfleet.io/v1alpha1", "kind": "InferenceService",
                       "metadata": {"name": "broken", "namespace": NS},
                       "spec": {"model": {"uri": "file:///m.gguf"}, "replicas": "three", "autoscaling": OPERATOR}})
    add_pod(kube, runtimes, "b0", Runtime(waiting=9), isvc_name="broken")
    index: dict = {}

    async def main():
        loop = autoscaler.AutoscalerLoop(client, index, settings(standalone=True), None, log)
        try:
            await passes(loop, kube, index, 3)
            assert set(loop.states) == {(NS, NAME), (NS, "other"), (NS, "broken")}
        finally:
            await loop.stop()

    asyncio.run(main())
    assert kube.get(ISVC, NS, NAME)["spec"]["replicas"] == 3  # ceil(5 / 2)
    assert kube.get(ISVC, NS, "other")["spec"]["replicas"] == 4  # ceil(7 / 2)
    assert kube.get(ISVC, NS, "broken")["spec"]["replicas"] == "three"
    failures = [r for r in caplog.records if r.getMessage() == f"autoscaler of {NS}/broken" and r.exc_info]
    assert len(failures) == 3 and isinstance(failures[0].exc_info[1], ValueError)  # every pass, logged
    assert [e[1] for e in events if e[1].startswith("Scaled")] == ["ScaledUp"]  # once, not per pass


def test_the_loop_retires_a_service_that_stops_being_autoscaled_then_forgets_it(cluster, fast):
    kube, client, events, runtimes = cluster
    create_isvc(kube, client, autoscaling=OPERATOR)
    add_pod(kube, runtimes, "p0", Runtime(waiting=0))
    create_isvc(kube, client, name="plain")  # not autoscaled: never visited
    index: dict = {}

    async def main():
        loop = autoscaler.AutoscalerLoop(client, index, settings(standalone=True), None, log)
        try:
            await passes(loop, kube, index, 2)
            assert condition(kube)["status"] == "True" and list(loop.states) == [(NS, NAME)]
            kube.patch(ISVC, NS, NAME, {"spec": {"autoscaling": {"mode": "none"}}})
            await passes(loop, kube, index)  # still indexed: its condition says otherwise
            cond = condition(kube)
            assert (cond["status"], cond["reason"]) == ("False", "OperatorAutoscalerOff")
            await passes(loop, kube, index)
            assert index == {} and loop.states == {}
            before = kube.writes()
            await passes(loop, kube, index, 3)
            assert kube.writes() == before
            assert not kube.get(ISVC, NS, NAME)["metadata"].get("finalizers")  # nothing holds a delete
        finally:
            await loop.stop()

    asyncio.run(main())


def test_a_paused_operator_neither_scales_nor_writes(cluster, fast):
    kube, client, events, runtimes = cluster
    kube.create("kopf.dev/v1/clusterkopfpeerings", {
        "apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering", "metadata": {"name": "kvfleet-operator"},
        "status": {"me": peer(100), "them": peer(200)}})
    create_isvc(kube, client, autoscaling=OPERATOR)
    rt = Runtime(waiting=5)
    add_pod(kube, runtimes, "p0", rt)
    index: dict = {}

    async def main():
        loop = autoscaler.AutoscalerLoop(client, index, settings(priority=100), "me", log)
        try:
            before = kube.writes()
            await passes(loop, kube, index, 3)
            assert kube.writes() == before and loop.paused and "them" in loop.paused
            assert kube.get(ISVC, NS, NAME)["spec"]["replicas"] == 1
            # The higher-priority peer's keep-alive expires: this operator takes over.
            kube.patch("kopf.dev/v1/clusterkopfpeerings", None, "kvfleet-operator",
                       {"status": {"them": peer(200, seconds_ago=120)}})
            loop.recheck_at = 0.0  # do not wait out the recheck interval
            await passes(loop, kube, index)
            assert loop.paused is None and kube.get(ISVC, NS, NAME)["spec"]["replicas"] == 3
            assert loop.states[(NS, NAME)].history
            # Paused again: the state is forgotten (seeded afresh on resume, as after a restart).
            kube.patch("kopf.dev/v1/clusterkopfpeerings", None, "kvfleet-operator", {"status": {"them": peer(200)}})
            rt.set(waiting=9)
            for st in loop.states.values():
                st.due = 0.0
            loop.recheck_at = 0.0  # the "not paused" answer is reused for PEERING_TTL
            before = kube.writes()
            await passes(loop, kube, index, 2)
            assert loop.paused and loop.states == {} and kube.writes() == before
        finally:
            await loop.stop()

    asyncio.run(main())


def test_peers_ahead_follows_kopfs_rule():
    now = datetime.datetime.now(datetime.UTC)
    status = {"me": peer(100), "high": peer(200), "low": peer(50), "dead": peer(900, seconds_ago=61),
              "twin": peer(100), "fresh": {"priority": 300}}  # no lastseen yet: alive
    assert peering.peers_ahead(status, identity="me", priority=100, now=now) == ["fresh", "high", "twin"]
    # Sharded operators (label selectors) do not pause for the same priority.
    assert peering.peers_ahead(status, identity="me", priority=100, now=now,
                                  same_priority_pauses=False) == ["fresh", "high"]
    # Unknown identity: an entry of the same priority may be this operator itself.
    assert peering.peers_ahead(status, identity=None, priority=100, now=now) == ["fresh", "high"]
    assert peering.peers_ahead({"me": peer(1)}, identity="me", priority=1, now=now) == []
    assert peering.peers_ahead(None, identity="me", priority=1, now=now) == []


def test_pause_reason_reads_the_peering_object_like_kopf(cluster):
    kube, client, events, runtimes = cluster
    assert peering.pause_reason(client, settings(standalone=True), "me", [NS]) is None
    # Mandatory peering (--peering NAME) without the object: kopf waits, so does the loop.
    assert "does not exist" in peering.pause_reason(client, settings(), "me", [NS])
    assert peering.pause_reason(client, settings(mandatory=False), "me", [NS]) is None
    kube.create("kopf.dev/v1/clusterkopfpeerings", {
        "apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering", "metadata": {"name": "kvfleet-operator"},
        "status": {"me": peer(100), "low": peer(10)}})
    assert peering.pause_reason(client, settings(), "me", [NS]) is None
    # A namespaced operator reads the KopfPeering of the namespaces it works in.
    namespaced = settings()
    namespaced.peering.clusterwide = False
    assert "KopfPeering llm/kvfleet-operator does not exist" in peering.pause_reason(client, namespaced, "me", [NS])
    kube.create("kopf.dev/v1/kopfpeerings", {
        "apiVersion": "kopf.dev/v1", "kind": "KopfPeering", "metadata": {"name": "kvfleet-operator", "namespace": NS},
        "status": {"me": peer(100), "boss": peer(101)}})
    assert "boss" in peering.pause_reason(client, namespaced, "me", [NS])


def test_no_kopf_handler_of_the_operator_needs_a_finalizer():
    import kvfleet.operator.handlers  # noqa: F401  (registers every handler, the autoscaler's too)

    registry = kopf.get_default_registry()
    ours = [h for sub in (registry._changing, registry._watching, registry._spawning, registry._indexing)
            for h in sub.get_all_handlers() if getattr(h.fn, "__module__", "").startswith("kvfleet.operator")]
    assert autoscaler.INDEX in {h.id for h in ours}
    assert not [h.id for h in ours if getattr(h, "requires_finalizer", False)]
    assert not [h for h in registry._spawning.get_all_handlers()
                if getattr(h.fn, "__module__", "").startswith("kvfleet.operator")]  # no daemons, no timers


def test_the_peering_object_is_read_once_per_ttl_not_once_per_object(monkeypatch):
    calls = []
    monkeypatch.setattr(peering, "pause_reason", lambda *a: calls.append(a) and None)
    seen = []

    async def fake_step(kube, namespace, name, state, logger, now=None):
        seen.append(name)
        return 60.0

    monkeypatch.setattr(autoscale_step, "step", fake_step)
    index = {(NS, f"s{i}"): "uid" for i in range(5)}

    async def main():
        loop = autoscaler.AutoscalerLoop(None, index, settings(), "me", log)
        try:
            await loop.tick()  # all five due: one read
            await asyncio.gather(*list(loop.running.values()))
            for st in loop.states.values():  # fall due one after the other
                st.due = 0.0
                await loop.tick()
                await asyncio.gather(*list(loop.running.values()))
            assert len(seen) == 10 and len(calls) == 1
            loop.recheck_at = 0.0  # the TTL is over: the next due object checks again
            next(iter(loop.states.values())).due = 0.0
            await loop.tick()
            assert len(calls) == 2
        finally:
            await loop.stop()

    asyncio.run(main())
