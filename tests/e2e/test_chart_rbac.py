"""The chart's RBAC covers every request the real operator makes.

`kvfleet operator` runs as a process against the Kubernetes emulator (tests/support/kube_emulator.py),
which here also records every HTTP request. The test walks an InferenceService through its
life (create with an API-key Secret and a PodDisruptionBudget, drop the PDB, delete), then
maps each request the operator sent (kopf's and the kubernetes client's, by User-Agent) to
the RBAC attributes an API server would check (verb, API group, resource, subresource,
namespace) and asserts that the rules `helm template` renders allow it: the ClusterRole in
cluster-wide mode, the Role (in the watched namespace) plus the read-only discovery
ClusterRole in namespaced mode.
"""

from __future__ import annotations

import base64
import re
import subprocess
import time

import attrs
import pytest
import yaml
from support.kube_emulator import ISVC, EmulatorThread, KubeEmulator
from support.operator_process import start_operator, stop_operator
from support.paths import ROOT

pytestmark = pytest.mark.slow

CHART = ROOT / "charts" / "kvfleet"
NS = "default"
OPERATOR_AGENTS = ("OpenAPI-Generator", "kopf")


@attrs.define(kw_only=True)
class RecordingEmulator(KubeEmulator):
    """The emulator, keeping (method, path, query, user agent) of every request."""

    request_log: list = attrs.field(factory=list, init=False)

    async def __call__(self, raw_request):
        self.request_log.append((raw_request.method, raw_request.path, dict(raw_request.query),
                                 raw_request.headers.get("User-Agent", "")))
        return await super().__call__(raw_request)


def attributes(method: str, path: str, query: dict) -> tuple[str, str, str, str | None, str | None] | None:
    """(verb, apiGroup, resource[/subresource], namespace, name) of a resource request; None for
    the non-resource discovery URLs (/api, /apis, /apis/G/V, /version) every client may read."""
    m = re.fullmatch(r"/api/v1/(.*)|/apis/([^/]+)/([^/]+)/(.*)", path.rstrip("/"))
    if not m:
        return None
    group, rest = ("", m.group(1)) if m.group(1) is not None else (m.group(2), m.group(4))
    parts = rest.split("/") if rest else []
    if not parts:
        return None
    namespace = None
    if parts[0] == "namespaces" and len(parts) >= 3:
        namespace, parts = parts[1], parts[2:]
    resource, name, sub = parts[0], (parts[1] if len(parts) > 1 else None), (parts[2] if len(parts) > 2 else None)
    watch = query.get("watch") in ("true", "1")
    verb = {"GET": "watch" if watch else ("get" if name else "list"), "POST": "create", "PATCH": "patch",
            "PUT": "update", "DELETE": "delete" if name else "deletecollection"}[method]
    return verb, group, resource + (f"/{sub}" if sub else ""), namespace, name


def allowed(rules: list[dict], verb: str, group: str, resource: str) -> bool:
    return any(group in r["apiGroups"] and resource in r["resources"] and verb in r["verbs"] for r in rules)


