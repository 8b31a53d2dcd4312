"""End to end: ``kvfleet operator`` as a real process against the Kubernetes emulator
(kmock + tests/support/kube_emulator.py) over real HTTP, pointed at it by a kubeconfig file.

Every wait is bounded (``EmulatorThread.wait_for``); operator logs are printed on failure.
"""

from __future__ import annotations

import re
import time

import httpx
import pytest
import yaml
from support.kube_emulator import ISVC, EmulatorThread
from support.operator_process import OperatorProcess, condition, manifest, running_operator

from kvfleet.operator import builders, service_spec

pytestmark = pytest.mark.slow

NS = "default"
DEPLOY, CM, SVC, EVENTS = "apps/v1/deployments", "v1/configmaps", "v1/services", "v1/events"
OPERATOR_AGENTS = ("OpenAPI-Generator", "kopf")
WAIT = 90
"""Seconds a wait for the operator's writes may take: each service has 11 children by default (the
router's and the fleet Secret included) and the module's earlier services stay watched, so on the
loaded 2-core machine (load average 12) one reconcile took up to 30 s."""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with running_operator(tmp_path_factory.mktemp("e2e")) as (emu, op):
        yield emu, op


def operator_writes(emu: EmulatorThread, since: int, needle: str) -> list:
    return [w for w in emu.writes()[since:] if needle in w.path and w.user_agent.startswith(OPERATOR_AGENTS)]


def settle(emu: EmulatorThread, needle: str, quiet: float = 3.0, timeout: float = WAIT) -> None:
    """Wait until the operator has made no write about ``needle`` for ``quiet`` seconds."""
    deadline = time.monotonic() + timeout
    count, since = -1, time.monotonic()
    while time.monotonic() < deadline:
        n = len(operator_writes(emu, 0, needle))
        if n != count:
            count, since = n, time.monotonic()
        elif time.monotonic() - since >= quiet:
            return
        time.sleep(0.2)
    raise AssertionError(f"the operator kept writing about {needle} for {timeout} s")


def mark_available(emu: EmulatorThread, name: str) -> None:
    d = emu.get(DEPLOY, NS, name)
    n = d["spec"]["replicas"]
    emu.patch(DEPLOY, NS, name, {"status": {"observedGeneration": d["metadata"]["generation"], "replicas": n,
                                            "updatedReplicas": n, "readyReplicas": n, "availableReplicas": n}},
              subresource="status")


def config_hash(deploy: dict) -> str:
    return deploy["spec"]["template"]["metadata"]["annotations"][service_spec.ANNOTATION_CONFIG_HASH]


def test_health_endpoint(cluster):
    _, op = cluster
    assert httpx.get(f"http://127.0.0.1:{op.health_port}/healthz", timeout=5).status_code == 200


def test_create_gives_children_with_content_and_owner(cluster):
    emu, _ = cluster
    isvc = emu.create(ISVC, manifest("e2e-create"))
    deploy = emu.wait_for(lambda: emu.get(DEPLOY, NS, "e2e-create"), WAIT, message="the Deployment")
    cm = emu.wait_for(lambda: emu.get(CM, NS, "e2e-create-config"), 10, message="the ConfigMap")
    svc = emu.wait_for(lambda: emu.get(SVC, NS, "e2e-create"), 10, message="the Service")
    want = {c["kind"]: c for c in builders.desired_children(emu.get(ISVC, NS, "e2e-create"))}
    for live, kind in ((deploy, "Deployment"), (cm, "ConfigMap"), (svc, "Service")):
        owner = live["metadata"]["ownerReferences"]
        assert owner == [{"apiVersion": "kvfleet.io/v1alpha1", "kind": "InferenceService", "name": "e2e-create",
                          "uid": isvc["metadata"]["uid"], "controller": True, "blockOwnerDeletion": True}]
        body = {k: v for k, v in want[kind].items() if k != "metadata"}
        assert {k: live[k] for k in body} == body, kind
        assert live["metadata"]["labels"] == want[kind]["metadata"]["labels"]
    assert svc["spec"]["ports"][0]["name"] == "http" and svc["spec"]["ports"][0]["port"] == 8000
    status = emu.wait_for(lambda: (emu.get(ISVC, NS, "e2e-create") or {}).get("status", {}).get("url") and
                          emu.get(ISVC, NS, "e2e-create")["status"], 15, message="status")
    assert status["url"] == "http://e2e-create-router.default.svc.cluster.local:8000/v1"  # the router: a default
    assert status["observedGeneration"] == 1
    assert {c["type"] for c in status["conditions"]} == {"Ready", "Progressing", "Degraded", "ModelCached"}
    assert condition(emu, "e2e-create", "Ready")["status"] == "False"
    # kopf's bookkeeping stays where the docs say: an annotation under kvfleet.io/ and status.kopf
    meta = emu.get(ISVC, NS, "e2e-create")["metadata"]
    assert not [k for k in meta.get("annotations", {}) if not k.startswith("kvfleet.io/")]
    assert emu.get(ISVC, NS, "e2e-create")["spec"] == manifest("e2e-create")["spec"]  # spec never rewritten


