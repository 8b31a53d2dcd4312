"""The Helm chart (charts/kvfleet), checked with the real `helm` binary.

`helm lint --strict`; `helm template` with default and non-default values, every rendered
object validated against the official Kubernetes schemas (kubernetes-validate) or, for the
kopf peering objects, against the chart's own CRDs; values that the schema must reject;
the CRDs identical to the top-level crds/; the monitoring objects
rendered only when asked or when the cluster serves them. What RBAC grants: test_chart_rbac_rules.py.
"""

from __future__ import annotations

import json
import re

import jsonschema
import kubernetes_validate
import pytest
import yaml
from support.helm_chart import CHART, VALUE_SETS, by_kind, helm, one, render
from support.paths import ROOT

K8S_VERSION = "1.35.0"  # the kubectl the project installs is v1.35

# Kinds whose schemas no offline package ships: checked field by field in the tests below.
PROMETHEUS_OPERATOR_KINDS = {("monitoring.coreos.com/v1", "PodMonitor"), ("monitoring.coreos.com/v1", "ServiceMonitor")}


def crd_schemas() -> dict[tuple[str, str], dict]:
    """(apiVersion, kind) -> openAPIV3Schema of every CRD the chart ships."""
    out = {}
    for path in sorted((CHART / "crds").glob("*.yaml")):
        for crd in yaml.safe_load_all(path.read_text()):
            if not crd:
                continue
            for v in crd["spec"]["versions"]:
                out[(f"{crd['spec']['group']}/{v['name']}", crd["spec"]["names"]["kind"])] = v["schema"]["openAPIV3Schema"]
    return out


def openapi_validator(schema: dict) -> jsonschema.protocols.Validator:
    """A CRD's openAPIV3Schema is OpenAPI 3.0, i.e. JSON Schema draft 4 plus extensions
    (boolean exclusiveMinimum, x-kubernetes-* keys that a validator ignores)."""
    return jsonschema.Draft4Validator(schema)


def validate_all(objs: list[dict]) -> None:
    """Every object validates: built-in kinds against Kubernetes' schemas (strict: unknown
    fields are errors), kinds of the chart's CRDs against those CRDs' schemas."""
    schemas = crd_schemas()
    assert objs
    for obj in objs:
        key = (obj["apiVersion"], obj["kind"])
        where = f"{obj['kind']}/{obj['metadata'].get('name')}"
        if key in PROMETHEUS_OPERATOR_KINDS:
            continue  # checked in test_monitoring_*
        if key in schemas:
            openapi_validator(schemas[key]).validate(obj)
            assert set(obj) <= {"apiVersion", "kind", "metadata", "spec", "status"}, where
            continue
        try:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            raise AssertionError(f"{where} does not validate: {e.message} at {list(e.path)}") from e


def test_values_schema_is_valid_json_schema_and_accepts_the_defaults():
    schema = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    jsonschema.Draft7Validator(schema).validate(yaml.safe_load((CHART / "values.yaml").read_text()))
    # additionalProperties: false on every object of the schema with named properties,
    # so that a misspelt key fails.
    def walk(node, path="$"):
        if isinstance(node, dict):
            if node.get("type") == "object" and "properties" in node:
                assert node.get("additionalProperties") is False, f"{path} allows unknown keys"
            for k, v in node.items():
                walk(v, f"{path}.{k}")
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, f"{path}[{i}]")
    for name in ("properties", "definitions"):
        for k, v in schema[name].items():
            if k in ("global", "topologySpreadConstraints"):  # open by design (helm globals; k8s passthrough)
                continue
            walk(v, f"$.{name}.{k}")


def test_every_default_value_is_described_by_the_schema():
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    missing = sorted(set(values) - set(schema["properties"]))
    assert not missing


@pytest.mark.parametrize("name", sorted(n for n in VALUE_SETS if "--api-versions" not in VALUE_SETS[n]))
def test_lint_strict(helm_bin, name):  # (helm lint has no --api-versions)
    proc = helm(helm_bin, "lint", "--strict", str(CHART), *VALUE_SETS[name], check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 chart(s) linted, 0 chart(s) failed" in proc.stdout


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_rendered_objects_validate_against_kubernetes_schemas(helm_bin, name):
    objs = render(helm_bin, *VALUE_SETS[name])
    validate_all(objs)
    # Names are unique per kind and namespace (two objects would overwrite each other).
    keys = [(o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]) for o in objs]
    assert len(keys) == len(set(keys)), keys


