"""reconcile.reconcile() against the Kubernetes emulator over real HTTP (no kopf):
what it writes, when it writes nothing, and how it handles drift and bad specs."""

from __future__ import annotations

import base64
import time

import kubernetes
import pytest
import yaml
from support.kube_emulator import ISVC, EmulatorThread
from support.paths import ROOT

from kvfleet.operator import builders, reconcile, router, service_spec
from kvfleet.operator.kube import ApiError, Kube

NS = "default"
OPERATOR_UA = "OpenAPI-Generator"


@pytest.fixture()
def kube_env(tmp_path):
    with EmulatorThread() as emu:
        cfg = kubernetes.client.Configuration()
        kubernetes.config.load_kube_config(config_file=str(emu.write_kubeconfig(tmp_path / "kubeconfig")),
                                           client_configuration=cfg)
        api = kubernetes.client.ApiClient(cfg)
        try:
            yield emu, Kube(api)
        finally:
            api.close()


def example(name: str = "minimal", **spec) -> dict:
    obj = yaml.safe_load((ROOT / f"examples/inferenceservice-{name}.yaml").read_text())
    obj["spec"].update(spec)
    return obj


def operator_writes(emu: EmulatorThread, since: int = 0) -> list:
    return [w for w in emu.writes()[since:] if w.user_agent.startswith(OPERATOR_UA)]


def test_first_reconcile_creates_children_second_writes_nothing(kube_env):
    emu, kube = kube_env
    isvc = emu.create(ISVC, example())
    out = reconcile.reconcile(kube, NS, "smollm2")
    # the fleet Secret first (the pods mount it), the runtime's children, then the router's (on by default)
    assert out.applied == ["Secret/smollm2-fleet", "ConfigMap/smollm2-config", "Service/smollm2",
                           "Deployment/smollm2", "PodDisruptionBudget/smollm2",
                           *[f"{k}/smollm2-router" for k in router.KINDS]]
    assert out.status_patch and out.error is None
    secret = emu.get("v1/secrets", NS, "smollm2-fleet")
    assert len(base64.b64decode(secret["data"]["secret"])) >= 32
    assert secret["metadata"]["ownerReferences"][0]["uid"] == isvc["metadata"]["uid"]
    live = {k: emu.get(r, NS, n) for k, r, n in [("cm", "v1/configmaps", "smollm2-config"),
                                                  ("svc", "v1/services", "smollm2"),
                                                  ("deploy", "apps/v1/deployments", "smollm2")]}
    for obj in live.values():
        assert obj["metadata"]["ownerReferences"][0]["uid"] == isvc["metadata"]["uid"]
    expected = {c["kind"]: c for c in builders.desired_children(emu.get(ISVC, NS, "smollm2"))}
    assert reconcile.is_subset(expected["Deployment"]["spec"], live["deploy"]["spec"])
    assert live["cm"]["data"] == expected["ConfigMap"]["data"]

    mark = len(emu.writes())
    out = reconcile.reconcile(kube, NS, "smollm2")
    assert not out.wrote and operator_writes(emu, mark) == []
    # with server-added fields on the live objects (as a real API server defaults them)
    emu.patch("apps/v1/deployments", NS, "smollm2", {"spec": {"progressDeadlineSeconds": 999,
                                                             "template": {"spec": {"dnsPolicy": "ClusterFirst"}}}})
    emu.patch("v1/services", NS, "smollm2", {"spec": {"clusterIP": "10.0.0.7"}})
    mark = len(emu.writes())
    out = reconcile.reconcile(kube, NS, "smollm2")
    assert out.applied == ["Deployment/smollm2"]  # progressDeadlineSeconds is ours: put back
    assert emu.get("apps/v1/deployments", NS, "smollm2")["spec"]["progressDeadlineSeconds"] == 12030
    assert emu.get("apps/v1/deployments", NS, "smollm2")["spec"]["template"]["spec"]["dnsPolicy"] == "ClusterFirst"
    mark = len(emu.writes())
    assert not reconcile.reconcile(kube, NS, "smollm2").wrote and operator_writes(emu, mark) == []
    assert emu.get("v1/secrets", NS, "smollm2-fleet")["data"] == secret["data"]  # never rewritten


