"""Closed loop, end to end, on this machine: the kmock Kubernetes emulator
(tests/support/kube_emulator.py) over real HTTP, ``kvfleet operator`` as a real process pointed at
it, and the test kubelet (tests/support/kubelet.py) that turns the Deployment's replicas into real
``kvfleet serve`` processes with the default model (max_num_seqs 2, so requests queue).

A load generator keeps more requests in flight than one replica runs at once: the operator
scales the InferenceService 1 -> 2 (its scale subresource); the second pod comes up and
takes load; the load stops: after the (shortened, 10 s) scale-down window it goes back to 1.
Prints the scale-up reaction time (load start -> spec.replicas 2).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from support.kube_emulator import ISVC, EmulatorThread
from support.kubelet import TestKubelet

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

NS = "llm"
NAME = "smollm2"
MODEL = "smollm2"
DOWN_WINDOW = 10
POLL = 1.0
CLIENTS = 6  # > max_num_seqs 2: 4 wait on one replica -> queue depth 4 / target 2 -> 2 replicas


def isvc_manifest() -> dict:
    return {
        "apiVersion": "kvfleet.io/v1alpha1", "kind": "InferenceService",
        "metadata": {"name": NAME, "namespace": NS},
        "spec": {
            # The kubelet drops `model` from the config: every process serves the embedded default.
            "model": {"uri": "file:///models/smollm2.gguf", "servedModelName": MODEL},
            "engine": {"maxNumSeqs": 2, "maxModelLen": 512},
            "replicas": 1,
            # The load goes to the runtime pods directly (as a Service would): no router in front,
            # so the kubelet's pods are the runtime's alone (the router is on by default).
            "router": {"enabled": False},
            "autoscaling": {
                "mode": "operator", "minReplicas": 1, "maxReplicas": 2, "targetQueueDepth": 2,
                "targetKVCacheUsage": 0.9,
                "scaleUp": {"stabilizationWindowSeconds": 0},
                "scaleDown": {"stabilizationWindowSeconds": DOWN_WINDOW},
                "metrics": {"intervalSeconds": 1},
            },
        },
    }


class Load:
    """``clients`` concurrent loops, each sending one completion at a time to a ready pod
    (round robin over the kubelet's ready pods: what the Service would do)."""

    def __init__(self, kubelet: TestKubelet, clients: int):
        self.kubelet, self.clients = kubelet, clients
        self.done = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._rr = itertools.count()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    async def _client(self, http: httpx.AsyncClient, i: int) -> None:
        while not self._stop.is_set():
            pods = self.kubelet.ready_pods()
            if not pods:
                await asyncio.sleep(0.2)
                continue
            pod = pods[next(self._rr) % len(pods)]
            try:
                r = await http.post(f"http://127.0.0.1:{pod.port}/v1/completions", timeout=120, json={
                    "model": MODEL, "prompt": f"Request {i}: count from one to fifty.", "max_tokens": 24,
                    "ignore_eos": True, "temperature": 0})
                if r.status_code == 200:
                    self.done += 1
                else:
                    self.errors.append(f"{r.status_code} {r.text[:200]}")
            except httpx.HTTPError as e:
                self.errors.append(repr(e))
                await asyncio.sleep(0.2)

    async def _main(self) -> None:
        async with httpx.AsyncClient() as http:
            tasks = [asyncio.create_task(self._client(http, i)) for i in range(self.clients)]
            while not self._stop.is_set():
                await asyncio.sleep(0.1)
            for t in tasks:  # disconnect: the runtime aborts the requests in flight
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def start(self) -> Load:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)


def replicas(kube: EmulatorThread) -> int | None:
    obj = kube.get(ISVC, NS, NAME)
    return None if obj is None else obj["spec"].get("replicas")


def events(kube: EmulatorThread, reason: str) -> list[dict]:
    return [e for e in kube.list("v1/events", NS)
            if e.get("reason") == reason and (e.get("involvedObject") or {}).get("name") == NAME]


