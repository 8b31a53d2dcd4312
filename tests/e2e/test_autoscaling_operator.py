"""The autoscaler inside a real ``kvfleet operator`` process against the Kubernetes emulator
(tests/support/kube_emulator.py, real HTTP), with pods whose /metrics serve the runtime's real
exposition (no model needed):

- autoscaled and tuned InferenceServices carry no finalizer, so deleting them completes
  while the operator is not running (nothing for a GitOps tool to wedge on);
- an operator paused by a higher-priority peer (kopf peering) does not scale or write, and
  takes over once that peer is gone.
"""

from __future__ import annotations

import datetime
import time
from pathlib import Path

import pytest
from support.autoscaler_cluster import NS, Runtime, add_pod
from support.kube_emulator import ISVC, EmulatorThread
from support.operator_process import start_operator, stop_operator

pytestmark = pytest.mark.slow

PEERING = "kopf.dev/v1/clusterkopfpeerings"
AUTOSCALING = {"mode": "operator", "minReplicas": 1, "maxReplicas": 4, "targetQueueDepth": 2,
               "scaleDown": {"stabilizationWindowSeconds": 600}}


def manifest(name: str, **spec) -> dict:
    return {"apiVersion": "kvfleet.io/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": name, "namespace": NS},
            "spec": {"model": {"uri": "file:///models/m.gguf"}, "replicas": 1, "engine": {"maxNumSeqs": 4}, **spec}}


def condition(emu: EmulatorThread, name: str, type_: str = "ScalingActive") -> dict | None:
    obj = emu.get(ISVC, NS, name) or {}
    return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c["type"] == type_), None)


def replicas(emu: EmulatorThread, name: str) -> int | None:
    return ((emu.get(ISVC, NS, name) or {}).get("spec") or {}).get("replicas")


def test_autoscaled_and_tuned_services_have_no_finalizer_and_delete_without_the_operator(tmp_path: Path):
    runtimes: list[Runtime] = []
    log = tmp_path / "operator.log"
    with EmulatorThread() as emu:
        proc, _ = start_operator(emu.write_kubeconfig(tmp_path / "kubeconfig", namespace=NS), log, "--standalone")
        try:
            emu.create(ISVC, manifest("auto", autoscaling=AUTOSCALING))
            emu.create(ISVC, manifest("tuned", tuning={"enabled": True}))
            for pod, name, runtime in (("a0", "auto", Runtime(waiting=5)), ("t0", "tuned", Runtime(waiting=0))):
                runtimes.append(runtime)
                add_pod(emu, [], pod, runtime, isvc_name=name)
            emu.wait_for(lambda: replicas(emu, "auto") == 3, message=f"auto scaled to 3\n{log.read_text()[-3000:]}")
            emu.wait_for(lambda: (condition(emu, "auto") or {}).get("status") == "True", message="ScalingActive")
            emu.wait_for(lambda: ((emu.get(ISVC, NS, "tuned") or {}).get("status") or {}).get("metrics"),
                         message="the tuned service's status.metrics")
            for name in ("auto", "tuned"):
                assert "kvfleet.io/finalizer" not in (emu.get(ISVC, NS, name)["metadata"].get("finalizers") or [])
        finally:
            stop_operator(proc)
            for r in runtimes:
                r.close()
            print(log.read_text()[-3000:])
        assert proc.poll() is not None  # the operator is gone ...
        for name in ("auto", "tuned"):
            emu.delete(ISVC, NS, name)
            assert emu.get(ISVC, NS, name) is None  # ... and the deletion completed at once


def peer(priority: int) -> dict:
    return {"priority": priority, "lifetime": 120, "lastseen": datetime.datetime.now(datetime.UTC).isoformat()}


def test_a_paused_operator_does_not_scale_until_the_higher_peer_is_gone(tmp_path: Path):
    log = tmp_path / "operator.log"
    rt = Runtime(waiting=0)
    with EmulatorThread() as emu:
        emu.create(PEERING, {"apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering",
                             "metadata": {"name": "kvfleet-operator"}})
        proc, _ = start_operator(emu.write_kubeconfig(tmp_path / "kubeconfig", namespace=NS), log,
                                 "--peering", "kvfleet-operator", "--priority", "100")
        try:
            emu.create(ISVC, manifest("auto", autoscaling=AUTOSCALING))
            add_pod(emu, [], "a0", rt, isvc_name="auto")
            emu.wait_for(lambda: (condition(emu, "auto") or {}).get("status") == "True",
                         message=f"the operator autoscaling\n{log.read_text()[-3000:]}")
            # A live peer with a higher priority appears: kopf pauses, and so does the loop.
            emu.patch(PEERING, None, "kvfleet-operator", {"status": {"boss": peer(200)}})
            # (The loop reads the peering object before it starts any iteration, reusing a "not
            # paused" answer for PEERING_TTL; once it logs the pause it has cancelled the
            # iterations in flight and starts none.)
            emu.wait_for(lambda: "Pausing operations" in log.read_text(), message=f"kopf pausing\n{log.read_text()[-3000:]}")
            emu.wait_for(lambda: "autoscaler paused" in log.read_text(), message=f"loop pausing\n{log.read_text()[-3000:]}")
            time.sleep(0.5)  # an API call of a cancelled iteration that was already on the wire
            mark = len(emu.writes())
            rt.set(waiting=9)  # would scale to 4
            time.sleep(5.0)  # five intervals (KVFLEET_AUTOSCALER_INTERVAL=1)
            assert replicas(emu, "auto") == 1
            assert "autoscaler paused: ClusterKopfPeering kvfleet-operator: paused in favour of boss" in log.read_text()
            assert not [w for w in emu.writes()[mark:] if "/inferenceservices/auto" in w.path], emu.writes()[mark:]
            # The peer leaves: kopf resumes, the loop scales.
            emu.patch(PEERING, None, "kvfleet-operator", {"status": {"boss": None}})
            emu.wait_for(lambda: replicas(emu, "auto") == 4, message=f"the scale-up after resuming\n{log.read_text()[-3000:]}")
            assert "autoscaler resumed" in log.read_text()
        finally:
            stop_operator(proc)
            rt.close()
            print(log.read_text()[-3000:])
