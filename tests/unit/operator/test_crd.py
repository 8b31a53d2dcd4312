"""The InferenceService CRD: generated file in sync, structural, validates the examples,
rejects bad specs through the OpenAPI schema (jsonschema) and the CEL rules (cel-python)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from support.crd_admission import CEL_ENV, admit, cel_errors, schema_errors
from support.paths import ROOT

from kvfleet.operator import crd, crd_schema

EXAMPLES = sorted((ROOT / "examples").glob("inferenceservice-*.yaml"))
K8S_VERSION = "1.30.0"


def load(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


# --------------------------------------------------------------------- the file


def test_generated_crd_files_are_in_sync():
    for rel, text in crd.rendered_files().items():
        assert (ROOT / rel).read_text() == text, f"{rel} drifted: run `python -m kvfleet.operator.crd`"
    assert crd.main(["--check"]) == 0


def test_check_detects_drift(tmp_path):
    assert crd.main([f"--root={tmp_path}", "--help"]) == 0 and not any(tmp_path.iterdir())  # writes nothing
    assert crd.main([f"--root={tmp_path}", "--chek"]) == 2 and not any(tmp_path.iterdir())
    assert crd.main([f"--root={tmp_path}", "--check"]) == 1
    assert crd.main([f"--root={tmp_path}"]) == 0
    assert crd.main([f"--root={tmp_path}", "--check"]) == 0
    f = tmp_path / f"crds/{crd.CRD_NAME}.yaml"
    f.write_text(f.read_text().replace("kis", "isvc"))
    assert crd.main([f"--root={tmp_path}", "--check"]) == 1


def test_crd_validates_against_the_kubernetes_schema():
    doc = load(ROOT / f"crds/{crd.CRD_NAME}.yaml")
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    for peering in yaml.safe_load_all((ROOT / "crds/kopf-peering.yaml").read_text()):
        kubernetes_validate.validate(peering, K8S_VERSION, strict=True)


def test_crd_shape():
    doc = crd.crd()
    assert doc["metadata"]["name"] == "inferenceservices.kvfleet.io"
    spec = doc["spec"]
    assert spec["scope"] == "Namespaced" and spec["group"] == "kvfleet.io"
    assert "isvc" not in spec["names"]["shortNames"] and "kis" in spec["names"]["shortNames"]
    (version,) = spec["versions"]
    assert version["name"] == "v1alpha1"
    assert version["subresources"]["status"] == {}
    assert version["subresources"]["scale"] == {"specReplicasPath": ".spec.replicas",
                                                 "statusReplicasPath": ".status.replicas",
                                                 "labelSelectorPath": ".status.selector"}
    assert [c["name"] for c in version["additionalPrinterColumns"]] == ["Model", "Replicas", "Ready", "Reason", "URL",
                                                                            "Age"]
    s = version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    assert set(s["autoscaling"]["properties"]) >= {"mode", "minReplicas", "maxReplicas", "targetQueueDepth",
                                                   "targetKVCacheUsage", "scaleUp", "scaleDown"}
    assert s["autoscaling"]["properties"]["mode"]["enum"] == ["none", "operator", "hpa"]
    assert set(s["tuning"]["properties"]) >= {"enabled", "gpuMemoryUtilization", "blockSizes", "minIntervalSeconds"}
    assert set(s["engine"]["properties"]) >= {"blockSize", "gpuMemoryUtilization", "maxNumSeqs",
                                              "maxNumBatchedTokens", "maxModelLen", "enablePrefixCaching",
                                              "schedulingPolicy", "dtype", "tensorParallelSize", "extraArgs",
                                              "quantization", "enforceEager", "kvCacheDtype"}
    assert s["engine"]["properties"]["quantization"]["enum"] == ["int8", "int4"]
    assert s["engine"]["properties"]["kvCacheDtype"]["enum"] == ["auto", "float32", "bfloat16"]
    assert s["engine"]["properties"]["enforceEager"]["type"] == "boolean"


def _structural_violations(schema: dict[str, Any], path: str = "") -> list[str]:
    """Kubernetes' structural-schema rule: every field and item node has a type, except
    int-or-string and preserve-unknown-fields nodes."""
    out = []
    exempt = schema.get("x-kubernetes-int-or-string") or schema.get("x-kubernetes-preserve-unknown-fields")
    if "type" not in schema and not exempt:
        out.append(path or "<root>")
    for key, sub in schema.get("properties", {}).items():
        out += _structural_violations(sub, f"{path}.{key}")
    if isinstance(schema.get("additionalProperties"), dict):
        out += _structural_violations(schema["additionalProperties"], f"{path}.*")
    if isinstance(schema.get("items"), dict):
        out += _structural_violations(schema["items"], f"{path}[]")
    for branch in schema.get("anyOf", []):  # branches must not set anything but validation
        assert set(branch) <= {"type"}, (path, branch)
    return out


def test_schema_is_structural():
    assert _structural_violations(crd_schema.OPENAPI_SCHEMA) == []


# --------------------------------------------------------------------- admission


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_examples_are_admitted(path):
    assert admit(load(path)) == []


def test_there_are_three_examples():
    stems = {p.stem for p in EXAMPLES}
    assert {"inferenceservice-minimal", "inferenceservice-autoscaled", "inferenceservice-gpu-tp2"} <= stems
    gpu = load(ROOT / "examples/inferenceservice-gpu-tp2.yaml")
    assert gpu["spec"]["engine"]["tensorParallelSize"] == 2


def _minimal() -> dict[str, Any]:
    return load(ROOT / "examples/inferenceservice-minimal.yaml")


def _with(path: str, value: Any) -> dict[str, Any]:
    obj = _minimal()
    node = obj
    *parents, last = path.split(".")
    for p in parents:
        node = node.setdefault(p, {})
    node[last] = value
    return obj


BAD_BY_CEL_AND_SCHEMA = [
    ("spec.engine.blockSize", 7, "blockSize must be one of"),
    ("spec.engine.gpuMemoryUtilization", 1.5, "gpuMemoryUtilization must be in (0, 1]"),
    ("spec.engine.gpuMemoryUtilization", 0, "gpuMemoryUtilization must be in (0, 1]"),
    ("spec.model.uri", "s3://bucket/model", "model.uri must use one of the schemes"),
]


@pytest.mark.parametrize("path,value,message", BAD_BY_CEL_AND_SCHEMA)
def test_bad_values_are_rejected_by_cel_and_by_schema(path, value, message):
    obj = crd.apply_defaults(_with(path, value))
    cel = cel_errors(obj, crd_schema.OPENAPI_SCHEMA)
    assert any(message in e for e in cel), cel
    assert schema_errors(obj), "the OpenAPI schema should reject it too"


def test_min_replicas_above_max_is_rejected_by_cel():
    obj = _with("spec.autoscaling", {"mode": "operator", "minReplicas": 5, "maxReplicas": 2})
    errors = admit(obj)
    assert any("minReplicas must be <= maxReplicas" in e for e in errors), errors
    # jsonschema alone cannot compare two fields: the CEL rule is what catches it.
    assert schema_errors(crd.apply_defaults(obj)) == []
    ok = _with("spec.autoscaling", {"mode": "operator", "minReplicas": 2, "maxReplicas": 2})
    assert admit(ok) == []


@pytest.mark.parametrize("obj,message", [
    (_with("spec.autoscaling", {"mode": "hpa"}), "maxReplicas is required"),
    (_with("spec.disruption", {"minAvailable": 1, "maxUnavailable": 1}), "at most one"),
    (_with("spec.tuning", {"enabled": True, "gpuMemoryUtilization": {"min": 0.9, "max": 0.8}}), "min must be <= max"),
])
def test_other_cel_rules(obj, message):
    assert any(message in e for e in admit(obj)), admit(obj)


@pytest.mark.parametrize("uri", [
    "hf://org/name/file.gguf", "hf://org/name/Q4_K_M/file.gguf@main", "hf://org/name/a/b/file-00001-of-00002.gguf",
])
def test_a_gguf_file_of_a_repository_is_admitted_in_any_folder(uri):
    """llama.cpp publishers put quantizations in subfolders: hf://ORG/NAME/FOLDER/FILE.gguf is admitted."""
    assert admit(_with("spec.model.uri", uri)) == []


