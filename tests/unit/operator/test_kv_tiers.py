"""``spec.engine.kvCache.tiers`` (issue 29): admission (schema + CEL), the runtime config keys the
runtime's own option parser accepts, the disk tier's volume, the router's peer hints. Issue 42: no
``tiers`` is the peer tier; ``tiers: []`` turns the runtime's own defaults off too."""

from __future__ import annotations

import copy

import kubernetes_validate
import pytest
import yaml
from support.crd_admission import admit
from support.paths import ROOT

from kvfleet.operator import builders, crd, kv_tiers, router
from kvfleet.runtime.config import EngineConfig
from kvfleet.runtime.entrypoints.openai.serve_args import parse_serve_args
from kvfleet.runtime.router.settings import parse_args as parse_router_args

PEER = {"type": "peer", "minPullBlocks": 8, "maxConcurrentPulls": 3}
DISK = {"type": "disk", "size": "2Gi"}


def isvc(*tiers, router_on: bool = False) -> dict:
    obj = yaml.safe_load((ROOT / "examples/inferenceservice-minimal.yaml").read_text())
    obj["metadata"].update(uid="u", namespace="default", generation=1)
    obj["spec"].setdefault("engine", {})["kvCache"] = {"tiers": [copy.deepcopy(t) for t in tiers]}
    if router_on:
        obj["spec"]["router"] = {"enabled": True}
    return crd.apply_defaults(obj)


def by_kind(children) -> dict:
    return {c["kind"]: c for c in children}


@pytest.mark.parametrize(("tiers", "message"), [
    ([PEER, PEER], "each tier type at most once"),
    ([{"type": "disk"}], "a disk tier needs a size"),
    ([{"type": "disk", "size": "1Gi", "hostPath": "/x", "claimName": "c"}], "hostPath or claimName, not both"),
])
def test_admission_refuses_bad_tiers(tiers, message):
    assert any(message in e for e in admit(isvc(*tiers))), admit(isvc(*tiers))


def test_admission_takes_good_tiers_and_refuses_an_unknown_type():
    assert admit(isvc(PEER, DISK)) == []
    assert admit(isvc({"type": "ram"}))


def test_peer_and_disk_tiers_reach_kvfleet_serve(tmp_path):
    obj = isvc(PEER, DISK, router_on=True)
    config = builders.engine_config(obj)
    assert config["kv_transfer_config"] == {
        "kv_connector": "PeerPullConnector", "kv_role": "kv_both", "min_pull_blocks": 8, "max_concurrent_pulls": 3,
        "disk_path": kv_tiers.DEFAULT_DISK_PATH, "disk_max_bytes": 2 * 2**30}
    assert config["kv_events_config"]["endpoint"] == "tcp://*:5557"
    path = tmp_path / "config.yaml"
    path.write_text(builders.config_text(config))
    engine = parse_serve_args(["--config", str(path)], environ={}).engine
    assert isinstance(engine, EngineConfig) and engine.kv_transfer_config.disk_max_bytes == 2 * 2**30
    assert engine.kv_events_config.enable_kv_cache_events

    children = by_kind(builders.desired_children(obj))
    pod = children["Deployment"]["spec"]["template"]["spec"]
    assert {"name": "kv-disk", "emptyDir": {"sizeLimit": "2Gi"}} in pod["volumes"]
    assert {"name": "kv-disk", "mountPath": kv_tiers.DEFAULT_DISK_PATH} in pod["containers"][0]["volumeMounts"]
    kubernetes_validate.validate(children["Deployment"], "1.30.0", strict=True)
    args = router.router_args(obj)
    assert "--no-kv-peer-hint" not in args
    assert parse_router_args(args[1:], environ={}).kv_peer_hint


