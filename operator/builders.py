"""Pure builders: an InferenceService dict in, its children (Kubernetes object dicts) out.

No API calls, no clocks, no randomness: the same input gives the same output, so the
children are tested exhaustively without a cluster (``tests/data/golden/``).
:func:`desired_children` gives every child of InferenceService ``NAME`` (namespace ``NS``),
each with a controller ownerReference to it and the labels of
:func:`kvfleet.operator.service_spec.labels`:

- ConfigMap ``NAME-config``: ``config.yaml``, the runtime's engine config
  (:class:`kvfleet.runtime.config.EngineConfig` field names), and ``lora_modules`` when LoRA
  adapters are declared (:mod:`kvfleet.operator.adapters`; not in the config hash);
- Service ``NAME`` (port 8000, ``http``) and Deployment ``NAME`` (the runtime pods; the pod
  template carries the config hash, so a config change rolls them), or with
  ``spec.parallelism.nodes > 1`` LeaderWorkerSet ``NAME`` (:mod:`kvfleet.operator.lws`: a group
  of pods per replica; the Service and the HPA then target the groups' leaders);
- PodDisruptionBudget ``NAME`` (``spec.disruption``; ``maxUnavailable: 1`` when it sets neither field), and
  HorizontalPodAutoscaler ``NAME`` in ``spec.autoscaling.mode: hpa``.

The Deployment is built in :mod:`kvfleet.operator.deployment`; what every child is built from
(the effective spec, names, labels, the pod's port and paths) is :mod:`kvfleet.operator.service_spec`.
A spec that cannot be built raises :class:`InvalidSpec`. The status is :mod:`kvfleet.operator.status`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Iterable, Mapping
from typing import Any

import yaml

from kvfleet.operator import adapters, disagg, hpa, kv_tiers, lws, parallelism, router, spec_view
from kvfleet.operator.crd import InvalidSpec
from kvfleet.operator.deployment import build_deployment
from kvfleet.operator.service_spec import (
    CONFIG_FILE,
    PORT,
    child_meta,
    names,
    selector_labels,
)
from kvfleet.operator.spec_enums import AutoscalingMode
from kvfleet.operator.weights import model_path_in_pod, parse_model_uri

ENGINE_SECTIONS = ("speculative", "kv_cache", "extra_args")
"""Fields of the view's ``spec.engine`` with a translation of their own (``speculative_config``,
:mod:`kvfleet.operator.kv_tiers`, the config file's other keys)."""
ENGINE_KEYS = tuple(f.name for f in dataclasses.fields(spec_view.Engine) if f.name not in ENGINE_SECTIONS)
"""Every other field of ``spec.engine``, written to the config file under its own (snake_case)
name: the runtime's EngineConfig field of that name. A new scalar engine field of the CRD needs no
line here (tests/unit/operator/test_engine_config.py checks that the runtime knows each)."""

SERVER_CONFIG_KEYS = ("engine_iteration_timeout", "log_level", "max_queue_len", "max_request_body_size",
                      "metrics_compat", "shutdown_timeout", "termination_log", "tool_call_parser",
                      "enable_auto_tool_choice", "allow_runtime_lora_updating", "pooler_config",
                      "max_stored_responses", "drain_handoff_grace", "chat_template",
                      "return_tokens_as_token_ids")
"""``kvfleet serve`` server options (``ServerSettings``) that ``engine.extraArgs`` may set in the
config file: all but ``host``, ``port`` (the pod's) and ``api_key`` (``apiKeySecretRef``)."""

DRAIN_HANDOFF_GRACE_SECONDS = 2
"""``drain_handoff_grace`` written for a service behind its router (``extraArgs`` may set another):
the runtime's default (``serve_args.DEFAULT_DRAIN_HANDOFF_GRACE``), written out so a pod's config
says what its drain does."""

TUNABLE_ENGINE_KEYS = ("blockSize", "gpuMemoryUtilization")
"""``status.engine`` keys the tuner (spec.tuning) may set; they override spec.engine."""


# ---------------------------------------------------------------------------------
# the engine config (ConfigMap)


def effective_engine(isvc: Mapping[str, Any], spec: spec_view.Spec | None = None) -> spec_view.Engine:
    """The view's ``spec.engine`` overlaid with the tuner's ``status.engine`` values for
    :data:`TUNABLE_ENGINE_KEYS` when ``spec.tuning.enabled``."""
    spec = spec_view.of(isvc) if spec is None else spec
    if not spec.tuning.enabled:
        return spec.engine
    tuned = (isvc.get("status") or {}).get("engine") or {}
    return dataclasses.replace(spec.engine, **{spec_view.snake(k): tuned[k] for k in TUNABLE_ENGINE_KEYS
                                               if tuned.get(k) is not None})


