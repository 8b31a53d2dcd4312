"""End to end: a multi-node InferenceService (``parallelism.nodes: 2``) on LeaderWorkerSet.

``kvfleet operator`` as a real process against the Kubernetes emulator, with LWS's API installed
mid-test and the fake LWS controller (support/fake_lws.py) creating each group's leader and worker
pods from the templates. One service walks through: the missing LWS API as a condition, the LWS
and its Ready groups once the API is there, scaling through ``/scale`` (the InferenceService's,
then the LWS's own in mode ``hpa``), a roll on a spec change, a broken group in the status, and a
group recreated when one of its pods restarts. About 90 s on the loaded 2-core machine.
"""

from __future__ import annotations

import re

import pytest
from support.fake_lws import LWS, PODS, FakeLwsController, LwsEmulator, install_lws_api
from support.kube_emulator import ISVC, EmulatorThread
from support.operator_process import condition, manifest, start_operator, stop_operator

from kvfleet.operator import lws

pytestmark = pytest.mark.slow

NS, NAME = "default", "lws-e2e"
WAIT = 90
"""Seconds a wait for the operator may take on the loaded 2-core machine (see test_operator.py)."""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lws")
    with EmulatorThread(LwsEmulator) as emu:
        log = tmp / "operator.log"
        proc, _ = start_operator(emu.write_kubeconfig(tmp / "kubeconfig"), log, "--standalone")
        try:
            yield emu, proc
        finally:
            stop_operator(proc)
            print("---- operator log (tail) ----\n" + log.read_text()[-6000:])


def pods(emu: EmulatorThread) -> list[dict]:
    return sorted((p for p in emu.list(PODS, NS) if p["metadata"]["name"].startswith(NAME + "-")),
                  key=lambda p: p["metadata"]["name"])


def cond(emu: EmulatorThread, type_: str, status: str, reason: str | None = None):
    def check():
        c = condition(emu, NAME, type_)
        return c if c and c["status"] == status and (reason is None or c["reason"] == reason) else None
    return check


def ready_groups(emu: EmulatorThread, n: int):
    def check():
        st = (emu.get(ISVC, NS, NAME) or {}).get("status") or {}
        ok = st.get("readyReplicas") == n and st.get("replicas") == n and cond(emu, "Ready", "True")()
        return st if ok and cond(emu, "GroupsWhole", "True")() and len(pods(emu)) == 2 * n else None
    return check


def test_a_two_node_service_on_leader_worker_set(cluster):
    emu, proc = cluster
    spec = {"parallelism": {"tensor": 2, "nodes": 2}, "router": {"enabled": False}}
    emu.create(ISVC, manifest(NAME, **spec))

    # no LWS API in the cluster: a clear condition, nothing rendered, the operator alive
    missing = emu.wait_for(cond(emu, "Degraded", "True", "LeaderWorkerSetMissing"), WAIT, message="the condition")
    assert "install LeaderWorkerSet" in missing["message"] and proc.poll() is None
    assert emu.get("apps/v1/deployments", NS, NAME) is None

    install_lws_api(emu)
    with FakeLwsController(emu, NS) as ctl:
        # the LWS (retried by the operator's back-off), its group, Ready
        obj = emu.wait_for(lambda: emu.get(LWS, NS, NAME), WAIT, message="the LeaderWorkerSet")
        assert obj["spec"]["leaderWorkerTemplate"]["size"] == 2 and obj["spec"]["replicas"] == 1
        emu.wait_for(ready_groups(emu, 1), WAIT, message="one ready group")
        leader, worker = pods(emu)
        env = {e["name"]: e.get("value") for e in worker["spec"]["containers"][0]["env"]}
        assert env["LWS_LEADER_ADDRESS"] == f"{NAME}-0.{NAME}.{NS}" and env["LWS_WORKER_INDEX"] == "1"
        assert "--headless" in worker["spec"]["containers"][0]["args"]
        assert emu.get("v1/services", NS, NAME)["spec"]["selector"][lws.LABEL_WORKER_INDEX] == "0"
        assert emu.get(ISVC, NS, NAME)["status"]["selector"].endswith(f"{lws.LABEL_WORKER_INDEX}=0")
        assert emu.get("apps/v1/deployments", NS, NAME) is None

        # scale through the InferenceService's /scale: a second group
        emu.patch(ISVC, NS, NAME, {"spec": {"replicas": 2}}, subresource="scale")
        emu.wait_for(ready_groups(emu, 2), WAIT, message="two ready groups")
        assert emu.get(LWS, NS, NAME, subresource="scale")["status"]["selector"] == (
            f"leaderworkerset.sigs.k8s.io/name={NAME},leaderworkerset.sigs.k8s.io/worker-index=0")

        # a spec change rolls every group onto the new template
        before = lws.template_hash(emu.get(LWS, NS, NAME))
        emu.patch(ISVC, NS, NAME, {"spec": {"engine": {"maxNumSeqs": 8}}})
        emu.wait_for(lambda: lws.template_hash(emu.get(LWS, NS, NAME)) != before, WAIT, message="the new template")
        after = lws.template_hash(emu.get(LWS, NS, NAME))

        def rolled():
            hashes = {p["metadata"]["annotations"].get(lws.ANNOTATION_TEMPLATE_HASH) for p in pods(emu)}
            return hashes == {after} and ready_groups(emu, 2)()
        emu.wait_for(rolled, WAIT, message="every group on the new template")
        assert {g for n, g in ctl.recreated if n == NAME} >= {0, 1}

        # a group whose worker does not come up: reported, then whole again
        ctl.break_group(NAME, 1)
        broken = emu.wait_for(cond(emu, "GroupsWhole", "False", "GroupNotWhole"), WAIT, message="a broken group")
        assert re.search(r"group 1: 1/2 pods ready \(worker lws-e2e-1-1 not ready\)", broken["message"])
        assert condition(emu, NAME, "Ready")["status"] == "False"
        ctl.break_group(NAME, 1, broken=False)

        # one worker restarts: its whole group is recreated (RecreateGroupOnPodRestart)
        leader_uid = emu.get(PODS, NS, f"{NAME}-0")["metadata"]["uid"]
        ctl.restart_pod(f"{NAME}-0-1")
        emu.wait_for(lambda: (emu.get(PODS, NS, f"{NAME}-0") or {}).get("metadata", {}).get("uid") not in
                     (None, leader_uid), WAIT, message="group 0 recreated")
        emu.wait_for(ready_groups(emu, 2), WAIT, message="whole and ready again")

        # mode hpa: the HPA targets the LWS, whose /scale the operator then leaves alone
        emu.patch(ISVC, NS, NAME, {"spec": {"autoscaling": {"mode": "hpa", "minReplicas": 1, "maxReplicas": 4}}})
        hpa = emu.wait_for(lambda: emu.get("autoscaling/v2/horizontalpodautoscalers", NS, NAME), WAIT,
                           message="the HPA")
        assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": lws.API_VERSION, "kind": lws.KIND, "name": NAME}
        emu.wait_for(lambda: "replicas" not in emu.get(LWS, NS, NAME)["spec"], WAIT, message="replicas left to the HPA")
        emu.patch(LWS, NS, NAME, {"spec": {"replicas": 3}}, subresource="scale")  # what the HPA controller does
        emu.wait_for(ready_groups(emu, 3), WAIT, message="three ready groups")
