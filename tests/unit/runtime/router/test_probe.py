"""The probe loop's load parsing (kvfleet.runtime.router.probe): kvfleet's and vLLM's metric names."""

from __future__ import annotations

from kvfleet.runtime.router.probe import parse_load


def test_parse_load_reads_kvfleet_and_vllm_names():
    text = ('# TYPE kvfleet:num_requests_waiting gauge\nkvfleet:num_requests_waiting{model_name="m"} 3.0\n'
            '# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name="m"} 2.0\n'
            '# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{model_name="m"} 9.0\n'
            '# TYPE kvfleet:kv_cache_usage_perc gauge\nkvfleet:kv_cache_usage_perc{model_name="m"} 0.25\n')
    assert parse_load(text) == {"waiting": 3.0, "running": 2.0, "kv_cache_usage": 0.25}
