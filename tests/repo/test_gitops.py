"""GitOps readiness: the Argo CD health check (Lua, run with lupa's Lua 5.1 like Argo CD's
gopher-lua) on sample statuses and on statuses the operator's own status builder produces;
the kustomize example rendered by the real `kubectl kustomize`; the snippets in
docs/gitops.md (argocd-cm, ignoreDifferences, Flux) parse and match the shipped files."""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from support.paths import ROOT

LUA_FILE = ROOT / "charts" / "kvfleet" / "files" / "argocd-health.lua"
KUSTOMIZE = ROOT / "examples" / "kustomize"
GITOPS_DOC = ROOT / "docs" / "gitops.md"
NOW = "2026-01-01T00:00:00Z"


def argocd_health(obj: dict) -> dict:
    """Run the health script the way Argo CD does: the object as the global `obj`, the
    chunk's return value is {status, message}."""
    import lupa.lua51

    lua = lupa.lua51.LuaRuntime(unpack_returned_tuples=True)
    lua.globals().obj = lua.table_from(copy.deepcopy(obj), recursive=True)
    result = lua.execute(LUA_FILE.read_text())
    return {"status": result["status"], "message": result["message"]}


def isvc(generation=2, status=None) -> dict:
    obj = {"apiVersion": "kvfleet.io/v1alpha1", "kind": "InferenceService",
           "metadata": {"name": "chat", "namespace": "llm", "generation": generation,
                        "uid": "0b8e5a2c-7f0e-4c71-9d51-3c1f6f0f1a11"},
           "spec": {"model": {"uri": "hf://HuggingFaceTB/SmolLM2-135M-Instruct"}, "replicas": 2}}
    if status is not None:
        obj["status"] = status
    return obj


def cond(type_, status, reason="R", message="", observed=None):
    c = {"type": type_, "status": status, "reason": reason, "message": message, "lastTransitionTime": NOW}
    if observed is not None:
        c["observedGeneration"] = observed
    return c


SAMPLES = [
    ("no status yet", isvc(status=None), "Progressing", "Waiting for the kvfleet operator"),
    ("status without conditions", isvc(status={"replicas": 0}), "Progressing", "Waiting"),
    ("ready for the current generation",
     isvc(2, {"observedGeneration": 2, "conditions": [cond("Ready", "True", "RolledOut", "2/2 replicas available"),
                                                       cond("Progressing", "False"), cond("Degraded", "False")]}),
     "Healthy", "RolledOut: 2/2 replicas available"),
    ("ready, but for the previous generation",
     isvc(3, {"observedGeneration": 2, "conditions": [cond("Ready", "True"), cond("Degraded", "False")]}),
     "Progressing", "observe generation 3 (last observed: 2)"),
    ("ready, status generation current but the condition is stale",
     isvc(3, {"observedGeneration": 3, "conditions": [cond("Ready", "True", observed=2),
                                                       cond("Progressing", "True", "RollingOut", "1/2 updated",
                                                            observed=3)]}),
     "Progressing", "RollingOut: 1/2 updated"),
    ("rolling out",
     isvc(2, {"observedGeneration": 2, "conditions": [
         cond("Ready", "False", "RollingOut", "1/2 replicas updated"),
         cond("Progressing", "True", "RollingOut", "1/2 replicas updated"),
         cond("Degraded", "False", "AsExpected")]}),
     "Progressing", "RollingOut: 1/2 replicas updated"),
    ("degraded: missing secret",
     isvc(2, {"observedGeneration": 2, "conditions": [
         cond("Ready", "False", "SecretNotFound", "secret llm/key not found"),
         cond("Progressing", "False", "SecretNotFound"),
         cond("Degraded", "True", "SecretNotFound", "secret llm/key not found")]}),
     "Degraded", "SecretNotFound: secret llm/key not found"),
    ("degraded wins over a stale ready",
     isvc(2, {"observedGeneration": 2, "conditions": [cond("Ready", "True"), cond("Degraded", "True", "X", "boom")]}),
     "Degraded", "X: boom"),
    ("not ready, nothing else said",
     isvc(1, {"observedGeneration": 1, "conditions": [cond("Ready", "False", "Waiting")]}),
     "Progressing", "Waiting"),
    ("no generation (not from an API server)",
     {"metadata": {"name": "x"}, "status": {"conditions": [cond("Ready", "True", "RolledOut")]}},
     "Healthy", "RolledOut"),
]


