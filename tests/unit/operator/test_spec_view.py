"""The typed view of the InferenceService spec (kvfleet.operator.spec_view): generated from the
CRD's schema, the schema's defaults in it, absent optional sections None, read-only, built from
a copy; and the enums (spec_enums) the schema's enum lists come from."""

from __future__ import annotations

import copy
import dataclasses

import pytest

from kvfleet.operator import builders, crd_schema, spec_enums, spec_view

ISVC = {"apiVersion": "kvfleet.io/v1alpha1", "kind": "InferenceService",
        "metadata": {"name": "chat", "namespace": "llm", "uid": "u-1"},
        "spec": {"model": {"uri": "hf://org/name"}}}


def _objects(schema, path=()):
    """(path, object schema) of every object with properties in ``schema``, items included."""
    if schema.get("type") == "object" and schema.get("properties"):
        yield path, schema
        for prop, sub in schema["properties"].items():
            yield from _objects(sub, (*path, prop))
    elif schema.get("type") == "array" and isinstance(schema.get("items"), dict):
        yield from _objects(schema["items"], (*path, "[]"))


def test_snake_case_names():
    assert spec_view.snake("kvCacheDtype") == "kv_cache_dtype"
    assert spec_view.snake("targetKVCacheUsage") == "target_kv_cache_usage"
    assert spec_view.snake("hfTokenSecretRef") == "hf_token_secret_ref"
    assert spec_view.snake("prometheusUrl") == "prometheus_url"
    assert spec_view.snake("uri") == "uri"


def test_every_schema_property_is_a_field_of_the_view():
    classes = {id(cls._schema): cls for cls in spec_view.ALL_CLASSES}
    n = 0
    for path, schema in _objects(crd_schema.SPEC):
        cls = classes[id(schema)]
        assert [f.name for f in dataclasses.fields(cls)] == [spec_view.snake(p) for p in schema["properties"]], path
        n += len(schema["properties"])
    assert n > 80


def test_defaults_come_from_the_schema():
    view = spec_view.of(ISVC)
    checked = 0
    for path in spec_view.ALWAYS_PRESENT:
        schema = crd_schema.SPEC
        node = view
        for key in path.split("."):
            schema = schema["properties"][key]
            node = getattr(node, spec_view.snake(key))
        for prop, sub in schema["properties"].items():
            if "default" in sub:
                value = getattr(node, spec_view.snake(prop))
                want = sub["default"]
                if isinstance(want, list) and want and isinstance(want[0], dict):
                    assert [dataclasses.asdict(v) for v in value] == [
                        {spec_view.snake(k): w.get(k) for k in sub["items"]["properties"]} for w in want]
                else:
                    assert value == (tuple(want) if isinstance(want, list) else want), (path, prop)
                checked += 1
    assert checked >= 25
    assert view.engine.block_size == 16 and view.router.algorithm == "precise-prefix-cache"
    assert view.model.download.allow_patterns == crd_schema.DEFAULT_ALLOW_PATTERNS
    assert view.runtime.image == crd_schema.DEFAULT_IMAGE and view.replicas == 1


def test_absent_optional_sections_are_none_and_declared_empty_lists_are_not():
    view = spec_view.of(ISVC)
    assert view.engine.speculative is None and view.engine.kv_cache is None
    assert view.model.adapters is None and view.runtime.api_key_secret_ref is None
    assert view.engine.max_num_seqs is None and view.autoscaling.max_replicas is None
    declared = copy.deepcopy(ISVC)
    declared["spec"]["model"]["adapters"] = []
    declared["spec"]["engine"] = {"kvCache": {}, "speculative": {"numSpeculativeTokens": 3},
                                  "extraArgs": {"max_queue_len": 4}}
    declared["spec"]["runtime"] = {"apiKeySecretRef": {"name": "k"}}
    view = spec_view.of(declared)
    assert view.model.adapters == ()
    assert [t.type for t in view.engine.kv_cache.tiers] == [spec_enums.KVTierType.PEER]  # the CRD's default
    assert (view.engine.speculative.method, view.engine.speculative.num_speculative_tokens) == ("ngram", 3)
    assert (view.runtime.api_key_secret_ref.name, view.runtime.api_key_secret_ref.key) == ("k", "api-key")
    assert view.engine.extra_args == {"max_queue_len": 4}


