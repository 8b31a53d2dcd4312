"""spec.parallelism and the LeaderWorkerSet of a multi-node InferenceService (operator/parallelism.py,
operator/lws.py, operator/lws_status.py): pure rendering and status, no cluster."""

from __future__ import annotations

import copy
import re

import kubernetes_validate
import pytest
import yaml
from support.paths import ROOT

from kvfleet.operator import builders, crd, lws, lws_status, parallelism, service_spec, spec_view, status
from kvfleet.operator.crd import InvalidSpec
from kvfleet.runtime.entrypoints.openai.serve_args import parse_serve_args

UID = "0b7f1c1e-5a8e-4a4b-9c33-6c3d2b1a0f00"


def isvc(**spec) -> dict:
    obj = yaml.safe_load((ROOT / "examples/inferenceservice-minimal.yaml").read_text())
    obj["metadata"].update(uid=UID, generation=1, namespace="default")
    obj["spec"].update(spec)
    return crd.apply_defaults(obj)


TWO_NODES = {"parallelism": {"tensor": 2, "nodes": 2}}


@pytest.mark.parametrize("spec, want", [
    ({}, parallelism.Parallelism(1, 1, 1)),
    ({"engine": {"tensorParallelSize": 4}}, parallelism.Parallelism(4, 1, 1)),  # the one-node form
    ({"engine": {"tensorParallelSize": 4}, "parallelism": {"nodes": 2}}, parallelism.Parallelism(4, 1, 2)),
    ({"parallelism": {"tensor": 2, "pipeline": 2, "nodes": 4}}, parallelism.Parallelism(2, 2, 4)),
])
def test_parallelism_reads_the_split_and_the_one_node_form(spec, want):
    got = parallelism.parallelism(spec)
    assert got == want and got.ranks_per_node == want.world // want.nodes


@pytest.mark.parametrize("spec, reason", [
    ({"engine": {"tensorParallelSize": 2}, "parallelism": {"tensor": 4}}, "ConflictingParallelism"),
    ({"parallelism": {"tensor": 2, "nodes": 4}}, "InvalidParallelism"),
])
def test_a_split_that_cannot_be_built_is_a_clear_reason(spec, reason):
    with pytest.raises(InvalidSpec) as e:
        builders.desired_children(isvc(**spec))
    assert e.value.reason == reason and "parallelism" in e.value.message


def test_pipeline_needs_a_runtime_that_has_it():
    known = ["tensor_parallel_size"]
    with pytest.raises(InvalidSpec, match="pipeline_parallel_size") as e:
        parallelism.engine_keys({"parallelism": {"pipeline": 2}}, known)
    assert e.value.reason == "PipelineParallelUnsupported"
    assert parallelism.engine_keys({"parallelism": {"tensor": 2, "pipeline": 2, "nodes": 2}},
                                   [*known, "pipeline_parallel_size"]) == {"tensor_parallel_size": 2,
                                                                          "pipeline_parallel_size": 2}


def test_one_node_keeps_the_deployment_and_its_gpus():
    kinds = [c["kind"] for c in builders.desired_children(isvc(engine={"tensorParallelSize": 2}))]
    assert "Deployment" in kinds and lws.KIND not in kinds
    assert service_spec.gpu_count(spec_view.of(isvc(engine={"tensorParallelSize": 2}))) == 2
    assert service_spec.gpu_count(spec_view.of(isvc(parallelism={"tensor": 4, "pipeline": 2, "nodes": 2}))) == 4


def children(**spec) -> dict:
    return {c["kind"]: c for c in builders.desired_children(isvc(**spec))}


