"""Pod-level reasons: why a runtime pod will not become ready, in the status at once.

Pure tests of :func:`status.pod_problem` / :func:`status.desired_status`, and end to end:
``kvfleet operator`` as a process against the emulator, with Pod objects in the states a
kubelet reports (image pull back-off, crash loop, unschedulable, a failing ``fetch-model``
init container, a missing Secret): within 30 s ``Ready=False`` / ``Degraded=True`` with the
reason and message, and one Warning Event.
"""

from __future__ import annotations

import time

import pytest
from kube_emulator import ISVC
from test_operator_e2e import condition, manifest, running_operator

from kvfleet.operator import builders, status

NS = "default"


def pod(name: str = "p-1", **st) -> dict:
    return {"metadata": {"name": name}, "status": st}


def waiting(reason: str, message: str = "", name: str = "runtime", last: dict | None = None) -> dict:
    cs = {"name": name, "image": "img:1", "state": {"waiting": {"reason": reason, "message": message}}}
    if last:
        cs["lastState"] = {"terminated": last}
    return cs


CASES = [
    (pod(containerStatuses=[waiting("ImagePullBackOff", 'Back-off pulling image "img:1"')]),
     "ImagePullBackOff", 'Back-off pulling image "img:1"'),
    (pod(containerStatuses=[waiting("CrashLoopBackOff", "back-off 5m0s", last={
        "exitCode": 1, "reason": "Error", "message": "ValueError: tensor_parallel_size 3 does not divide 9"})]),
     "CrashLoopBackOff", "ValueError: tensor_parallel_size 3 does not divide 9"),
    (pod(containerStatuses=[waiting("CrashLoopBackOff", last={"exitCode": 137, "reason": "OOMKilled"})]),
     "CrashLoopBackOff", "OOMKilled with exit code 137"),
    (pod(conditions=[{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                      "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."}]),
     "Unschedulable", "3 Insufficient nvidia.com/gpu"),
    (pod(initContainerStatuses=[waiting("CrashLoopBackOff", name="fetch-model", last={
        "exitCode": 1, "message": "attempt 3/3: failed with exit code 1"})]),
     "ModelFetchFailed", "init container fetch-model failed: attempt 3/3"),
    (pod(containerStatuses=[waiting("CreateContainerConfigError", 'secret "hf" not found')]),
     "SecretNotFound", 'secret "hf" not found'),
    (pod(containerStatuses=[waiting("CreateContainerConfigError", "couldn't find key token in Secret default/hf")]),
     "SecretKeyNotFound", "couldn't find key token"),
]


@pytest.mark.parametrize(("p", "reason", "needle"), CASES, ids=[c[1] for c in CASES])
def test_pod_problem_names_the_reason_and_message(p, reason, needle):
    got = status.pod_problem([p])
    assert got is not None and got[0] == reason and needle in got[1] and got[1].startswith("pod p-1: ")


def test_pods_that_start_normally_have_no_problem():
    assert status.pod_problem([pod(containerStatuses=[waiting("ContainerCreating")])]) is None
    assert status.pod_problem([pod(containerStatuses=[{"name": "runtime", "state": {"running": {}}}])]) is None
    assert status.pod_problem([]) is None


def isvc() -> dict:
    obj = manifest("s")
    obj["metadata"].update(uid="u1", generation=2, namespace=NS)
    return obj


def test_desired_status_is_degraded_with_the_pod_reason_until_rolled_out():
    desired = next(c for c in builders.desired_children(isvc()) if c["kind"] == "Deployment")
    live = {**desired, "metadata": {**desired["metadata"], "generation": 1},
            "status": {"observedGeneration": 1, "replicas": 1, "updatedReplicas": 1}}
    bad = [pod(containerStatuses=[waiting("ImagePullBackOff", "no such image")])]
    st = status.desired_status(isvc(), deployment=live, desired_deployment=desired, now="t", pods=bad)
    conds = {c["type"]: c for c in st["conditions"]}
    assert (conds["Ready"]["status"], conds["Ready"]["reason"]) == ("False", "ImagePullBackOff")
    assert (conds["Degraded"]["status"], conds["Degraded"]["reason"]) == ("True", "ImagePullBackOff")
    assert "no such image" in conds["Degraded"]["message"]
    live["status"].update(readyReplicas=1, availableReplicas=1)  # rolled out: an old pod's state is history
    st = status.desired_status(isvc(), deployment=live, desired_deployment=desired, now="t", pods=bad)
    assert {c["type"]: c["status"] for c in st["conditions"]} == {"Ready": "True", "Progressing": "False",
                                                                 "Degraded": "False", "ModelCached": "True"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with running_operator(tmp_path_factory.mktemp("pods")) as (emu, _):
        yield emu


@pytest.mark.slow
@pytest.mark.parametrize(("p", "reason", "needle"), [CASES[0], CASES[1], CASES[3], CASES[4], CASES[5]],
                         ids=["image", "crashloop", "unschedulable", "fetch", "secret"])
def test_operator_reports_pod_reason_within_30s_with_an_event(cluster, p, reason, needle):
    emu = cluster
    name = f"pods-{reason.lower()}"
    emu.create(ISVC, manifest(name))
    deploy = emu.wait_for(lambda: emu.get("apps/v1/deployments", NS, name), 30, message="the Deployment")
    labels = deploy["spec"]["template"]["metadata"]["labels"]
    t0 = time.monotonic()
    emu.create("v1/pods", {"apiVersion": "v1", "kind": "Pod",
                           "metadata": {"name": f"{name}-abc", "namespace": NS, "labels": labels},
                           "spec": {"containers": [{"name": "runtime", "image": "img:1"}]},
                           "status": {"phase": "Pending", **p["status"]}})
    degraded = emu.wait_for(lambda: (c := condition(emu, name, "Degraded")) and c["status"] == "True" and c,
                            30, message=f"Degraded={reason}")
    assert time.monotonic() - t0 < 30
    assert degraded["reason"] == reason and needle in degraded["message"]
    ready = condition(emu, name, "Ready")
    assert (ready["status"], ready["reason"]) == ("False", reason)
    events = emu.wait_for(lambda: [e for e in emu.list("v1/events", NS) if e.get("reason") == reason
                                   and e["involvedObject"]["name"] == name], 15, message="the Warning Event")
    assert len(events) == 1 and events[0]["type"] == "Warning" and needle in events[0]["message"]
