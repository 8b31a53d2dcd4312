"""kopf handlers of the kvfleet operator: thin wrappers around :func:`reconcile.reconcile`.

Every trigger runs the same idempotent reconcile of one InferenceService: the InferenceService
created, changed or found at start-up (an invalid spec: a Warning Event, then kopf retries with
:func:`backoff`), and any watch event of a child labelled
``app.kubernetes.io/managed-by=kvfleet-operator`` (rollout progress moves the status; a child
edited or deleted by hand is put back), and of a runtime pod (labelled ``kvfleet.io/inferenceservice``:
the status names why it is not ready). No handler needs a finalizer. Importing this module
registers these handlers and, through :mod:`kvfleet.operator.autoscaler`, the autoscaler's.
All settings live in the one start-up handler :func:`configure` (see docs/operator.md).
"""

from __future__ import annotations

import logging
from typing import Any

import kopf

from kvfleet.operator import builders, crd, reconcile
from kvfleet.operator.kube import ApiError, Kube, make_kube
from kvfleet.operator.service_spec import FIELD_MANAGER, LABEL_ISVC, LABEL_MANAGED_BY
from kvfleet.runtime import env

DIFFBASE_PREFIX = "kvfleet.io"
DIFFBASE_KEY = "last-handled-configuration"
PROGRESS_FIELD = "status.kopf"
FINALIZER = "kvfleet.io/finalizer"
DEFAULT_PEERING = "kvfleet-operator"

CHILD_RESOURCES = [
    ("", "v1", "configmaps"),
    ("", "v1", "services"),
    ("apps", "v1", "deployments"),
    ("policy", "v1", "poddisruptionbudgets"),
    ("autoscaling", "v2", "horizontalpodautoscalers"),
    ("leaderworkerset.x-k8s.io", "v1", "leaderworkersets"),  # kopf skips it (a warning) where LWS is not installed
]

MANAGED = {LABEL_MANAGED_BY: FIELD_MANAGER}


def backoff(retry: int) -> float:
    """Delay before retry number ``retry`` (0-based) of a failed reconcile, seconds."""
    return float(min(300, 10 * 2 ** min(retry, 5)))


def _kube(memo: Any) -> Kube:
    kube = getattr(memo, "kube", None)
    if kube is None:  # start-up handlers run first; this is a safety net for direct calls
        kube = memo.kube = make_kube()
    return kube


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: Any, logger: logging.Logger, **_: Any) -> None:
    """All operator settings, in one place (see the module docstring)."""
    settings.persistence.progress_storage = kopf.StatusProgressStorage(field=PROGRESS_FIELD)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=DIFFBASE_PREFIX,
                                                                            key=DIFFBASE_KEY)
    settings.persistence.finalizer = FINALIZER
    settings.posting.level = logging.WARNING
    settings.posting.reporting_component = FIELD_MANAGER
    settings.execution.max_workers = 8
    settings.networking.request_timeout = 60
    settings.networking.connect_timeout = 10
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.peering.lifetime = env.PEERING_LIFETIME.get()
    if not settings.peering.mandatory:  # no --peering NAME: use ours when it exists, else run alone
        settings.peering.name = DEFAULT_PEERING
    memo.kube = make_kube()
    logger.info("kvfleet operator configured: field manager %s, diff-base %s/%s, progress in %s",
                FIELD_MANAGER, DIFFBASE_PREFIX, DIFFBASE_KEY, PROGRESS_FIELD)


@kopf.on.login()
def login(**kwargs: Any) -> Any:
    """Log in the way the kubernetes client does (in-cluster, else ``$KUBECONFIG``)."""
    return kopf.login_via_client(**kwargs)