def test_two_nodes_render_a_leader_worker_set_instead_of_a_deployment():
    kids = children(**TWO_NODES, replicas=3)
    assert "Deployment" not in kids
    obj = kids[lws.KIND]
    assert obj["apiVersion"] == "leaderworkerset.x-k8s.io/v1" and obj["metadata"]["name"] == "smollm2"
    spec = obj["spec"]
    assert spec["replicas"] == 3 and spec["startupPolicy"] == "LeaderCreated"
    group = spec["leaderWorkerTemplate"]
    assert group["size"] == 2 and group["restartPolicy"] == "RecreateGroupOnPodRestart"
    (leader,) = group["leaderTemplate"]["spec"]["containers"]
    (worker,) = group["workerTemplate"]["spec"]["containers"]
    assert leader["args"][-8:] == ["--nnodes", "2", "--node-rank", "0", "--master-addr", "$(LWS_LEADER_ADDRESS)",
                                   "--master-port", "29500"]
    assert "--port" in leader["args"] and leader["readinessProbe"] and leader["startupProbe"]
    assert worker["args"] == ["serve", "--config", "/etc/kvfleet/config.yaml", "--headless", "--nnodes", "2",
                              "--node-rank", "$(LWS_WORKER_INDEX)", "--master-addr", "$(LWS_LEADER_ADDRESS)",
                              "--master-port", "29500"]
    assert not {"ports", "startupProbe", "readinessProbe", "livenessProbe", "lifecycle"} & set(worker)
    # one GPU per pod (2 ranks over 2 nodes), the weights and config mounted on both
    for c in (leader, worker):
        assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
        assert {m["name"] for m in c["volumeMounts"]} >= {"config", "models"}
    workers_annotations = group["workerTemplate"]["metadata"]["annotations"]
    assert not [k for k in workers_annotations if k.startswith("prometheus.io/")]
    assert workers_annotations[lws.ANNOTATION_TEMPLATE_HASH] == lws.template_hash(obj)
    assert kids["Service"]["spec"]["selector"][lws.LABEL_WORKER_INDEX] == "0"  # the router reaches leaders only
    config = yaml.safe_load(kids["ConfigMap"]["data"]["config.yaml"])
    assert config["tensor_parallel_size"] == 2 and config["kv_transfer_config"] is None  # no peer tier when split


def test_the_inference_pool_selects_the_leaders():
    from kvfleet.operator import gie, reconcile

    obj = isvc(**TWO_NODES, router={"inferencePool": {"enabled": True, "endpointPickerRef": {"name": "epp"}}})
    (pool,) = [c for c in reconcile.desired_objects(obj) if c["kind"] == gie.KIND]
    assert pool["spec"]["selector"]["matchLabels"][lws.LABEL_WORKER_INDEX] == "0"


def test_the_templates_are_valid_pods():
    group = children(**TWO_NODES)[lws.KIND]["spec"]["leaderWorkerTemplate"]
    for key in ("leaderTemplate", "workerTemplate"):
        pod = {"apiVersion": "v1", "kind": "Pod", **copy.deepcopy(group[key])}
        pod["metadata"]["name"] = "p"
        kubernetes_validate.validate(pod, "1.30.0", strict=True)


def _resolve(args: list[str], env: dict[str, str], config: str) -> list[str]:
    out = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in args]
    return [config if a == "/etc/kvfleet/config.yaml" else a for a in out]


def test_the_runtime_accepts_the_rendered_command_lines(tmp_path):
    """Each template's args, with the LWS controller's variables filled in, parse with ``kvfleet
    serve``'s own parser into the node layout the runtime checks."""
    kids = children(**TWO_NODES)
    config = tmp_path / "config.yaml"
    config.write_text(kids["ConfigMap"]["data"]["config.yaml"])
    group = kids[lws.KIND]["spec"]["leaderWorkerTemplate"]
    env = {"LWS_LEADER_ADDRESS": "smollm2-0.smollm2.default", "LWS_GROUP_SIZE": "2", "LWS_NAME": "smollm2"}
    for key, index in (("leaderTemplate", "0"), ("workerTemplate", "1")):
        args = _resolve(group[key]["spec"]["containers"][0]["args"], {**env, "LWS_WORKER_INDEX": index}, str(config))
        engine = parse_serve_args(args[1:], environ={}).engine
        assert (engine.nnodes, engine.node_rank, engine.headless) == (2, int(index), index != "0")
        assert (engine.master_addr, engine.master_port, engine.tensor_parallel_size) == (
            "smollm2-0.smollm2.default", 29500, 2)


def test_mode_hpa_scales_the_leader_worker_set():
    kids = children(**TWO_NODES, autoscaling={"mode": "hpa", "minReplicas": 1, "maxReplicas": 4})
    assert kids["HorizontalPodAutoscaler"]["spec"]["scaleTargetRef"] == {
        "apiVersion": "leaderworkerset.x-k8s.io/v1", "kind": "LeaderWorkerSet", "name": "smollm2"}
    assert "replicas" not in kids[lws.KIND]["spec"]  # the HPA owns it; the operator stops writing it
    assert lws.pod_selector(isvc(**TWO_NODES))[lws.LABEL_WORKER_INDEX] == "0"
    assert lws.LABEL_WORKER_INDEX not in lws.pod_selector(isvc())


