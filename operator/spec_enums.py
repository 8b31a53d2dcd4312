"""Every enum of the ``InferenceService`` spec, declared once (KubeAI's style: the schema lists
the members, the code switches on the constants).

:mod:`kvfleet.operator.crd_schema` builds each ``"enum"`` of the CRD from these classes, and the
builders, policies and status compare against the members (a :class:`enum.StrEnum` equals its
string, so the spec's plain strings compare as they are). The router's algorithms are
:class:`kvfleet.runtime.router.routing.Algorithm` (the router's own enum; re-exported here as
:data:`RouterAlgorithm`). Stdlib only.
"""

from __future__ import annotations

import enum

from kvfleet.runtime.router.routing import Algorithm as RouterAlgorithm


class ImagePullPolicy(enum.StrEnum):
    ALWAYS = "Always"
    IF_NOT_PRESENT = "IfNotPresent"
    NEVER = "Never"


class KVTierType(enum.StrEnum):
    """``engine.kvCache.tiers[].type``."""

    PEER = "peer"
    DISK = "disk"


class SchedulingPolicy(enum.StrEnum):
    FCFS = "fcfs"
    PRIORITY = "priority"
    FAIR = "fair"


class Dtype(enum.StrEnum):
    AUTO = "auto"
    FLOAT32 = "float32"
    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"


class KVCacheDtype(enum.StrEnum):
    AUTO = "auto"
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"


class Quantization(enum.StrEnum):
    INT8 = "int8"
    INT4 = "int4"


class SpeculativeMethod(enum.StrEnum):
    NGRAM = "ngram"
    SUFFIX = "suffix"


class AutoscalingMode(enum.StrEnum):
    """``autoscaling.mode``: who scales."""

    NONE = "none"
    OPERATOR = "operator"
    HPA = "hpa"


class MetricsSource(enum.StrEnum):
    """``autoscaling.metrics.source``."""

    PODS = "pods"
    PROMETHEUS = "prometheus"


class RolloutStrategy(enum.StrEnum):
    AVAILABILITY = "Availability"
    RESOURCE_AWARE = "ResourceAware"


class FailureMode(enum.StrEnum):
    """``router.inferencePool.endpointPickerRef.failureMode``."""

    FAIL_OPEN = "FailOpen"
    FAIL_CLOSE = "FailClose"


class ConditionStatus(enum.StrEnum):
    TRUE = "True"
    FALSE = "False"
    UNKNOWN = "Unknown"


def values(enum_cls: type[enum.Enum]) -> list[str]:
    """The members' values in declaration order (a schema's ``"enum"`` list)."""
    return [m.value for m in enum_cls]


__all__ = ["AutoscalingMode", "ConditionStatus", "Dtype", "FailureMode", "ImagePullPolicy", "KVCacheDtype",
           "KVTierType", "MetricsSource", "Quantization", "RolloutStrategy", "RouterAlgorithm", "SchedulingPolicy",
           "SpeculativeMethod", "values"]