def test_default_render_has_the_operator_pieces(helm_bin):
    objs = render(helm_bin)
    kinds = sorted({o["kind"] for o in objs})
    assert kinds == sorted(["CustomResourceDefinition", "ServiceAccount", "ClusterRole", "ClusterRoleBinding",
                            "Deployment", "Service", "PodDisruptionBudget", "ConfigMap", "Pod",
                            "ClusterKopfPeering"])
    crds = {o["metadata"]["name"] for o in by_kind(objs, "CustomResourceDefinition")}
    assert "inferenceservices.kvfleet.io" in crds


def test_operator_deployment_is_hardened_and_probed(helm_bin):
    objs = render(helm_bin)
    dep = one(objs, "Deployment")
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert c["resources"]["requests"]["cpu"] and c["resources"]["limits"]["memory"]
    # Writable /tmp on a read-only root filesystem.
    assert {"name": "tmp", "mountPath": "/tmp"} in c["volumeMounts"]
    # Liveness on the operator's health endpoint: the port the operator is told to listen on.
    port = next(p for p in c["ports"] if p["name"] == "health")["containerPort"]
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert f"--health-port={port}" in c["args"]
    assert "--all-namespaces" in c["args"]
    assert "--peering=kvfleet-operator" in c["args"]
    # kopf peering tells the replicas apart by POD_ID.
    env = {e["name"]: e for e in c["env"]}
    assert env["POD_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    # The ServiceAccount the pod runs as is the one the RBAC binds.
    sa = one(objs, "ServiceAccount")["metadata"]["name"]
    assert pod["serviceAccountName"] == sa
    binding = one(objs, "ClusterRoleBinding")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa, "namespace": "kvfleet-system"}]
    # The health Service selects exactly the operator pods.
    svc = one(objs, "Service")
    assert svc["spec"]["selector"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]
    pdb = one(objs, "PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"]
    assert pdb["spec"]["maxUnavailable"] == 1


def test_image_tag_defaults_to_app_version_and_digest_wins(helm_bin):
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    (c,) = one(render(helm_bin), "Deployment")["spec"]["template"]["spec"]["containers"]
    assert c["image"] == f"ghcr.io/kvfleet/kvfleet-operator:{chart['appVersion']}"
    digest = "sha256:" + "b" * 64
    (c,) = one(render(helm_bin, "--set", f"image.digest={digest}", "--set", "image.tag=x"),
               "Deployment")["spec"]["template"]["spec"]["containers"]
    assert c["image"] == f"ghcr.io/kvfleet/kvfleet-operator@{digest}"


def _monitors(objs):
    return [o for o in objs if o["apiVersion"] == "monitoring.coreos.com/v1"]


def test_monitoring_rendered_only_when_served_or_forced(helm_bin):
    assert not _monitors(render(helm_bin))  # auto, and this "cluster" has no monitoring.coreos.com
    served = ["--api-versions", "monitoring.coreos.com/v1/PodMonitor"]
    (pm,) = _monitors(render(helm_bin, *served))
    assert pm["kind"] == "PodMonitor"
    assert not _monitors(render(helm_bin, *served, "--set", "monitoring.enabled=false"))
    # auto + ServiceMonitor needs the ServiceMonitor kind served, not just PodMonitor.
    assert not _monitors(render(helm_bin, *served, "--set", "monitoring.kind=ServiceMonitor"))
    (sm,) = _monitors(render(helm_bin, "--set", "monitoring.enabled=true", "--set", "monitoring.kind=ServiceMonitor"))
    assert sm["kind"] == "ServiceMonitor"


