"""The prefill pool's own scaling (``spec.disaggregation``, issue 43; docs/autoscaling.md,
"Per-pool autoscaling").

Contract: with ``autoscaling.mode: operator`` and ``disaggregation.prefill.maxReplicas`` set
(:func:`kvfleet.operator.disagg.prefill_autoscaled`), each autoscaler iteration
(:mod:`kvfleet.operator.autoscale_step`) also calls :func:`scale_prefill`: it reads the prefill
pods (Deployment ``NAME-prefill``) through the same metrics source as the decode pool, decides
with the same HPA algorithm (:func:`kvfleet.operator.policy.decide_scale`, its own history) on
the pool's waiting prompt tokens (``kvfleet:num_waiting_prompt_tokens`` against
``prefill.targetWaitingPromptTokens`` per pod) besides queue depth, KV usage and busy slots,
bounded by ``prefill.minReplicas`` (default 1) and ``prefill.maxReplicas``, and writes the
decision through the prefill Deployment's scale subresource (the reconcile then leaves that
Deployment's ``replicas`` out). The decode pool is the InferenceService's own children, scaled
by ``spec.autoscaling`` as without disaggregation. :func:`pools_status` is ``status.pools`` (a
prefill pool that is not autoscaled: :func:`read_prefill`, its Deployment's counts).
Without ``maxReplicas`` the prefill pool keeps ``prefill.replicas`` (as before).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvfleet.operator import disagg, policy, service_spec, spec_view
from kvfleet.operator.kube import Kube
from kvfleet.operator.metrics_source import MetricsSourceError, pod_is_ready
from kvfleet.operator.pod_metrics import MetricsAggregate

DEFAULT_MAX_NUM_SEQS = 128


@dataclass
class PoolState:
    """What the loop remembers about the prefill pool between iterations."""

    history: tuple[policy.Recommendation, ...] | None = None
    previous: MetricsAggregate | None = None
    last_reason: str | None = None
    changes: list[tuple[float, int, int]] = dataclasses.field(default_factory=list)


def prefill_config(isvc: Mapping[str, Any], base: policy.AutoscalingConfig) -> policy.AutoscalingConfig | None:
    """The prefill pool's config (``base``'s targets and windows, the pool's bounds and
    prompt-token target), or None when the pool is not autoscaled.

    Raises ValueError as :meth:`policy.AutoscalingConfig.checked` (e.g. minReplicas > maxReplicas)."""
    spec = disagg.disaggregation(isvc)
    if spec is None or not disagg.prefill_autoscaled(isvc, spec):
        return None
    pool = spec["prefill"]
    max_r = int(pool["maxReplicas"])
    min_r = int(pool["minReplicas"]) if pool.get("minReplicas") is not None else min(1, max_r)
    checked = policy.AutoscalingConfig.checked(base.mode, min_r, max_r, base.target_queue_depth,
                                               base.target_kv_cache_usage, base.scale_up_window,
                                               base.scale_down_window)
    return dataclasses.replace(checked, target_waiting_prompt_tokens=float(pool["targetWaitingPromptTokens"]))


def pools_status(prefill: tuple[int, int] | None, decode: tuple[int, int]) -> dict[str, Any]:
    """``status.pools`` from ``(replicas, ready)`` of each pool (prefill None: not read)."""
    out = {"decode": {"replicas": decode[0], "readyReplicas": decode[1]}}
    if prefill is not None:
        out["prefill"] = {"replicas": prefill[0], "readyReplicas": prefill[1]}
    return out


async def read_prefill(kube: Kube, isvc: Mapping[str, Any]) -> tuple[int, int] | None:
    """A prefill pool that is not autoscaled: ``(replicas, ready)`` from its Deployment (None
    while it does not exist)."""
    name = disagg.pool_isvc(isvc, "prefill")["metadata"]["name"]
    deployment = await asyncio.to_thread(kube.get, "Deployment", isvc["metadata"]["namespace"], name)
    if deployment is None:
        return None
    return (int((deployment.get("spec") or {}).get("replicas", 1)),
            int((deployment.get("status") or {}).get("readyReplicas") or 0))


async def scale_prefill(kube: Kube, isvc: Mapping[str, Any], config: policy.AutoscalingConfig, state: PoolState,
                        source: Any, logger: logging.Logger, *, now: float) -> tuple[int, int] | None:
    """One decision for the prefill pool, written to its Deployment's scale subresource.
    Returns ``(replicas, ready)`` after it, or None while the Deployment does not exist yet.

    Raises:
        ApiError, httpx.HTTPError, OSError: an API call failed (the loop retries)."""
    namespace = isvc["metadata"]["namespace"]
    pool = disagg.pool_isvc(isvc, "prefill")
    name = pool["metadata"]["name"]
    deployment = await asyncio.to_thread(kube.get, "Deployment", namespace, name)
    if deployment is None:
        return None
    current = int((deployment.get("spec") or {}).get("replicas", 1))
    pods = await asyncio.to_thread(kube.list_objects, "Pod", namespace, service_spec.selector_labels(pool))
    ready = sum(1 for p in pods if pod_is_ready(p))
    try:
        metrics: MetricsAggregate | None = await source.read(pods, now=now, previous=state.previous)
    except MetricsSourceError as e:
        logger.warning("metrics of %s/%s unavailable: %s", namespace, name, e)
        metrics = None
    if metrics is not None:
        state.previous = metrics
    if state.history is None:
        state.history = (policy.Recommendation(now, current),)
    max_num_seqs = spec_view.of(pool).engine.max_num_seqs or DEFAULT_MAX_NUM_SEQS
    decision = policy.decide_scale(config, now=now, current=current, ready=ready, metrics=metrics,
                                   history=state.history, max_num_seqs=int(max_num_seqs))
    state.history = decision.history
    if decision.changed:
        await asyncio.to_thread(kube.scale, "Deployment", namespace, name, decision.replicas)
        state.changes.append((now, decision.current, decision.replicas))
    if decision.changed or decision.reason != state.last_reason:
        logger.info("%s/%s (prefill pool): %s", namespace, name, decision.message)
    state.last_reason = decision.reason
    return decision.replicas, ready
