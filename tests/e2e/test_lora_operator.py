"""LoRA adapters through the operator (issue 17): ``kvfleet operator`` on the emulator, a real
``kvfleet serve`` pod from tests/kubelet.py. The pod starts with the declared adapter (read from the
adapters ConfigMap); adding an adapter to the spec loads it on the running pod without a restart
(same pod, same process, same pod-template hash); removing one unloads it; ``status.adapters`` and
the ``AdaptersLoaded`` condition follow, with a reason when an adapter fails to load. Also the pure
builder side: a different adapter list gives the same pod template."""

from __future__ import annotations

import copy

import httpx
import pytest
from support.kube_emulator import ISVC
from support.kubelet import TestKubelet
from support.lora import random_adapter, scaled_b
from support.operator_process import running_operator

from kvfleet.operator import builders
from kvfleet.operator.crd import InvalidSpec

NS, NAME, MODEL = "default", "lora-svc", "smollm2"


def isvc(adapters: list[dict]) -> dict:
    return {"apiVersion": "kvfleet.io/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": NAME, "namespace": NS, "uid": "u-1", "generation": 1},
            "spec": {"model": {"uri": "file:///models/smollm2.gguf", "servedModelName": MODEL, "adapters": adapters},
                     "engine": {"maxModelLen": 256, "extraArgs": {"kv_cache_memory": "64MiB", "max_lora_rank": 8}}}}


def test_the_adapter_list_never_changes_the_pod_template():
    def template(adapters):
        children = builders.desired_children(isvc(adapters))
        return next(c for c in children if c["kind"] == "Deployment")["spec"]["template"], children

    t0, c0 = template([])
    t1, c1 = template([{"name": "a", "uri": "hf://org/a@v1"}, {"name": "b", "uri": "file:///ad/b"}])
    assert t0 == t1
    cm = next(c for c in c1 if c["kind"] == "ConfigMap")
    assert cm["data"]["lora_modules"] == '[{"name": "a", "path": "hf://org/a@v1"}, {"name": "b", "path": "/ad/b"}]'
    config = cm["data"]["config.yaml"]
    assert "enable_lora: true" in config and "skip_failed_lora_modules: true" in config
    env = {e["name"]: e for e in t1["spec"]["containers"][0]["env"]}
    assert env["KVFLEET_LORA_MODULES"]["valueFrom"]["configMapKeyRef"] == {"name": f"{NAME}-config",
                                                                           "key": "lora_modules"}
    assert env["KVFLEET_ALLOW_RUNTIME_LORA_UPDATING"]["value"] == "true"
    for bad, reason in (([{"name": "a", "uri": "s3://x"}], "InvalidAdapterURI"),
                        ([{"name": "a", "uri": "file:///x"}, {"name": "a", "uri": "file:///y"}], "InvalidAdapter"),
                        ([{"name": "a", "uri": "pvc://other/x"}], "AdapterClaimNotMounted")):
        with pytest.raises(InvalidSpec) as err:
            builders.desired_children(isvc(bad))
        assert err.value.reason == reason
    plain = copy.deepcopy(isvc([]))
    del plain["spec"]["model"]["adapters"]
    assert "KVFLEET_LORA_MODULES" not in str(builders.desired_children(plain))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_new_adapter_reaches_the_running_pod_without_a_restart(tmp_path):
    random_adapter(tmp_path / "a1", 21)
    scaled_b(tmp_path / "a1", tmp_path / "a2", -2.0)
    with running_operator(tmp_path) as (emu, _op):
        kubelet = TestKubelet(emu.url, NS, tmp_path / "kubelet", config_overrides={"model": None},
                              env={"OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "1"})
        with kubelet:
            body = isvc([{"name": "a1", "uri": f"file://{tmp_path / 'a1'}"}])
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