@pytest.mark.parametrize("kind,endpoints", [("PodMonitor", "podMetricsEndpoints"), ("ServiceMonitor", "endpoints")])
def test_monitoring_scrapes_the_runtime_metrics_port(helm_bin, kind, endpoints):
    objs = render(helm_bin, "--set", "monitoring.enabled=true", "--set", f"monitoring.kind={kind}",
                  "--set-json", 'monitoring.labels={"release":"kps"}')
    (m,) = _monitors(objs)
    assert m["metadata"]["labels"]["release"] == "kps"
    assert m["spec"]["namespaceSelector"] == {"any": True}
    (ep,) = m["spec"][endpoints]
    assert ep["port"] == "http" and ep["path"] == "/metrics"
    (relabel,) = ep["relabelings"]
    assert relabel["targetLabel"] == "inferenceservice"
    src = "pod" if kind == "PodMonitor" else "service"
    assert relabel["sourceLabels"] == [f"__meta_kubernetes_{src}_label_kvfleet_io_inferenceservice"]
    # Restricted to the watched namespaces when the operator is namespaced.
    (m,) = _monitors(render(helm_bin, "--set", "monitoring.enabled=true", "--set", f"monitoring.kind={kind}",
                            "--set", "operator.watchNamespaces={llm,llm-dev}"))
    assert m["spec"]["namespaceSelector"] == {"matchNames": ["llm", "llm-dev"]}