@pytest.mark.parametrize("obj", [
    _with("spec.model.uri", "hf://org/name/sub/not-gguf.bin"),
    _with("spec.model.uri", "hf://org/name/sub//file.gguf"),
    _with("spec.autoscaling", {"mode": "sometimes", "maxReplicas": 2}),
    _with("spec.rollout", {"strategy": "Yolo"}),
    _with("spec.engine.tensorParallelSize", 0),
    _with("spec.engine.quantization", "awq"),
    _with("spec.engine.enforceEager", "yes"),
    _with("spec.replicas", -1),
    _with("spec.runtime", {"resources": {"memory": "lots"}}),
    _with("spec.model.uri", "hf://just-a-name"),
    _with("spec.model.uri", "hf://org/name/extra"),
    {"apiVersion": "kvfleet.io/v1alpha1", "kind": "InferenceService", "metadata": {"name": "x"}, "spec": {}},
])
def test_schema_rejects(obj):
    assert schema_errors(crd.apply_defaults(obj)), obj


def test_defaults_follow_api_server_rules():
    obj = crd.apply_defaults(_minimal())
    assert obj["spec"]["replicas"] == 1
    assert "engine" not in obj["spec"]  # absent parents are not invented
    obj = crd.apply_defaults(_with("spec.engine", {}))
    assert obj["spec"]["engine"] == {"blockSize": 16, "gpuMemoryUtilization": 0.9, "tensorParallelSize": 1}
    obj = crd.apply_defaults(_with("spec.autoscaling", {"mode": "operator", "maxReplicas": 3}))
    assert obj["spec"]["autoscaling"]["minReplicas"] == 1
    assert obj["spec"]["autoscaling"]["targetQueueDepth"] == 4


def _all_rules(schema: dict[str, Any]) -> list[str]:
    rules = [r["rule"] for r in schema.get("x-kubernetes-validations", [])]
    for sub in schema.get("properties", {}).values():
        rules += _all_rules(sub)
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            rules += _all_rules(schema[key])
    return rules


def test_every_cel_rule_compiles_and_has_a_message():
    rules = _all_rules(crd_schema.OPENAPI_SCHEMA)
    assert len(rules) == 11 + 2 * 5  # uri scheme, blockSize, gpuMemoryUtilization, 3 kvCache tiers, 2 autoscaling,
    # tuning, disruption, parallelism; the engine's 5 again in each disaggregation pool's engine
    for rule in rules:
        CEL_ENV.compile(rule)  # raises on a syntax error

    def messages(schema):
        out = [("message" in r) for r in schema.get("x-kubernetes-validations", [])]
        for sub in schema.get("properties", {}).values():
            out += messages(sub)
        return out
    assert all(messages(crd_schema.OPENAPI_SCHEMA))
