"""The CRD schema of per-pool autoscaling (``spec.disaggregation.prefill``'s bounds and target,
``status.pools``), plain dicts that :mod:`kvfleet.operator.crd_schema` puts in the spec and the
status; read by :mod:`kvfleet.operator.pool_autoscale` (docs/autoscaling.md, "Per-pool autoscaling")."""

from __future__ import annotations

from typing import Any


def _int(desc: str, minimum: int, **extra: Any) -> dict[str, Any]:
    return {"type": "integer", "description": desc, "minimum": minimum, **extra}


PREFILL_AUTOSCALING: dict[str, Any] = {
    "minReplicas": _int("Fewest prefill pods under autoscaling.mode operator (default 1). With maxReplicas the pool "
                        "is scaled on its own load; without, it keeps replicas.", 0, maximum=1000),
    "maxReplicas": _int("Most prefill pods the operator's autoscaler sets.", 1, maximum=1000),
    "targetWaitingPromptTokens": _int("Waiting prompt tokens (kvfleet:num_waiting_prompt_tokens) per prefill pod the "
                                      "pool is sized for.", 1, default=4096),
}

POOLS_STATUS: dict[str, Any] = {
    "type": "object",
    "description": "spec.disaggregation: each pool's pods, wanted and ready, as the autoscaler last read them.",
    "properties": {role: {"type": "object", "description": f"The {role} pool.", "properties": {
        "replicas": _int("Pods wanted.", 0), "readyReplicas": _int("Pods ready.", 0)}}
        for role in ("prefill", "decode")},
}
