"""spec.router and spec.router.inferencePool: the router's children (pure builders), the status
URL and ScaleFromZero condition, wake from zero in the scaling policy, the routers' metrics, and
the InferencePool validated against the published GIE CRD (tests/data/golden/)."""

from __future__ import annotations

import copy

import jsonschema
import kubernetes_validate
import pytest
import yaml
from support.crd_admission import admit, cel_errors
from support.paths import GOLDEN

from kvfleet.operator import crd, gie, pod_metrics, policy, reconcile, router, service_spec, spec_view
from kvfleet.operator.router_load import parse_router_load
from kvfleet.operator.status import desired_status

GIE_CRD = GOLDEN / "gie-inferencepools-v1.6.0.yaml"
UID = "0b7f1c1e-5a8e-4a4b-9c33-6c3d2b1a0f00"


def isvc(**spec) -> dict:
    obj = {"apiVersion": crd.API_VERSION, "kind": crd.KIND,
           "metadata": {"name": "chat", "namespace": "llm", "uid": UID, "generation": 1},
           "spec": {"model": {"uri": "hf://HuggingFaceTB/SmolLM2-135M-Instruct"}, **spec}}
    assert admit(copy.deepcopy(obj)) == []
    return crd.apply_defaults(obj)


def by_kind(children):
    return {c["kind"]: c for c in children}


def test_router_children_only_when_enabled_and_owned():
    assert [c["kind"] for c in router.desired_children(isvc())] == list(router.KINDS)  # on by default (issue 42)
    assert router.desired_children(isvc(router={"enabled": False})) == []
    kids = by_kind(router.desired_children(isvc(router={"enabled": True, "replicas": 3})))
    assert list(kids) == list(router.KINDS)
    for child in kids.values():
        assert child["metadata"]["name"] == "chat-router" and child["metadata"]["namespace"] == "llm"
        assert child["metadata"]["ownerReferences"][0]["uid"] == UID
        kubernetes_validate.validate(child, "1.30.0", strict=True)
    assert kids["Deployment"]["spec"]["replicas"] == 3


