"""``autoscaling.mode: hpa``: the HorizontalPodAutoscaler the operator makes is one of
``builders.desired_children`` (and absent in the other modes), validates against the official
Kubernetes schema (kubernetes-validate) and targets the InferenceService's scale subresource
with the queue-depth Pods metric."""

from __future__ import annotations

import copy

import kubernetes_validate
import pytest
import yaml
from support.paths import ROOT

from kvfleet.operator import builders, crd, crd_schema, router, service_spec
from kvfleet.operator.hpa import HPA_KV_METRIC, HPA_METRIC, build_hpa, hpas_targeting, scalers_targeting
from kvfleet.operator.reconcile import desired_objects

K8S_VERSION = "1.33"


def hpa_children(obj: dict) -> list[dict]:
    """The HPAs among every child the builders give."""
    return [c for c in builders.desired_children(obj) if c["kind"] == "HorizontalPodAutoscaler"]


def isvc(**autoscaling) -> dict:
    obj = yaml.safe_load((ROOT / "examples" / "inferenceservice-autoscaled.yaml").read_text())
    obj["metadata"]["uid"] = "0b6c2c1e-8f0c-4c1e-9a57-3f3c8f0e4d21"
    obj["spec"]["autoscaling"].update(mode="hpa", **autoscaling)
    return obj


def test_hpa_validates_and_targets_the_scale_subresource():
    obj = isvc(targetQueueDepth=3, scaleDown={"stabilizationWindowSeconds": 120})
    (hpa,) = hpa_children(obj)
    kubernetes_validate.validate(hpa, K8S_VERSION, strict=True)
    assert hpa["apiVersion"] == "autoscaling/v2" and hpa["kind"] == "HorizontalPodAutoscaler"
    # Targets the InferenceService itself (its scale subresource), not the Deployment.
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": crd.API_VERSION, "kind": "InferenceService",
                                             "name": obj["metadata"]["name"]}
    scale = crd.crd()["spec"]["versions"][0]["subresources"]["scale"]
    assert scale["specReplicasPath"] == ".spec.replicas" and scale["labelSelectorPath"] == ".status.selector"
    metric, kv = hpa["spec"]["metrics"]
    assert metric == {"type": "Pods", "pods": {"metric": {"name": HPA_METRIC},
                                               "target": {"type": "AverageValue", "averageValue": "3"}}}
    assert kv["pods"]["metric"]["name"] == HPA_KV_METRIC
    assert hpa["spec"]["behavior"] == {"scaleUp": {"stabilizationWindowSeconds": 0},
                                       "scaleDown": {"stabilizationWindowSeconds": 120}}
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (1, 4)
    assert hpa["metadata"]["ownerReferences"] == [service_spec.owner_reference(obj)]
    assert hpa["metadata"]["labels"] == service_spec.labels(obj)
    assert hpa["metadata"]["namespace"] == "default"


def test_fractional_target_and_min_zero():
    (hpa,) = hpa_children(isvc(targetQueueDepth=2.5, minReplicas=0))
    kubernetes_validate.validate(hpa, K8S_VERSION, strict=True)
    assert hpa["spec"]["metrics"][0]["pods"]["target"]["averageValue"] == "2500m"
    assert hpa["spec"]["minReplicas"] == 1  # the HPA cannot go to 0 without the HPAScaleToZero gate


def test_a_broken_hpa_would_fail_validation():
    """Control: the schema check is not vacuous."""
    (hpa,) = hpa_children(isvc())
    bad = copy.deepcopy(hpa)
    del bad["spec"]["scaleTargetRef"]["kind"]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)
    bad = copy.deepcopy(hpa)
    bad["spec"]["maxReplicas"] = "4"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


def test_only_mode_hpa_makes_an_hpa_child():
    obj = isvc()
    kinds = [c["kind"] for c in builders.desired_children(obj)]
    assert kinds == ["ConfigMap", "Service", "Deployment", "PodDisruptionBudget", "HorizontalPodAutoscaler"]
    assert builders.build_hpa(obj) == hpa_children(obj)[0]
    # The reconcile applies (and prunes) exactly what the builders give: the HPA too.
    assert [c["kind"] for c in desired_objects(obj)] == kinds + list(router.KINDS)  # and the router's, by default
    for mode in ("operator", "none"):
        other = copy.deepcopy(obj)
        other["spec"]["autoscaling"]["mode"] = mode
        assert builders.build_hpa(other) is None
        assert "HorizontalPodAutoscaler" not in [c["kind"] for c in builders.desired_children(other)]
        assert "HorizontalPodAutoscaler" not in [c["kind"] for c in desired_objects(other)]
    no_autoscaling = copy.deepcopy(obj)
    del no_autoscaling["spec"]["autoscaling"]
    assert hpa_children(no_autoscaling) == []


def test_invalid_autoscaling_is_an_invalid_spec():
    obj = isvc(minReplicas=5, maxReplicas=2)
    with pytest.raises(builders.InvalidSpec) as e:
        hpa_children(obj)
    assert e.value.reason == "InvalidAutoscaling"


def test_conflicting_hpa_detection():
    ours = build_hpa({"metadata": {"name": "a"}, "spec": {"autoscaling": {"mode": "hpa", "maxReplicas": 3}}})
    other = {"metadata": {"name": "mine"}, "spec": {"scaleTargetRef": {
        "apiVersion": "kvfleet.io/v1alpha1", "kind": "InferenceService", "name": "a"}}}
    deploy = {"metadata": {"name": "d"}, "spec": {"scaleTargetRef": {
        "apiVersion": "apps/v1", "kind": "Deployment", "name": "a"}}}
    assert hpas_targeting([ours, other, deploy], "a") == ["a", "mine"]
    assert hpas_targeting([ours, other, deploy], "a", own="a") == ["mine"]
    assert hpas_targeting([ours, other], "b") == []
    keda = {"metadata": {"name": "so"}, "spec": {"scaleTargetRef": {"name": "a"}}}  # KEDA: Deployment by default
    assert scalers_targeting([other, deploy], [keda], "a", deployment="a") == [
        ("HorizontalPodAutoscaler d", "Deployment"), ("HorizontalPodAutoscaler mine", "InferenceService"),
        ("ScaledObject so", "Deployment")]
    assert scalers_targeting([deploy], [keda], "a") == []  # without the Deployment's name: only the resource


def test_hpa_honours_the_kv_usage_target_and_min_replicas_zero_acts_as_one():
    hpa = build_hpa({"metadata": {"name": "a"}, "spec": {"autoscaling": {
        "mode": "hpa", "minReplicas": 0, "maxReplicas": 3, "targetQueueDepth": 2, "targetKVCacheUsage": 0.7}}})
    targets = {m["pods"]["metric"]["name"]: m["pods"]["target"]["averageValue"] for m in hpa["spec"]["metrics"]}
    assert targets == {HPA_METRIC: "2", HPA_KV_METRIC: "700m"}
    assert hpa["spec"]["minReplicas"] == 1
    assert "acts as 1" in crd_schema.AUTOSCALING["properties"]["minReplicas"]["description"]