def test_the_minimal_service_renders_the_router_the_peer_tier_and_the_hand_off_grace(cluster):
    """Issue 42: examples/inferenceservice-minimal.yaml, as is, gets every fleet feature; one switch
    each turns them off."""
    emu, _ = cluster
    emu.create(ISVC, manifest("e2e-defaults"))
    router = emu.wait_for(lambda: emu.get(DEPLOY, NS, "e2e-defaults-router"), WAIT, message="the router Deployment")
    cm = emu.wait_for(lambda: emu.get(CM, NS, "e2e-defaults-config"), 10, message="the ConfigMap")
    secret = emu.wait_for(lambda: emu.get("v1/secrets", NS, "e2e-defaults-fleet"), 10, message="the fleet Secret")
    runtime = emu.wait_for(lambda: emu.get(DEPLOY, NS, "e2e-defaults"), 10, message="the runtime Deployment")
    config = yaml.safe_load(cm["data"]["config.yaml"])
    assert config["drain_handoff_grace"] == 2
    assert config["kv_transfer_config"]["kv_role"] == "kv_both"  # the peer tier
    assert config["kv_events_config"]["enable_kv_cache_events"]
    (rc,) = router["spec"]["template"]["spec"]["containers"]
    assert rc["args"][rc["args"].index("--routing-algorithm") + 1] == "precise-prefix-cache"
    assert "--no-kv-peer-hint" not in rc["args"]
    fleet_env = {"name": "KVFLEET_FLEET_SECRET", "valueFrom": {"secretKeyRef": {"name": "e2e-defaults-fleet",
                                                                                "key": "secret"}}}
    assert fleet_env in rc["env"] and fleet_env in runtime["spec"]["template"]["spec"]["containers"][0]["env"]
    assert secret["data"]["secret"]
    assert emu.wait_for(lambda: emu.get("policy/v1/poddisruptionbudgets", NS, "e2e-defaults"), 10,
                        message="the runtime PDB")["spec"]["maxUnavailable"] == 1
    # the switches: no router, no tiers -> the router's children go, the runtime's defaults are written off
    emu.patch(ISVC, NS, "e2e-defaults", {"spec": {"router": {"enabled": False},
                                                  "engine": {"kvCache": {"tiers": []}}}})
    emu.wait_for(lambda: emu.get(DEPLOY, NS, "e2e-defaults-router") is None, WAIT, message="the router gone")
    config = yaml.safe_load(emu.wait_for(
        lambda: (c := emu.get(CM, NS, "e2e-defaults-config")) and "drain_handoff_grace" not in c["data"]["config.yaml"]
        and c, WAIT, message="the ConfigMap without the router's keys")["data"]["config.yaml"])
    assert config["kv_transfer_config"] is None and config["kv_events_config"] is None


def test_block_size_change_rolls_config_and_pod_hash(cluster):
    emu, _ = cluster
    emu.create(ISVC, manifest("e2e-blocks"))
    before = emu.wait_for(lambda: emu.get(DEPLOY, NS, "e2e-blocks"), WAIT, message="the Deployment")
    emu.patch(ISVC, NS, "e2e-blocks", {"spec": {"engine": {"blockSize": 32}}})
    cm = emu.wait_for(lambda: (c := emu.get(CM, NS, "e2e-blocks-config")) and
                      yaml.safe_load(c["data"]["config.yaml"]).get("block_size") == 32 and c, WAIT,
                      message="block_size 32 in the ConfigMap")
    after = emu.wait_for(lambda: (d := emu.get(DEPLOY, NS, "e2e-blocks")) and
                         config_hash(d) != config_hash(before) and d, 15, message="a new pod-template hash")
    assert config_hash(after) == builders.content_hash(cm["data"])


