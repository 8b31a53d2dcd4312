"""The status the operator writes on an InferenceService, from its live Deployment (pure).

:func:`desired_status` gives ``observedGeneration``, the replica counts, ``selector`` (the
scale subresource's), ``url`` and the kstatus conditions ``Ready`` / ``Progressing`` /
``Degraded`` (https://github.com/kubernetes-sigs/cli-utils/blob/master/pkg/kstatus/README.md);
:func:`set_condition` keeps ``lastTransitionTime`` unless a condition's ``status`` changes (API
conventions); :func:`status_patch` is the merge patch of only the keys that changed.
:func:`pod_problem` names why a runtime pod will not become ready (image, crash loop,
scheduling, Secret, model fetch); :func:`event` builds a ``core/v1`` Event about an object.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from kvfleet.operator import crd, router, spec_view
from kvfleet.operator.crd import InvalidSpec
from kvfleet.operator.service_spec import ANNOTATION_CONFIG_HASH, names, selector_string
from kvfleet.operator.spec_enums import AutoscalingMode
from kvfleet.runtime.model_errors import reason_of


def set_condition(conditions: list[Mapping[str, Any]] | None, *, type: str, status: str, reason: str,
                  message: str, now: str, observed_generation: int | None = None) -> list[dict[str, Any]]:
    """Return ``conditions`` with one condition set (a new list; the input is not modified).

    ``lastTransitionTime`` is ``now`` (an RFC 3339 string) only when the condition is new or
    its ``status`` changed; otherwise the previous time is kept (API conventions).
    """
    out = [dict(c) for c in (conditions or [])]
    new = {"type": type, "status": status, "reason": reason, "message": message}
    if observed_generation is not None:
        new["observedGeneration"] = observed_generation
    for i, old in enumerate(out):
        if old.get("type") == type:
            new["lastTransitionTime"] = (old.get("lastTransitionTime") or now) if old.get("status") == status else now
            out[i] = new
            return out
    new["lastTransitionTime"] = now
    out.append(new)
    return out


def deployment_progress(deployment: Mapping[str, Any] | None,
                        desired: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Summarise a live Deployment for the conditions.

    Returns ``{"exists", "replicas", "ready", "updated", "available", "current", "rolled_out",
    "stalled", "stall_message"}``: ``current`` is True when the Deployment controller observed the
    latest Deployment generation and (when ``desired`` is given) the live pod template carries the
    desired config hash; ``rolled_out`` when, in addition, every wanted replica is updated and
    available and no old pods remain (the ``kubectl rollout status`` rule); ``stalled`` when the
    Progressing condition says ``ProgressDeadlineExceeded``.
    """
    if not deployment:
        return {"exists": False, "replicas": 0, "ready": 0, "updated": 0, "available": 0,
                "current": False, "rolled_out": False, "stalled": False, "stall_message": ""}
    spec = deployment.get("spec") or {}
    st = deployment.get("status") or {}
    want = int(spec.get("replicas", 1))
    gen = (deployment.get("metadata") or {}).get("generation")
    observed = st.get("observedGeneration")
    current = gen is None or (observed is not None and observed >= gen)
    if desired is not None:
        def _hash(d: Mapping[str, Any] | None) -> Any:
            return (((d or {}).get("spec") or {}).get("template") or {}).get("metadata", {}).get(
                "annotations", {}).get(ANNOTATION_CONFIG_HASH)
        current = current and _hash(deployment) == _hash(desired) and want == int(
            (desired.get("spec") or {}).get("replicas", want))
    replicas = int(st.get("replicas") or 0)
    updated = int(st.get("updatedReplicas") or 0)
    available = int(st.get("availableReplicas") or 0)
    stall = next((c for c in st.get("conditions") or [] if c.get("type") == "Progressing"
                  and c.get("reason") == "ProgressDeadlineExceeded"), None)
    return {
        "exists": True, "replicas": replicas, "ready": int(st.get("readyReplicas") or 0),
        "updated": updated, "available": available, "current": current,
        "rolled_out": current and updated >= want and available >= want and replicas <= updated,
        "stalled": stall is not None, "stall_message": (stall or {}).get("message", ""),
    }


