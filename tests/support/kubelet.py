"""A small test "kubelet" (plus the bits of the Deployment/ReplicaSet controllers a test
needs): it turns the Deployments in one namespace of a Kubernetes API (the kmock
emulator, over real HTTP) into real ``kvfleet serve`` processes on local ports.

For every Deployment it keeps ``spec.replicas`` pods whose pod-template hash
(``kvfleet.io/config-hash``) is current:

* a new pod is a Pod object (labels, annotations and spec from the template) plus a
  ``kvfleet serve --config FILE --host 127.0.0.1 --port PORT`` process, where FILE holds the
  ``config.yaml`` of the ConfigMap the template mounts (so engine config changes reach the
  process) and PORT is a free loopback port. The pod carries the annotation
  ``kvfleet.io/metrics-port: PORT``, the documented override the operator's metrics source
  reads (every test pod has podIP 127.0.0.1);
* the pod is reported ``Pending`` until the process answers ``GET /ready`` with 200, then
  ``Running`` with ``podIP: 127.0.0.1`` and ``Ready=True``;
* pods above the replica count, or with a stale template hash (the runtime's config hash, else
  a hash of the whole pod template; a Recreate-style rollout:
  stale pods go first), are deleted and their processes stopped;
* a process that exits is reported in ``containerStatuses[].lastState.terminated``
  (exit code, reason ``Error``, last log line as the message) and restarted;
* the Deployment's status (replicas, readyReplicas, availableReplicas, updatedReplicas,
  observedGeneration, Available condition) follows.

With ``rollout="surge"`` a template change rolls like the Deployment controller does under the
template's ``maxSurge`` / ``maxUnavailable`` (integers): new pods first, an old pod stops only
while enough others are ready; a stopping pod leaves :meth:`ready_pods` (the endpoints) at once,
sleeps its container's ``preStop`` (``prestop_seconds`` overrides), gets SIGTERM (the runtime
drains), and is killed after ``terminationGracePeriodSeconds``.

A pod whose container runs ``kvfleet router`` (args starting with ``router``, as the operator's
router Deployment) runs that command instead, with ``--host``/``--port`` set to the loopback port
and ``KUBECONFIG`` pointing at the API (``kubeconfig``). As the EndpointSlice controller would,
every pod selected by a Service of the namespace gets an EndpointSlice ``<service>-<pod>``
(address 127.0.0.1, the pod's own port, ``conditions.ready``), deleted with the pod; a pod's KV
events socket binds a free port of its own (the operator's fixed port would collide on one host).

Not a real kubelet: no probes beyond /ready, no resources, no init containers, no
volumes except the config file, no env naming a pod path. The model is whatever ``config_overrides`` leaves: the
closed-loop test drops ``model`` so every process serves the embedded default.
"""

from __future__ import annotations

import base64
import hashlib
import itertools
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import yaml

from support.serve import free_port

CONFIG_HASH_ANNOTATION = "kvfleet.io/config-hash"
METRICS_PORT_ANNOTATION = "kvfleet.io/metrics-port"


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def template_hash(template: Mapping[str, Any]) -> str:
    """What tells a pod's template apart: the runtime's config-hash annotation where the template
    has one (the runtime pods), else a hash of the whole template (the router's pods)."""
    annotations = (template.get("metadata") or {}).get("annotations") or {}
    if CONFIG_HASH_ANNOTATION in annotations:
        return annotations[CONFIG_HASH_ANNOTATION]
    return hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:8]


@dataclass
class FakePod:
    name: str
    deployment: str
    template_hash: str
    port: int
    process: subprocess.Popen
    log_path: Path
    started: float
    ready_at: float | None = None
    terminating: bool = False
    restarts: int = 0
    last_terminated: dict[str, Any] | None = None
    reported: dict[str, Any] = field(default_factory=dict)