def engine_config(isvc: Mapping[str, Any], *, known_keys: Iterable[str] | None = None,
                  spec: spec_view.Spec | None = None) -> dict[str, Any]:
    """The runtime's config-file content: EngineConfig field names -> values.

    Only keys the user set (or the CRD defaults) are written; the runtime's own defaults
    cover the rest. ``tensor_parallel_size`` is written only when above 1 and when the
    runtime knows the key.

    Args:
        known_keys: the runtime's accepted keys (default: ``EngineConfig.model_fields`` and
            :data:`SERVER_CONFIG_KEYS`); extraArgs keys outside it raise.
        spec: the reconcile's view of ``isvc``'s spec (default: built here).

    Raises:
        InvalidSpec: an ``engine.extraArgs`` key the runtime does not know
            (reason ``UnknownEngineArg``), or an extraArgs key that shadows a typed field.
    """
    spec = spec_view.of(isvc) if spec is None else spec
    engine = effective_engine(isvc, spec)
    known = set(_engine_config_fields() if known_keys is None else known_keys)
    model = parse_model_uri(spec.model.uri)
    config: dict[str, Any] = {"model": model_path_in_pod(model)}
    served = spec.model.served_model_name or (model["repo"] if model["scheme"] == "hf" else isvc["metadata"]["name"])
    config["served_model_name"] = served
    config.update(adapters.engine_keys(spec))  # LoRA adapters: see kvfleet.operator.adapters
    # spec.engine.kvCache.tiers and the KV events precise routing reads: see kvfleet.operator.kv_tiers
    split = parallelism.parallelism(spec)  # spec.parallelism: tensor x pipeline ranks over nodes
    tiers_engine = dataclasses.replace(engine, tensor_parallel_size=split.world)  # any split: no KV tier
    config.update(kv_tiers.engine_keys(tiers_engine, kv_events=router.precise(spec)))
    for key in ENGINE_KEYS:
        value = getattr(engine, key)
        if value is None:
            continue
        if key == "tensor_parallel_size" and (int(value) <= 1 or key not in known):
            continue  # GPUs and /dev/shm still follow it; the runtime may not take the key yet
        config[key] = value
    config.update(parallelism.engine_keys(spec, known))
    if engine.speculative is not None:
        config["speculative_config"] = speculative_config(engine.speculative)
    extra = engine.extra_args or {}
    if spec.router.enabled and "drain_handoff_grace" not in extra:
        config["drain_handoff_grace"] = DRAIN_HANDOFF_GRACE_SECONDS  # the router's streams move on at a roll
    for key, value in sorted(extra.items()):
        if key in config:
            raise InvalidSpec("ConflictingEngineArg",
                              f"engine.extraArgs.{key} duplicates a typed engine field; set that field instead")
        if key not in known:
            raise InvalidSpec("UnknownEngineArg", f"engine.extraArgs.{key} is not a runtime config key "
                                                  f"(known: {', '.join(sorted(known))})")
        config[key] = value
    for key in list(config):
        if key not in known:
            raise InvalidSpec("UnknownEngineArg", f"the runtime does not accept {key!r}")
    return config


def speculative_config(spec: spec_view.Speculative) -> dict[str, Any]:
    """``spec.engine.speculative`` as ``--speculative-config``'s object (vLLM's snake_case
    fields: the view's names; the fields set), checked as the runtime checks it.

    Raises:
        InvalidSpec: a value the runtime would refuse (reason ``InvalidSpeculativeConfig``)."""
    from pydantic import ValidationError

    from kvfleet.runtime.spec_decode.config import SpeculativeConfig  # pydantic only, no torch

    out = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec) if getattr(spec, f.name) is not None}
    try:
        SpeculativeConfig.model_validate(out)
    except ValidationError as exc:
        msg = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'speculative'}: {e['msg']}" for e in exc.errors())
        raise InvalidSpec("InvalidSpeculativeConfig", f"engine.speculative: {msg}") from None
    return out


def _engine_config_fields() -> list[str]:
    """Every key ``kvfleet serve --config`` accepts that the operator does not set itself."""
    from kvfleet.runtime.config import EngineConfig  # pydantic only, no torch

    return [*EngineConfig.model_fields, *SERVER_CONFIG_KEYS]


def config_text(config: Mapping[str, Any]) -> str:
    """The config file as YAML (keys sorted, so the hash is stable)."""
    return yaml.safe_dump(dict(config), sort_keys=True, default_flow_style=False)