def test_closed_loop_scales_up_under_load_and_back_down(tmp_path: Path):
    with EmulatorThread() as kube:
        kubeconfig = kube.write_kubeconfig(tmp_path / "kubeconfig", namespace=NS)
        env = {**os.environ, "KVFLEET_AUTOSCALER_INTERVAL": str(POLL), "HF_HUB_OFFLINE": "1",
               "OMP_WAIT_POLICY": "PASSIVE"}
        op_log = open(tmp_path / "operator.log", "wb")
        operator = subprocess.Popen(
            [sys.executable, "-m", "kvfleet.runtime.cli", "operator", "--kubeconfig", str(kubeconfig),
             "--namespace", NS, "--standalone", "--verbose"],
            stdout=op_log, stderr=subprocess.STDOUT, env=env)
        kubelet = TestKubelet(kube.url, NS, tmp_path / "kubelet", config_overrides={"model": None},
                              env={"OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "1"})
        load = Load(kubelet, CLIENTS)

        def tail() -> str:
            op_log.flush()
            return (tmp_path / "operator.log").read_text(errors="replace")[-4000:]

        try:
            kubelet.start()
            kube.create(ISVC, isvc_manifest())
            kube.wait_for(lambda: len(kubelet.ready_pods()) == 1, timeout=180,
                          message=f"the first runtime pod to be ready\n{tail()}")
            assert operator.poll() is None, tail()
            assert replicas(kube) == 1

            # ---- scale up under load ---------------------------------------------------
            t_load = time.monotonic()
            load.start()
            kube.wait_for(lambda: replicas(kube) == 2, timeout=120, interval=0.1,
                          message=f"the operator to scale to 2 under load\n{tail()}")
            reaction = time.monotonic() - t_load
            print(f"\nscale-up reaction time: {reaction:.1f} s (load start -> spec.replicas 2, "
                  f"poll interval {POLL:g} s)")
            up = kube.wait_for(lambda: events(kube, "ScaledUp"), timeout=30, message="a ScaledUp Event")
            assert "queueDepth" in up[0]["message"], up[0]
            # The Deployment follows, the kubelet starts the second runtime, and it takes load.
            kube.wait_for(lambda: (kube.get("apps/v1/deployments", NS, NAME) or {}).get("spec", {}).get("replicas") == 2,
                          timeout=30, message="the Deployment at 2 replicas")
            kube.wait_for(lambda: len(kubelet.ready_pods()) == 2, timeout=180, message="the second pod ready")
            time.sleep(3 * POLL)
            assert replicas(kube) == 2  # no flapping while loaded (max is 2 anyway: never above)
            status = kube.get(ISVC, NS, NAME)["status"]
            assert status["metrics"]["podsRead"] >= 1, status
            active = next(c for c in status["conditions"] if c["type"] == "ScalingActive")
            assert active["status"] == "True", active

            # ---- load stops: back to 1 after the down window --------------------------------
            load.stop()
            t_stop = time.monotonic()
            assert load.done > 0, load.errors[-5:]
            kube.wait_for(lambda: replicas(kube) == 1, timeout=DOWN_WINDOW + 90, interval=0.2,
                          message=f"the operator to scale back to 1\n{tail()}")
            down = time.monotonic() - t_stop
            print(f"scale-down after the load stopped: {down:.1f} s (window {DOWN_WINDOW} s)")
            assert down >= DOWN_WINDOW - 2 * POLL, "scaled down before the stabilization window passed"
            kube.wait_for(lambda: events(kube, "ScaledDown"), timeout=30, message="a ScaledDown Event")
            kube.wait_for(lambda: len(kubelet.pods) == 1, timeout=60, message="the kubelet at 1 pod")
            assert operator.poll() is None, tail()
            # The user's manifest fields other than replicas are untouched by the autoscaler.
            spec = kube.get(ISVC, NS, NAME)["spec"]
            assert spec["autoscaling"] == isvc_manifest()["spec"]["autoscaling"]

            # Autoscaled, and no finalizer: nothing would hold a deletion.
            assert not kube.get(ISVC, NS, NAME)["metadata"].get("finalizers")

            # ---- autoscaling off: the loop says so, then leaves the service alone ------------
            kube.patch(ISVC, NS, NAME, {"spec": {"autoscaling": {"mode": "none"}}})

            def retired():
                obj = kube.get(ISVC, NS, NAME)
                cond = next(c for c in obj["status"]["conditions"] if c["type"] == "ScalingActive")
                return cond["reason"] == "OperatorAutoscalerOff" and not obj["metadata"].get("finalizers")
            kube.wait_for(retired, timeout=60, message=f"ScalingActive=False\n{tail()}")
        finally:
            load.stop()
            operator.terminate()
            try:
                operator.wait(timeout=20)
            except subprocess.TimeoutExpired:
                operator.kill()
                operator.wait()
            kubelet.stop()
            op_log.close()
