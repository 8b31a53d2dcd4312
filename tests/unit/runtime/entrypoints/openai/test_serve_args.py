"""`kvfleet serve` options: command line > KVFLEET_* environment > --config file > defaults."""

from __future__ import annotations

import json

import pytest

from kvfleet.runtime.config import EngineConfig
from kvfleet.runtime.entrypoints.openai.serve_args import (
    ServerSettings,
    build_parser,
    env_var,
    load_config_file,
    option_names,
    parse_serve_args,
    parse_size,
)

ISSUE_OPTIONS = [
    "model", "host", "port", "served_model_name", "block_size", "max_num_seqs", "max_num_batched_tokens",
    "max_model_len", "gpu_memory_utilization", "kv_cache_memory", "dtype", "api_key", "max_queue_len",
    "enable_prefix_caching", "scheduling_policy", "metrics_compat",
]  # fmt: skip


def test_every_engine_field_and_issue_option_has_a_flag_and_env_var():
    assert set(EngineConfig.model_fields) <= set(option_names())
    assert set(ISSUE_OPTIONS) <= set(option_names())
    help_text = build_parser().format_help()
    for name in option_names():
        assert "--" + name.replace("_", "-") in help_text
        assert env_var(name) in help_text
    assert "--config" in help_text and "--no-enable-prefix-caching" in help_text


def test_precedence_cli_over_env_over_file(tmp_path):
    cfg = tmp_path / "kvfleet.yaml"
    cfg.write_text("block-size: 32\nmax_num_seqs: 8\nport: 9000\nmax-model-len: 1024\napi_key: from-file\n")
    env = {"KVFLEET_MAX_NUM_SEQS": "16", "KVFLEET_PORT": "9100", "KVFLEET_CONFIG": str(cfg)}
    args = parse_serve_args(["--port", "9200"], env)
    assert args.server.port == 9200 and args.sources["port"] == "cli"
    assert args.engine.max_num_seqs == 16 and args.sources["max_num_seqs"] == "env"
    assert args.engine.block_size == 32 and args.sources["block_size"] == "file"
    assert args.engine.max_model_len == 1024
    assert args.server.api_key == "from-file"
    assert args.engine.max_num_batched_tokens == EngineConfig().max_num_batched_tokens
    assert "max_num_batched_tokens" not in args.sources


def test_json_config_and_explicit_config_flag(tmp_path):
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"gpu_memory_utilization": 0.5, "scheduling-policy": "fair", "metrics_compat": "vllm",
                               "enable_prefix_caching": False, "kv_cache_memory": "512MiB"}))  # fmt: skip
    args = parse_serve_args(["--config", str(cfg)], {})
    assert args.engine.gpu_memory_utilization == 0.5
    assert args.engine.scheduling_policy == "fair"
    assert args.engine.enable_prefix_caching is False
    assert args.engine.kv_cache_memory == 512 * 1024**2
    assert args.server.metrics_compat == "vllm"