def desired_status(isvc: Mapping[str, Any], *, deployment: Mapping[str, Any] | None,
                   desired_deployment: Mapping[str, Any] | None, now: str,
                   error: InvalidSpec | None = None,
                   pods: list[Mapping[str, Any]] | None = None,
                   claim: Mapping[str, Any] | None = None,
                   scaling_conflict: str | None = None,
                   spec: spec_view.Spec | None = None) -> dict[str, Any]:
    """The status the operator owns, computed from the live Deployment.

    Args:
        isvc: the InferenceService (its ``status.conditions`` keep their transition times).
        deployment: the live Deployment (None when absent).
        desired_deployment: what the operator applied (for the config hash check).
        now: the current time, RFC 3339 (``2026-01-01T00:00:00Z``); used only for transitions.
        error: the reason the spec could not be applied, if any (-> Degraded=True, Ready=False).
        pods: the runtime pods; while the generation is not rolled out, a :func:`pod_problem`
            gives Ready=False and Degraded=True with its reason and message; for ``hf://``
            models they also give the ``ModelCached`` condition (:func:`model_cached`).
        claim: the live PersistentVolumeClaim of the model volume, if any (a ReadWriteOnce
            claim that pods on several nodes would mount: :func:`claim_problem`).
        scaling_conflict: a message when a foreign autoscaler targets the Deployment itself
            (-> ``ScalingActive=False``, reason ``ConflictingAutoscaler``).
        spec: the reconcile's view of ``isvc``'s spec (default: built here).

    Returns:
        ``{"observedGeneration", "replicas", "readyReplicas", "updatedReplicas", "selector",
        "url", "conditions"}``. Conditions (kstatus): ``Ready`` True only when the current
        generation is fully rolled out; ``Progressing`` True while a rollout is under way;
        ``Degraded`` True on an invalid spec or a stalled rollout.
    """
    spec = spec_view.of(isvc) if spec is None else spec
    meta = isvc.get("metadata") or {}
    gen = meta.get("generation")
    old = (isvc.get("status") or {}).get("conditions") or []
    prog = deployment_progress(deployment, desired_deployment)
    want = int(((desired_deployment or deployment or {}).get("spec") or {}).get("replicas", 0))
    problem = None
    if error is None and prog["exists"] and not prog["rolled_out"]:
        problem = pod_problem(pods) or claim_problem(claim, desired_deployment or deployment)

    if error is not None:
        ready = ("False", error.reason, error.message)
        progressing = ("False", error.reason, "the spec cannot be applied")
        degraded = ("True", error.reason, error.message)
    elif not prog["exists"]:
        ready = ("False", "DeploymentMissing", "the Deployment does not exist yet")
        progressing = ("True", "Creating", "creating the runtime Deployment")
        degraded = ("False", "AsExpected", "")
    elif problem is not None:
        ready = ("False", *problem)
        progressing = ("False", "ProgressDeadlineExceeded", prog["stall_message"]) if prog["stalled"] else (
            "True", "RollingOut", "the runtime pods are not becoming ready")
        degraded = ("True", *problem)
    elif prog["stalled"]:
        ready = ("False", "ProgressDeadlineExceeded", prog["stall_message"] or "rollout stalled")
        progressing = ("False", "ProgressDeadlineExceeded", prog["stall_message"] or "rollout stalled")
        degraded = ("True", "ProgressDeadlineExceeded", prog["stall_message"] or "rollout stalled")
    elif prog["rolled_out"]:
        ready = ("True", "RolledOut", f"{prog['available']}/{want} replicas available")
        progressing = ("False", "RolledOut", "the current generation is rolled out")
        degraded = ("False", "AsExpected", "")
    else:
        msg = (f"{prog['updated']}/{want} replicas updated, {prog['available']} available"
               if prog["current"] else "waiting for the Deployment controller to observe the new spec")
        ready = ("False", "RollingOut", msg)
        progressing = ("True", "RollingOut", msg)
        degraded = ("False", "AsExpected", "")

    conds: list[dict[str, Any]] = [dict(c) for c in old]
    cached = model_cached(spec, pods, claim, desired_deployment or deployment,
                          available=prog["available"]) if prog["exists"] else None
    extra = [("ModelCached", cached)] if cached else []
    mode = spec.autoscaling.mode
    was = next((c for c in old if c.get("type") == "ScalingActive"), {})
    if scaling_conflict:
        extra.append(("ScalingActive", ("False", "ConflictingAutoscaler", scaling_conflict)))
    elif was.get("reason") == "ConflictingAutoscaler" and mode != AutoscalingMode.OPERATOR:  # the conflict is gone
        extra.append(("ScalingActive", ("False", "OperatorAutoscalerOff", autoscaler_off_message(isvc, mode))))
    from_zero = router.scale_from_zero_condition(isvc, spec)  # minReplicas 0: does anything wake it?
    if from_zero is not None:
        extra.append(("ScaleFromZero", from_zero))
    for type_, (status, reason, message) in (("Ready", ready), ("Progressing", progressing),
                                             ("Degraded", degraded), *extra):
        conds = set_condition(conds, type=type_, status=status, reason=reason, message=message,
                              now=now, observed_generation=gen)
    status: dict[str, Any] = {
        "replicas": prog["replicas"],
        "readyReplicas": prog["ready"],
        "updatedReplicas": prog["updated"],
        "selector": selector_string(isvc),
        "url": router.status_url(isvc, spec),  # the router's Service when spec.router.enabled
        "conditions": conds,
    }
    if gen is not None:
        status["observedGeneration"] = gen
    return status