def test_a_disk_tier_alone_on_a_host_path_and_no_tiers_at_all():
    obj = isvc({"type": "disk", "size": "500Mi", "path": "/kv", "hostPath": "/mnt/kv"})
    config = builders.engine_config(obj)
    assert config["kv_transfer_config"]["kv_role"] == "kv_producer"
    assert config["kv_events_config"]["enable_kv_cache_events"]  # for the router's precise routing (the default)
    assert config["kv_transfer_config"]["disk_path"] == "/kv"
    pod = by_kind(builders.desired_children(obj))["Deployment"]["spec"]["template"]["spec"]
    assert {"name": "kv-disk", "hostPath": {"path": "/mnt/kv", "type": "DirectoryOrCreate"}} in pod["volumes"]
    assert "--no-kv-peer-hint" in router.router_args(obj)
    shared = by_kind(builders.desired_children(isvc({"type": "disk", "size": "5Gi", "claimName": "kv-shared"})))
    assert {"name": "kv-disk", "persistentVolumeClaim": {"claimName": "kv-shared"}} in \
        shared["Deployment"]["spec"]["template"]["spec"]["volumes"]
    plain = isvc()  # tiers: [] -- off, the runtime's defaults included
    assert builders.engine_config(plain)["kv_transfer_config"] is None
    with_default = isvc()
    with_default["spec"]["engine"].pop("kvCache")  # no tiers: the peer tier
    assert builders.engine_config(with_default)["kv_transfer_config"]["kv_role"] == "kv_both"
    assert "--no-kv-peer-hint" not in router.router_args(with_default)
    assert not [v for v in by_kind(builders.desired_children(plain))["Deployment"]["spec"]["template"]["spec"]
                ["volumes"] if v["name"] == "kv-disk"]


def test_extra_args_keep_their_own_kv_config():
    obj = isvc(PEER)
    obj["spec"]["engine"]["extraArgs"] = {"kv_events_config": {"enable_kv_cache_events": True, "topic": "t"}}
    assert builders.engine_config(obj)["kv_events_config"]["topic"] == "t"


def test_the_disk_tiers_size_reaches_status_metrics():
    from kvfleet.operator.metrics_source import parse_metrics
    from kvfleet.operator.pod_metrics import aggregate, metrics_changed
    from kvfleet.runtime.core.sched.output import SchedulerStats
    from kvfleet.runtime.engine.stats import IterationStats
    from kvfleet.runtime.metrics import PrometheusStatLogger, exposition

    def pod(name: str, disk_bytes: int | None):
        lg = PrometheusStatLogger("m")
        lg.record(SchedulerStats(), IterationStats(kv_disk_bytes=disk_bytes))
        return parse_metrics(name, exposition(lg.registry).decode())

    status = aggregate(1.0, [pod("a", 3 * 2**20), pod("b", 2**20)]).to_status()
    assert status["kvDiskBytes"] == 4 * 2**20
    assert "kvDiskBytes" not in aggregate(1.0, [pod("a", None)]).to_status()  # no disk tier: no field
    grown = aggregate(2.0, [pod("a", 30 * 2**20), pod("b", 2**20)]).to_status()
    assert metrics_changed(status, grown)
    assert not metrics_changed(status, aggregate(2.0, [pod("a", 3 * 2**20 + 10), pod("b", 2**20)]).to_status())


def precise_isvc(**router_extra) -> dict:
    obj = isvc()  # no tiers: events for the router only
    obj["spec"]["router"] = {"enabled": True, "algorithm": "precise-prefix-cache", **router_extra}
    return crd.apply_defaults(obj)