@pytest.mark.parametrize("name,obj,status,message", SAMPLES, ids=[s[0] for s in SAMPLES])
def test_argocd_health_on_sample_statuses(name, obj, status, message):
    got = argocd_health(obj)
    assert got["status"] == status, got
    assert message in got["message"], got


def _deployment(replicas=2, updated=2, available=2, generation=1, observed=1, stalled=False, config_hash=None):
    conditions = []
    if stalled:
        conditions.append({"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded",
                           "message": 'ReplicaSet "chat-abc" has timed out progressing.'})
    dep = {"apiVersion": "apps/v1", "kind": "Deployment",
           "metadata": {"name": "chat", "namespace": "llm", "generation": generation},
           "spec": {"replicas": replicas, "template": {"metadata": {"annotations": {}}}},
           "status": {"observedGeneration": observed, "replicas": replicas, "updatedReplicas": updated,
                      "readyReplicas": available, "availableReplicas": available, "conditions": conditions}}
    return dep


@pytest.mark.parametrize("scenario,expected", [
    ("no deployment yet", "Progressing"),
    ("rolling out", "Progressing"),
    ("rolled out", "Healthy"),
    ("stalled", "Degraded"),
    ("invalid spec", "Degraded"),
    ("rolled out, then the spec changes", "Progressing"),
])
def test_argocd_health_on_statuses_from_the_operator(scenario, expected):
    """The statuses kvfleet.operator.status.desired_status writes, read by the Lua check."""
    from kvfleet.operator import builders, status

    obj = isvc(generation=1)
    desired = next(c for c in builders.desired_children(obj) if c["kind"] == "Deployment")
    live = copy.deepcopy(desired)
    live.setdefault("metadata", {})["generation"] = 1
    kwargs = {"deployment": None, "desired_deployment": desired, "now": NOW}
    if scenario == "rolling out":
        live["status"] = _deployment(updated=1, available=1)["status"]
        kwargs["deployment"] = live
    elif scenario in ("rolled out", "rolled out, then the spec changes"):
        live["status"] = _deployment()["status"]
        kwargs["deployment"] = live
    elif scenario == "stalled":
        live["status"] = _deployment(updated=1, available=1, stalled=True)["status"]
        kwargs["deployment"] = live
    elif scenario == "invalid spec":
        kwargs["error"] = builders.InvalidSpec("SecretNotFound", "secret llm/key does not exist")
    obj["status"] = status.desired_status(obj, **kwargs)
    if scenario == "rolled out, then the spec changes":
        assert argocd_health(obj)["status"] == "Healthy"
        obj["metadata"]["generation"] = 2  # the API server bumps it; the operator has not seen it yet
    got = argocd_health(obj)
    assert got["status"] == expected, (got, obj["status"])


# --- kustomize -------------------------------------------------------------------------

