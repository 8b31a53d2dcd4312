"""Pure status of an InferenceService (kvfleet.operator.status): Ready only when the current
generation has rolled out, transition times that move only with the status, Degraded on a bad spec
or a stalled rollout, conditions kept in order."""

from __future__ import annotations

import copy

from support.operator_objects import by_kind, minimal

from kvfleet.operator import builders, status
from kvfleet.operator.builders import InvalidSpec

T0, T1, T2 = "2026-01-01T00:00:00Z", "2026-01-01T00:01:00Z", "2026-01-01T00:02:00Z"


def live_deployment(isvc, *, available: int, updated: int | None = None, observed: int = 1, generation: int = 1,
                    stalled: bool = False):
    d = copy.deepcopy(by_kind(builders.desired_children(isvc))["Deployment"])
    want = d["spec"]["replicas"]
    updated = want if updated is None else updated
    d["metadata"]["generation"] = generation
    d["status"] = {"observedGeneration": observed, "replicas": max(want, updated), "updatedReplicas": updated,
                   "readyReplicas": available, "availableReplicas": available}
    if stalled:
        d["status"]["conditions"] = [{"type": "Progressing", "status": "False",
                                      "reason": "ProgressDeadlineExceeded", "message": "too slow"}]
    return d


def cond(status, type_):
    return next(c for c in status["conditions"] if c["type"] == type_)


def test_status_ready_only_when_rolled_out_for_the_current_generation():
    isvc = minimal(replicas=2)
    desired = by_kind(builders.desired_children(isvc))["Deployment"]
    st = status.desired_status(isvc, deployment=None, desired_deployment=desired, now=T0)
    assert cond(st, "Ready")["status"] == "False" and cond(st, "Progressing")["status"] == "True"
    assert st["url"] == "http://smollm2-router.default.svc.cluster.local:8000/v1"  # the router: on by default
    assert st["selector"] == ("app.kubernetes.io/component=inference-server,app.kubernetes.io/instance=smollm2,"
                              "app.kubernetes.io/name=kvfleet")
    assert st["observedGeneration"] == 1

    rolling = live_deployment(isvc, available=1)
    st = status.desired_status(isvc, deployment=rolling, desired_deployment=desired, now=T0)
    assert cond(st, "Ready")["status"] == "False" and cond(st, "Progressing")["reason"] == "RollingOut"

    stale = live_deployment(isvc, available=2, observed=1, generation=2)  # controller has not seen gen 2
    st = status.desired_status(isvc, deployment=stale, desired_deployment=desired, now=T0)
    assert cond(st, "Ready")["status"] == "False"

    done = live_deployment(isvc, available=2)
    st = status.desired_status(isvc, deployment=done, desired_deployment=desired, now=T0)
    assert cond(st, "Ready")["status"] == "True" and cond(st, "Ready")["observedGeneration"] == 1
    assert cond(st, "Degraded")["status"] == "False" and st["readyReplicas"] == 2

    # a new config the Deployment does not carry yet is not Ready
    isvc2 = minimal(replicas=2, engine={"blockSize": 32})
    desired2 = by_kind(builders.desired_children(isvc2))["Deployment"]
    st = status.desired_status(isvc2, deployment=done, desired_deployment=desired2, now=T0)
    assert cond(st, "Ready")["status"] == "False"


def test_last_transition_time_changes_only_with_status():
    isvc = minimal()
    desired = by_kind(builders.desired_children(isvc))["Deployment"]
    st0 = status.desired_status(isvc, deployment=live_deployment(isvc, available=0, updated=1),
                                  desired_deployment=desired, now=T0)
    isvc["status"] = st0
    st1 = status.desired_status(isvc, deployment=live_deployment(isvc, available=0, updated=1),
                                  desired_deployment=desired, now=T1)
    assert st1 == st0 and status.status_patch(st0, st1) == {}
    isvc["status"] = st1
    st2 = status.desired_status(isvc, deployment=live_deployment(isvc, available=1),
                                  desired_deployment=desired, now=T2)
    assert cond(st2, "Ready")["lastTransitionTime"] == T2
    assert cond(st2, "Degraded")["lastTransitionTime"] == T0  # stayed False
    assert set(status.status_patch(st1, st2)) == {"conditions", "readyReplicas"}


def test_degraded_on_invalid_spec_and_stalled_rollout():
    isvc = minimal()
    err = InvalidSpec("SecretNotFound", "Secret default/k not found")
    st = status.desired_status(isvc, deployment=None, desired_deployment=None, now=T0, error=err)
    assert cond(st, "Degraded") == {"type": "Degraded", "status": "True", "reason": "SecretNotFound",
                                    "message": "Secret default/k not found", "observedGeneration": 1,
                                    "lastTransitionTime": T0}
    assert cond(st, "Ready")["status"] == "False"
    desired = by_kind(builders.desired_children(isvc))["Deployment"]
    st = status.desired_status(isvc, deployment=live_deployment(isvc, available=0, stalled=True),
                                 desired_deployment=desired, now=T0)
    assert cond(st, "Degraded")["reason"] == "ProgressDeadlineExceeded"


def test_set_condition_keeps_order_and_time():
    c = status.set_condition([], type="Ready", status="False", reason="A", message="", now=T0)
    c = status.set_condition(c, type="Ready", status="False", reason="B", message="m", now=T1)
    assert c == [{"type": "Ready", "status": "False", "reason": "B", "message": "m", "lastTransitionTime": T0}]
    c = status.set_condition(c, type="Ready", status="True", reason="C", message="", now=T2)
    assert c[0]["lastTransitionTime"] == T2


# --------------------------------------------------------------------- the fetching init container
