"""Pure builders: children and status of an InferenceService, without a cluster.

Golden files under tests/data/golden/ show the children of every example; regenerate with
``KVFLEET_UPDATE_GOLDEN=1 pytest tests/unit/operator/test_builders.py``.
"""

from __future__ import annotations

import copy
import fnmatch
import os
import time
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from support.operator_objects import UID, by_kind, minimal, stored
from support.paths import GOLDEN, ROOT

from kvfleet.operator import builders, crd_schema, fetch, spec_view, status, weights
from kvfleet.operator.builders import InvalidSpec
from kvfleet.runtime.config import EngineConfig
from kvfleet.runtime.entrypoints.openai.serve_args import DEFAULT_DRAIN_HANDOFF_GRACE, ServerSettings

EXAMPLES = sorted((ROOT / "examples").glob("inferenceservice-*.yaml"))
K8S_VERSION = "1.30.0"


def pod_spec(isvc: dict[str, Any]) -> dict[str, Any]:
    return by_kind(builders.desired_children(isvc))["Deployment"]["spec"]["template"]["spec"]


def runtime_container(isvc: dict[str, Any]) -> dict[str, Any]:
    return pod_spec(isvc)["containers"][0]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_children_validate_against_kubernetes_schemas(path):
    children = builders.desired_children(stored(path))
    assert [c["kind"] for c in children][:3] == ["ConfigMap", "Service", "Deployment"]
    for child in children:
        kubernetes_validate.validate(child, K8S_VERSION, strict=True)


