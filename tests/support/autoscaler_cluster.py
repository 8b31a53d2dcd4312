"""An InferenceService on the Kubernetes emulator (real HTTP) with runtime pods whose /metrics
serve a real stat logger's exposition: what the autoscaler's tests (tests/unit/operator/
test_autoscaler*.py, tests/e2e/test_autoscaling_operator.py) drive it with. ``cluster`` is a
fixture: a module uses it with ``cluster = autoscaler_cluster.cluster``."""

from __future__ import annotations

import asyncio
import http.server
import logging
import threading
from pathlib import Path

import kubernetes
import pytest

from kvfleet.operator import autoscale_step, reconcile, service_spec
from kvfleet.operator.kube import Kube
from kvfleet.operator.metrics_source import METRICS_PORT_ANNOTATION
from kvfleet.runtime.core.sched.output import SchedulerStats
from kvfleet.runtime.metrics import CONTENT_TYPE, PrometheusStatLogger, exposition
from support.kube_emulator import ISVC, EmulatorThread
from support.serve import free_port

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
            def do_GET(self):
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


class Events:
    """The Events the operator posted about InferenceService ``name``, read from the
    emulator: ``(type, reason, message)`` in order."""

    def __init__(self, kube: EmulatorThread, name: str = NAME):
        self.kube, self.name = kube, name

    def _all(self) -> list[tuple[str, str, str]]:
        return [(e["type"], e["reason"], e["message"]) for e in self.kube.list("v1/events", NS)
                if (e.get("involvedObject") or {}).get("name") == self.name]

    def __iter__(self):
        return iter(self._all())

    def __len__(self) -> int:
        return len(self._all())


@pytest.fixture
def cluster(tmp_path: Path):
    """(emulator, Kube client, the Events about NAME, runtimes to close)."""
    runtimes: list[Runtime] = []
    with EmulatorThread() as kube:
        path = kube.write_kubeconfig(tmp_path / "kubeconfig", namespace=NS)
        cfg = kubernetes.client.Configuration()
        kubernetes.config.load_kube_config(config_file=str(path), client_configuration=cfg)
        client = Kube(kubernetes.client.ApiClient(cfg))
        yield kube, client, Events(kube), runtimes
    for r in runtimes:
        r.close()


def create_isvc(kube, client, *, autoscaling=None, tuning=None, replicas=1, engine=None, name=NAME) -> dict:
    obj = {"apiVersion": "kvfleet.io/v1alpha1", "kind": "InferenceService",
           "metadata": {"name": name, "namespace": NS},
           "spec": {"model": {"uri": "file:///models/m.gguf"}, "replicas": replicas,
                    "engine": engine or {"maxNumSeqs": 4}}}
    if autoscaling is not None:
        obj["spec"]["autoscaling"] = autoscaling
    if tuning is not None:
        obj["spec"]["tuning"] = tuning
    kube.create(ISVC, obj)
    reconcile.reconcile(client, NS, name)
    return kube.get(ISVC, NS, name)


def add_pod(kube, runtimes, name, runtime: Runtime | None, *, ready=True, terminated=None, isvc_name=NAME) -> None:
    isvc = kube.get(ISVC, NS, isvc_name)
    port = runtime.port if runtime else free_port()
    if runtime:
        runtimes.append(runtime)
    kube.create("v1/pods", {"metadata": {"name": name, "namespace": NS, "labels": service_spec.labels(isvc),
                                         "annotations": {METRICS_PORT_ANNOTATION: str(port)}},
                            "spec": {"containers": [{"name": "runtime", "image": "x"}]}})
    cs = {"name": "runtime", "ready": ready, "restartCount": 1 if terminated else 0}
    if terminated:
        cs["lastState"] = {"terminated": terminated}
    kube.patch("v1/pods", NS, name, {"status": {
        "phase": "Running" if ready else "Pending", "podIP": "127.0.0.1" if ready else None,
        "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        "containerStatuses": [cs]}}, subresource="status")


def rolled_out(kube, name=NAME) -> None:
    """Report the Deployment as the Deployment controller would once every pod is updated and available."""
    d = kube.get("apps/v1/deployments", NS, name)
    n = d["spec"]["replicas"]
    kube.patch("apps/v1/deployments", NS, name, {"status": {
        "observedGeneration": d["metadata"]["generation"], "replicas": n, "updatedReplicas": n,
        "readyReplicas": n, "availableReplicas": n}}, subresource="status")


def run(client, state, now=T0):
    return asyncio.run(autoscale_step.step(client, NS, NAME, state, log, now=now))


def condition(kube, type_="ScalingActive"):
    return next((c for c in kube.get(ISVC, NS, NAME)["status"].get("conditions") or [] if c["type"] == type_), None)


OPERATOR = {"mode": "operator", "minReplicas": 1, "maxReplicas": 4, "targetQueueDepth": 2,
            "scaleDown": {"stabilizationWindowSeconds": 60}}


def long_sequences() -> Runtime:
    """A runtime whose 150 finished requests averaged 2000 tokens (block size 64 fits)."""
    rt = Runtime(waiting=0)
    rt.logger.log_engine_initialized(8192)
    from kvfleet.runtime.engine.stats import FinishedRequestStats, IterationStats

    rt.logger.record(None, IterationStats(finished_requests=[
        FinishedRequestStats("length", 10.0, 0.1, 1500, 500) for _ in range(150)]))
    return rt