def status_patch(current: Mapping[str, Any] | None, desired: Mapping[str, Any]) -> dict[str, Any]:
    """The merge patch that turns ``current`` status into ``desired`` for the keys the operator
    owns (empty dict when nothing changed: the reconcile then writes nothing)."""
    current = current or {}
    return {k: copy.deepcopy(v) for k, v in desired.items() if current.get(k) != v}


# ---------------------------------------------------------------------------------
# pod-level reasons

POD_WAITING_REASONS = ("ImagePullBackOff", "ErrImagePull", "InvalidImageName", "CreateContainerConfigError",
                       "CreateContainerError", "CrashLoopBackOff", "RunContainerError")
"""Container ``state.waiting`` reasons that say a pod will not become ready by itself."""
FETCH_CONTAINER = "fetch-model"


def _secret_reason(message: str) -> str:
    """``SecretNotFound`` / ``SecretKeyNotFound`` for the kubelet's CreateContainerConfigError
    messages (``secret "x" not found``, ``couldn't find key k in Secret ns/x``), else the
    kubelet's own reason."""
    low = message.lower()
    if "couldn't find key" in low:
        return "SecretKeyNotFound"
    if "secret" in low and "not found" in low:
        return "SecretNotFound"
    return "CreateContainerConfigError"


def _container_problem(cs: Mapping[str, Any], init: bool) -> tuple[str, str] | None:
    waiting = (cs.get("state") or {}).get("waiting") or {}
    last = (cs.get("lastState") or {}).get("terminated") or (cs.get("state") or {}).get("terminated") or {}
    reason, message = waiting.get("reason"), str(waiting.get("message") or "")
    fetch = init and cs.get("name") == FETCH_CONTAINER
    if reason in ("ImagePullBackOff", "ErrImagePull", "InvalidImageName"):
        return reason, message or f"cannot pull image {cs.get('image', '')}"
    if reason == "CreateContainerConfigError":
        return _secret_reason(message), message
    if fetch and int(last.get("exitCode") or 0) != 0:
        detail = str(last.get("message") or "").strip() or f"exit code {last.get('exitCode')}"
        return "ModelFetchFailed", f"init container {FETCH_CONTAINER} failed: {detail}"
    if reason in POD_WAITING_REASONS or (last and int(last.get("exitCode") or 0) != 0):
        detail = str(last.get("message") or "").strip()
        model_reason = reason_of(detail)
        if model_reason and not init:  # the model itself: the runtime's own reason
            return model_reason, f"container {cs.get('name')}: {detail}"
    if reason in POD_WAITING_REASONS:
        if last and not detail:
            detail = f"{last.get('reason') or 'exited'} with exit code {last.get('exitCode')}"
        return reason, f"container {cs.get('name')}: {detail or message or reason}"
    return None