def test_booleans_from_every_source(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("enable_prefix_caching: false\n")
    assert parse_serve_args(["--config", str(cfg)], {}).engine.enable_prefix_caching is False
    assert parse_serve_args(["--config", str(cfg)], {"KVFLEET_ENABLE_PREFIX_CACHING": "true"}).engine.enable_prefix_caching
    assert parse_serve_args(["--enable-prefix-caching"], {"KVFLEET_ENABLE_PREFIX_CACHING": "0"}).engine.enable_prefix_caching
    assert not parse_serve_args(["--no-enable-prefix-caching"], {}).engine.enable_prefix_caching


def test_empty_env_value_is_unset_and_none_unsets(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("max_model_len: 512\n")
    assert parse_serve_args(["--config", str(cfg)], {"KVFLEET_MAX_MODEL_LEN": ""}).engine.max_model_len == 512
    assert parse_serve_args(["--config", str(cfg)], {"KVFLEET_MAX_MODEL_LEN": "none"}).engine.max_model_len is None


@pytest.mark.parametrize(
    "argv,env,needle",
    [
        (["--block-size", "abc"], {}, "--block-size='abc'"),
        ([], {"KVFLEET_PORT": "http"}, "KVFLEET_PORT='http'"),
        (["--gpu-memory-utilization", "1.5"], {}, "--gpu-memory-utilization"),
        (["--max-queue-len", "0"], {}, "--max-queue-len"),
        (["--dtype", "int3"], {}, "invalid choice"),
        (["--kv-cache-memory", "lots"], {}, "--kv-cache-memory"),
    ],
)
def test_invalid_values_exit_2_naming_the_source(capsys, argv, env, needle):
    with pytest.raises(SystemExit) as exc:
        parse_serve_args(argv, env)
    assert exc.value.code == 2
    assert needle in capsys.readouterr().err


def test_config_file_errors(tmp_path, capsys):
    bad_key = tmp_path / "a.yaml"
    bad_key.write_text("block_size: 16\nmax_sequences: 3\n")
    with pytest.raises(ValueError, match="unknown option 'max_sequences'"):
        load_config_file(bad_key)
    not_map = tmp_path / "b.yaml"
    not_map.write_text("- 1\n- 2\n")
    with pytest.raises(ValueError, match="mapping"):
        load_config_file(not_map)
    bad_value = tmp_path / "c.yaml"
    bad_value.write_text("block_size: huge\n")
    with pytest.raises(SystemExit):
        parse_serve_args(["--config", str(bad_value)], {})
    assert "config key block_size='huge'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_serve_args(["--config", str(tmp_path / "missing.yaml")], {})
    assert load_config_file(_write(tmp_path / "empty.yaml", "")) == {}


def _write(path, text):
    path.write_text(text)
    return path


def test_parse_size():
    assert parse_size("2GiB") == 2 * 1024**3
    assert parse_size("512MiB") == 512 * 1024**2
    assert parse_size("800M") == 800_000_000
    assert parse_size("1.5G") == 1_500_000_000
    assert parse_size("4096") == 4096
    assert parse_size(123) == 123
    assert parse_size("lots") == "lots"


def test_server_settings_defaults():
    s = ServerSettings()
    assert (s.host, s.port, s.api_key, s.max_queue_len, s.metrics_compat) == ("0.0.0.0", 8000, None, None, "none")


def test_serve_options_take_vllm_spellings():
    from kvfleet.runtime.entrypoints.openai.serve_args import parse_serve_args

    args = parse_serve_args(["--enable-lora", "--max-loras", "4", "--max-lora-rank", "8", "--max-cpu-loras", "8",
                             "--lora-modules", "a=/ad/a", "b=/ad/b", "--lora-modules",
                             '{"name": "c", "path": "/ad/c", "base_model_name": "base"}'],
                            environ={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"})
    e = args.engine
    assert (e.enable_lora, e.max_loras, e.max_lora_rank, e.max_cpu_loras) == (True, 4, 8, 8)
    assert [(m.name, m.path, m.base_model_name) for m in e.lora_modules] == [
        ("a", "/ad/a", None), ("b", "/ad/b", None), ("c", "/ad/c", "base")]
    assert args.server.allow_runtime_lora_updating
    env = {"KVFLEET_ENABLE_LORA": "true", "KVFLEET_LORA_MODULES": '[{"name": "x", "path": "/p"}]'}
    assert parse_serve_args([], environ=env).engine.lora_modules[0].name == "x"
    assert not parse_serve_args([], environ={}).server.allow_runtime_lora_updating
    with pytest.raises(SystemExit):
        parse_serve_args(["--enable-lora", "--lora-modules", "no-equals-sign"], environ={})


def test_a_replica_is_a_fleet_member_with_no_flag_and_each_part_turns_off():
    """Issue 42: KV events (a free port, hashes only), peer KV pull and the drain hand-off are
    on by default; ``none`` from any source turns each off; an explicit config is kept as given."""
    from kvfleet.runtime.entrypoints.openai.serve_args import DEFAULT_DRAIN_HANDOFF_GRACE

    args = parse_serve_args([], environ={})
    events, transfer = args.engine.kv_events_config, args.engine.kv_transfer_config
    assert events.enabled and events.publisher == "zmq" and events.endpoint == "tcp://*:0"
    assert not events.include_token_ids
    assert transfer.kv_role == "kv_both" and transfer.serves and transfer.pulls
    assert args.server.drain_handoff_grace == DEFAULT_DRAIN_HANDOFF_GRACE <= args.server.shutdown_timeout
    off = parse_serve_args(["--kv-events-config", "none", "--drain-handoff-grace", "none"],
                           environ={"KVFLEET_KV_TRANSFER_CONFIG": "none"})
    assert off.engine.kv_events_config is None and off.engine.kv_transfer_config is None
    assert off.server.drain_handoff_grace is None
    given = parse_serve_args(["--kv-events-config", '{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}'],
                             environ={})
    assert given.engine.kv_events_config.endpoint == "tcp://*:5557" and given.engine.kv_events_config.include_token_ids
    # tensor parallel: no peer pull by default (refused there), events still on
    tp = parse_serve_args(["--tensor-parallel-size", "2"], environ={})
    assert tp.engine.kv_transfer_config is None and tp.engine.kv_events_config.enabled
