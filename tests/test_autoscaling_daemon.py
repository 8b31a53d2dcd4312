"""The autoscaler daemon's iteration (kvfleet.operator.autoscaler.step) against the
Kubernetes emulator over real HTTP, with pods whose /metrics are real HTTP endpoints
serving the runtime's exposition (no model needed): what it reads, decides and writes."""

from __future__ import annotations

import asyncio
import http.server
import logging
import threading
from pathlib import Path

import kubernetes
import pytest
import yaml

from kube_emulator import ISVC, EmulatorThread
from kvfleet.operator import autoscaler, builders, reconcile
from kvfleet.operator.metrics_source import METRICS_PORT_ANNOTATION
from kvfleet.runtime.metrics import CONTENT_TYPE, PrometheusStatLogger, exposition
from kvfleet.runtime.stats import SchedulerStats
from support import free_port

NS = "llm"
NAME = "svc"
T0 = 1_800_000_000.0
log = logging.getLogger("test-autoscaler")


class Runtime:
    """A /metrics endpoint serving a real stat logger's exposition."""

    def __init__(self, waiting: int, running: int = 1, kv: float = 0.2):
        self.logger = PrometheusStatLogger("m")
        self.set(waiting, running, kv)
        registry = self.logger.registry

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                body = exposition(registry)
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def set(self, waiting: int, running: int = 1, kv: float = 0.2) -> None:
        self.logger.record(SchedulerStats(num_running_reqs=running, num_waiting_reqs=waiting, kv_cache_usage=kv), None)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def cluster(tmp_path: Path, monkeypatch):
    """(emulator, Kube client, recorded Events)."""
    events: list[tuple[str, str, str]] = []
    monkeypatch.setattr(autoscaler, "_event", lambda body, t, reason, message, inputs=None:
                        events.append((t, reason, message + (f" {inputs}" if inputs else ""))))
    runtimes: list[Runtime] = []
    with EmulatorThread() as kube:
        path = kube.write_kubeconfig(tmp_path / "kubeconfig", namespace=NS)
        cfg = kubernetes.client.Configuration()
        kubernetes.config.load_kube_config(config_file=str(path), client_configuration=cfg)
        client = reconcile.Kube(kubernetes.client.ApiClient(cfg))
        yield kube, client, events, runtimes
    for r in runtimes:
        r.close()


def create_isvc(kube, client, *, autoscaling=None, tuning=None, replicas=1, engine=None) -> dict:
    obj = {"apiVersion": "kvfleet.io/v1alpha1", "kind": "InferenceService",
           "metadata": {"name": NAME, "namespace": NS},
           "spec": {"model": {"uri": "file:///models/m.gguf"}, "replicas": replicas,
                    "engine": engine or {"maxNumSeqs": 4}}}
    if autoscaling is not None:
        obj["spec"]["autoscaling"] = autoscaling
    if tuning is not None:
        obj["spec"]["tuning"] = tuning
    kube.create(ISVC, obj)
    reconcile.reconcile(client, NS, NAME)
    return kube.get(ISVC, NS, NAME)


