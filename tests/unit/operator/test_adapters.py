"""LoRA adapters in the operator's pure builders (kvfleet.operator.adapters, builders): the adapter
list goes to the config's ConfigMap and the pod's env, never into the pod template (so adding an
adapter rolls nothing); bad adapter lists are refused with their reason. The running pod loading
them: tests/e2e/test_lora_operator.py."""

from __future__ import annotations

import copy

import pytest
from support.lora import lora_isvc

from kvfleet.operator import builders
from kvfleet.operator.crd import InvalidSpec

NAME = "lora-svc"


def test_the_adapter_list_never_changes_the_pod_template():
    def template(adapters):
        children = builders.desired_children(lora_isvc(adapters))
        return next(c for c in children if c["kind"] == "Deployment")["spec"]["template"], children

    t0, c0 = template([])
    t1, c1 = template([{"name": "a", "uri": "hf://org/a@v1"}, {"name": "b", "uri": "file:///ad/b"}])
    assert t0 == t1
    cm = next(c for c in c1 if c["kind"] == "ConfigMap")
    assert cm["data"]["lora_modules"] == '[{"name": "a", "path": "hf://org/a@v1"}, {"name": "b", "path": "/ad/b"}]'
    config = cm["data"]["config.yaml"]
    assert "enable_lora: true" in config and "skip_failed_lora_modules: true" in config
    env = {e["name"]: e for e in t1["spec"]["containers"][0]["env"]}
    assert env["KVFLEET_LORA_MODULES"]["valueFrom"]["configMapKeyRef"] == {"name": f"{NAME}-config",
                                                                           "key": "lora_modules"}
    assert env["KVFLEET_ALLOW_RUNTIME_LORA_UPDATING"]["value"] == "true"
    for bad, reason in (([{"name": "a", "uri": "s3://x"}], "InvalidAdapterURI"),
                        ([{"name": "a", "uri": "file:///x"}, {"name": "a", "uri": "file:///y"}], "InvalidAdapter"),
                        ([{"name": "a", "uri": "pvc://other/x"}], "AdapterClaimNotMounted")):
        with pytest.raises(InvalidSpec) as err:
            builders.desired_children(lora_isvc(bad))
        assert err.value.reason == reason
    plain = copy.deepcopy(lora_isvc([]))
    del plain["spec"]["model"]["adapters"]
    assert "KVFLEET_LORA_MODULES" not in str(builders.desired_children(plain))
