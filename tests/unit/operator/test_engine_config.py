"""Config passthrough: ``engine.extraArgs`` takes every option ``kvfleet serve --config``
accepts (engine and server options alike), except those the operator sets itself; the
ConfigMap the operator writes is read back by the runtime's own option parser."""

from __future__ import annotations

import copy

import pytest
import yaml
from support.paths import ROOT

from kvfleet.operator import builders, service_spec
from kvfleet.operator.builders import InvalidSpec
from kvfleet.runtime.config import EngineConfig
from kvfleet.runtime.entrypoints.openai.serve_args import ServerSettings, parse_serve_args

OWNED_BY_THE_OPERATOR = {"host", "port", "api_key"}  # the pod's address; apiKeySecretRef


def isvc(**extra) -> dict:
    obj = yaml.safe_load((ROOT / "examples/inferenceservice-minimal.yaml").read_text())
    obj["metadata"].update(uid="u", namespace="default", generation=1)
    obj["spec"].setdefault("engine", {})["extraArgs"] = extra
    return copy.deepcopy(obj)


def test_every_server_option_but_the_operators_own_passes_through():
    assert set(builders.SERVER_CONFIG_KEYS) == set(ServerSettings.model_fields) - OWNED_BY_THE_OPERATOR


def test_every_typed_engine_field_is_a_runtime_option_of_its_name():
    # spec.engine's fields reach the config file by name (builders.ENGINE_KEYS is the view's fields)
    assert set(builders.ENGINE_KEYS) <= set(EngineConfig.model_fields)
    assert {"block_size", "gpu_memory_utilization", "kv_cache_dtype", "enforce_eager"} <= set(builders.ENGINE_KEYS)
    assert not set(builders.ENGINE_SECTIONS) & set(builders.ENGINE_KEYS)


def test_extra_args_reach_kvfleet_serve_through_the_config_file(tmp_path):
    config = builders.engine_config(isvc(metrics_compat="vllm", max_queue_len=4, shutdown_timeout=45,
                                         enable_chunked_prefill=True))
    path = tmp_path / "config.yaml"
    path.write_text(builders.config_text(config))
    args = parse_serve_args(["--config", str(path)], environ={})
    assert (args.server.metrics_compat, args.server.max_queue_len, args.server.shutdown_timeout) == ("vllm", 4, 45)
    assert args.engine.enable_chunked_prefill is True


@pytest.mark.parametrize("key", sorted(OWNED_BY_THE_OPERATOR) + ["no_such_option"])
def test_what_the_operator_sets_or_the_runtime_lacks_is_refused(key):
    with pytest.raises(InvalidSpec) as e:
        builders.engine_config(isvc(**{key: 1}))
    assert e.value.reason == "UnknownEngineArg"


def test_typed_fields_still_win_over_extra_args():
    with pytest.raises(InvalidSpec) as e:
        builders.engine_config(isvc(block_size=32))
    assert e.value.reason == "ConflictingEngineArg"
    assert "block_size" in EngineConfig.model_fields


def runtime_pod(**extra) -> dict:
    deploy = next(c for c in builders.desired_children(isvc(**extra)) if c["kind"] == "Deployment")
    return deploy["spec"]["template"]["spec"]


def test_pod_drains_within_its_grace_period():
    """preStop sleep first (endpoints go), then the runtime's drain bounded by shutdown_timeout,
    all inside terminationGracePeriodSeconds; the default matches `kvfleet serve`'s own."""
    assert service_spec.DEFAULT_SHUTDOWN_TIMEOUT == ServerSettings.model_fields["shutdown_timeout"].default
    pod = runtime_pod()
    (c,) = pod["containers"]
    assert c["lifecycle"]["preStop"] == {"exec": {"command": ["sleep", str(service_spec.PRESTOP_SECONDS)]}}
    assert pod["terminationGracePeriodSeconds"] == service_spec.PRESTOP_SECONDS + 30 + service_spec.SHUTDOWN_MARGIN_SECONDS
    assert runtime_pod(shutdown_timeout=120)["terminationGracePeriodSeconds"] == (
        service_spec.PRESTOP_SECONDS + 120 + service_spec.SHUTDOWN_MARGIN_SECONDS)
    with pytest.raises(InvalidSpec):
        runtime_pod(shutdown_timeout="soon")


def test_termination_messages_fall_back_to_the_logs():
    pod = runtime_pod()
    assert [c["terminationMessagePolicy"] for c in pod["containers"] + pod["initContainers"]] == [
        "FallbackToLogsOnError", "FallbackToLogsOnError"]


def test_the_minimal_example_is_not_best_effort():
    (c,) = runtime_pod()["containers"]
    requests = c["resources"]["requests"]
    assert {"cpu", "memory"} <= set(requests) and c["resources"]["limits"]["memory"] == requests["memory"]