def _prometheus_label(label: str) -> str:
    """How Kubernetes service discovery names a label: non-alphanumerics become `_`."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", label)


@pytest.mark.parametrize("kind", ["PodMonitor", "ServiceMonitor"])
def test_monitoring_selects_the_pods_and_services_the_operator_builds(helm_bin, kind):
    """The selector and the relabelling read labels that kvfleet.operator.builders really sets."""
    from kvfleet.operator import builders

    isvc = yaml.safe_load((ROOT / "examples" / "inferenceservice-minimal.yaml").read_text())
    isvc["metadata"].update(uid="0b8e5a2c-7f0e-4c71-9d51-3c1f6f0f1a11", generation=1)
    children = {c["kind"]: c for c in builders.desired_children(isvc)}
    target = (children["Deployment"]["spec"]["template"]["metadata"]["labels"] if kind == "PodMonitor"
              else children["Service"]["metadata"]["labels"])
    (m,) = _monitors(render(helm_bin, "--set", "monitoring.enabled=true", "--set", f"monitoring.kind={kind}"))
    selector = m["spec"]["selector"]["matchLabels"]
    assert selector.items() <= target.items(), (selector, target)
    # ... and selects nothing of the chart's own (the operator pods).
    operator_labels = one(render(helm_bin), "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert not selector.items() <= operator_labels.items()
    endpoints = m["spec"]["podMetricsEndpoints" if kind == "PodMonitor" else "endpoints"]
    (relabel,) = endpoints[0]["relabelings"]
    (source,) = relabel["sourceLabels"]
    src = "pod" if kind == "PodMonitor" else "service"
    by_prom_name = {f"__meta_kubernetes_{src}_label_{_prometheus_label(k)}": v for k, v in target.items()}
    assert by_prom_name.get(source) == isvc["metadata"]["name"], (source, sorted(by_prom_name))
    # The scraped port is the runtime's named port.
    if kind == "PodMonitor":
        (container,) = [c for c in children["Deployment"]["spec"]["template"]["spec"]["containers"]
                        if any(p.get("name") == "http" for p in c.get("ports", []))]
    else:
        assert any(p["name"] == "http" for p in children["Service"]["spec"]["ports"])


def test_prometheus_adapter_rule_configmap(helm_bin):
    objs = render(helm_bin)
    cm = one(objs, "ConfigMap", "kvf-kvfleet-prometheus-adapter")
    config = yaml.safe_load(cm["data"]["config.yaml"])
    assert config == yaml.safe_load((CHART / "files" / "prometheus-adapter-rules.yaml").read_text())
    assert [r["name"]["as"] for r in config["rules"]] == ["kvfleet_num_requests_waiting", "kvfleet_kv_cache_usage_perc"]
    for rule in config["rules"]:
        assert rule["seriesQuery"].startswith(rule["name"]["as"].replace("kvfleet_", "kvfleet:", 1) + "{")
        assert rule["resources"]["overrides"] == {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}
    objs = render(helm_bin, "--set", "prometheusAdapter.rules.enabled=false")
    assert not [o for o in by_kind(objs, "ConfigMap") if o["metadata"]["name"].endswith("prometheus-adapter")]


def test_grafana_dashboard_configmap(helm_bin):
    objs = render(helm_bin, "--set", "grafanaDashboard.namespace=monitoring")
    cm = one(objs, "ConfigMap", "kvf-kvfleet-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["namespace"] == "monitoring"
    (text,) = cm["data"].values()
    dash = json.loads(text)
    titles = " | ".join(p["title"] for p in dash["panels"]).lower()
    for topic in ("queue depth", "running requests", "kv cache usage", "time to first token",
                  "inter-token latency", "token throughput", "replicas"):
        assert topic in titles, topic
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert sum("histogram_quantile" in e and "time_to_first_token_seconds_bucket" in e for e in exprs) >= 3
    assert sum("histogram_quantile" in e and "inter_token_latency_seconds_bucket" in e for e in exprs) >= 3
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    assert not [o for o in by_kind(render(helm_bin, "--set", "grafanaDashboard.enabled=false"), "ConfigMap")
                if o["metadata"]["name"].endswith("-dashboard")]


def test_helm_test_hook_pod(helm_bin):
    objs = render(helm_bin)
    pod = one(objs, "Pod")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    (c,) = pod["spec"]["containers"]
    svc = one(objs, "Service")
    port = svc["spec"]["ports"][0]["port"]
    assert f"http://{svc['metadata']['name']}.kvfleet-system.svc:{port}/healthz" in c["command"][-1]
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    # The script is valid Python (it runs in the operator image).
    compile(c["command"][-1], "helm-test", "exec")
    assert not by_kind(render(helm_bin, "--set", "tests.enabled=false"), "Pod")


def test_notes_say_how_to_apply_a_first_inferenceservice(helm_bin):
    proc = helm(helm_bin, "install", "kvf", str(CHART), "--dry-run=client", "--namespace", "kvfleet-system")
    notes = proc.stdout.split("NOTES:", 1)[1]
    assert "kind: InferenceService" in notes and "kubectl apply" in notes and "kubectl get inferenceservices" in notes
    # The embedded manifest is a valid InferenceService for the shipped CRD.
    block = notes.split("-f -\n", 1)[1].split("YAML\n", 1)[0]
    lines = block.splitlines()
    indent = min(len(line) - len(line.lstrip()) for line in lines if line.strip())
    isvc = yaml.safe_load("\n".join(line[indent:] for line in lines))
    openapi_validator(crd_schemas()[("kvfleet.io/v1alpha1", "InferenceService")]).validate(isvc)


# Values that must be rejected by values.schema.json (helm fails before rendering anything).
BAD_VALUES = {
    "unknown top-level key": ["--set", "replicas=2"],
    "unknown nested key": ["--set", "operator.namespace=x"],
    "negative replicas": ["--set", "replicaCount=-1"],
    "pull policy": ["--set", "image.pullPolicy=Sometimes"],
    "digest": ["--set", "image.digest=sha1:abc"],
    "namespace name": ["--set", "operator.watchNamespaces={Team_A}"],
    "root filesystem writable": ["--set", "securityContext.readOnlyRootFilesystem=false"],
    "privilege escalation": ["--set", "securityContext.allowPrivilegeEscalation=true"],
    "root user": ["--set", "podSecurityContext.runAsNonRoot=false"],
    "monitoring mode": ["--set", "monitoring.enabled=maybe"],
    "monitoring kind": ["--set", "monitoring.kind=Probe"],
    "scrape interval": ["--set", "monitoring.interval=fast"],
    "memory quantity": ["--set", "resources.limits.memory=lots"],
    "log level": ["--set", "operator.logLevel=trace"],
    "health port": ["--set", "operator.healthPort=80"],
    "pdb percent": ["--set", "podDisruptionBudget.minAvailable=150%"],
    "toleration effect": ["--set-json", 'tolerations=[{"key":"a","effect":"Sometimes"}]'],
    "extra arg": ["--set-json", 'operator.extraArgs=["verbose"]'],
    "adapter toggle type": ["--set", "prometheusAdapter.rules.enabled=yes"],
    "dashboard label value": ["--set-json", 'grafanaDashboard.labels={"grafana_dashboard":"not a label!"}'],
}


@pytest.mark.parametrize("name", sorted(BAD_VALUES))
def test_bad_values_are_rejected_by_the_schema(helm_bin, name):
    proc = helm(helm_bin, "template", "kvf", str(CHART), *BAD_VALUES[name], check=False)
    assert proc.returncode != 0, f"{name}: accepted"
    assert "values don't meet the specifications of the schema" in proc.stderr, proc.stderr


def test_chart_crds_are_the_top_level_crds():
    top = {p.name: p.read_bytes() for p in sorted((ROOT / "crds").glob("*.yaml"))}
    chart = {p.name: p.read_bytes() for p in sorted((CHART / "crds").glob("*.yaml"))}
    assert "inferenceservices.kvfleet.io.yaml" in top, "crds/inferenceservices.kvfleet.io.yaml is missing"
    assert sorted(chart) == sorted(top), "charts/kvfleet/crds/ and crds/ hold different files"
    for name in top:
        assert chart[name] == top[name], f"charts/kvfleet/crds/{name} differs from crds/{name}: cp crds/*.yaml charts/kvfleet/crds/"


def test_crds_validate_and_match_what_the_chart_relies_on():
    for crd in (c for p in (CHART / "crds").glob("*.yaml") for c in yaml.safe_load_all(p.read_text()) if c):
        kubernetes_validate.validate(crd, K8S_VERSION, strict=True)
    isvc = next(c for p in (CHART / "crds").glob("*.yaml") for c in yaml.safe_load_all(p.read_text())
                if c and c["metadata"]["name"] == "inferenceservices.kvfleet.io")
    (version,) = [v for v in isvc["spec"]["versions"] if v["storage"]]
    # RBAC grants the scale and status subresources: the CRD must have them.
    assert set(version["subresources"]) == {"status", "scale"}
    assert version["subresources"]["scale"]["specReplicasPath"] == ".spec.replicas"


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_operator_args_parse_with_the_operators_own_parser(helm_bin, name):
    """The rendered `kvfleet operator` arguments are accepted by kvfleet.operator.main and
    mean what the values say (namespaces, peering, health port, verbosity)."""
    from kvfleet.operator import main

    values = yaml.safe_load((CHART / "values.yaml").read_text())
    objs = render(helm_bin, *VALUE_SETS[name])
    (c,) = one(objs, "Deployment")["spec"]["template"]["spec"]["containers"]
    args = main.parse_args(c["args"])
    rendered_ns = sorted(o["metadata"]["namespace"] for o in by_kind(objs, "RoleBinding"))
    if by_kind(objs, "ClusterRoleBinding") and not rendered_ns:
        assert args.namespace == [] and args.all_namespaces
    if rendered_ns:
        assert sorted(args.namespace) == rendered_ns
    port = next(p for p in c["ports"] if p["name"] == "health")["containerPort"]
    assert args.health_port == port
    peering = by_kind(objs, "ClusterKopfPeering") + by_kind(objs, "KopfPeering")
    if peering:
        assert {p["metadata"]["name"] for p in peering} == {args.peering}
        assert not args.standalone
    elif name == "all-optional-off":
        assert args.standalone and args.peering is None
    assert args.verbose == (name == "ha-and-scheduling")  # the set with operator.logLevel=debug
    assert values["operator"]["peering"]["name"] == main.DEFAULT_PEERING


def test_chart_app_version_is_the_package_version_and_the_default_runtime_tag():
    import tomllib

    from kvfleet.operator import crd_schema

    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert chart["appVersion"] == project["version"]
    assert crd_schema.DEFAULT_IMAGE.rsplit(":", 1)[1] == chart["appVersion"]


def test_runtime_image_value_is_the_operators_default_runtime_image(helm_bin):
    def env(*args):
        (c,) = one(render(helm_bin, *args), "Deployment")["spec"]["template"]["spec"]["containers"]
        return {e["name"]: e.get("value") for e in c["env"]}["KVFLEET_RUNTIME_IMAGE"]

    from kvfleet.operator import crd_schema

    assert env() == crd_schema.DEFAULT_IMAGE  # the chart's appVersion: the same image the CRD documents
    assert env("--set", "runtimeImage.repository=registry.example/kvfleet-runtime",
               "--set", "runtimeImage.tag=dev") == "registry.example/kvfleet-runtime:dev"
    digest = "sha256:" + "a" * 64
    assert env("--set", f"runtimeImage.digest={digest}") == f"ghcr.io/kvfleet/kvfleet-runtime@{digest}"