def pod_problem(pods: list[Mapping[str, Any]] | None) -> tuple[str, str] | None:
    """The first reason, over ``pods`` (sorted by name), that a runtime pod will not become
    ready by itself, as ``(reason, message)``; None when there is none.

    Reasons: ``Unschedulable`` (PodScheduled False), ``ImagePullBackOff`` / ``ErrImagePull`` /
    ``InvalidImageName``, ``SecretNotFound`` / ``SecretKeyNotFound`` (from the kubelet's
    CreateContainerConfigError), ``ModelFetchFailed`` (the ``fetch-model`` init container
    exited non-zero), a model load reason of :mod:`kvfleet.runtime.model_errors`
    (``UnsupportedArchitecture``, ``InvalidModelFile``, ``UnsupportedQuantization``: the runtime
    container's last termination message starts with it), ``CrashLoopBackOff`` (with the last
    termination message); the message starts with ``pod NAME:``.
    """
    for pod in sorted(pods or [], key=lambda p: (p.get("metadata") or {}).get("name", "")):
        name = (pod.get("metadata") or {}).get("name", "?")
        st = pod.get("status") or {}
        if (pod.get("metadata") or {}).get("deletionTimestamp"):
            continue
        for cond in st.get("conditions") or []:
            if cond.get("type") == "PodScheduled" and cond.get("status") == "False" \
                    and cond.get("reason") == "Unschedulable":
                return "Unschedulable", f"pod {name}: {cond.get('message') or 'cannot be scheduled'}"
        for key, init in (("initContainerStatuses", True), ("containerStatuses", False)):
            for cs in st.get(key) or []:
                found = _container_problem(cs, init)
                if found:
                    return found[0], f"pod {name}: {found[1]}"[:1024]
    return None


def event(body: Mapping[str, Any], type_: str, reason: str, message: str, now: str,
          component: str = "kvfleet-operator") -> dict[str, Any]:
    """A ``core/v1`` Event about ``body`` (``reportingComponent`` ``component``), to create."""
    meta = body.get("metadata") or {}
    namespace = meta.get("namespace") or "default"
    return {
        "apiVersion": "v1", "kind": "Event",
        "metadata": {"generateName": f"{meta.get('name')}.", "namespace": namespace},
        "involvedObject": {"apiVersion": body.get("apiVersion") or crd.API_VERSION,
                           "kind": body.get("kind") or crd.KIND, "name": meta.get("name"),
                           "namespace": namespace, "uid": meta.get("uid"),
                           "resourceVersion": meta.get("resourceVersion")},
        "type": type_, "reason": reason, "message": message[:1024],
        "source": {"component": component},
        "reportingComponent": component, "reportingInstance": component,
        "firstTimestamp": now, "lastTimestamp": now, "count": 1,
    }