def add_pod(kube, runtimes, name, runtime: Runtime | None, *, ready=True, terminated=None) -> None:
    isvc = kube.get(ISVC, NS, NAME)
    port = runtime.port if runtime else free_port()
    if runtime:
        runtimes.append(runtime)
    kube.create("v1/pods", {"metadata": {"name": name, "namespace": NS, "labels": builders.labels(isvc),
                                         "annotations": {METRICS_PORT_ANNOTATION: str(port)}},
                            "spec": {"containers": [{"name": "runtime", "image": "x"}]}})
    cs = {"name": "runtime", "ready": ready, "restartCount": 1 if terminated else 0}
    if terminated:
        cs["lastState"] = {"terminated": terminated}
    kube.patch("v1/pods", NS, name, {"status": {
        "phase": "Running" if ready else "Pending", "podIP": "127.0.0.1" if ready else None,
        "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        "containerStatuses": [cs]}}, subresource="status")


def run(client, state, now=T0):
    return asyncio.run(autoscaler.step(client, NS, NAME, state, log, now=now))


def condition(kube, type_="ScalingActive"):
    return next((c for c in kube.get(ISVC, NS, NAME)["status"].get("conditions") or [] if c["type"] == type_), None)


OPERATOR = {"mode": "operator", "minReplicas": 1, "maxReplicas": 4, "targetQueueDepth": 2,
            "scaleDown": {"stabilizationWindowSeconds": 60}}


def test_scales_through_the_scale_subresource(cluster):
    kube, client, events, runtimes = cluster
    create_isvc(kube, client, autoscaling=OPERATOR)
    add_pod(kube, runtimes, "p0", Runtime(waiting=5))
    add_pod(kube, runtimes, "p1", None, ready=False)  # starting: not read, not a failure
    state = autoscaler.DaemonState()
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
    assert "1 -> 3" in ev[2] and "'queueDepth': 5" in ev[2]
    # The reconcile moves the Deployment to the new count.
    reconcile.reconcile(client, NS, NAME)
    assert kube.get("apps/v1/deployments", NS, NAME)["spec"]["replicas"] == 3


def test_scale_up_waits_for_starting_pods_and_down_for_the_window(cluster):
    kube, client, events, runtimes = cluster
    create_isvc(kube, client, autoscaling=OPERATOR, replicas=2)
    rt = Runtime(waiting=20)
    add_pod(kube, runtimes, "p0", rt)
    add_pod(kube, runtimes, "p1", None, ready=False)
    state = autoscaler.DaemonState()
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
    state = autoscaler.DaemonState()
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
    state = autoscaler.DaemonState()
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


def test_only_autoscaled_or_tuned_services_get_a_daemon():
    assert autoscaler.wants_daemon({"autoscaling": {"mode": "operator"}})
    assert autoscaler.wants_daemon({"autoscaling": {"mode": "none"}, "tuning": {"enabled": True}})
    assert not autoscaler.wants_daemon({"autoscaling": {"mode": "hpa"}})
    assert not autoscaler.wants_daemon({"model": {"uri": "file:///m"}})


def test_switching_to_hpa_then_none_retires_the_condition_then_writes_nothing(cluster):
    kube, client, events, runtimes = cluster
    create_isvc(kube, client, autoscaling=OPERATOR)
    add_pod(kube, runtimes, "p0", Runtime(waiting=0))
    run(client, autoscaler.DaemonState())
    assert condition(kube)["status"] == "True"
    # mode hpa: the HPA child appears, the operator's autoscaler says it is off.
    kube.patch(ISVC, NS, NAME, {"spec": {"autoscaling": {"mode": "hpa"}}})
    reconcile.reconcile(client, NS, NAME)
    hpa = kube.get("autoscaling/v2/horizontalpodautoscalers", NS, NAME)
    assert hpa["spec"]["scaleTargetRef"]["kind"] == "InferenceService"
    run(client, autoscaler.DaemonState())
    cond = condition(kube)
    assert (cond["status"], cond["reason"]) == ("False", "OperatorAutoscalerOff") and NAME in cond["message"]
    # mode none: the reconcile prunes the HPA; after one update of the condition, silence.
    kube.patch(ISVC, NS, NAME, {"spec": {"autoscaling": {"mode": "none"}}})
    reconcile.reconcile(client, NS, NAME)
    assert kube.get("autoscaling/v2/horizontalpodautoscalers", NS, NAME) is None
    state = autoscaler.DaemonState()
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
    run(client, autoscaler.DaemonState(), now=T0)
    obj = kube.get(ISVC, NS, NAME)
    assert obj["status"]["engine"]["gpuMemoryUtilization"] == 0.85
    assert obj["spec"]["engine"]["gpuMemoryUtilization"] == 0.9  # the user's spec is not rewritten
    cm = yaml.safe_load(kube.get("v1/configmaps", NS, f"{NAME}-config")["data"]["config.yaml"])
    assert cm["gpu_memory_utilization"] == 0.85
    deploy = kube.get("apps/v1/deployments", NS, NAME)
    assert deploy["spec"]["template"]["metadata"]["annotations"][builders.ANNOTATION_CONFIG_HASH] == \
        builders.content_hash(kube.get("v1/configmaps", NS, f"{NAME}-config")["data"])
    assert [e[1] for e in events] == ["GpuMemoryLowered"]
    # The same termination seen again: no second lowering.
    run(client, autoscaler.DaemonState(), now=T0 + 30)
    assert kube.get(ISVC, NS, NAME)["status"]["engine"]["gpuMemoryUtilization"] == 0.85


def test_long_sequences_choose_a_larger_block_size_through_the_configmap(cluster):
    kube, client, events, runtimes = cluster
    create_isvc(kube, client, tuning={"enabled": True, "blockSizes": [16, 64], "minIntervalSeconds": 0},
                engine={"blockSize": 16, "maxNumSeqs": 4})
    rt = Runtime(waiting=0)
    rt.logger.log_engine_initialized(8192)
    from kvfleet.runtime.stats import FinishedRequestStats, IterationStats

    rt.logger.record(None, IterationStats(finished_requests=[
        FinishedRequestStats("length", 10.0, 0.1, 1500, 500) for _ in range(150)]))
    add_pod(kube, runtimes, "p0", rt)
    run(client, autoscaler.DaemonState(), now=T0)
    obj = kube.get(ISVC, NS, NAME)
    assert obj["status"]["engine"]["blockSize"] == 64  # mean 2000 tokens / 16 = 125 -> 64
    assert obj["spec"]["engine"]["blockSize"] == 16
    cm = yaml.safe_load(kube.get("v1/configmaps", NS, f"{NAME}-config")["data"]["config.yaml"])
    assert cm["block_size"] == 64
    (ev,) = events
    assert ev[1] == "BlockSizeChanged" and "2000 tokens" in ev[2]