def render(helm_bin: str, *args: str) -> list[dict]:
    out = subprocess.run([helm_bin, "template", "kvf", str(CHART), "-n", "kvfleet-system", *args],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def life_cycle(emu: EmulatorThread) -> None:
    """Create (with a Secret and a PDB), change (drop the PDB: the operator deletes it; turn on
    autoscaling by the operator, then by an HPA), delete."""
    emu.create("v1/secrets", {"apiVersion": "v1", "kind": "Secret",
                              "metadata": {"name": "rbac-key", "namespace": NS},
                              "data": {"api-key": base64.b64encode(b"secret").decode()}})
    isvc = yaml.safe_load((ROOT / "examples" / "inferenceservice-minimal.yaml").read_text())
    isvc["metadata"].update(name="rbac", namespace=NS)
    isvc["spec"]["runtime"] = {"apiKeySecretRef": {"name": "rbac-key"}}
    isvc["spec"]["disruption"] = {"minAvailable": 1}
    emu.create(ISVC, isvc)
    emu.wait_for(lambda: emu.get("apps/v1/deployments", NS, "rbac"), message="the Deployment")
    emu.wait_for(lambda: emu.get("policy/v1/poddisruptionbudgets", NS, "rbac"), message="the PDB")
    emu.wait_for(lambda: (emu.get(ISVC, NS, "rbac") or {}).get("status", {}).get("conditions"), message="status")
    emu.patch(ISVC, NS, "rbac", {"spec": {"disruption": None}})  # the PDB back to its default
    emu.wait_for(lambda: "minAvailable" not in (emu.get("policy/v1/poddisruptionbudgets", NS, "rbac") or {})
                 .get("spec", {"minAvailable": 0}), message="PDB back to the default")
    # the router (on by default) turned off: its children, its PDB included, are deleted
    emu.patch(ISVC, NS, "rbac", {"spec": {"router": {"enabled": False}}})
    emu.wait_for(lambda: emu.get("policy/v1/poddisruptionbudgets", NS, "rbac-router") is None,
                 message="the router's PDB deleted")
    # Autoscaling by the operator (reads pods and HPAs), then by an HPA the operator creates.
    emu.patch(ISVC, NS, "rbac", {"spec": {"autoscaling": {"mode": "operator", "minReplicas": 1, "maxReplicas": 2}}})
    time.sleep(3.0)
    emu.patch(ISVC, NS, "rbac", {"spec": {"autoscaling": {"mode": "hpa"}}})
    time.sleep(3.0)
    emu.delete(ISVC, NS, "rbac")
    time.sleep(2.0)


@pytest.mark.parametrize("mode", ["cluster-wide", "namespaced"])
def test_rbac_allows_every_request_the_operator_makes(helm_bin, tmp_path, mode):
    if mode == "cluster-wide":
        objs = render(helm_bin, "--set", "operator.peering.enabled=false")
        (role,) = [o for o in objs if o["kind"] == "ClusterRole"]
        namespaced_rules, cluster_rules = role["rules"], role["rules"]
        args = ["--all-namespaces", "--standalone"]
    else:
        objs = render(helm_bin, "--set", f"operator.watchNamespaces={{{NS}}}", "--set", "operator.peering.enabled=false")
        (role,) = [o for o in objs if o["kind"] == "Role"]
        assert role["metadata"]["namespace"] == NS
        (discovery,) = [o for o in objs if o["kind"] == "ClusterRole"]
        namespaced_rules, cluster_rules = role["rules"], discovery["rules"]
        args = [f"--namespace={NS}", "--standalone"]
    # The arguments the chart passes (peering off -> --standalone), as the Deployment has them.
    (c,) = next(o for o in objs if o["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"]
    for a in args:
        assert a in c["args"]

    with EmulatorThread(RecordingEmulator) as emu:
        log = tmp_path / "operator.log"
        proc, _ = start_operator(emu.write_kubeconfig(tmp_path / "kubeconfig"), log, *args)
        try:
            life_cycle(emu)
        finally:
            stop_operator(proc)
        requests = [r for r in emu.emulator.request_log if r[3].startswith(OPERATOR_AGENTS)]

    seen, denied, secrets = set(), [], set()
    for method, path, query, agent in requests:
        attrs_ = attributes(method, path, query)
        if attrs_ is None:
            continue
        verb, group, resource, namespace, _name = attrs_
        if resource == "secrets":
            secrets.add((verb, _name))
        seen.add((verb, group, resource))
        if mode == "namespaced" and namespace not in (None, NS):
            denied.append(f"{method} {path}: outside the watched namespace")
            continue
        rules = namespaced_rules if namespace is not None else cluster_rules
        if not allowed(rules, verb, group, resource):
            denied.append(f"{method} {path} ({verb} {group or 'core'}/{resource}, {agent.split('/')[0]})")
    print("operator requests (verb, group, resource):", *sorted(seen), sep="\n  ")
    assert not denied, "denied by the chart's RBAC:\n" + "\n".join(sorted(set(denied)))
    # The walk really exercised the operator (the test cannot pass on silence).
    for must in [("watch", "kvfleet.io", "inferenceservices"), ("patch", "apps", "deployments"),
                 ("patch", "kvfleet.io", "inferenceservices/status"), ("watch", "", "pods"),
                 ("delete", "policy", "poddisruptionbudgets")]:
        assert must in seen, must
    # Least privilege: an apiKeySecretRef Secret is never read (its absence shows in the pods); the
    # only Secret touched is the service's own fleet Secret, read by name and created once
    assert secrets == {("get", "rbac-fleet"), ("create", None)}, secrets
    assert [sorted(r["verbs"]) for r in role["rules"] if "secrets" in r["resources"]] == [["create", "get"]]


def docs_rbac_rules() -> set[tuple[str, str, frozenset]]:
    """(apiGroup, resource, verbs) of each row of docs/operator.md's permissions table."""
    text = (ROOT / "docs" / "operator.md").read_text()
    section = text.split("## Permissions", 1)[1].split("\n## ", 1)[0]
    out = set()
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[1].startswith("`"):
            continue
        group = "" if cells[0] == "core" else cells[0].strip("`")
        verbs = frozenset(v.strip() for v in cells[2].split(","))
        for resource in re.findall(r"`([^`]+)`", cells[1]):
            out.add((group, resource, verbs))
    return out


def test_docs_rbac_table_equals_the_charts_cluster_role(helm_bin):
    (role,) = [o for o in render(helm_bin) if o["kind"] == "ClusterRole"]
    chart = {(g, r, frozenset(rule["verbs"])) for rule in role["rules"] for g in rule["apiGroups"]
             for r in rule["resources"]}
    docs = docs_rbac_rules()
    assert docs == chart, f"only in docs: {sorted(docs - chart)}; only in the chart: {sorted(chart - docs)}"
