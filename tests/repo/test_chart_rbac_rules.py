"""What the chart's RBAC grants (charts/kvfleet/templates/rbac.yaml, `helm template`): exactly what
the operator needs, cluster-wide or in the watched namespaces only. Which requests the operator
really makes: tests/e2e/test_chart_rbac.py."""

from __future__ import annotations

from support.helm_chart import CHART, VALUE_SETS, by_kind, helm, one, render


def _rules(role: dict) -> dict[tuple[str, str], set[str]]:
    out: dict[tuple[str, str], set[str]] = {}
    for rule in role["rules"]:
        for g in rule["apiGroups"]:
            for r in rule["resources"]:
                out.setdefault((g, r), set()).update(rule["verbs"])
    return out


# What the operator does, and so what it needs (least privilege: nothing more).
EXPECTED_RULES = {
    ("kvfleet.io", "inferenceservices"): {"get", "list", "watch", "patch"},
    ("kvfleet.io", "inferenceservices/status"): {"get", "patch"},
    ("kvfleet.io", "inferenceservices/scale"): {"patch"},
    ("", "configmaps"): {"get", "list", "watch", "create", "patch"},
    ("", "services"): {"get", "list", "watch", "create", "patch", "delete"},  # delete: spec.router turned off
    ("apps", "deployments"): {"get", "list", "watch", "create", "patch", "delete"},
    ("policy", "poddisruptionbudgets"): {"get", "list", "watch", "create", "patch", "delete"},
    ("autoscaling", "horizontalpodautoscalers"): {"get", "list", "watch", "create", "patch", "delete"},
    ("", "pods"): {"get", "list", "watch"},               # watched: pod-level reasons
    ("", "persistentvolumeclaims"): {"get"},              # the model volume's access modes
    ("keda.sh", "scaledobjects"): {"list"},               # one scaler per target
    ("", "events"): {"create"},                           # others' secrets: learnt from the pods
    ("", "secrets"): {"get", "create"},                   # its own fleet Secret: read by name, created once
    # spec.router: the router's own RBAC, and what its Role grants (RBAC escalation check)
    ("", "serviceaccounts"): {"get", "create", "patch", "delete"},
    ("rbac.authorization.k8s.io", "roles"): {"get", "create", "patch", "delete"},
    ("rbac.authorization.k8s.io", "rolebindings"): {"get", "create", "patch", "delete"},
    ("discovery.k8s.io", "endpointslices"): {"get", "list", "watch"},
    ("inference.networking.k8s.io", "inferencepools"): {"get", "create", "patch", "delete"},  # GIE
    # spec.parallelism.nodes > 1: the runtime LeaderWorkerSet, pruned when back to one node; its /scale
    ("leaderworkerset.x-k8s.io", "leaderworkersets"): {"get", "list", "watch", "create", "patch", "delete"},
    ("leaderworkerset.x-k8s.io", "leaderworkersets/scale"): {"patch"},
}


def test_cluster_wide_rbac_is_least_privilege(helm_bin):
    role = one(render(helm_bin), "ClusterRole")
    rules = _rules(role)
    expected = dict(EXPECTED_RULES)
    expected[("kopf.dev", "clusterkopfpeerings")] = {"get", "list", "watch", "patch"}
    expected[("apiextensions.k8s.io", "customresourcedefinitions")] = {"list", "watch"}
    assert rules == expected
    for rule in role["rules"]:
        assert "*" not in rule["verbs"] + rule["resources"] + rule["apiGroups"]
        assert "resourceNames" not in rule


def test_namespaced_rbac_grants_only_in_the_watched_namespaces(helm_bin):
    objs = render(helm_bin, *VALUE_SETS["namespaced"])
    (c,) = one(objs, "Deployment")["spec"]["template"]["spec"]["containers"]
    assert "--namespace=team-a" in c["args"] and "--namespace=team-b" in c["args"]
    assert "--all-namespaces" not in c["args"]
    roles = by_kind(objs, "Role")
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    for role in roles:
        expected = dict(EXPECTED_RULES)
        expected[("kopf.dev", "kopfpeerings")] = {"get", "list", "watch", "patch"}
        assert _rules(role) == expected
    bindings = by_kind(objs, "RoleBinding")
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["team-a", "team-b"]
    for b in bindings:
        assert b["subjects"][0]["namespace"] == "kvfleet-system"  # the operator's own namespace
    # Cluster-wide: only read-only discovery of namespaces and CRDs, nothing inside a namespace.
    (cr,) = by_kind(objs, "ClusterRole")
    assert _rules(cr) == {("", "namespaces"): {"list", "watch"},
                          ("apiextensions.k8s.io", "customresourcedefinitions"): {"list", "watch"}}
    peerings = by_kind(objs, "KopfPeering")
    assert sorted(p["metadata"]["namespace"] for p in peerings) == ["team-a", "team-b"]
    assert not by_kind(objs, "ClusterKopfPeering")

    objs = render(helm_bin, *VALUE_SETS["namespaced-no-discovery"])
    assert not by_kind(objs, "ClusterRole") and not by_kind(objs, "ClusterRoleBinding")


def test_existing_serviceaccount_and_no_rbac(helm_bin):
    objs = render(helm_bin, *VALUE_SETS["existing-serviceaccount"])
    assert not [o for o in objs if o["kind"] in ("ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role",
                                                 "RoleBinding")]
    assert one(objs, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"] == "ops-sa"
    proc = helm(helm_bin, "template", "kvf", str(CHART), "--set", "serviceAccount.create=false", check=False)
    assert proc.returncode != 0 and "serviceAccount.name is required" in proc.stderr


def test_standalone_without_peering(helm_bin):
    objs = render(helm_bin, "--set", "operator.peering.enabled=false")
    (c,) = one(objs, "Deployment")["spec"]["template"]["spec"]["containers"]
    assert "--standalone" in c["args"] and not any(a.startswith("--peering") for a in c["args"])
    assert not by_kind(objs, "ClusterKopfPeering")
    assert ("kopf.dev", "clusterkopfpeerings") not in _rules(one(objs, "ClusterRole"))
