"""`kvfleet router --kube-service` follows the Service's EndpointSlices (ready addresses only)
through the kubernetes client's list + watch, against the project's API emulator (kmock)."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest
from support.kube_emulator import EmulatorThread
from support.serve import free_port

pytestmark = pytest.mark.slow

SLICES = "discovery.k8s.io/v1/endpointslices"


def _slice(name: str, service: str, port: int, ready: dict[str, bool]) -> dict:
    return {
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": name, "namespace": "default", "labels": {"kubernetes.io/service-name": service}},
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
        "endpoints": [{"addresses": [ip], "conditions": {"ready": ok}} for ip, ok in ready.items()],
    }


def test_router_endpoints_follow_endpoint_slices(tmp_path):
    with EmulatorThread() as kube:
        kube.create(SLICES, _slice("svc-a", "svc", 8000, {"10.1.0.1": True, "10.1.0.2": False}))
        kube.create(SLICES, _slice("other-a", "other", 8000, {"10.9.0.1": True}))
        kubeconfig = kube.write_kubeconfig(tmp_path / "kubeconfig")
        port = free_port()
        env = {**os.environ, "PYTHONSAFEPATH": "1", "KUBECONFIG": str(kubeconfig)}
        cmd = [sys.executable, "-m", "kvfleet.runtime.cli", "router", "--host", "127.0.0.1", "--port", str(port),
               "--kube-service", "svc", "--kube-namespace", "default", "--probe-interval", "30"]
        log = tmp_path / "router.log"
        with open(log, "wb") as fh:
            proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env)
        base = f"http://127.0.0.1:{port}"

        def endpoints():
            try:
                r = httpx.get(base + "/metrics", timeout=2)
            except httpx.TransportError:
                return None
            lines = [ln for ln in r.text.splitlines() if ln.startswith("kvfleet:router_endpoints{")]
            return sum(float(ln.rsplit(" ", 1)[1]) for ln in lines)

        try:
            kube.wait_for(lambda: endpoints() == 1, 30, message=f"1 endpoint\n{log.read_text()}")
            assert httpx.get(base + "/ready").json()["endpoints"] == 1
            # a pod turns ready, a second slice appears: 3; the watch delivers both
            kube.patch(SLICES, "default", "svc-a", {"endpoints": [
                {"addresses": ["10.1.0.1"], "conditions": {"ready": True}},
                {"addresses": ["10.1.0.2"], "conditions": {"ready": True}}]})
            kube.create(SLICES, _slice("svc-b", "svc", 8000, {"10.1.0.3": True}))
            kube.wait_for(lambda: endpoints() == 3, 20, message="3 endpoints")
            # pods go away: terminating (not ready) and a deleted slice
            kube.patch(SLICES, "default", "svc-a", {"endpoints": [
                {"addresses": ["10.1.0.1"], "conditions": {"ready": False, "terminating": True}}]})
            kube.delete(SLICES, "default", "svc-b")
            kube.wait_for(lambda: endpoints() == 0, 20, message="0 endpoints")
            assert proc.poll() is None
            assert "relisting" not in log.read_text()  # followed by the watch, not by failing and relisting
        finally:
            proc.kill()
            proc.wait()