def autoscaler_off_message(isvc: Mapping[str, Any], mode: str) -> str:
    """The ``ScalingActive=False`` / ``OperatorAutoscalerOff`` message (mode ``none`` or ``hpa``)."""
    message = f"autoscaling.mode is {mode}: the operator's autoscaler does not scale this InferenceService"
    if mode == AutoscalingMode.HPA:
        message += f" (HorizontalPodAutoscaler {names(isvc)['hpa']} does)"
    return message


def claim_problem(claim: Mapping[str, Any] | None,
                  deployment: Mapping[str, Any] | None) -> tuple[str, str] | None:
    """``("ReadWriteOnceClaim", message)`` when the model volume's claim is ReadWriteOnce(Pod)
    and the Deployment runs more than one pod at a time (replicas above 1, or a surge pod
    during a rolling update): pods on another node cannot mount it and hang in
    ContainerCreating. None otherwise."""
    if not claim or not deployment:
        return None
    modes = set((claim.get("spec") or {}).get("accessModes") or [])
    if not modes or not modes <= {"ReadWriteOnce", "ReadWriteOncePod"}:
        return None
    spec = deployment.get("spec") or {}
    replicas = int(spec.get("replicas", 1))
    surge = ((spec.get("strategy") or {}).get("rollingUpdate") or {}).get("maxSurge", 0)
    if replicas <= 1 and surge in (0, "0", "0%"):
        return None
    name = (claim.get("metadata") or {}).get("name")
    why = f"{replicas} replicas" if replicas > 1 else "the surge pod of a rolling update"
    return "ReadWriteOnceClaim", (
        f"PersistentVolumeClaim {name} is {'/'.join(sorted(modes))}, but {why} may run on another node, "
        "where it cannot be mounted: use a ReadWriteMany (or ReadOnlyMany) claim, or 1 replica with "
        "rollout.strategy ResourceAware")


def model_cached(spec: spec_view.Spec, pods: list[Mapping[str, Any]] | None,
                 claim: Mapping[str, Any] | None = None,
                 deployment: Mapping[str, Any] | None = None, *, available: int = 0) -> tuple[str, str, str] | None:
    """The ``ModelCached`` condition ``(status, reason, message)`` of an ``hf://`` model (None
    for other schemes), from the pods' ``fetch-model`` init containers: ``True``/``Fetched``
    once one finished (or a runtime container runs, or ``available`` pods serve), ``False``/``ModelFetchFailed``,
    ``False``/``Downloading`` while one runs, else ``False``/``Pending``. A
    :func:`claim_problem` is appended to the message."""
    uri = str(spec.model.uri or "")
    if not uri.startswith("hf://"):
        return None
    result = ("False", "Pending", f"no pod has fetched {uri} yet")
    if available > 0:
        result = ("True", "Fetched", f"{uri} is in the model cache ({available} pods serve it)")
    for pod in [] if available > 0 else sorted(pods or [], key=lambda p: (p.get("metadata") or {}).get("name", "")):
        name = (pod.get("metadata") or {}).get("name", "?")
        st = pod.get("status") or {}
        fetchers = [c for c in st.get("initContainerStatuses") or [] if c.get("name") == FETCH_CONTAINER]
        done = any(((c.get("state") or {}).get("terminated") or {}).get("exitCode") == 0 for c in fetchers) or any(
            "running" in (c.get("state") or {}) for c in st.get("containerStatuses") or [])
        if done:
            result = ("True", "Fetched", f"{uri} is in the model cache (pod {name})")
            break
        if any(int(((c.get("lastState") or {}).get("terminated") or {}).get("exitCode") or 0) for c in fetchers):
            result = ("False", "ModelFetchFailed", f"pod {name}: init container {FETCH_CONTAINER} failed")
        elif result[1] == "Pending" and any("running" in (c.get("state") or {}) for c in fetchers):
            result = ("False", "Downloading", f"pod {name} is downloading {uri}")
    rwo = claim_problem(claim, deployment)
    return (result[0], result[1], f"{result[2]}; {rwo[1]}") if rwo else result