def test_ready_only_for_the_current_generation(cluster):
    emu, _ = cluster
    emu.create(ISVC, manifest("e2e-ready"))
    emu.wait_for(lambda: emu.get(DEPLOY, NS, "e2e-ready"), WAIT, message="the Deployment")
    mark_available(emu, "e2e-ready")
    ready = emu.wait_for(lambda: (c := condition(emu, "e2e-ready", "Ready")) and c["status"] == "True" and c,
                         WAIT, message="Ready=True")
    assert ready["observedGeneration"] == 1 and emu.get(ISVC, NS, "e2e-ready")["status"]["observedGeneration"] == 1
    assert emu.get(ISVC, NS, "e2e-ready")["status"]["readyReplicas"] == 1

    emu.patch(ISVC, NS, "e2e-ready", {"spec": {"engine": {"blockSize": 64}}})
    emu.wait_for(lambda: (c := condition(emu, "e2e-ready", "Ready")) and c["status"] == "False"
                 and c["observedGeneration"] == 2, WAIT, message="Ready=False for generation 2")
    mark_available(emu, "e2e-ready")  # the "Deployment controller" rolls out the new template
    ready = emu.wait_for(lambda: (c := condition(emu, "e2e-ready", "Ready")) and c["status"] == "True" and c,
                         WAIT, message="Ready=True again")
    assert ready["observedGeneration"] == 2


def test_field_removed_from_spec_disappears_from_children(cluster):
    emu, _ = cluster
    emu.create(ISVC, manifest("e2e-remove", runtime={"nodeSelector": {"pool": "gpu"}},
                              disruption={"minAvailable": 1}))
    emu.wait_for(lambda: emu.get("policy/v1/poddisruptionbudgets", NS, "e2e-remove") and
                 emu.get(DEPLOY, NS, "e2e-remove"), WAIT, message="the PDB and the Deployment")
    assert emu.get(DEPLOY, NS, "e2e-remove")["spec"]["template"]["spec"]["nodeSelector"] == {"pool": "gpu"}
    emu.patch(ISVC, NS, "e2e-remove", {"spec": {"runtime": None, "disruption": None}})
    emu.wait_for(lambda: "nodeSelector" not in emu.get(DEPLOY, NS, "e2e-remove")["spec"]["template"]["spec"],
                 WAIT, message="nodeSelector removed from the pod template")
    # the PDB stays, back to the default (one replica at a time), its minAvailable gone
    emu.wait_for(lambda: (emu.get("policy/v1/poddisruptionbudgets", NS, "e2e-remove") or {}).get("spec", {})
                 .keys() == {"selector", "maxUnavailable"}, WAIT, message="the PDB back to the default")


def test_hand_edits_and_deletions_are_put_back(cluster):
    emu, _ = cluster
    emu.create(ISVC, manifest("e2e-drift"))
    emu.wait_for(lambda: emu.get(DEPLOY, NS, "e2e-drift") and emu.get(SVC, NS, "e2e-drift"), WAIT,
                 message="children")
    emu.patch(DEPLOY, NS, "e2e-drift", {"spec": {"replicas": 9}})
    emu.wait_for(lambda: emu.get(DEPLOY, NS, "e2e-drift")["spec"]["replicas"] == 1, WAIT,
                 message="replicas put back to 1")
    emu.delete(SVC, NS, "e2e-drift")
    svc = emu.wait_for(lambda: emu.get(SVC, NS, "e2e-drift"), WAIT, message="the Service recreated")
    assert svc["spec"]["ports"][0]["name"] == "http"


def test_unchanged_resource_gets_no_writes(cluster):
    emu, _ = cluster
    emu.create(ISVC, manifest("e2e-quiet"))
    emu.wait_for(lambda: condition(emu, "e2e-quiet", "Ready"), WAIT, message="status")
    settle(emu, "e2e-quiet")
    mark = len(emu.writes())
    # events about the children without a change to what the operator owns
    emu.patch(SVC, NS, "e2e-quiet", {"metadata": {"annotations": {"someone.else/note": "hi"}}})
    emu.patch(DEPLOY, NS, "e2e-quiet", {"metadata": {"labels": {"team": "ml"}}})
    time.sleep(4)
    assert operator_writes(emu, mark, "e2e-quiet") == []
    assert len(emu.writes()) - mark == 2  # only the test's own two writes


def test_invalid_spec_is_degraded_with_an_event_and_recovers(cluster):
    emu, op = cluster
    emu.create(ISVC, manifest("e2e-invalid", engine={"extraArgs": {"no_such_option": 1}}))
    degraded = emu.wait_for(lambda: (c := condition(emu, "e2e-invalid", "Degraded")) and c["status"] == "True"
                            and c, WAIT, message="Degraded=True")
    assert degraded["reason"] == "UnknownEngineArg"
    events = emu.wait_for(lambda: [e for e in emu.list(EVENTS, NS)
                                   if e.get("involvedObject", {}).get("name") == "e2e-invalid"
                                   and e.get("reason") == "UnknownEngineArg"], 15, message="a Warning Event")
    assert events[0]["type"] == "Warning"
    assert emu.get(DEPLOY, NS, "e2e-invalid") is None and op.alive()
    emu.patch(ISVC, NS, "e2e-invalid", {"spec": {"engine": {"extraArgs": None}}})
    emu.wait_for(lambda: emu.get(DEPLOY, NS, "e2e-invalid"), 45, message="the Deployment after the fix")
    emu.wait_for(lambda: condition(emu, "e2e-invalid", "Degraded")["status"] == "False", 15,
                 message="Degraded=False")