def test_kubernetes_validate_catches_a_broken_child():
    deploy = by_kind(builders.desired_children(minimal()))["Deployment"]
    deploy["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "eight thousand"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deploy, K8S_VERSION, strict=True)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_golden_children(path):
    text = yaml.safe_dump_all(builders.desired_children(stored(path)), sort_keys=False, width=100)
    golden = GOLDEN / f"{path.stem}.yaml"
    if os.environ.get("KVFLEET_UPDATE_GOLDEN") == "1":
        golden.write_text(text)
    assert golden.exists(), "run with KVFLEET_UPDATE_GOLDEN=1 to create the golden file"
    assert text == golden.read_text(), f"children changed; review and regenerate {golden.name}"


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_config_file_is_accepted_by_the_runtime(path):
    cm = by_kind(builders.desired_children(stored(path)))["ConfigMap"]
    config = yaml.safe_load(cm["data"]["config.yaml"])
    server = {k: config.pop(k) for k in list(config) if k in builders.SERVER_CONFIG_KEYS}
    EngineConfig(**config).check_engine_support()  # extra="forbid": an unknown key raises; and it can run
    ServerSettings(**server)
    assert set(config) <= set(EngineConfig.model_fields)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_labels_and_owner_on_every_child(path):
    isvc = stored(path)
    name = isvc["metadata"]["name"]
    for child in builders.desired_children(isvc):
        meta = child["metadata"]
        assert meta["namespace"] == "default"
        assert meta["labels"]["app.kubernetes.io/name"] == "kvfleet"
        assert meta["labels"]["app.kubernetes.io/instance"] == name
        assert meta["labels"]["app.kubernetes.io/component"] == "inference-server"
        assert meta["labels"]["app.kubernetes.io/managed-by"] == "kvfleet-operator"
        assert meta["ownerReferences"] == [{"apiVersion": "kvfleet.io/v1alpha1", "kind": "InferenceService",
                                            "name": name, "uid": UID, "controller": True,
                                            "blockOwnerDeletion": True}]


def test_builders_are_pure():
    isvc = stored(EXAMPLES[0])
    before = copy.deepcopy(isvc)
    assert builders.desired_children(isvc) == builders.desired_children(isvc)
    assert isvc == before


def test_missing_uid_is_an_invalid_spec():
    isvc = minimal()
    del isvc["metadata"]["uid"]
    with pytest.raises(InvalidSpec) as e:
        builders.desired_children(isvc)
    assert e.value.reason == "MissingUID"


def test_service_port_and_selector():
    isvc = minimal()
    kinds = by_kind(builders.desired_children(isvc))
    svc = kinds["Service"]
    assert svc["spec"]["ports"] == [{"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP",
                                     "appProtocol": "http"}]
    assert svc["spec"]["selector"] == kinds["Deployment"]["spec"]["selector"]["matchLabels"]
    pod_labels = kinds["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= pod_labels.items()


def test_pod_basics():
    isvc = minimal()
    deploy = by_kind(builders.desired_children(isvc))["Deployment"]
    tpl = deploy["spec"]["template"]
    c = tpl["spec"]["containers"][0]
    assert c["command"] == ["kvfleet"] and c["args"][:3] == ["serve", "--config", "/etc/kvfleet/config.yaml"]
    assert c["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"},  # KV events: peer tier
                          {"name": "kv-events", "containerPort": 5557, "protocol": "TCP"}]
    assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert c["startupProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert tpl["spec"]["securityContext"]["runAsNonRoot"] is True
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    vols = {v["name"]: v for v in tpl["spec"]["volumes"]}
    assert {"/tmp", "/cache", "/dev/shm", "/etc/kvfleet"} <= set(mounts)
    assert vols[mounts["/dev/shm"]]["emptyDir"] == {"medium": "Memory", "sizeLimit": "1Gi"}
    assert vols[mounts["/tmp"]]["emptyDir"] == {} and vols[mounts["/cache"]]["emptyDir"] == {}
    assert vols["config"]["configMap"]["name"] == "smollm2-config"
    ann = tpl["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true" and ann["prometheus.io/port"] == "8000"
    assert ann["prometheus.io/path"] == "/metrics"
    config_map = by_kind(builders.desired_children(isvc))["ConfigMap"]
    assert ann["kvfleet.io/config-hash"] == builders.content_hash(config_map["data"])
    assert "resources" not in c or "nvidia.com/gpu" not in c["resources"].get("limits", {})
    assert deploy["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}


def test_hf_model_is_fetched_by_an_init_container():
    spec = pod_spec(minimal())
    (init,) = spec["initContainers"]
    assert init["args"][:2] == ["-m", "kvfleet.operator.fetch"]
    args = dict(zip(init["args"][2::2], init["args"][3::2]))
    assert args == {"--repo": "HuggingFaceTB/SmolLM2-135M-Instruct",
                    "--dest": "/models/HuggingFaceTB--SmolLM2-135M-Instruct@main",
                    "--timeout": "3600", "--retries": "3", "--allow-pattern": "*.jinja"}
    patterns = [b for a, b in zip(init["args"], init["args"][1:]) if a == "--allow-pattern"]
    assert patterns == list(crd_schema.DEFAULT_ALLOW_PATTERNS) and "*.safetensors" in patterns
    assert {"name": "models", "emptyDir": {}} in spec["volumes"]
    assert {"name": "models", "mountPath": "/models", "readOnly": True} in spec["containers"][0]["volumeMounts"]
    config = yaml.safe_load(by_kind(builders.desired_children(minimal()))["ConfigMap"]["data"]["config.yaml"])
    assert config["model"] == "/models/HuggingFaceTB--SmolLM2-135M-Instruct@main"
    assert config["served_model_name"] == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_hf_revision_token_and_cache_claim():
    isvc = minimal(model={"uri": "hf://org/name@v2", "hfTokenSecretRef": {"name": "hf"},
                          "download": {"claimName": "model-cache", "timeoutSeconds": 60, "retries": 5}})
    spec = pod_spec(isvc)
    init = spec["initContainers"][0]
    args = dict(zip(init["args"][2::2], init["args"][3::2]))
    assert args["--revision"] == "v2" and args["--timeout"] == "60" and args["--retries"] == "5"
    assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}} in init["env"]
    assert {"name": "models", "persistentVolumeClaim": {"claimName": "model-cache"}} in spec["volumes"]


def test_pvc_and_file_models():
    spec = pod_spec(minimal(model={"uri": "pvc://store/llama/8b"}))
    assert "initContainers" not in spec
    assert {"name": "models", "persistentVolumeClaim": {"claimName": "store", "readOnly": True}} in spec["volumes"]
    cm = by_kind(builders.desired_children(minimal(model={"uri": "pvc://store/llama/8b"})))["ConfigMap"]
    assert yaml.safe_load(cm["data"]["config.yaml"])["model"] == "/models/llama/8b"
    isvc = minimal(model={"uri": "file:///opt/models/smollm2.gguf"})
    spec = pod_spec(isvc)
    assert "initContainers" not in spec and "models" not in {v["name"] for v in spec["volumes"]}
    cm = by_kind(builders.desired_children(isvc))["ConfigMap"]
    config = yaml.safe_load(cm["data"]["config.yaml"])
    assert config["model"] == "/opt/models/smollm2.gguf" and config["served_model_name"] == "smollm2"


def test_gpu_tensor_parallel_example():
    isvc = stored(ROOT / "examples/inferenceservice-gpu-tp2.yaml")
    kinds = by_kind(builders.desired_children(isvc))
    deploy = kinds["Deployment"]
    c = deploy["spec"]["template"]["spec"]["containers"][0]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "2" and c["resources"]["requests"]["nvidia.com/gpu"] == "2"
    vols = {v["name"]: v for v in deploy["spec"]["template"]["spec"]["volumes"]}
    assert vols["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "8Gi"}
    assert deploy["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}
    api_key = {"name": "KVFLEET_API_KEY", "valueFrom": {"secretKeyRef": {"name": "llm-api-key", "key": "api-key"}}}
    assert api_key in c["env"]
    assert kinds["PodDisruptionBudget"]["spec"]["minAvailable"] == 1
    assert deploy["spec"]["replicas"] == 2
    # 16Gi of weights: 120 s + 20 s/GiB = 440 s -> 44 probes of 10 s
    assert c["startupProbe"]["failureThreshold"] == 44
    assert deploy["spec"]["progressDeadlineSeconds"] >= 440


def test_tensor_parallel_defaults_gpus_and_rejects_too_few():
    isvc = minimal(engine={"tensorParallelSize": 4})
    assert runtime_container(isvc)["resources"]["limits"]["nvidia.com/gpu"] == "4"
    with pytest.raises(InvalidSpec) as e:
        builders.desired_children(minimal(engine={"tensorParallelSize": 4}, runtime={"resources": {"gpus": 2}}))
    assert e.value.reason == "NotEnoughGPUs"


def test_startup_probe_override_and_unknown_size():
    assert runtime_container(minimal())["startupProbe"]["failureThreshold"] == 60  # 600 s default
    isvc = minimal(runtime={"startupTimeoutSeconds": 1800})
    assert runtime_container(isvc)["startupProbe"]["failureThreshold"] == 180


def test_block_size_change_changes_config_and_pod_hash_but_replicas_do_not():
    a = by_kind(builders.desired_children(minimal()))
    b = by_kind(builders.desired_children(minimal(engine={"blockSize": 32})))
    c = by_kind(builders.desired_children(minimal(replicas=3)))
    h = lambda k: k["Deployment"]["spec"]["template"]["metadata"]["annotations"]["kvfleet.io/config-hash"]
    assert "block_size: 32" in b["ConfigMap"]["data"]["config.yaml"]
    assert a["ConfigMap"] != b["ConfigMap"] and h(a) != h(b)
    assert h(a) == h(c) and c["Deployment"]["spec"]["replicas"] == 3
    assert builders.desired_children(minimal(), replicas=5)[2]["spec"]["replicas"] == 5


def test_removed_fields_disappear_from_children():
    with_key = by_kind(builders.desired_children(minimal(runtime={"apiKeySecretRef": {"name": "k"},
                                                                  "nodeSelector": {"a": "b"}},
                                                         disruption={"minAvailable": 1})))
    without = by_kind(builders.desired_children(minimal()))
    def env_names(children: dict) -> set[str]:
        return {e["name"] for e in children["Deployment"]["spec"]["template"]["spec"]["containers"][0]["env"]}

    assert "KVFLEET_API_KEY" in env_names(with_key)
    assert "KVFLEET_API_KEY" not in env_names(without)
    assert "nodeSelector" not in without["Deployment"]["spec"]["template"]["spec"]
    assert with_key["PodDisruptionBudget"]["spec"]["minAvailable"] == 1
    assert without["PodDisruptionBudget"]["spec"]["maxUnavailable"] == 1  # the default: one at a time


def test_extra_args_pass_through_and_unknown_ones_are_invalid():
    extra = {"extraArgs": {"enable_chunked_prefill": False}}
    cm = by_kind(builders.desired_children(minimal(engine=extra)))["ConfigMap"]
    assert yaml.safe_load(cm["data"]["config.yaml"])["enable_chunked_prefill"] is False
    with pytest.raises(InvalidSpec) as e:
        builders.desired_children(minimal(engine={"extraArgs": {"warp_drive": True}}))
    assert e.value.reason == "UnknownEngineArg"
    with pytest.raises(InvalidSpec) as e:
        builders.desired_children(minimal(engine={"blockSize": 16, "extraArgs": {"block_size": 32}}))
    assert e.value.reason == "ConflictingEngineArg"


def test_quantization_enforce_eager_and_kv_cache_dtype_reach_the_engine_config():
    from kvfleet.runtime.config import EngineConfig

    spec = {"quantization": "int4", "enforceEager": False, "kvCacheDtype": "float32"}
    cm = by_kind(builders.desired_children(minimal(engine=spec)))["ConfigMap"]
    config = yaml.safe_load(cm["data"]["config.yaml"])
    assert config["quantization"] == "int4" and config["enforce_eager"] is False
    assert config["kv_cache_dtype"] == "float32"
    engine = EngineConfig.model_validate({k: v for k, v in config.items() if k in EngineConfig.model_fields})
    assert engine.quantization == "int4" and engine.enforce_eager is False and engine.kv_cache_dtype == "float32"
    unset = yaml.safe_load(by_kind(builders.desired_children(minimal()))["ConfigMap"]["data"]["config.yaml"])
    assert not {"quantization", "enforce_eager", "kv_cache_dtype"} & set(unset)  # the runtime's defaults


def test_speculative_reaches_the_engine_config_and_bad_values_are_invalid():
    spec = {"method": "ngram", "numSpeculativeTokens": 3, "promptLookupMin": 2}
    cm = by_kind(builders.desired_children(minimal(engine={"speculative": spec})))["ConfigMap"]
    config = yaml.safe_load(cm["data"]["config.yaml"])
    assert config["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2}
    engine = EngineConfig.model_validate({k: v for k, v in config.items() if k in EngineConfig.model_fields})
    assert engine.speculative_config.num_speculative_tokens == 3
    with pytest.raises(InvalidSpec) as e:
        builders.desired_children(minimal(engine={"speculative": {"promptLookupMin": 5, "promptLookupMax": 2}}))
    assert e.value.reason == "InvalidSpeculativeConfig" and "prompt_lookup_min" in str(e.value)


def test_tuned_values_from_status_only_when_tuning_is_enabled():
    tuned = minimal(engine={"blockSize": 16}, tuning={"enabled": True})
    tuned["status"] = {"engine": {"blockSize": 32, "gpuMemoryUtilization": 0.85}}
    config = yaml.safe_load(by_kind(builders.desired_children(tuned))["ConfigMap"]["data"]["config.yaml"])
    assert config["block_size"] == 32 and config["gpu_memory_utilization"] == 0.85
    tuned["spec"]["tuning"]["enabled"] = False
    config = yaml.safe_load(by_kind(builders.desired_children(tuned))["ConfigMap"]["data"]["config.yaml"])
    assert config["block_size"] == 16 and config["gpu_memory_utilization"] == 0.9


# --------------------------------------------------------------------- status

def test_fetch_retries_then_succeeds(tmp_path):
    calls = tmp_path / "calls"

    def flaky(repo, revision, dest, allow_patterns):
        n = len(calls.read_text()) if calls.exists() else 0
        calls.write_text("x" * (n + 1))
        if n < 2:
            raise SystemExit(3)
        (Path(dest) / "config.json").write_text("{}")

    sleeps = []
    assert fetch.fetch("o/m", str(tmp_path / "m"), retries=3, timeout=30, download=flaky,
                       sleep=sleeps.append, log=lambda *_: None)
    assert calls.read_text() == "xxx" and sleeps == [10.0, 20.0]
    assert (tmp_path / "m/config.json").exists() and (tmp_path / "m" / fetch.MARKER).exists()
    # complete: a second run does not download again
    assert fetch.fetch("o/m", str(tmp_path / "m"), download=lambda *a: 1 / 0, log=lambda *_: None)


def test_fetch_times_out_and_gives_up(tmp_path):
    t = time.monotonic()
    ok = fetch.fetch("o/m", str(tmp_path / "m"), retries=2, timeout=0.5, download=lambda *a: time.sleep(30),
                     sleep=lambda s: None, log=lambda *_: None)
    assert not ok and time.monotonic() - t < 10
    assert not (tmp_path / "m" / fetch.MARKER).exists()


# --------------------------------------------------------------------- the model cache


def test_each_revision_has_its_own_cache_dir_and_deadline_covers_the_download():
    a, b = (pod_spec(minimal(model={"uri": f"hf://org/name@{rev}", "download": {"claimName": "cache"}}))
            for rev in ("v1", "refs/pr/2"))
    dest = [dict(zip(s["initContainers"][0]["args"][2::2], s["initContainers"][0]["args"][3::2]))["--dest"]
            for s in (a, b)]
    assert dest == ["/models/org--name@v1", "/models/org--name@refs--pr--2"]
    config = yaml.safe_load(by_kind(builders.desired_children(minimal(model={"uri": "hf://org/name@v1"})))[
        "ConfigMap"]["data"]["config.yaml"])
    assert config["model"] == "/models/org--name@v1"
    patterns = minimal(model={"uri": "hf://org/name", "download": {"allowPatterns": ["*.gguf"]}})
    args = pod_spec(patterns)["initContainers"][0]["args"]
    assert [b for a, b in zip(args, args[1:]) if a == "--allow-pattern"] == ["*.gguf"]
    # every attempt timing out, with the back-offs between them, fits in the progress deadline
    isvc = minimal(model={"uri": "hf://org/name", "download": {"timeoutSeconds": 1000, "retries": 4}})
    _check_deadline(isvc)


def test_one_gguf_file_of_a_repository_is_fetched_alone_and_served():
    """``hf://ORG/NAME/FILE.gguf``: a GGUF repository holds one file per quantization; the init
    container fetches that one file (its config and tokenizer are inside it) into the revision's
    folder, and the runtime's --model is the file."""
    isvc = minimal(model={"uri": "hf://unsloth/gemma-3-270m-it-GGUF/gemma-3-270m-it-Q4_K_M.gguf@abc"})
    args = pod_spec(isvc)["initContainers"][0]["args"]
    pairs = list(zip(args, args[1:]))
    assert ("--dest", "/models/unsloth--gemma-3-270m-it-GGUF@abc") in pairs
    assert ("--repo", "unsloth/gemma-3-270m-it-GGUF") in pairs and ("--revision", "abc") in pairs
    assert [b for a, b in pairs if a == "--allow-pattern"] == ["gemma-3-270m-it-Q4_K_M.gguf"]
    config = yaml.safe_load(by_kind(builders.desired_children(isvc))["ConfigMap"]["data"]["config.yaml"])
    assert config["model"] == "/models/unsloth--gemma-3-270m-it-GGUF@abc/gemma-3-270m-it-Q4_K_M.gguf"
    for bad in ("hf://org/name/sub", "hf://org//x.gguf", "hf://org/name/a//b.gguf", "hf://org/name/../b.gguf",
                "hf://org/name/./b.gguf"):
        with pytest.raises(InvalidSpec, match=r"hf://ORG/NAME/\[FOLDER/\]FILE.gguf"):
            weights.parse_model_uri(bad)


def test_a_gguf_file_in_a_repository_subfolder_is_fetched_alone_and_served():
    """``hf://ORG/NAME/FOLDER/FILE.gguf`` (llama.cpp publishers put quantizations in subfolders):
    the init container fetches that path alone (an fnmatch pattern that matches it and nothing
    else), which the hub writes under the same subfolder of the revision's folder: --model."""
    isvc = minimal(model={"uri": "hf://org/big-GGUF/Q4_K_M/big-Q4_K_M-00001-of-00002.gguf@v1"})
    assert weights.parse_model_uri(isvc["spec"]["model"]["uri"])["file"] == "Q4_K_M/big-Q4_K_M-00001-of-00002.gguf"
    args = pod_spec(isvc)["initContainers"][0]["args"]
    pairs = list(zip(args, args[1:]))
    assert ("--dest", "/models/org--big-GGUF@v1") in pairs and ("--repo", "org/big-GGUF") in pairs
    assert [b for a, b in pairs if a == "--allow-pattern"] == ["Q4_K_M/big-Q4_K_M-00001-of-00002.gguf"]
    config = yaml.safe_load(by_kind(builders.desired_children(isvc))["ConfigMap"]["data"]["config.yaml"])
    assert config["model"] == "/models/org--big-GGUF@v1/Q4_K_M/big-Q4_K_M-00001-of-00002.gguf"
    # a name with fnmatch's special characters is matched literally (the pattern fetches that file alone)
    odd = minimal(model={"uri": "hf://org/repo/a[1]/m?*.gguf"})
    args = pod_spec(odd)["initContainers"][0]["args"]
    (pattern,) = [b for a, b in zip(args, args[1:]) if a == "--allow-pattern"]
    assert fnmatch.fnmatchcase("a[1]/m?*.gguf", pattern)
    assert not any(fnmatch.fnmatchcase(other, pattern) for other in ("a1/m?*.gguf", "a[1]/mx*.gguf", "a[1]/m?x.gguf"))


def _check_deadline(isvc):
    deploy = by_kind(builders.desired_children(isvc))["Deployment"]
    budget = fetch.budget_seconds(1000, 4)
    assert budget == 4000 + 10 + 20 + 40
    assert deploy["spec"]["progressDeadlineSeconds"] >= budget + weights.startup_seconds(spec_view.of(isvc))
    pvc = by_kind(builders.desired_children(minimal(model={"uri": "pvc://store/m"})))["Deployment"]
    assert pvc["spec"]["progressDeadlineSeconds"] == weights.DEFAULT_STARTUP_SECONDS + 600


def test_replicas_sharing_a_volume_download_once(tmp_path):
    """Two fetchers at once on one cache directory (two pods on one PVC): one download."""
    import multiprocessing

    calls = tmp_path / "calls"

    def slow(repo, revision, dest, allow_patterns):
        with open(calls, "a") as fh:
            fh.write("x")
        time.sleep(1.0)
        (Path(dest) / "config.json").write_text("{}")

    dest = str(tmp_path / "o--m@main")
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=fetch.fetch, args=("o/m", dest), kwargs={"download": slow, "log": lambda *_: None})
             for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
    assert calls.read_text() == "x" and (Path(dest) / fetch.MARKER).exists()


def test_model_cached_condition_and_read_write_once_claim():
    isvc = minimal(model={"uri": "hf://org/name", "download": {"claimName": "cache"}})
    init = {"name": "fetch-model"}
    pods = lambda *cs: [{"metadata": {"name": "p"}, "status": {"initContainerStatuses": list(cs)}}]
    assert status.model_cached(spec_view.of(isvc), []) == ("False", "Pending", "no pod has fetched hf://org/name yet")
    assert status.model_cached(spec_view.of(isvc), pods({**init, "state": {"running": {}}}))[1] == "Downloading"
    assert status.model_cached(spec_view.of(isvc), pods({**init, "state": {"terminated": {"exitCode": 0}}}))[:2] == (
        "True", "Fetched")
    assert status.model_cached(spec_view.of(isvc), pods({**init, "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                                           "lastState": {"terminated": {"exitCode": 1}}}))[1] == "ModelFetchFailed"
    assert status.model_cached(spec_view.of(minimal(model={"uri": "pvc://store/m"})), []) is None
    deploy = by_kind(builders.desired_children(isvc))["Deployment"]  # Availability: maxSurge 1
    rwo = {"metadata": {"name": "cache"}, "spec": {"accessModes": ["ReadWriteOnce"]}}
    rwx = {"metadata": {"name": "cache"}, "spec": {"accessModes": ["ReadWriteMany"]}}
    reason, message = status.claim_problem(rwo, deploy)
    assert reason == "ReadWriteOnceClaim" and "surge pod" in message and "cache" in message
    assert status.claim_problem(rwx, deploy) is None
    one = by_kind(builders.desired_children({**isvc, "spec": {**isvc["spec"], "rollout": {
        "strategy": "ResourceAware"}}}))["Deployment"]
    assert status.claim_problem(rwo, one) is None
    st = status.desired_status(isvc, deployment=deploy, desired_deployment=deploy, now="2026-01-01T00:01:00Z", pods=[], claim=rwo)
    conds = {c["type"]: c for c in st["conditions"]}
    assert conds["Degraded"]["reason"] == "ReadWriteOnceClaim" and conds["ModelCached"]["status"] == "False"
    assert builders.model_claim(isvc) == "cache" and builders.model_claim(minimal(model={"uri": "pvc://s/m"})) == "s"


def test_the_minimal_service_gets_the_router_the_peer_tier_and_the_hand_off_grace():
    """Issue 42: the defaults are the product; each part has its switch."""
    from kvfleet.operator import fleet_secret, router

    isvc = stored(ROOT / "examples" / "inferenceservice-minimal.yaml")
    kinds = by_kind(builders.desired_children(isvc) + router.desired_children(isvc))
    config = yaml.safe_load(kinds["ConfigMap"]["data"]["config.yaml"])
    assert config["drain_handoff_grace"] == builders.DRAIN_HANDOFF_GRACE_SECONDS == DEFAULT_DRAIN_HANDOFF_GRACE
    assert config["kv_transfer_config"]["kv_role"] == "kv_both" and config["kv_events_config"]["enable_kv_cache_events"]
    args = kinds["Deployment"]["spec"]["template"]["spec"]["containers"][0]["args"]  # the router's (last applied)
    assert args[0] == "router" and args[args.index("--routing-algorithm") + 1] == "precise-prefix-cache"
    assert "--no-kv-peer-hint" not in args  # hints on
    assert builders.build_pdb(isvc)["spec"]["maxUnavailable"] == 1  # the runtime pods'
    runtime = next(c for c in builders.desired_children(isvc) if c["kind"] == "Deployment")
    assert fleet_secret.env_entry(isvc) in runtime["spec"]["template"]["spec"]["containers"][0]["env"]
    assert fleet_secret.env_entry(isvc) in kinds["Deployment"]["spec"]["template"]["spec"]["containers"][0]["env"]
    # the switches: no router (then no hand-off grace written), no tiers (and the runtime's defaults off)
    off = minimal(router={"enabled": False}, engine={"kvCache": {"tiers": []}})
    assert router.desired_children(off) == []
    config = yaml.safe_load(by_kind(builders.desired_children(off))["ConfigMap"]["data"]["config.yaml"])
    assert "drain_handoff_grace" not in config
    assert config["kv_transfer_config"] is None and config["kv_events_config"] is None
