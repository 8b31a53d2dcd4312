"""LoRA adapters through the operator (issue 17): ``kvfleet operator`` on the emulator, a real
``kvfleet serve`` pod from tests/support/kubelet.py. The pod starts with the declared adapter (read from the
adapters ConfigMap); adding an adapter to the spec loads it on the running pod without a restart
(same pod, same process, same pod-template hash); removing one unloads it; ``status.adapters`` and
the ``AdaptersLoaded`` condition follow, with a reason when an adapter fails to load. The pure
builder side: tests/unit/operator/test_adapters.py."""

from __future__ import annotations

import httpx
import pytest
from support.kube_emulator import ISVC
from support.kubelet import TestKubelet
from support.lora import lora_isvc, random_adapter, scaled_b
from support.operator_process import running_operator

NS, NAME, MODEL = "default", "lora-svc", "smollm2"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_new_adapter_reaches_the_running_pod_without_a_restart(tmp_path):
    random_adapter(tmp_path / "a1", 21)
    scaled_b(tmp_path / "a1", tmp_path / "a2", -2.0)
    with running_operator(tmp_path) as (emu, _op):
        kubelet = TestKubelet(emu.url, NS, tmp_path / "kubelet", config_overrides={"model": None},
                              env={"OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "1"})
        with kubelet:
            body = lora_isvc([{"name": "a1", "uri": f"file://{tmp_path / 'a1'}"}])
            del body["metadata"]["uid"], body["metadata"]["generation"]
            emu.create(ISVC, body)
            pod = emu.wait_for(lambda: kubelet.ready_pods(NAME) and kubelet.ready_pods(NAME)[0], 300,
                               message="the pod ready")

            def served() -> set[str]:
                data = httpx.get(f"http://127.0.0.1:{pod.port}/v1/models", timeout=10).json()["data"]
                return {m["id"] for m in data if m.get("parent") == MODEL}

            def status() -> dict:
                return (emu.get(ISVC, NS, NAME) or {}).get("status") or {}

            def loaded(name: str):
                return next((a for a in status().get("adapters") or [] if a["name"] == name
                             and a["loadedReplicas"] == 1), None)

            assert served() == {"a1"}  # the pod started with the declared adapter
            emu.wait_for(lambda: loaded("a1"), 60, message="status.adapters a1")
            template_hash = emu.get("apps/v1/deployments", NS, NAME)["spec"]["template"]["metadata"]["annotations"]
            pid = pod.process.pid

            emu.patch(ISVC, NS, NAME, {"spec": {"model": {"adapters": [
                {"name": "a1", "uri": f"file://{tmp_path / 'a1'}"}, {"name": "a2", "uri": f"file://{tmp_path / 'a2'}"}]}}})
            emu.wait_for(lambda: "a2" in served(), 120, message="a2 loaded on the running pod")
            emu.wait_for(lambda: loaded("a2"), 60, message="status.adapters a2")
            r = httpx.post(f"http://127.0.0.1:{pod.port}/v1/completions", timeout=120,
                           json={"model": "a2", "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0})
            assert r.status_code == 200, r.text

            emu.patch(ISVC, NS, NAME, {"spec": {"model": {"adapters": [
                {"name": "a2", "uri": f"file://{tmp_path / 'a2'}"}, {"name": "bad", "uri": "file:///no/such/adapter"}]}}})
            emu.wait_for(lambda: served() == {"a2"}, 120, message="a1 unloaded")

            def failed():
                c = next((c for c in status().get("conditions") or [] if c["type"] == "AdaptersLoaded"), {})
                return c if c.get("reason") == "AdapterLoadFailed" else None
            cond = emu.wait_for(failed, 60, message="AdaptersLoaded False for the bad adapter")
            assert cond["status"] == "False" and "bad" in cond["message"] and "no such directory" in cond["message"]

            assert [p.name for p in kubelet.ready_pods(NAME)] == [pod.name] and pod.process.pid == pid
            assert pod.restarts == 0
            now = emu.get("apps/v1/deployments", NS, NAME)["spec"]["template"]["metadata"]["annotations"]
            assert now == template_hash