def test_delete_stops_the_operator_touching_it(cluster):
    emu, _ = cluster
    emu.create(ISVC, manifest("e2e-delete"))
    # the whole first reconcile done (its last child is the router's PDB), so none is mid-way at the delete
    emu.wait_for(lambda: emu.get(DEPLOY, NS, "e2e-delete") and emu.get("policy/v1/poddisruptionbudgets", NS,
                                                                          "e2e-delete-router"),
                 WAIT, message="the Deployment and the router's PDB")
    settle(emu, "e2e-delete")
    emu.delete(ISVC, NS, "e2e-delete")
    emu.wait_for(lambda: emu.get(ISVC, NS, "e2e-delete") is None, 20, message="the InferenceService gone")
    emu.wait_for(lambda: emu.get(DEPLOY, NS, "e2e-delete") is None and emu.get(CM, NS, "e2e-delete-config") is None,
                 10, message="children garbage-collected")
    mark = len(emu.writes())
    time.sleep(4)
    assert operator_writes(emu, mark, "e2e-delete") == []
    assert emu.get(DEPLOY, NS, "e2e-delete") is None


def test_restart_writes_nothing(tmp_path):
    with EmulatorThread() as emu:
        kubeconfig = emu.write_kubeconfig(tmp_path / "kubeconfig")
        op = OperatorProcess(kubeconfig, tmp_path / "op1.log", "--standalone").start()
        try:
            emu.create(ISVC, manifest("e2e-restart"))
            emu.wait_for(lambda: emu.get(DEPLOY, NS, "e2e-restart"), WAIT, message="the Deployment")
            mark_available(emu, "e2e-restart")
            emu.wait_for(lambda: (c := condition(emu, "e2e-restart", "Ready")) and c["status"] == "True", WAIT,
                         message="Ready=True")
            settle(emu, "e2e-restart")
        finally:
            op.stop()
        mark = len(emu.writes())
        op2 = OperatorProcess(kubeconfig, tmp_path / "op2.log", "--standalone").start()
        try:
            emu.wait_for(lambda: "resum" in op2.log.read_text().lower() or "e2e-restart" in op2.log.read_text(),
                         20, message="the resume handling")
            time.sleep(4)
            assert [w for w in emu.writes()[mark:] if w.user_agent.startswith(OPERATOR_AGENTS)] == []
        finally:
            op2.stop()
            print(op2.log.read_text()[-3000:])


def test_peering_lets_one_operator_act(tmp_path):
    with EmulatorThread() as emu:
        kubeconfig = emu.write_kubeconfig(tmp_path / "kubeconfig")
        emu.create("kopf.dev/v1/clusterkopfpeerings", {"apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering",
                                                       "metadata": {"name": "kvfleet-operator"}})
        high = OperatorProcess(kubeconfig, tmp_path / "high.log", "--peering", "kvfleet-operator",
                               "--priority", "200").start()
        low = OperatorProcess(kubeconfig, tmp_path / "low.log", "--peering", "kvfleet-operator",
                              "--priority", "100").start()
        try:
            # kopf starts paused until it has seen the peers; the low one must stay paused
            emu.wait_for(lambda: len((emu.get("kopf.dev/v1/clusterkopfpeerings", None, "kvfleet-operator") or {})
                                     .get("status") or {}) == 2, 20, message="both peers registered")
            time.sleep(2)
            assert "Resuming operations" not in low.log.read_text()
            emu.create(ISVC, manifest("e2e-peer"))
            emu.wait_for(lambda: emu.get(DEPLOY, NS, "e2e-peer"), WAIT, message="the Deployment")
            time.sleep(2)
            assert re.search(r"applied [^\n]*ConfigMap/e2e-peer-config", high.log.read_text())  # after its Secret
            assert "e2e-peer" not in low.log.read_text()
            high.stop()  # leaves the peering: the low one takes over
            emu.wait_for(lambda: "Resuming operations" in low.log.read_text(), WAIT, message="the low one resuming")
            emu.create(ISVC, manifest("e2e-peer2"))
            emu.wait_for(lambda: emu.get(DEPLOY, NS, "e2e-peer2"), WAIT, message="the second Deployment")
        finally:
            high.stop()
            low.stop()
            print(low.log.read_text()[-3000:])