def test_precise_routing_turns_on_the_replicas_kv_events_and_the_router_follows_them(tmp_path):
    obj = precise_isvc()
    assert admit(obj) == []
    config = builders.engine_config(obj)
    assert config["kv_events_config"] == {"enable_kv_cache_events": True, "publisher": "zmq",
                                          "endpoint": kv_tiers.KV_EVENTS_ENDPOINT, "include_token_ids": False}
    assert config["kv_transfer_config"] is None  # events only: no tier, no pull
    path = tmp_path / "config.yaml"
    path.write_text(builders.config_text(config))
    assert parse_serve_args(["--config", str(path)], environ={}).engine.kv_events_config.enabled
    runtime = by_kind(builders.desired_children(obj))["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "kv-events", "containerPort": 5557, "protocol": "TCP"} in runtime["ports"]
    args = router.router_args(obj)
    settings = parse_router_args(args[1:], environ={})
    assert settings.routing_algorithm == "precise-prefix-cache" and not settings.kv_peer_hint
    # the same algorithm without the router, or another algorithm: no events, no port
    off = crd.apply_defaults({**obj, "spec": {**obj["spec"], "router": {"enabled": False,
                                                                         "algorithm": "precise-prefix-cache"}}})
    plain = crd.apply_defaults({**obj, "spec": {**obj["spec"], "router": {"enabled": True,
                                                                           "algorithm": "prefix-hash"}}})
    for other in (off, plain):
        assert builders.engine_config(other)["kv_events_config"] is None
        ports = by_kind(builders.desired_children(other))["Deployment"]["spec"]["template"]["spec"]
        assert [p["name"] for p in ports["containers"][0]["ports"]] == ["http"]


def test_precise_routing_with_its_own_events_config_gets_the_topic_and_the_api_key():
    obj = precise_isvc()
    obj["spec"]["engine"]["extraArgs"] = {"kv_events_config": {"enable_kv_cache_events": True,
                                                               "endpoint": "tcp://*:6000", "topic": "kv"}}
    obj["spec"]["runtime"]["apiKeySecretRef"] = {"name": "chat-key"}
    assert builders.engine_config(obj)["kv_events_config"]["topic"] == "kv"
    settings = parse_router_args(router.router_args(obj)[1:], environ={})
    assert settings.kv_events_topic == "kv" and settings.kv_events_auth == "fleet"
    # replicas publishing in plaintext (for a reader outside the fleet): the router reads them so
    obj["spec"]["engine"]["extraArgs"]["kv_events_config"]["auth"] = "none"
    assert parse_router_args(router.router_args(obj)[1:], environ={}).kv_events_auth == "none"
    obj["spec"]["engine"]["extraArgs"]["kv_events_config"].pop("auth")
    deploy = by_kind(router.desired_children(obj))["Deployment"]
    (container,) = deploy["spec"]["template"]["spec"]["containers"]
    assert {"name": "KVFLEET_ROUTER_API_KEY",
            "valueFrom": {"secretKeyRef": {"name": "chat-key", "key": "api-key"}}} in container["env"]
    kubernetes_validate.validate(deploy, "1.30.0", strict=True)
    # the user's own endpoint: the operator declares no port it did not choose
    runtime = by_kind(builders.desired_children(obj))["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    assert [p["name"] for p in runtime["ports"]] == ["http"]
    # a router that reads no events gets no key (it checks none today), only the fleet secret
    plain = crd.apply_defaults({**obj, "spec": {**obj["spec"], "router": {"enabled": True,
                                                                           "algorithm": "prefix-hash"}}})
    (container,) = by_kind(router.desired_children(plain))["Deployment"]["spec"]["template"]["spec"]["containers"]
    assert [e["name"] for e in container["env"]] == ["KVFLEET_FLEET_SECRET"]


@pytest.mark.parametrize("events", [{"enable_kv_cache_events": False}, {"enable_kv_cache_events": True,
                                                                          "publisher": "null"}])
def test_an_events_config_that_publishes_nothing_is_refused_when_events_are_needed(events):
    for obj in (precise_isvc(), isvc(PEER)):
        obj["spec"]["engine"]["extraArgs"] = {"kv_events_config": events}
        with pytest.raises(crd.InvalidSpec, match="kv_events_config must publish"):
            builders.engine_config(obj)
    obj = isvc()
    obj["spec"]["router"] = {"enabled": False}
    obj["spec"]["engine"]["extraArgs"] = {"kv_events_config": events}
    assert builders.engine_config(obj)["kv_events_config"] == events  # nothing needs them: the user's choice


def test_tensor_parallel_gets_no_default_tier_and_refuses_a_listed_one():
    """Each rank caches a share of the heads: the runtime refuses kv_transfer_config there."""
    obj = isvc()
    obj["spec"]["engine"].pop("kvCache")
    obj["spec"]["engine"]["tensorParallelSize"] = 2
    config = builders.engine_config(obj)
    assert config["kv_transfer_config"] is None and config["tensor_parallel_size"] == 2
    obj["spec"]["engine"]["kvCache"] = {"tiers": [PEER]}
    with pytest.raises(crd.InvalidSpec, match="tensorParallelSize"):
        builders.engine_config(obj)