def test_writes_are_server_side_apply_with_one_field_manager(kube_env):
    emu, kube = kube_env
    emu.create(ISVC, example())
    reconcile.reconcile(kube, NS, "smollm2")
    emu.patch(ISVC, NS, "smollm2", {"spec": {"engine": {"blockSize": 32}}})
    reconcile.reconcile(kube, NS, "smollm2")
    child_writes = [w for w in operator_writes(emu) if "/inferenceservices/" not in w.path]
    assert child_writes and all(w.field_manager == "kvfleet-operator" for w in child_writes)
    applies = [r for r in emu.emulator._requests if r.headers.get("Content-Type") == "application/apply-patch+yaml"]
    assert applies and all(r.params.get("force") == "true" for r in applies)


def test_block_size_change_rolls_config_and_hash(kube_env):
    emu, kube = kube_env
    emu.create(ISVC, example())
    reconcile.reconcile(kube, NS, "smollm2")
    before = emu.get("apps/v1/deployments", NS, "smollm2")
    emu.patch(ISVC, NS, "smollm2", {"spec": {"engine": {"blockSize": 32}}})
    assert emu.get(ISVC, NS, "smollm2")["metadata"]["generation"] == 2
    out = reconcile.reconcile(kube, NS, "smollm2")
    assert set(out.applied) == {"ConfigMap/smollm2-config", "Deployment/smollm2"}
    cm = emu.get("v1/configmaps", NS, "smollm2-config")
    assert yaml.safe_load(cm["data"]["config.yaml"])["block_size"] == 32
    after = emu.get("apps/v1/deployments", NS, "smollm2")
    h = lambda d: d["spec"]["template"]["metadata"]["annotations"][service_spec.ANNOTATION_CONFIG_HASH]
    assert h(after) != h(before) and h(after) == builders.content_hash(cm["data"])


def test_removed_fields_disappear_and_optional_children_are_pruned(kube_env):
    emu, kube = kube_env
    emu.create(ISVC, example(runtime={"nodeSelector": {"pool": "gpu"}, "podAnnotations": {"team": "a"}},
                             disruption={"minAvailable": 1}))
    reconcile.reconcile(kube, NS, "smollm2")
    deploy = emu.get("apps/v1/deployments", NS, "smollm2")
    assert deploy["spec"]["template"]["spec"]["nodeSelector"] == {"pool": "gpu"}
    assert emu.get("policy/v1/poddisruptionbudgets", NS, "smollm2") is not None
    # a foreign field on the Deployment (another manager) must survive
    emu.patch("apps/v1/deployments", NS, "smollm2", {"metadata": {"annotations": {"other.io/note": "keep"}}})

    emu.patch(ISVC, NS, "smollm2", {"spec": {"runtime": None, "disruption": None}})
    out = reconcile.reconcile(kube, NS, "smollm2")
    # the PDB stays, back to the default (one replica at a time), minAvailable gone
    assert {"Deployment/smollm2", "PodDisruptionBudget/smollm2"} <= set(out.applied) and out.deleted == []
    deploy = emu.get("apps/v1/deployments", NS, "smollm2")
    assert "nodeSelector" not in deploy["spec"]["template"]["spec"]
    assert "team" not in deploy["spec"]["template"]["metadata"]["annotations"]
    assert deploy["metadata"]["annotations"]["other.io/note"] == "keep"
    assert emu.get("policy/v1/poddisruptionbudgets", NS, "smollm2")["spec"] == {
        "selector": {"matchLabels": service_spec.selector_labels(example())}, "maxUnavailable": 1}
    assert not reconcile.reconcile(kube, NS, "smollm2").wrote