def test_read_only_and_built_from_a_copy():
    isvc = copy.deepcopy(ISVC)
    isvc["spec"]["engine"] = {"extraArgs": {"log_level": "info"}}
    isvc["spec"]["runtime"] = {"env": [{"name": "A", "value": "1"}]}
    before = copy.deepcopy(isvc)
    view = spec_view.of(isvc)
    with pytest.raises(dataclasses.FrozenInstanceError):
        view.engine.block_size = 32
    view.engine.extra_args["log_level"] = "debug"
    view.runtime.env[0]["value"] = "2"
    assert isvc == before  # neither building the view nor changing its plain values touches the resource
    assert spec_view.of(isvc).engine.extra_args == {"log_level": "info"}


def test_the_dict_form_is_the_same_spec():
    isvc = copy.deepcopy(ISVC)
    isvc["spec"]["autoscaling"] = {"mode": "operator", "maxReplicas": 3}
    d = spec_view.effective_dict(isvc)
    view = spec_view.of(isvc)
    assert d["autoscaling"]["scaleDown"]["stabilizationWindowSeconds"] == view.autoscaling.scale_down.stabilization_window_seconds
    assert d["autoscaling"]["maxReplicas"] == view.autoscaling.max_replicas == 3
    assert "spec" not in isvc["spec"] and "engine" not in isvc["spec"]


def test_a_new_schema_field_is_in_the_view_with_its_default():
    # A field added to crd_schema needs no line in spec_view (the issue's "files touched by a new field").
    schema = copy.deepcopy(crd_schema.ROUTER)
    schema["properties"]["warmupSeconds"] = {"type": "integer", "default": 7}
    view = spec_view.section(schema, {"replicas": 3})
    assert (view.warmup_seconds, view.replicas, view.algorithm) == (7, 3, "precise-prefix-cache")
    assert spec_view.section(crd_schema.ROUTER, None).enabled is True
    # a spec section given alone gets the objects of()'s view always has, as in of()
    auto = spec_view.section(crd_schema.AUTOSCALING, {"mode": "operator"})
    assert auto == spec_view.of({"spec": {"autoscaling": {"mode": "operator"}}}).autoscaling
    assert auto.scale_down.stabilization_window_seconds == 300
    tier = crd_schema.KV_CACHE["properties"]["tiers"]["items"]
    assert spec_view.section(tier, {"type": "disk", "size": "1Gi"}).size == "1Gi"


def test_the_schema_enums_are_the_declared_constants():
    schema_enums = {
        ("runtime", "imagePullPolicy"): spec_enums.ImagePullPolicy,
        ("engine", "schedulingPolicy"): spec_enums.SchedulingPolicy,
        ("engine", "dtype"): spec_enums.Dtype,
        ("engine", "kvCacheDtype"): spec_enums.KVCacheDtype,
        ("engine", "quantization"): spec_enums.Quantization,
        ("autoscaling", "mode"): spec_enums.AutoscalingMode,
        ("rollout", "strategy"): spec_enums.RolloutStrategy,
        ("router", "algorithm"): spec_enums.RouterAlgorithm,
    }
    for (section, prop), enum_cls in schema_enums.items():
        assert crd_schema.SPEC["properties"][section]["properties"][prop]["enum"] == spec_enums.values(enum_cls)
    tiers = crd_schema.KV_CACHE["properties"]["tiers"]["items"]["properties"]["type"]
    assert tiers["enum"] == spec_enums.values(spec_enums.KVTierType)
    assert spec_enums.AutoscalingMode.HPA == "hpa" and f"{spec_enums.AutoscalingMode.HPA}" == "hpa"


def test_one_view_of_the_spec_per_build(monkeypatch):
    """desired_children builds the typed view once and hands it down; given one, it builds none
    (the reconcile passes the view it built)."""
    isvc = copy.deepcopy(ISVC)
    isvc["spec"].update(autoscaling={"mode": "hpa", "maxReplicas": 3},
                        engine={"kvCache": {"tiers": [{"type": "peer"}, {"type": "disk", "size": "1Gi"}]}})
    view = spec_view.of(isvc)
    calls = []
    real = spec_view.of
    monkeypatch.setattr(spec_view, "of", lambda obj: calls.append(1) or real(obj))
    built = builders.desired_children(isvc)
    assert len(calls) == 1
    assert builders.desired_children(isvc, spec=view) == built and len(calls) == 1