def content_hash(data: Any) -> str:
    """First 16 hex digits of the SHA-256 of the canonical JSON of ``data``."""
    return hashlib.sha256(json.dumps(data, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


def build_configmap(isvc: Mapping[str, Any], spec: spec_view.Spec | None = None) -> dict[str, Any]:
    """The ConfigMap holding ``config.yaml`` (and, with LoRA adapters declared, their list under
    ``lora_modules``: :mod:`kvfleet.operator.adapters`)."""
    spec = spec_view.of(isvc) if spec is None else spec
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": child_meta(isvc, names(isvc)["configmap"]),
            "data": {CONFIG_FILE: config_text(engine_config(isvc, spec=spec)), **adapters.configmap_data(spec)}}


# ---------------------------------------------------------------------------------
# the other children


def build_service(isvc: Mapping[str, Any]) -> dict[str, Any]:
    """The ClusterIP Service in front of the runtime pods (port 8000, ``http``)."""
    return {"apiVersion": "v1", "kind": "Service", "metadata": child_meta(isvc, names(isvc)["service"]),
            "spec": {"type": "ClusterIP", "selector": selector_labels(isvc),
                     "ports": [{"name": "http", "port": PORT, "targetPort": "http", "protocol": "TCP",
                                "appProtocol": "http"}]}}


def build_pdb(isvc: Mapping[str, Any], spec: spec_view.Spec | None = None) -> dict[str, Any] | None:
    """The PodDisruptionBudget: ``spec.disruption``'s field, else ``maxUnavailable: 1`` (voluntary
    disruptions take one replica at a time; with one replica a drain still proceeds)."""
    dis = (spec_view.of(isvc) if spec is None else spec).disruption
    body: dict[str, Any] = {"selector": {"matchLabels": selector_labels(isvc)}}
    if dis.min_available is not None:
        body["minAvailable"] = dis.min_available
    else:
        body["maxUnavailable"] = dis.max_unavailable if dis.max_unavailable is not None else 1
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": child_meta(isvc, names(isvc)["pdb"]), "spec": body}


def build_hpa(isvc: Mapping[str, Any], spec: spec_view.Spec | None = None) -> dict[str, Any] | None:
    """The HorizontalPodAutoscaler (:func:`hpa.build_hpa`'s spec) in mode ``hpa``, else None.

    Raises:
        InvalidSpec: an invalid ``spec.autoscaling`` (reason ``InvalidAutoscaling``).
    """
    spec = spec_view.of(isvc) if spec is None else spec
    if spec.autoscaling.mode != AutoscalingMode.HPA:
        return None
    try:
        built = hpa.build_hpa(isvc, spec=spec)
    except ValueError as e:
        raise InvalidSpec("InvalidAutoscaling", str(e)) from None
    return {"apiVersion": built["apiVersion"], "kind": built["kind"], "metadata": child_meta(isvc, names(isvc)["hpa"]),
            "spec": built["spec"]}


def desired_children(isvc: Mapping[str, Any], *, replicas: int | None = None,
                     scaled_externally: bool = False, spec: spec_view.Spec | None = None) -> list[dict[str, Any]]:
    """Every child the InferenceService should have, in apply order: ConfigMap, Service,
    Deployment, then the PodDisruptionBudget and the HorizontalPodAutoscaler when asked.

    Args:
        isvc: the InferenceService as a dict (``metadata.name``, ``metadata.uid`` required).
        replicas: override of ``spec.replicas`` for the Deployment, pods.
        scaled_externally: see :func:`kvfleet.operator.deployment.build_deployment`.
        spec: the reconcile's view of ``isvc``'s spec (:func:`kvfleet.operator.spec_view.of`;
            default: built here, once for every child).

    Raises:
        InvalidSpec: the spec cannot be built (reason and message for a Degraded condition).
    """
    if disagg.disaggregation(isvc) is not None:  # two pools: spec.disaggregation (kvfleet.operator.disagg)
        return disagg.desired_children(isvc, desired_children, replicas=replicas, scaled_externally=scaled_externally)
    spec = spec_view.of(isvc) if spec is None else spec
    cm = build_configmap(isvc, spec)
    config_hash = content_hash(adapters.hashed_data(cm["data"]))  # the LoRA adapter list never rolls pods
    if parallelism.parallelism(spec).multi_node:  # parallelism.nodes > 1: groups of pods, see kvfleet.operator.lws
        hpa_child = build_hpa(isvc, spec)
        return [cm, lws.leaders_only(build_service(isvc)),
                lws.build_leader_worker_set(isvc, config_hash=config_hash, replicas=replicas,
                                            scaled_externally=scaled_externally, spec=spec),
                *[c for c in (build_pdb(isvc, spec), hpa_child and lws.hpa_target(hpa_child)) if c is not None]]
    children = [cm, build_service(isvc), build_deployment(isvc, config_hash=config_hash, replicas=replicas,
                                                          scaled_externally=scaled_externally, spec=spec)]
    children += [c for c in (build_pdb(isvc, spec), build_hpa(isvc, spec)) if c is not None]
    return children


def model_claim(isvc: Mapping[str, Any], spec: spec_view.Spec | None = None) -> str | None:
    """The PersistentVolumeClaim the model volume mounts (``download.claimName`` of an
    ``hf://`` model, the claim of a ``pvc://`` one), or None."""
    try:
        spec = spec_view.of(isvc) if spec is None else spec
        model = parse_model_uri(spec.model.uri)
    except (InvalidSpec, KeyError, TypeError, AttributeError):
        return None
    if model["scheme"] == "pvc":
        return model["claim"]
    return spec.model.download.claim_name if model["scheme"] == "hf" else None