def test_hand_edits_and_deletions_are_put_back(kube_env):
    emu, kube = kube_env
    emu.create(ISVC, example())
    reconcile.reconcile(kube, NS, "smollm2")
    good_cm = emu.get("v1/configmaps", NS, "smollm2-config")["data"]
    emu.patch("apps/v1/deployments", NS, "smollm2", {"spec": {"replicas": 7}})
    emu.patch("v1/configmaps", NS, "smollm2-config", {"data": {"config.yaml": "block_size: 8\n"}})
    emu.delete("v1/services", NS, "smollm2")
    out = reconcile.reconcile(kube, NS, "smollm2")
    assert set(out.applied) == {"ConfigMap/smollm2-config", "Service/smollm2", "Deployment/smollm2"}
    assert emu.get("apps/v1/deployments", NS, "smollm2")["spec"]["replicas"] == 1
    assert emu.get("v1/configmaps", NS, "smollm2-config")["data"] == good_cm
    assert emu.get("v1/services", NS, "smollm2")["spec"]["ports"][0]["name"] == "http"


def test_a_missing_secret_is_learnt_from_the_pods_never_by_reading_secrets(kube_env, monkeypatch):
    emu, kube = kube_env
    paths = []
    call = kube._call
    monkeypatch.setattr(kube, "_call", lambda method, path, **kw: paths.append(path) or call(method, path, **kw))
    emu.create(ISVC, example(runtime={"apiKeySecretRef": {"name": "nope"}}))
    out = reconcile.reconcile(kube, NS, "smollm2")
    assert out.error is None and "Deployment/smollm2" in out.applied  # the operator reads no Secret
    deploy = emu.get("apps/v1/deployments", NS, "smollm2")
    emu.create("v1/pods", {"apiVersion": "v1", "kind": "Pod", "metadata": {
        "name": "smollm2-1", "namespace": NS, "labels": deploy["spec"]["template"]["metadata"]["labels"]},
        "status": {"phase": "Pending", "containerStatuses": [{"name": "runtime", "state": {"waiting": {
            "reason": "CreateContainerConfigError", "message": 'secret "nope" not found'}}}]}})
    reconcile.reconcile(kube, NS, "smollm2")
    degraded = next(c for c in emu.get(ISVC, NS, "smollm2")["status"]["conditions"] if c["type"] == "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "SecretNotFound")
    assert 'secret "nope" not found' in degraded["message"]
    # the only Secret it touches is its own fleet Secret (read by name, created once)
    assert paths and {p for p in paths if "/secrets" in p} == {f"/api/v1/namespaces/{NS}/secrets/smollm2-fleet",
                                                               f"/api/v1/namespaces/{NS}/secrets"}

def test_ready_when_deployment_available_for_current_generation(kube_env):
    emu, kube = kube_env
    emu.create(ISVC, example(replicas=2))  # the router on (the default): Ready is the runtime pods' readiness
    reconcile.reconcile(kube, NS, "smollm2")
    deploy = emu.get("apps/v1/deployments", NS, "smollm2")
    emu.patch("apps/v1/deployments", NS, "smollm2", {"status": {
        "observedGeneration": deploy["metadata"]["generation"], "replicas": 2, "updatedReplicas": 2,
        "readyReplicas": 2, "availableReplicas": 2}}, subresource="status")
    reconcile.reconcile(kube, NS, "smollm2")
    isvc = emu.get(ISVC, NS, "smollm2")
    ready = next(c for c in isvc["status"]["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "True" and ready["observedGeneration"] == isvc["metadata"]["generation"]
    assert isvc["status"]["readyReplicas"] == 2
    scale = emu.get(ISVC, NS, "smollm2", "scale")
    assert scale["status"] == {"replicas": 2, "selector": service_spec.selector_string(isvc)}


def test_gone_or_deleting_resource_is_not_touched(kube_env):
    emu, kube = kube_env
    assert reconcile.reconcile(kube, NS, "ghost").found is False
    obj = example()
    obj["metadata"]["finalizers"] = ["test/hold"]
    emu.create(ISVC, obj)
    emu.delete(ISVC, NS, "smollm2")  # held by the finalizer: deletionTimestamp set
    mark = len(emu.writes())
    assert reconcile.reconcile(kube, NS, "smollm2").found is False
    assert operator_writes(emu, mark) == []


def test_emulator_garbage_collects_children(kube_env):
    emu, kube = kube_env
    emu.create(ISVC, example())
    reconcile.reconcile(kube, NS, "smollm2")
    emu.delete(ISVC, NS, "smollm2")
    assert emu.list("apps/v1/deployments", NS) == [] and emu.list("v1/configmaps", NS) == []


def test_unreachable_api_is_an_api_error():
    cfg = kubernetes.client.Configuration()
    cfg.host = "http://127.0.0.1:9"  # discard port: connection refused
    cfg.retries = 0
    with kubernetes.client.ApiClient(cfg) as api:
        with pytest.raises(ApiError) as e:
            Kube(api).get("ConfigMap", NS, "x")
    assert e.value.status == 0


def test_read_write_once_model_claim_with_surge_pods_is_reported(kube_env):
    emu, kube = kube_env
    emu.create("v1/persistentvolumeclaims", {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                                             "metadata": {"name": "cache", "namespace": NS},
                                             "spec": {"accessModes": ["ReadWriteOnce"]}})
    emu.create(ISVC, example(replicas=2, model={"uri": "hf://org/name", "download": {"claimName": "cache"}}))
    reconcile.reconcile(kube, NS, "smollm2")
    conds = {c["type"]: c for c in emu.get(ISVC, NS, "smollm2")["status"]["conditions"]}
    assert (conds["Degraded"]["status"], conds["Degraded"]["reason"]) == ("True", "ReadWriteOnceClaim")
    assert "2 replicas" in conds["Degraded"]["message"] and "ReadWriteOnce" in conds["ModelCached"]["message"]
    events = [e for e in emu.list("v1/events", NS) if e.get("reason") == "ReadWriteOnceClaim"]
    assert len(events) == 1 and events[0]["type"] == "Warning"


def test_an_hpa_on_the_deployment_gets_its_replicas_and_the_condition_says_so(kube_env):
    emu, kube = kube_env
    emu.create(ISVC, example())
    reconcile.reconcile(kube, NS, "smollm2")
    emu.create("autoscaling/v2/horizontalpodautoscalers", {
        "apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": "on-deploy", "namespace": NS},
        "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "smollm2"},
                 "minReplicas": 1, "maxReplicas": 5}})
    emu.patch("apps/v1/deployments", NS, "smollm2", {"spec": {"replicas": 3}}, subresource="scale")  # the HPA
    out = reconcile.reconcile(kube, NS, "smollm2")
    assert out.applied == ["Deployment/smollm2"]  # once: replicas is no longer the operator's
    assert emu.get("apps/v1/deployments", NS, "smollm2")["spec"]["replicas"] == 3
    cond = next(c for c in emu.get(ISVC, NS, "smollm2")["status"]["conditions"] if c["type"] == "ScalingActive")
    assert (cond["status"], cond["reason"]) == ("False", "ConflictingAutoscaler")
    assert "HorizontalPodAutoscaler on-deploy (targets the Deployment)" in cond["message"]
    emu.patch("apps/v1/deployments", NS, "smollm2", {"spec": {"replicas": 4}}, subresource="scale")
    mark = len(emu.writes())
    assert not reconcile.reconcile(kube, NS, "smollm2").wrote and operator_writes(emu, mark) == []
    emu.delete("autoscaling/v2/horizontalpodautoscalers", NS, "on-deploy")  # the operator takes replicas back
    reconcile.reconcile(kube, NS, "smollm2")
    assert emu.get("apps/v1/deployments", NS, "smollm2")["spec"]["replicas"] == 1


def test_fields_a_mutating_webhook_adds_are_not_drift(kube_env):
    """A webhook that injects an env var, a sidecar and its volume: no re-apply, on any event."""
    emu, kube = kube_env
    emu.create(ISVC, example())
    reconcile.reconcile(kube, NS, "smollm2")
    live = emu.get("apps/v1/deployments", NS, "smollm2")
    pod = live["spec"]["template"]["spec"]
    pod["containers"][0]["env"].insert(0, {"name": "INJECTED_BY_WEBHOOK", "value": "1"})
    pod["containers"][0]["volumeMounts"].append({"name": "istio-envoy", "mountPath": "/etc/istio"})
    pod["containers"].append({"name": "istio-proxy", "image": "istio/proxyv2:1.22"})
    pod["volumes"].append({"name": "istio-envoy", "emptyDir": {}})
    live["spec"]["template"]["metadata"]["annotations"]["sidecar.istio.io/status"] = "injected"
    emu.patch("apps/v1/deployments", NS, "smollm2", {"spec": live["spec"]})
    mark = len(emu.writes())
    for _ in range(3):
        assert not reconcile.reconcile(kube, NS, "smollm2").wrote
    assert operator_writes(emu, mark) == []
    # a field the operator owns is still put back
    pod["containers"][0]["env"] = [e for e in pod["containers"][0]["env"] if e["name"] != "HF_HUB_OFFLINE"]
    emu.patch("apps/v1/deployments", NS, "smollm2", {"spec": live["spec"]})
    assert reconcile.reconcile(kube, NS, "smollm2").applied == ["Deployment/smollm2"]


def test_is_subset_treats_named_lists_as_maps():
    desired = {"containers": [{"name": "runtime", "env": [{"name": "A", "value": "1"}]}], "args": ["x", "y"]}
    assert reconcile.is_subset(desired, {"containers": [{"name": "sidecar"}, {"name": "runtime", "env": [
        {"name": "B", "value": "2"}, {"name": "A", "value": "1"}]}], "args": ["x", "y"]})
    assert not reconcile.is_subset(desired, {"containers": [{"name": "runtime", "env": [{"name": "A", "value": "2"}]}],
                                             "args": ["x", "y"]})
    assert not reconcile.is_subset(desired, {"containers": [{"name": "runtime", "env": [{"name": "A", "value": "1"}]}],
                                             "args": ["x", "y", "z"]})  # atomic lists: exactly


def test_the_operators_default_runtime_image_applies_where_the_spec_sets_none(kube_env, monkeypatch):
    emu, kube = kube_env
    monkeypatch.setenv(reconcile.RUNTIME_IMAGE_ENV, "registry.example/kvfleet-runtime:dev")
    emu.create(ISVC, example())
    pinned = example(runtime={"image": "registry.example/pinned:1"})
    pinned["metadata"]["name"] = "pinned"
    emu.create(ISVC, pinned)
    for name in ("smollm2", "pinned"):
        reconcile.reconcile(kube, NS, name)
    def images(name):
        spec = emu.get("apps/v1/deployments", NS, name)["spec"]["template"]["spec"]
        return {c["image"] for c in spec["containers"] + spec.get("initContainers", [])}
    assert images("smollm2") == {"registry.example/kvfleet-runtime:dev"}
    assert images("pinned") == {"registry.example/pinned:1"}
    assert "image" not in (emu.get(ISVC, NS, "smollm2")["spec"].get("runtime") or {})  # nothing written to the spec


def test_one_lock_per_resource_and_the_count_the_probe_reports():
    before = reconcile.locked_count()
    a = reconcile.lock_for("ns-lock-test", "a")
    assert reconcile.lock_for("ns-lock-test", "a") is a
    assert reconcile.lock_for("ns-lock-test", "b") is not a
    assert reconcile.locked_count() == before + 2


def test_router_pdb_is_its_own_child_and_pruned_with_the_router(kube_env):
    emu, kube = kube_env
    pdbs = "policy/v1/poddisruptionbudgets"
    emu.create(ISVC, example(router={"enabled": True}, disruption={"maxUnavailable": 1}))
    out = reconcile.reconcile(kube, NS, "smollm2")
    assert {"PodDisruptionBudget/smollm2", "PodDisruptionBudget/smollm2-router"} <= set(out.applied)
    assert emu.get("apps/v1/deployments", NS, "smollm2-router")["spec"]["replicas"] == 2
    # the runtime's PDB and the router's are two children: spec.disruption changes only the runtime's
    emu.patch(ISVC, NS, "smollm2", {"spec": {"disruption": {"minAvailable": 1}}})
    out = reconcile.reconcile(kube, NS, "smollm2")
    assert out.applied == ["PodDisruptionBudget/smollm2"] and out.deleted == []
    assert emu.get(pdbs, NS, "smollm2-router")["spec"]["maxUnavailable"] == 1
    # router off: every router child goes, its PDB included
    emu.patch(ISVC, NS, "smollm2", {"spec": {"router": {"enabled": False}}})
    out = reconcile.reconcile(kube, NS, "smollm2")
    assert out.deleted == [f"{k}/smollm2-router" for k in router.KINDS]
    assert emu.get(pdbs, NS, "smollm2-router") is None and emu.get("apps/v1/deployments", NS, "smollm2-router") is None
    assert not reconcile.reconcile(kube, NS, "smollm2").wrote


def test_a_burst_of_watch_events_costs_at_most_two_reconciles(kube_env, monkeypatch):
    """While a reconcile runs (here: its lock held), the first event after it waits and every
    later one is skipped: the waiting one reads everything fresh once the lock is free."""
    import threading

    emu, kube = kube_env
    emu.create(ISVC, example())
    runs = []
    real = reconcile.reconcile
    monkeypatch.setattr(reconcile, "reconcile", lambda *a, **kw: runs.append(a[2]) or real(*a, **kw))
    outcomes = []
    with reconcile.lock_for(NS, "smollm2"):  # a reconcile running
        waiting = threading.Thread(target=lambda: outcomes.append(reconcile.reconcile_coalesced(kube, NS, "smollm2")))
        waiting.start()
        deadline = time.monotonic() + 10
        while (NS, "smollm2") not in reconcile._waiting and time.monotonic() < deadline:
            time.sleep(0.01)
        skipped = [reconcile.reconcile_coalesced(kube, NS, "smollm2") for _ in range(5)]  # the burst
    waiting.join(30)
    assert skipped == [None] * 5 and runs == ["smollm2"]
    assert outcomes[0].applied and emu.get("apps/v1/deployments", NS, "smollm2") is not None  # it did reconcile
    assert reconcile.reconcile_coalesced(kube, NS, "smollm2") is not None  # idle again: runs at once


def test_parallelism_nodes_switches_the_runtime_between_deployment_and_leader_worker_set(kube_env):
    """nodes 2 without the LWS API: a clear reason, nothing applied; with it: the LWS, not the
    Deployment (pruned), a leaders-only Service, no writes when unchanged; nodes 1: back."""
    from support.fake_lws import LWS, install_lws_api

    from kvfleet.operator import lws

    emu, kube = kube_env
    emu.create(ISVC, example(router={"enabled": False}))
    reconcile.reconcile(kube, NS, "smollm2")
    assert emu.get("apps/v1/deployments", NS, "smollm2") is not None
    emu.patch(ISVC, NS, "smollm2", {"spec": {"parallelism": {"tensor": 2, "nodes": 2}}})
    out = reconcile.reconcile(kube, NS, "smollm2")
    assert out.error.reason == "LeaderWorkerSetMissing" and not out.applied and not out.deleted
    assert emu.get("apps/v1/deployments", NS, "smollm2") is not None  # the old pods keep serving

    install_lws_api(emu)
    out = reconcile.reconcile(kube, NS, "smollm2")
    assert out.error is None and "LeaderWorkerSet/smollm2" in out.applied and out.deleted == ["Deployment/smollm2"]
    assert emu.get(LWS, NS, "smollm2")["spec"]["leaderWorkerTemplate"]["size"] == 2
    assert emu.get("v1/services", NS, "smollm2")["spec"]["selector"][lws.LABEL_WORKER_INDEX] == "0"
    assert not reconcile.reconcile(kube, NS, "smollm2").wrote

    emu.patch(ISVC, NS, "smollm2", {"spec": {"parallelism": {"tensor": 2, "nodes": 1}}})
    out = reconcile.reconcile(kube, NS, "smollm2")
    assert "Deployment/smollm2" in out.applied and out.deleted == ["LeaderWorkerSet/smollm2"]
    assert lws.LABEL_WORKER_INDEX not in emu.get("v1/services", NS, "smollm2")["spec"]["selector"]