def test_no_single_router_two_pods_a_pdb_and_rolls_that_never_leave_zero():
    obj = isvc(router={"enabled": True})
    kids = by_kind(router.desired_children(obj))
    deploy, pdb = kids["Deployment"]["spec"], kids["PodDisruptionBudget"]
    assert deploy["replicas"] == 2  # the default
    assert deploy["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    pod = deploy["template"]["spec"]
    (c,) = pod["containers"]
    assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    # the PDB covers exactly the router pods, one down at a time, and not the runtime pods
    assert pdb["apiVersion"] == "policy/v1" and pdb["spec"]["maxUnavailable"] == 1
    assert "minAvailable" not in pdb["spec"]
    assert pdb["spec"]["selector"] == deploy["selector"] == {"matchLabels": router.selector_labels(obj)}
    assert pdb["metadata"]["name"] != service_spec.names(obj)["pdb"]
    assert pdb["spec"]["selector"]["matchLabels"] != service_spec.selector_labels(obj)
    term = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]
    assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    assert term["podAffinityTerm"]["labelSelector"] == deploy["selector"]
    # preStop sleep (endpoints go first), then the SIGTERM drain, both within the kubelet's grace
    flags = dict(zip(c["args"][1::2], c["args"][2::2]))
    assert c["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "10"]
    assert flags["--shutdown-timeout"] == "30" and pod["terminationGracePeriodSeconds"] == 10 + 30 + 5
    longer = by_kind(router.desired_children(isvc(router={"enabled": True, "shutdownTimeoutSeconds": 600})))
    assert longer["Deployment"]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 615
    one = by_kind(router.desired_children(isvc(router={"enabled": True, "replicas": 1})))
    assert one["Deployment"]["spec"]["replicas"] == 1 and one["PodDisruptionBudget"]["spec"]["maxUnavailable"] == 1


def test_router_rbac_is_least_privilege():
    kids = by_kind(router.desired_children(isvc(router={"enabled": True})))
    assert kids["Role"]["rules"] == [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                                      "verbs": ["get", "list", "watch"]}]
    binding = kids["RoleBinding"]
    assert binding["roleRef"]["name"] == "chat-router"
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "chat-router", "namespace": "llm"}]
    pod = kids["Deployment"]["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "chat-router"


def test_router_deployment_watches_the_runtime_service_and_is_not_selected_by_it():
    obj = isvc(router={"enabled": True, "algorithm": "least-load", "pendingTimeoutSeconds": 900, "maxPending": 64})
    kids = by_kind(router.desired_children(obj))
    c = kids["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    args = c["args"]
    assert c["command"] == ["kvfleet"] and args[0] == "router"
    flags = dict(zip(args[1::2], args[2::2]))
    assert flags["--kube-service"] == service_spec.names(obj)["service"] == "chat"
    assert flags["--routing-algorithm"] == "least-load"
    assert flags["--pending-timeout"] == "900" and flags["--max-pending"] == "64" and flags["--port"] == "8000"
    assert c["image"] == spec_view.of(obj).runtime.image
    runtime_selector = service_spec.selector_labels(obj)
    router_labels = kids["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert not all(router_labels.get(k) == v for k, v in runtime_selector.items())  # runtime Service skips it
    assert kids["Service"]["spec"]["selector"] == router.selector_labels(obj)
    # the settings the router parses are exactly these flags
    from kvfleet.runtime.router.settings import parse_args
    s = parse_args(args[1:], environ={})
    assert s.kube_service == "chat" and s.pending_timeout == 900 and s.routing_algorithm == "least-load"
    assert s.shutdown_timeout == 30


def test_status_url_points_at_the_router_when_enabled():
    off, on = isvc(router={"enabled": False}), isvc()  # on by default
    kw = {"deployment": None, "desired_deployment": None, "now": "2026-12-01T00:00:00Z"}
    assert desired_status(off, **kw)["url"] == "http://chat.llm.svc.cluster.local:8000/v1"
    assert desired_status(on, **kw)["url"] == "http://chat-router.llm.svc.cluster.local:8000/v1"


def test_scale_from_zero_condition_makes_min_replicas_zero_explicit():
    auto = {"mode": "operator", "minReplicas": 0, "maxReplicas": 2}
    kw = {"deployment": None, "desired_deployment": None, "now": "2026-12-01T00:00:00Z"}

    def cond(obj):
        return next((c for c in desired_status(obj, **kw)["conditions"] if c["type"] == "ScaleFromZero"), None)

    trap = cond(isvc(autoscaling=auto, router={"enabled": False}))
    assert (trap["status"], trap["reason"]) == ("False", "NoRouter") and "router" in trap["message"]
    ok = cond(isvc(autoscaling=auto))  # the router is on by default: scale-from-zero holds requests
    assert (ok["status"], ok["reason"]) == ("True", "RouterHoldsRequests")
    assert cond(isvc(autoscaling={**auto, "minReplicas": 1})) is None
    assert cond(isvc()) is None


def test_reconcile_desires_router_children_and_pool():
    objs = reconcile.desired_objects(isvc(router={"enabled": True, "inferencePool": {"enabled": True}}))
    kinds = [o["kind"] for o in objs]
    assert kinds[:3] == ["ConfigMap", "Service", "Deployment"]
    assert kinds[-7:] == [*router.KINDS, "InferencePool"]
    config = yaml.safe_load(objs[0]["data"]["config.yaml"])
    assert config["metrics_compat"] == "vllm"  # GIE's endpoint picker reads vllm: names
    assert "metrics_compat" not in yaml.safe_load(reconcile.desired_objects(isvc())[0]["data"]["config.yaml"])


def _gie_schema() -> dict:
    doc = yaml.safe_load(GIE_CRD.read_text())
    assert doc["spec"]["group"] == gie.GROUP and doc["spec"]["names"]["kind"] == gie.KIND
    version = next(v for v in doc["spec"]["versions"] if v["name"] == gie.VERSION)
    assert version["served"] and version["storage"]
    return version["schema"]["openAPIV3Schema"]


def _gie_errors(obj: dict) -> list[str]:
    """As the API server admits it: the CRD's defaults, the OpenAPI schema, then its CEL rules."""
    schema = _gie_schema()
    obj = crd.apply_defaults(obj, schema)
    errors = [e.message for e in jsonschema.Draft4Validator(schema).iter_errors(obj)]
    return errors + cel_errors(obj, schema)


def test_inference_pool_validates_against_the_published_crd():
    assert gie.build_inference_pool(isvc()) is None
    obj = isvc(router={"inferencePool": {"enabled": True,
                                         "endpointPickerRef": {"name": "vllm-epp", "failureMode": "FailOpen"}}})
    pool = gie.build_inference_pool(obj)
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1" and pool["kind"] == "InferencePool"
    assert pool["spec"]["selector"]["matchLabels"] == service_spec.selector_labels(obj)
    assert pool["spec"]["targetPorts"] == [{"number": 8000}]
    assert pool["spec"]["endpointPickerRef"] == {"name": "vllm-epp", "port": {"number": 9002}, "failureMode": "FailOpen"}
    assert _gie_errors(pool) == []
    bare = gie.build_inference_pool(isvc(router={"inferencePool": {"enabled": True}}))
    assert "endpointPickerRef" not in bare["spec"] and _gie_errors(bare) == []
    # the schema is really checked: a pool without ports, or a picker Service without a port, is refused
    broken = copy.deepcopy(pool)
    broken["spec"]["targetPorts"] = []
    assert _gie_errors(broken)
    broken = copy.deepcopy(pool)
    del broken["spec"]["endpointPickerRef"]["port"]
    assert any("port is required" in e for e in _gie_errors(broken))


def test_crd_rejects_bad_router_values():
    base = {"apiVersion": crd.API_VERSION, "kind": crd.KIND, "metadata": {"name": "x"},
            "spec": {"model": {"uri": "hf://a/b"}}}
    for bad in ({"algorithm": "random"}, {"replicas": 0}, {"replicas": 101}, {"shutdownTimeoutSeconds": -1},
                {"loadFactor": 0.5},
                {"inferencePool": {"enabled": True, "endpointPickerRef": {}}}):
        obj = copy.deepcopy(base)
        obj["spec"]["router"] = bad
        assert admit(obj), bad


def test_policy_wakes_from_zero_on_pending_requests_at_once():
    cfg = policy.AutoscalingConfig.from_spec({"mode": "operator", "minReplicas": 0, "maxReplicas": 3,
                                              "scaleUp": {"stabilizationWindowSeconds": 600}})
    empty = pod_metrics.aggregate(1000.0, [])
    d = policy.decide_scale(cfg, now=1000.0, current=0, ready=0, metrics=empty,
                            router=policy.RouterLoad(pending=2, in_flight=0))
    assert (d.replicas, d.reason) == (1, "ScaledFromZero") and "2 request" in d.message
    idle = policy.decide_scale(cfg, now=1000.0, current=0, ready=0, metrics=empty,
                               router=policy.RouterLoad(pending=0, in_flight=0))
    assert idle.replicas == 0
    assert policy.decide_scale(cfg, now=1000.0, current=0, ready=0, metrics=empty).replicas == 0


def test_policy_never_scales_to_zero_with_requests_in_flight():
    cfg = policy.AutoscalingConfig.from_spec({"mode": "operator", "minReplicas": 0, "maxReplicas": 3,
                                              "scaleDown": {"stabilizationWindowSeconds": 0}})
    metrics = pod_metrics.aggregate(1000.0, [pod_metrics.PodMetrics("p-1")])  # an idle replica
    down = policy.decide_scale(cfg, now=1000.0, current=1, ready=1, metrics=metrics)
    assert (down.replicas, down.reason) == (0, "ScaledToZero")
    busy = policy.decide_scale(cfg, now=1000.0, current=1, ready=1, metrics=metrics,
                               router=policy.RouterLoad(pending=0, in_flight=1))
    assert (busy.replicas, busy.reason) == (1, "RequestsInFlight")
    quiet = policy.decide_scale(cfg, now=1000.0, current=1, ready=1, metrics=metrics,
                                router=policy.RouterLoad(pending=0, in_flight=0))
    assert quiet.replicas == 0
    # with a scale-down window, it runs from the last moment the router had work
    windowed = policy.AutoscalingConfig.from_spec({"mode": "operator", "minReplicas": 0, "maxReplicas": 3,
                                                   "scaleDown": {"stabilizationWindowSeconds": 10}})
    d = policy.decide_scale(windowed, now=1000.0, current=1, ready=1, metrics=metrics,
                            history=(policy.Recommendation(980.0, 1),), router=policy.RouterLoad(0, 1))
    for t in (1005.0, 1009.5):
        d = policy.decide_scale(windowed, now=t, current=1, ready=1, metrics=metrics, history=d.history,
                                router=policy.RouterLoad(0, 0))
        assert d.replicas == 1, (t, d.reason)
    d = policy.decide_scale(windowed, now=1010.5, current=1, ready=1, metrics=metrics, history=d.history,
                            router=policy.RouterLoad(0, 0))
    assert (d.replicas, d.reason) == (0, "ScaledToZero")


def test_parse_router_load():
    text = ("# TYPE kvfleet:router_pending_requests gauge\nkvfleet:router_pending_requests 3.0\n"
            "# TYPE kvfleet:router_in_flight_requests gauge\nkvfleet:router_in_flight_requests 2.0\n")
    assert parse_router_load(text) == policy.RouterLoad(3.0, 2.0)
    assert parse_router_load("") == policy.RouterLoad(0.0, 0.0)
    with pytest.raises(ValueError):
        parse_router_load("not { prometheus")


def test_the_operators_router_image_applies_to_the_default_router_too():
    # spec.router absent: the router is on (issue 42), so the chart's router.image is its image
    for obj in (isvc(), isvc(router={"enabled": True})):
        deploy = by_kind(router.desired_children(router.with_default_image(obj, "example/router:1")))["Deployment"]
        assert deploy["spec"]["template"]["spec"]["containers"][0]["image"] == "example/router:1"
    own = isvc(router={"image": "mine/router:2"})
    assert router.with_default_image(own, "example/router:1") == own
    off = isvc(router={"enabled": False})
    assert router.with_default_image(off, "example/router:1") == off
