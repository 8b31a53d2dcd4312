"""Pod-level reasons end to end: ``kvfleet operator`` as a process against the emulator, with Pod
objects in the states a kubelet reports (image pull back-off, crash loop, unschedulable, a failing
``fetch-model`` init container, a missing Secret; support/pod_states.py): within 30 s
``Ready=False`` / ``Degraded=True`` with the reason and message, and one Warning Event. The pure
status code: tests/unit/operator/test_pod_status.py.
"""

from __future__ import annotations

import time

import pytest
from support.kube_emulator import ISVC
from support.operator_process import NS, condition, manifest, running_operator
from support.pod_states import CASES


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
