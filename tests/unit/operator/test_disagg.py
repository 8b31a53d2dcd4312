"""spec.disaggregation (operator/disagg.py): two pools of runtime pods rendered through the ordinary
builders (decode: the InferenceService's own children; prefill: ``NAME-prefill``), each with its
engine settings over spec.engine, its replicas and its role label, owned by the InferenceService;
the router's ``--prefill-kube-service``; specs the two legs could not run refused."""

from __future__ import annotations

import copy

import kubernetes_validate
import pytest
import yaml
from support.crd_admission import admit

from kvfleet.operator import builders, crd, disagg, router, service_spec
from kvfleet.operator.crd import InvalidSpec

UID = "0b7f1c1e-5a8e-4a4b-9c33-6c3d2b1a0f00"
POOLS = {"prefill": {"replicas": 2, "engine": {"maxNumBatchedTokens": 4096}},
         "decode": {"replicas": 3, "engine": {"maxNumSeqs": 64}}}


def isvc(**spec) -> dict:
    obj = {"apiVersion": crd.API_VERSION, "kind": crd.KIND,
           "metadata": {"name": "chat", "namespace": "llm", "uid": UID, "generation": 1},
           "spec": {"model": {"uri": "hf://HuggingFaceTB/SmolLM2-135M-Instruct"}, "engine": {"maxNumSeqs": 16},
                    **spec}}
    assert admit(copy.deepcopy(obj)) == []
    return crd.apply_defaults(obj)


def kinds(children) -> list[tuple[str, str]]:
    return [(c["kind"], c["metadata"]["name"]) for c in children]


def test_two_pools_with_their_engines_replicas_roles_and_owner():
    children = builders.desired_children(isvc(disaggregation=POOLS))
    assert kinds(children) == [("ConfigMap", "chat-config"), ("Service", "chat"), ("Deployment", "chat"),
                               ("PodDisruptionBudget", "chat"), ("ConfigMap", "chat-prefill-config"),
                               ("Service", "chat-prefill"), ("Deployment", "chat-prefill"),
                               ("PodDisruptionBudget", "chat-prefill")]
    by_name = {(c["kind"], c["metadata"]["name"]): c for c in children}
    for child in children:
        meta = child["metadata"]
        assert meta["ownerReferences"][0]["name"] == "chat" and meta["ownerReferences"][0]["uid"] == UID
        assert meta["labels"][service_spec.LABEL_ISVC] == "chat"
        assert meta["labels"][disagg.ROLE_LABEL] == ("prefill" if "prefill" in meta["name"] else "decode")
        kubernetes_validate.validate(child, "1.30.0", strict=True)
    decode, prefill = by_name[("Deployment", "chat")], by_name[("Deployment", "chat-prefill")]
    assert (decode["spec"]["replicas"], prefill["spec"]["replicas"]) == (3, 2)
    assert prefill["spec"]["template"]["metadata"]["labels"][disagg.ROLE_LABEL] == "prefill"
    assert decode["spec"]["selector"] == {"matchLabels": service_spec.selector_labels(isvc())}  # unchanged
    selector = by_name[("Service", "chat-prefill")]["spec"]["selector"]
    assert selector == prefill["spec"]["selector"]["matchLabels"] != decode["spec"]["selector"]["matchLabels"]
    config = {role: yaml.safe_load(by_name[("ConfigMap", name)]["data"]["config.yaml"])
              for role, name in (("decode", "chat-config"), ("prefill", "chat-prefill-config"))}
    assert config["decode"]["max_num_seqs"] == 64 and "max_num_batched_tokens" not in config["decode"]
    assert config["prefill"]["max_num_seqs"] == 16 and config["prefill"]["max_num_batched_tokens"] == 4096
    for c in config.values():  # both pools move blocks through the peer connector
        assert c["kv_transfer_config"]["kv_connector"] == "PeerPullConnector"
    # the autoscaler's decision goes to the decode pool
    scaled = builders.desired_children(isvc(disaggregation=POOLS), replicas=5)
    assert [c["spec"].get("replicas") for c in scaled if c["kind"] == "Deployment"] == [5, 2]


def test_router_flags_and_plain_services_unchanged():
    args = router.router_args(isvc(disaggregation=POOLS))
    assert args[args.index("--kube-service") + 1] == "chat"  # the decode pool
    assert args[args.index("--prefill-kube-service") + 1] == "chat-prefill"
    plain = isvc()
    assert "--prefill-kube-service" not in router.router_args(plain)
    children = builders.desired_children(plain)
    assert all(disagg.ROLE_LABEL not in c["metadata"]["labels"] for c in children)
    assert ("Deployment", "chat-prefill") not in kinds(children)


@pytest.mark.parametrize("spec", [
    {"router": {"enabled": False}},
    {"engine": {"kvCache": {"tiers": [{"type": "disk", "size": "1Gi"}]}}},
    {"disaggregation": {**POOLS, "prefill": {"engine": {"tensorParallelSize": 2}}}},
])
def test_specs_the_legs_could_not_run_are_refused(spec):
    obj = isvc(**{"disaggregation": POOLS, **spec})
    with pytest.raises(InvalidSpec) as exc:
        builders.desired_children(obj)
    assert exc.value.reason == "InvalidDisaggregation"