def pod(group: int, worker: int, *, ready: bool = True, digest: str = "h") -> dict:
    return {"metadata": {"name": f"smollm2-{group}" + (f"-{worker}" if worker else ""),
                         "labels": {lws.LABEL_GROUP_INDEX: str(group), lws.LABEL_WORKER_INDEX: str(worker)},
                         "annotations": {lws.ANNOTATION_TEMPLATE_HASH: digest}},
            "status": {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


def lws_obj(replicas: int = 2, digest: str = "h") -> dict:
    tmpl = {"metadata": {"annotations": {lws.ANNOTATION_TEMPLATE_HASH: digest}}}
    return {"spec": {"replicas": replicas, "leaderWorkerTemplate": {"size": 2, "leaderTemplate": tmpl}}}


def conditions(pods: list[dict], live: dict | None = None) -> dict[str, dict]:
    obj = isvc(**TWO_NODES, replicas=2)
    live = live or lws_obj()
    view, want = lws_status.progress_views(lws_obj(), live, pods)
    st = status.desired_status(obj, deployment=view, desired_deployment=want, now="2026-01-01T00:00:00Z", pods=pods)
    st = lws_status.group_status(obj, st, desired=lws_obj(), live=live, pods=pods, now="2026-01-01T00:00:00Z")
    assert st["selector"].endswith(f"{lws.LABEL_WORKER_INDEX}=0")
    return {c["type"]: c for c in st["conditions"]} | {"_status": st}


def test_whole_groups_are_ready():
    conds = conditions([pod(g, w) for g in (0, 1) for w in (0, 1)])
    assert conds["Ready"]["status"] == "True" and conds["GroupsWhole"]["reason"] == "AllGroupsWhole"
    assert conds["_status"]["readyReplicas"] == 2 and conds["_status"]["replicas"] == 2


def test_a_group_with_a_worker_down_or_missing_is_reported():
    conds = conditions([pod(0, 0), pod(0, 1, ready=False), pod(1, 0)])
    assert conds["Ready"]["status"] == "False"
    assert conds["GroupsWhole"]["status"] == "False" and conds["GroupsWhole"]["reason"] == "GroupNotWhole"
    msg = conds["GroupsWhole"]["message"]
    assert "group 0: 1/2 pods ready (worker smollm2-0-1 not ready)" in msg
    assert "group 1: 1/2 pods ready (worker 1 missing)" in msg
    assert conds["_status"]["readyReplicas"] == 0


def test_groups_on_an_old_template_are_not_rolled_out():
    conds = conditions([pod(0, 0), pod(0, 1), pod(1, 0, digest="old"), pod(1, 1, digest="old")])
    assert conds["Ready"]["status"] == "False" and conds["Progressing"]["status"] == "True"
    assert conds["_status"]["updatedReplicas"] == 1 and conds["GroupsWhole"]["status"] == "True"


class NoLws:
    def served(self, api_version, plural):
        assert (api_version, plural) == ("leaderworkerset.x-k8s.io/v1", "leaderworkersets")
        return False


def test_a_cluster_without_the_lws_api_gets_a_clear_reason():
    with pytest.raises(InvalidSpec) as e:
        lws.require_api(NoLws())
    assert e.value.reason == "LeaderWorkerSetMissing" and "install LeaderWorkerSet" in e.value.message


def test_parallelism_reads_an_attribute_view_as_a_dict():
    """The typed spec view (snake_case attributes, None when absent) reads the same."""
    from types import SimpleNamespace as View

    view = View(parallelism=View(tensor=2, pipeline=None, nodes=2), engine=View(tensor_parallel_size=1))
    assert parallelism.parallelism(view) == parallelism.Parallelism(2, 1, 2)
    assert parallelism.parallelism(View(parallelism=None, engine=View(tensor_parallel_size=4))).tensor == 4


def test_the_multi_node_example_is_admitted_and_renders_valid_groups():
    """examples/multinode/llama-405b.yaml: admitted by the CRD (schema and CEL), 8 GPUs per pod,
    every child valid (the LWS's templates as Pods)."""
    from support.crd_admission import admit
    from support.fake_lws import validatable

    raw = yaml.safe_load((ROOT / "examples/multinode/llama-405b.yaml").read_text())
    assert admit(copy.deepcopy(raw)) == []
    raw["metadata"].update(uid=UID, generation=1)
    kids = builders.desired_children(crd.apply_defaults(raw))
    for obj in [o for c in kids for o in validatable(c)]:
        kubernetes_validate.validate(obj, "1.30.0", strict=True)
    group = next(c for c in kids if c["kind"] == lws.KIND)["spec"]["leaderWorkerTemplate"]
    assert group["size"] == 2
    for key in ("leaderTemplate", "workerTemplate"):
        assert group[key]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "8"


def test_this_runtime_takes_a_pipeline_split_end_to_end():
    """With the runtime's own keys (EngineConfig has pipeline_parallel_size since pipeline
    parallelism landed), a pipeline split reaches the config file instead of the refusal."""
    config = builders.engine_config(isvc(parallelism={"tensor": 2, "pipeline": 2, "nodes": 2}))
    assert config["pipeline_parallel_size"] == 2 and config["tensor_parallel_size"] == 2
