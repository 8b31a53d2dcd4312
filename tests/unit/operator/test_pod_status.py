"""Pod-level reasons: why a runtime pod will not become ready, in the status at once.

Pure tests of :func:`status.pod_problem` / :func:`status.desired_status` on Pod objects in the
states a kubelet reports (support/pod_states.py; the operator process reporting them:
tests/e2e/test_operator_pods.py).
"""

from __future__ import annotations

import pytest
from support.operator_process import manifest
from support.pod_states import CASES, pod, waiting

from kvfleet.operator import builders, status

NS = "default"


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