def _reconcile(memo: Any, namespace: str, name: str, logger: logging.Logger) -> reconcile.Outcome:
    try:
        out = reconcile.reconcile(_kube(memo), namespace, name)
    except ApiError as e:
        raise kopf.TemporaryError(f"API error: {e}", delay=10) from None
    if out.applied or out.deleted:
        logger.info("applied %s; deleted %s", ", ".join(out.applied) or "nothing", ", ".join(out.deleted) or "nothing")
    return out


@kopf.on.resume(crd.GROUP, crd.VERSION, crd.PLURAL)
@kopf.on.create(crd.GROUP, crd.VERSION, crd.PLURAL)
@kopf.on.update(crd.GROUP, crd.VERSION, crd.PLURAL)
def reconcile_inference_service(body: kopf.Body, namespace: str, name: str, retry: int, memo: Any,
                                logger: logging.Logger, **_: Any) -> None:
    """Reconcile on create, change and operator start; retry an invalid spec with back-off."""
    out = _reconcile(memo, namespace, name, logger)
    if out.error is not None:
        kopf.warn(body, reason=out.error.reason, message=out.error.message)
        raise kopf.TemporaryError(f"{out.error.reason}: {out.error.message}", delay=backoff(retry))
    if out.applied:
        kopf.event(body, type="Normal", reason="Applied", message="applied " + ", ".join(out.applied))


def _owner(body: kopf.Body) -> str | None:
    for ref in body.get("metadata", {}).get("ownerReferences") or []:
        ours = ref.get("kind") == crd.KIND and ref.get("apiVersion", "").startswith(crd.GROUP + "/")
        if ours and ref.get("controller"):
            return ref.get("name")
    return None


def _register_child_watch(group: str, version: str, plural: str) -> None:
    @kopf.on.event(group, version, plural, labels=MANAGED, id=f"child-{plural}")
    def child_changed(body: kopf.Body, namespace: str, memo: Any, logger: logging.Logger, type: str | None,
                      **_: Any) -> None:
        """A child changed, appeared or disappeared: reconcile its owner (status, drift), unless a
        reconcile of it is already waiting (:func:`reconcile.reconcile_coalesced`)."""
        owner = _owner(body)
        if owner is None or type is None:  # type None: the initial listing; on.resume covers it
            return
        try:
            out = reconcile.reconcile_coalesced(_kube(memo), namespace, owner)
        except ApiError as e:
            logger.warning("reconcile of %s/%s after a %s event failed: %s", namespace, owner, plural, e)
            return
        if out is not None and (out.applied or out.deleted):
            logger.info("%s/%s: put back %s after a %s event on %s", namespace, owner,
                        ", ".join(out.applied + out.deleted), type, plural)


for _group, _version, _plural in CHILD_RESOURCES:
    _register_child_watch(_group, _version, _plural)


@kopf.on.event("", "v1", "pods", labels={**MANAGED, LABEL_ISVC: kopf.PRESENT}, id="runtime-pods")
def pod_changed(body: kopf.Body, namespace: str, memo: Any, logger: logging.Logger, type: str | None,
                **_: Any) -> None:
    """A runtime pod changed (pulling, crash-looping, unschedulable, ready): reconcile its
    InferenceService (named by its label) so the status says why within one event."""
    owner = (body.get("metadata", {}).get("labels") or {}).get(LABEL_ISVC)
    if owner is None or type is None:
        return
    try:
        reconcile.reconcile_coalesced(_kube(memo), namespace, owner)
    except ApiError as e:
        logger.warning("reconcile of %s/%s after a pod event failed: %s", namespace, owner, e)


@kopf.on.probe(id="inferenceservices")
def probe_reconciles(**_: Any) -> int:
    """Liveness probe payload: the number of InferenceServices this process has locked so far."""
    return reconcile.locked_count()


# The autoscaler's kopf handlers (its index, its loop's start-up and clean-up), registered
# after configure so that kopf runs its start-up handler second.
from kvfleet.operator import autoscaler  # noqa: E402

__all__ = ["autoscaler", "backoff", "builders", "configure", "reconcile_inference_service"]