def kustomize(kubectl_bin: str, path: Path) -> list[dict]:
    proc = subprocess.run([kubectl_bin, "kustomize", str(path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def isvc_schema() -> dict:
    crd = yaml.safe_load((ROOT / "crds" / "inferenceservices.kvfleet.io.yaml").read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["storage"]]
    return version["schema"]["openAPIV3Schema"]


def validate(objs: list[dict]) -> None:
    for obj in objs:
        if obj["apiVersion"] == "kvfleet.io/v1alpha1":
            jsonschema.Draft4Validator(isvc_schema()).validate(obj)
        else:
            kubernetes_validate.validate(obj, "1.35.0", strict=True)


def test_kustomize_base(kubectl_bin):
    objs = kustomize(kubectl_bin, KUSTOMIZE / "base")
    validate(objs)
    (obj,) = objs
    assert obj["kind"] == "InferenceService" and obj["spec"]["autoscaling"]["mode"] == "operator"
    # Under autoscaling the manifest leaves spec.replicas to the operator (no GitOps drift).
    assert "replicas" not in obj["spec"]


def test_kustomize_production_overlay(kubectl_bin):
    objs = kustomize(kubectl_bin, KUSTOMIZE / "overlays" / "production")
    validate(objs)
    kinds = {o["kind"]: o for o in objs}
    assert set(kinds) == {"Namespace", "InferenceService"}
    obj = kinds["InferenceService"]
    assert obj["metadata"]["namespace"] == "llm-prod" == kinds["Namespace"]["metadata"]["name"]
    assert obj["metadata"]["labels"] == {"app.kubernetes.io/part-of": "chat", "environment": "production"}
    spec = obj["spec"]
    assert (spec["autoscaling"]["minReplicas"], spec["autoscaling"]["maxReplicas"]) == (2, 8)
    assert spec["runtime"]["resources"]["gpus"] == 1
    assert spec["model"]["uri"].startswith("pvc://")
    # Base fields the patch does not touch survive the strategic merge.
    assert spec["engine"]["enablePrefixCaching"] is True and spec["engine"]["blockSize"] == 16
    assert "replicas" not in spec


def test_kustomize_overlay_that_breaks_the_schema_is_caught(kubectl_bin, tmp_path):
    """The validation above can fail: an overlay setting a bad block size is rejected."""
    shutil.copytree(KUSTOMIZE / "base", tmp_path / "base")
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "resources": ["base"],
        "patches": [{"target": {"kind": "InferenceService"},
                     "patch": "- op: replace\n  path: /spec/engine/blockSize\n  value: 7\n"}]}))
    objs = kustomize(kubectl_bin, tmp_path)
    assert objs[0]["spec"]["engine"]["blockSize"] == 7
    with pytest.raises(jsonschema.ValidationError):
        validate(objs)


# --- docs/gitops.md snippets --------------------------------------------------------------

def yaml_blocks(text: str) -> list:
    return [yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", text, flags=re.S)]


def test_gitops_doc_ships_the_lua_health_check_verbatim():
    blocks = yaml_blocks(GITOPS_DOC.read_text())
    cms = [b for b in blocks if isinstance(b, dict) and b.get("kind") == "ConfigMap"
           and b["metadata"]["name"] == "argocd-cm"]
    assert cms, "docs/gitops.md has no argocd-cm snippet"
    lua = cms[0]["data"]["resource.customizations.health.kvfleet.io_InferenceService"]
    assert lua.strip() == LUA_FILE.read_text().strip()
    kubernetes_validate.validate(cms[0], "1.35.0", strict=True)


def test_gitops_doc_ignore_differences_cover_replicas():
    blocks = yaml_blocks(GITOPS_DOC.read_text())
    apps = [b for b in blocks if isinstance(b, dict) and b.get("kind") == "Application"]
    assert apps, "docs/gitops.md has no Argo CD Application snippet"
    spec = apps[0]["spec"]
    (ignore,) = [d for d in spec["ignoreDifferences"] if d.get("kind") == "InferenceService"]
    assert ignore["group"] == "kvfleet.io"
    assert "/spec/replicas" in ignore["jsonPointers"]
    # Without RespectIgnoreDifferences a sync would still write the git value back.
    assert "RespectIgnoreDifferences=true" in spec["syncPolicy"]["syncOptions"]
    flux = [b for b in blocks if isinstance(b, dict) and b.get("kind") == "HelmRelease"]
    assert flux, "docs/gitops.md has no Flux HelmRelease snippet"
    ignores = flux[0]["spec"]["driftDetection"]["ignore"]
    assert any("/spec/replicas" in i["paths"] and i["target"]["kind"] == "InferenceService" for i in ignores)
