"""GitOps, end to end: the operator (a real `kvfleet operator` process against the Kubernetes
emulator) never rewrites an InferenceService's spec, and everything it adds to the object's
metadata is listed in docs/gitops.md, where GitOps users learn what to ignore."""

from __future__ import annotations

import copy
import time

import pytest
import yaml
from support.kube_emulator import ISVC, EmulatorThread
from support.operator_process import start_operator, stop_operator
from support.paths import ROOT

pytestmark = pytest.mark.slow

NS = "default"


def test_operator_leaves_the_spec_alone_and_docs_list_its_metadata(tmp_path):
    doc = (ROOT / "docs" / "gitops.md").read_text()
    applied = yaml.safe_load((ROOT / "examples" / "kustomize" / "base" / "inferenceservice.yaml").read_text())
    applied["metadata"]["namespace"] = NS
    applied["metadata"]["labels"] = {"team": "chat"}
    applied["metadata"]["annotations"] = {"owner": "platform"}
    with EmulatorThread() as emu:
        log = tmp_path / "operator.log"
        proc, _ = start_operator(emu.write_kubeconfig(tmp_path / "kubeconfig"), log, "--standalone")
        try:
            emu.create(ISVC, copy.deepcopy(applied))
            emu.wait_for(lambda: emu.get("apps/v1/deployments", NS, "chat"), message="the Deployment")
            emu.wait_for(lambda: (emu.get(ISVC, NS, "chat") or {}).get("status", {}).get("conditions"),
                         message="status conditions")
            # A spec change from git: the operator handles it and still leaves the spec alone.
            emu.patch(ISVC, NS, "chat", {"spec": {"engine": {"maxNumSeqs": 32}}})
            applied["spec"]["engine"]["maxNumSeqs"] = 32
            emu.wait_for(lambda: (emu.get("v1/configmaps", NS, "chat-config") or {}).get("data")
                         and "32" in yaml.safe_dump(emu.get("v1/configmaps", NS, "chat-config")["data"]),
                         message="the engine ConfigMap to follow the spec")
            time.sleep(2.0)
            live = emu.get(ISVC, NS, "chat")
        finally:
            stop_operator(proc)
            print(log.read_text()[-3000:])

    assert live["spec"] == applied["spec"], "the operator changed the spec"
    meta = live["metadata"]
    assert meta.get("labels") == applied["metadata"]["labels"], "the operator changed the labels"
    added = sorted(set(meta.get("annotations") or {}) - set(applied["metadata"]["annotations"]))
    assert meta["annotations"]["owner"] == "platform"
    for key in added:
        assert f'metadata.annotations["{key}"]' in doc, f"docs/gitops.md does not list the annotation {key}"
    for finalizer in meta.get("finalizers") or []:
        assert f"metadata.finalizers: [{finalizer}]" in doc, f"docs/gitops.md does not list the finalizer {finalizer}"
    assert added, "expected kopf's diff-base annotation"