class TestKubelet:
    """Runs in a background thread; :meth:`start` / :meth:`stop` (stop kills every process).

    Args:
        api: base URL of the Kubernetes API (no auth).
        namespace: the namespace whose Deployments it runs.
        workdir: where config files and process logs go.
        serve_args: extra ``kvfleet serve`` options (e.g. ``["--max-num-seqs", "2"]``); they
            come after ``--config`` and so beat the ConfigMap's values.
        config_overrides: keys to set in (or, with value None, remove from) the ConfigMap's
            config before the process reads it.
        env: extra environment of the processes.
        poll: seconds between two passes.
    """

    __test__ = False  # not a pytest class

    def __init__(self, api: str, namespace: str, workdir: Path, *, serve_args: Sequence[str] = (),
                 config_overrides: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None,
                 poll: float = 0.5, log: Callable[[str], None] = print, rollout: str = "recreate",
                 prestop_seconds: float | None = None, kubeconfig: Path | None = None):
        self.api = api.rstrip("/")
        self.namespace = namespace
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.serve_args = list(serve_args)
        self.config_overrides = dict(config_overrides or {})
        self.env = {**os.environ, "HF_HUB_OFFLINE": "1", **dict(env or {})}
        self.poll = poll
        self.log = log
        self.rollout = rollout
        self.prestop_seconds = prestop_seconds
        self.kubeconfig = kubeconfig
        self.pod_labels: dict[str, dict[str, str]] = {}
        self.slices: dict[str, bool] = {}
        """EndpointSlices this kubelet wrote: name -> the endpoint's ready condition."""
        self.pods: dict[str, FakePod] = {}
        self.events: list[tuple[float, str, str]] = []
        """``(monotonic time, what, pod)``: started, ready, deleted, exited."""
        self._names = itertools.count(1)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._client = httpx.Client(base_url=self.api, timeout=10.0)
        self.errors: list[str] = []

    # ---- lifecycle -----------------------------------------------------------------

    def start(self) -> TestKubelet:
        self._thread = threading.Thread(target=self._run, name="test-kubelet", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        pods = list(self.pods.values())
        for pod in pods:  # all at once: each drains for a moment (the runtime, the router)
            if pod.process.poll() is None:
                pod.process.terminate()
        for pod in pods:
            try:
                pod.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pod.process.kill()
                pod.process.wait(timeout=10)
        self._client.close()

    def __enter__(self) -> TestKubelet:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.sync()
            except Exception as exc:  # keep going: the API may be briefly unavailable
                self.errors.append(repr(exc))
                self.log(f"kubelet: {exc!r}")
            self._stop.wait(self.poll)

    # ---- API helpers -----------------------------------------------------------------

    def _path(self, group_version: str, plural: str, name: str | None = None) -> str:
        base = "/api/v1" if group_version == "v1" else f"/apis/{group_version}"
        path = f"{base}/namespaces/{self.namespace}/{plural}"
        return f"{path}/{name}" if name else path

    def _get(self, path: str) -> Any:
        r = self._client.get(path)
        if r.status_code == 404:
            return None
        r.raise_for_status()
        return r.json()

    def _patch(self, path: str, body: Mapping[str, Any]) -> None:
        r = self._client.patch(path, json=body, headers={"Content-Type": "application/merge-patch+json"})
        r.raise_for_status()

    # ---- one pass ----------------------------------------------------------------------

    def sync(self) -> None:
        """One reconcile pass over every Deployment of the namespace."""
        deployments = (self._get(self._path("apps/v1", "deployments")) or {}).get("items") or []
        wanted = set()
        for dep in deployments:
            if dep.get("metadata", {}).get("deletionTimestamp"):
                continue
            wanted.add(dep["metadata"]["name"])
            self._sync_deployment(dep)
        for pod in [p for p in self.pods.values() if p.deployment not in wanted]:
            self._delete(pod, "deployment gone")
        self._sync_endpoint_slices()

    def _sync_endpoint_slices(self) -> None:
        services = (self._get(self._path("v1", "services")) or {}).get("items") or []
        want: dict[str, tuple[str, FakePod, bool]] = {}
        for svc in services:
            selector = (svc.get("spec") or {}).get("selector") or {}
            if not selector:
                continue
            for pod in list(self.pods.values()):
                labels = self.pod_labels.get(pod.name, {})
                if all(labels.get(k) == v for k, v in selector.items()):
                    ready = pod.ready_at is not None and not pod.terminating
                    want[f"{svc['metadata']['name']}-{pod.name}"] = (svc["metadata"]["name"], pod, ready)
        for name, (service, pod, ready) in want.items():
            if self.slices.get(name) == ready:
                continue
            endpoints = [{"addresses": ["127.0.0.1"], "conditions": {"ready": ready, "terminating": pod.terminating}}]
            if name in self.slices:
                self._patch(self._path("discovery.k8s.io/v1", "endpointslices", name), {"endpoints": endpoints})
            else:
                body = {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                        "metadata": {"name": name, "namespace": self.namespace,
                                     "labels": {"kubernetes.io/service-name": service}},
                        "addressType": "IPv4", "ports": [{"name": "http", "port": pod.port, "protocol": "TCP"}],
                        "endpoints": endpoints}
                self._client.post(self._path("discovery.k8s.io/v1", "endpointslices"), json=body).raise_for_status()
            self.slices[name] = ready
        for name in [n for n in self.slices if n not in want]:
            r = self._client.delete(self._path("discovery.k8s.io/v1", "endpointslices", name))
            if r.status_code not in (200, 202, 404):
                r.raise_for_status()
            del self.slices[name]

    def _sync_deployment(self, dep: Mapping[str, Any]) -> None:
        name = dep["metadata"]["name"]
        spec = dep.get("spec") or {}
        template = spec.get("template") or {}
        want = int(spec.get("replicas", 1))
        thash = template_hash(template)
        mine = [p for p in self.pods.values() if p.deployment == name]

        for pod in mine:
            if not pod.terminating:
                self._check_process(pod, template)
            elif pod.process.poll() is not None:
                self._delete(pod, "rolled")

        # Stale template first, then not-ready, then the youngest: that is what goes.
        mine = [p for p in mine if not p.terminating]
        current = [p for p in mine if p.template_hash == thash]
        stale = [p for p in mine if p.template_hash != thash]
        if self.rollout == "surge" and stale:
            self._roll(dep, thash, want, current, stale)
        else:
            for pod in stale:
                self._delete(pod, "template changed")
            excess = len(current) - want
            if excess > 0:
                for pod in sorted(current, key=lambda p: (p.ready_at is not None, -p.started))[:excess]:
                    self._delete(pod, "scaled down")
                    current.remove(pod)
            for _ in range(want - len(current)):
                current.append(self._create(dep, thash))

        alive = current + [p for p in stale if p.name in self.pods and not p.terminating]
        ready = sum(1 for p in alive if p.ready_at is not None)
        status = {
            "observedGeneration": dep["metadata"].get("generation", 1),
            "replicas": len(alive),
            "updatedReplicas": len(current),
            "readyReplicas": ready,
            "availableReplicas": ready,
            "unavailableReplicas": len(alive) - ready,
            "conditions": [{"type": "Available", "status": "True" if ready >= want else "False",
                            "reason": "MinimumReplicasAvailable" if ready >= want else "MinimumReplicasUnavailable"}],
        }
        if {k: (dep.get("status") or {}).get(k) for k in status} != status:
            self._patch(self._path("apps/v1", "deployments", name) + "/status", {"status": status})

    # ---- pods and processes -----------------------------------------------------------

    def _roll(self, dep: Mapping[str, Any], thash: str, want: int, current: list[FakePod],
              stale: list[FakePod]) -> None:
        """One step of a rolling update under the Deployment's maxSurge / maxUnavailable."""
        ru = ((dep.get("spec") or {}).get("strategy") or {}).get("rollingUpdate") or {}
        surge, unavailable = int(ru.get("maxSurge", 1)), int(ru.get("maxUnavailable", 0))
        while len(current) < want and len(current) + len(stale) < want + surge:
            current.append(self._create(dep, thash))
        ready = sum(1 for p in current + stale if p.ready_at is not None)
        for pod in sorted(stale, key=lambda p: p.ready_at is not None):
            if pod.ready_at is None or ready - 1 >= want - unavailable:
                ready -= pod.ready_at is not None
                self._terminate(pod, (dep.get("spec") or {}).get("template") or {})

    def _terminate(self, pod: FakePod, template: Mapping[str, Any]) -> None:
        """Graceful pod deletion in the background: out of the endpoints at once, preStop,
        SIGTERM, SIGKILL after the grace period; the next pass deletes the Pod object."""
        spec = template.get("spec") or {}
        hook = ((spec.get("containers") or [{}])[0].get("lifecycle") or {}).get("preStop") or {}
        command = (hook.get("exec") or {}).get("command") or []
        prestop = self.prestop_seconds if self.prestop_seconds is not None else (
            float(command[1]) if command[:1] == ["sleep"] else 0.0)
        grace = float(spec.get("terminationGracePeriodSeconds", 30))
        pod.terminating = True
        self.events.append((time.monotonic(), "terminating", pod.name))

        def run() -> None:
            time.sleep(prestop)
            pod.process.terminate()
            try:
                pod.process.wait(timeout=max(1.0, grace - prestop))
            except subprocess.TimeoutExpired:
                pod.process.kill()
                pod.process.wait(timeout=10)
            self.events.append((time.monotonic(), "exited after SIGTERM", pod.name))

        threading.Thread(target=run, name=f"terminate {pod.name}", daemon=True).start()

    def _config_text(self, template: Mapping[str, Any]) -> str:
        volumes = (template.get("spec") or {}).get("volumes") or []
        cm_name = next((v["configMap"]["name"] for v in volumes if "configMap" in v), None)
        config: dict[str, Any] = {}
        if cm_name:
            cm = self._get(self._path("v1", "configmaps", cm_name)) or {}
            data = cm.get("data") or {}
            if data:
                config = yaml.safe_load(next(iter(data.values()))) or {}
        for key, value in self.config_overrides.items():
            if value is None:
                config.pop(key, None)
            else:
                config[key] = value
        events = config.get("kv_events_config")
        if isinstance(events, dict) and events.get("endpoint"):
            # every pod here shares one host: each its own events port, as each pod has its own IP
            # (the router reads it from the replica's /kv_events/snapshot either way)
            config["kv_events_config"] = {**events, "endpoint": "tcp://127.0.0.1:0"}
        return yaml.safe_dump(config, sort_keys=True)

    def _spawn(self, name: str, port: int, template: Mapping[str, Any]) -> tuple[subprocess.Popen, Path]:
        config_path = self.workdir / f"{name}.yaml"
        config_path.write_text(self._config_text(template))
        log_path = self.workdir / f"{name}.log"
        cmd = [sys.executable, "-m", "kvfleet.runtime.cli", "serve", "--config", str(config_path),
               "--host", "127.0.0.1", "--port", str(port), *self.serve_args]
        env = {**self.env, **self._cm_env(template)}
        args = (((template.get("spec") or {}).get("containers") or [{}])[0]).get("args") or []
        if args[:1] == ["router"]:  # the operator's router Deployment: kvfleet router, on this port
            flags = list(args[1:])
            for flag, value in (("--host", "127.0.0.1"), ("--port", str(port))):
                if flag in flags:
                    flags[flags.index(flag) + 1] = value
                else:
                    flags += [flag, value]
            cmd = [sys.executable, "-m", "kvfleet.runtime.cli", "router", *flags]
            env = {**self.env, **self._cm_env(template),
                   **({"KUBECONFIG": str(self.kubeconfig)} if self.kubeconfig else {})}
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True)
        return proc, log_path

    def _cm_env(self, template: Mapping[str, Any]) -> dict[str, str]:
        """The first container's env entries: plain values, and values read from a ConfigMap key
        (``valueFrom.configMapKeyRef``) or a Secret key (``secretKeyRef``: the fleet secret, an
        API key) resolved at process start as the kubelet does at container start. Values that are
        absolute paths (pod paths: HOME, cache folders) are left out."""
        out: dict[str, str] = {}
        for c in ((template.get("spec") or {}).get("containers") or [])[:1]:
            for e in c.get("env") or []:
                if isinstance(e.get("value"), str) and not e["value"].startswith("/"):
                    out[e["name"]] = e["value"]
                ref = (e.get("valueFrom") or {}).get("configMapKeyRef")
                if ref:
                    cm = self._get(self._path("v1", "configmaps", ref["name"])) or {}
                    value = (cm.get("data") or {}).get(ref["key"])
                    if value is not None:
                        out[e["name"]] = value
                ref = (e.get("valueFrom") or {}).get("secretKeyRef")
                if ref:
                    secret = self._get(self._path("v1", "secrets", ref["name"])) or {}
                    value = (secret.get("data") or {}).get(ref["key"])
                    if value is not None:
                        out[e["name"]] = base64.b64decode(value).decode()
        return out

    def _create(self, dep: Mapping[str, Any], thash: str) -> FakePod:
        dep_name = dep["metadata"]["name"]
        template = (dep.get("spec") or {}).get("template") or {}
        name = f"{dep_name}-{(thash or 'x')[:8]}-{next(self._names)}"
        taken = {p.port for p in self.pods.values()}
        port = free_port()
        while port in taken:  # a port handed to a pod still starting looks free to bind(0)
            port = free_port()
        proc, log_path = self._spawn(name, port, template)
        pod = FakePod(name, dep_name, thash, port, proc, log_path, time.monotonic())
        self.pods[name] = pod
        meta = template.get("metadata") or {}
        self.pod_labels[name] = dict(meta.get("labels") or {})
        body = {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {
                "name": name, "namespace": self.namespace,
                "labels": dict(meta.get("labels") or {}),
                "annotations": {**(meta.get("annotations") or {}), METRICS_PORT_ANNOTATION: str(port)},
                # No ownerReference: there is no ReplicaSet object, and the emulator's garbage
                # collector would delete a pod whose owner does not exist.
            },
            "spec": template.get("spec") or {},
            "status": self._pod_status(pod),
        }
        r = self._client.post(self._path("v1", "pods"), json=body)
        r.raise_for_status()
        pod.reported = body["status"]
        self.events.append((time.monotonic(), "started", name))
        self.log(f"kubelet: started {name} on 127.0.0.1:{port} (pid {proc.pid})")
        return pod

    def _pod_status(self, pod: FakePod) -> dict[str, Any]:
        ready = pod.ready_at is not None
        cs: dict[str, Any] = {"name": "runtime", "ready": ready, "restartCount": pod.restarts,
                              "image": "kvfleet-runtime:test", "started": True,
                              "state": {"running": {"startedAt": _now()}}}
        if pod.last_terminated:
            cs["lastState"] = {"terminated": pod.last_terminated}
        return {
            "phase": "Running" if ready else "Pending",
            "podIP": "127.0.0.1" if ready else None,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"},
                           {"type": "ContainersReady", "status": "True" if ready else "False"}],
            "containerStatuses": [cs],
        }

    def _report(self, pod: FakePod) -> None:
        status = self._pod_status(pod)
        comparable = lambda s: {**s, "containerStatuses": [{k: v for k, v in c.items() if k != "state"}
                                                            for c in s["containerStatuses"]]}
        if comparable(status) != comparable(pod.reported):
            self._patch(self._path("v1", "pods", pod.name) + "/status", {"status": status})
            pod.reported = status

    def _check_process(self, pod: FakePod, template: Mapping[str, Any]) -> None:
        code = pod.process.poll()
        if code is not None:
            lines = pod.log_path.read_text(errors="replace").strip().splitlines() if pod.log_path.exists() else []
            pod.last_terminated = {"exitCode": code, "reason": "OOMKilled" if code == 137 else "Error",
                                   "message": (lines[-1] if lines else "")[-1024:], "finishedAt": _now()}
            pod.restarts += 1
            pod.ready_at = None
            self.events.append((time.monotonic(), "exited", pod.name))
            self.log(f"kubelet: {pod.name} exited with {code}; restarting")
            pod.process, _ = self._spawn(pod.name, pod.port, template)
            pod.started = time.monotonic()
        elif pod.ready_at is None:
            try:
                ok = httpx.get(f"http://127.0.0.1:{pod.port}/ready", timeout=1.0).status_code == 200
            except httpx.HTTPError:
                ok = False
            if ok:
                pod.ready_at = time.monotonic()
                self.events.append((pod.ready_at, "ready", pod.name))
                self.log(f"kubelet: {pod.name} ready after {pod.ready_at - pod.started:.1f} s")
        self._report(pod)

    def _kill(self, pod: FakePod) -> None:
        if pod.process.poll() is None:
            pod.process.terminate()
            try:
                pod.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pod.process.kill()
                pod.process.wait(timeout=10)

    def _delete(self, pod: FakePod, why: str) -> None:
        self._kill(pod)
        self.pods.pop(pod.name, None)
        r = self._client.delete(self._path("v1", "pods", pod.name))
        if r.status_code not in (200, 202, 404):
            r.raise_for_status()
        self.events.append((time.monotonic(), "deleted", pod.name))
        self.log(f"kubelet: deleted {pod.name} ({why})")

    # ---- for tests ---------------------------------------------------------------------

    def ready_pods(self, deployment: str | None = None) -> list[FakePod]:
        return [p for p in list(self.pods.values()) if p.ready_at is not None and not p.terminating
                and (deployment is None or p.deployment == deployment)]
