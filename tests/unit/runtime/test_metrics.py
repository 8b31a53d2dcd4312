"""The Prometheus stat logger: vLLM's names, buckets and suffixes under kvfleet: (and vllm:)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from kvfleet.runtime.core.sched.output import SchedulerStats, SpecDecodingStats
from kvfleet.runtime.engine.stats import FinishedRequestStats, IterationStats
from kvfleet.runtime.metrics import (
    ITERATION_TOKENS_BUCKETS,
    ITL_BUCKETS,
    REQUEST_LATENCY_BUCKETS,
    TTFT_BUCKETS,
    PrometheusStatLogger,
    build_1_2_5_buckets,
    exposition,
)


def families(logger: PrometheusStatLogger) -> dict:
    return {f.name: f for f in text_string_to_metric_families(exposition(logger.registry).decode())}


def value(fams, name, suffix="", **labels):
    fam = fams[name]
    for s in fam.samples:
        if s.name == name + suffix and all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    raise KeyError((name, suffix, labels))


def bucket_bounds(fams, name):
    return [float(s.labels["le"]) for s in fams[name].samples
            if s.name == name + "_bucket" and s.labels["le"] != "+Inf"]  # fmt: skip


def test_buckets_are_vllms():
    # vllm/v1/metrics/loggers.py
    assert len(TTFT_BUCKETS) == 22 and TTFT_BUCKETS[0] == 0.001 and TTFT_BUCKETS[-1] == 2560.0
    assert len(ITL_BUCKETS) == 19 and ITL_BUCKETS[0] == 0.01 and ITL_BUCKETS[-1] == 80.0
    assert len(REQUEST_LATENCY_BUCKETS) == 21
    assert REQUEST_LATENCY_BUCKETS[0] == 0.3 and REQUEST_LATENCY_BUCKETS[-1] == 7680.0
    assert build_1_2_5_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    assert build_1_2_5_buckets(2048) == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000]


def test_record_updates_every_series():
    lg = PrometheusStatLogger("m", max_model_len=2048)
    lg.log_engine_initialized(2048, {"block_size": "16", "num_blocks": "128", "gpu_memory_utilization": "0.9"})
    lg.record(
        SchedulerStats(num_running_reqs=3, num_waiting_reqs=2, num_waiting_prompt_tokens=300, kv_cache_usage=0.25,
                       num_preemptions=1,
                       prefix_cache_queries=40, prefix_cache_hits=16),
        IterationStats(num_prompt_tokens=40, num_generation_tokens=3, time_to_first_tokens=[0.05, 0.3],
                       inter_token_latencies=[0.02],
                       finished_requests=[FinishedRequestStats("stop", 1.2, 0.1, 20, 7),
                                          FinishedRequestStats("abort", 0.4, 0.0, 20, 1)]),
    )  # fmt: skip
    assert value(families(lg), "kvfleet:num_waiting_prompt_tokens") == 300
    lg.record(SchedulerStats(num_running_reqs=1, kv_cache_usage=0.5, prefix_cache_queries=10),
              IterationStats(num_generation_tokens=1))  # fmt: skip
    f = families(lg)
    assert value(f, "kvfleet:num_requests_running", model_name="m") == 1
    assert value(f, "kvfleet:num_requests_waiting") == 0
    assert value(f, "kvfleet:num_waiting_prompt_tokens") == 0
    assert value(f, "kvfleet:kv_cache_usage_perc") == 0.5
    assert value(f, "kvfleet:num_preemptions", "_total") == 1
    assert value(f, "kvfleet:prompt_tokens", "_total") == 40
    assert value(f, "kvfleet:generation_tokens", "_total") == 4
    assert value(f, "kvfleet:prefix_cache_queries", "_total") == 50
    assert value(f, "kvfleet:prefix_cache_hits", "_total") == 16
    assert value(f, "kvfleet:request_success", "_total", finished_reason="stop") == 1
    assert value(f, "kvfleet:request_success", "_total", finished_reason="abort") == 1
    assert value(f, "kvfleet:request_success", "_total", finished_reason="length") == 0
    assert value(f, "kvfleet:time_to_first_token_seconds", "_count") == 2
    assert value(f, "kvfleet:time_to_first_token_seconds", "_bucket", le="0.06") == 1
    assert value(f, "kvfleet:inter_token_latency_seconds", "_sum") == pytest.approx(0.02)
    assert value(f, "kvfleet:e2e_request_latency_seconds", "_sum") == pytest.approx(1.6)
    assert value(f, "kvfleet:request_queue_time_seconds", "_count") == 2
    assert value(f, "kvfleet:request_prompt_tokens", "_sum") == 40
    assert value(f, "kvfleet:request_generation_tokens", "_bucket", le="5.0") == 1
    assert bucket_bounds(f, "kvfleet:time_to_first_token_seconds") == list(TTFT_BUCKETS)
    assert bucket_bounds(f, "kvfleet:inter_token_latency_seconds") == list(ITL_BUCKETS)
    assert bucket_bounds(f, "kvfleet:e2e_request_latency_seconds") == list(REQUEST_LATENCY_BUCKETS)
    assert bucket_bounds(f, "kvfleet:request_prompt_tokens") == build_1_2_5_buckets(2048)
    assert value(f, "kvfleet:cache_config_info", num_blocks="128", block_size="16", gpu_memory_utilization="0.9") == 1
    assert not [n for n in f if not n.startswith("kvfleet:")]


def test_speculative_decoding_counters_are_vllms():
    lg = PrometheusStatLogger("m", max_model_len=512)
    spec = SpecDecodingStats()
    spec.observe(4, 2)
    spec.observe(3, 3)
    lg.record(SchedulerStats(spec_decoding=spec), None)
    f = families(lg)
    assert value(f, "kvfleet:spec_decode_num_drafts", "_total") == 2
    assert value(f, "kvfleet:spec_decode_num_draft_tokens", "_total") == 7
    assert value(f, "kvfleet:spec_decode_num_accepted_tokens", "_total") == 5
    per_pos = [value(f, "kvfleet:spec_decode_num_accepted_tokens_per_pos", "_total", position=str(i)) for i in range(3)]
    assert per_pos == [2, 2, 1]


def test_vllm_compat_exports_the_same_series_under_vllm_names():
    lg = PrometheusStatLogger("m", prefixes=("kvfleet:", "vllm:"), max_model_len=512)
    lg.log_engine_initialized(512, {"block_size": "16", "num_blocks": "8", "gpu_memory_utilization": "0.9"})
    lg.record(SchedulerStats(num_waiting_reqs=7, kv_cache_usage=0.75), IterationStats(
        finished_requests=[FinishedRequestStats("length", 2.0, 0.5, 3, 4)]))
    f = families(lg)
    kv = {n[len("kvfleet:"):] for n in f if n.startswith("kvfleet:")}
    vl = {n[len("vllm:"):] for n in f if n.startswith("vllm:")}
    kvfleet_only = {"kv_pull_tokens", "kv_pull_failures", "kv_disk_load_tokens", "kv_disk_usage_bytes",
                    "kv_peer_hints_refused", "num_waiting_prompt_tokens"}  # peer pull, its hints, disk tier,
    # the prefill pool's scaling signal: not vLLM's
    assert vl == (kv - kvfleet_only) | {"gpu_cache_usage_perc"} and len(kv) == 32  # v0's name, which GIE's picker reads
    assert value(f, "vllm:gpu_cache_usage_perc", model_name="m") == 0.75
    assert value(f, "vllm:num_requests_waiting", model_name="m") == 7
    assert value(f, "vllm:kv_cache_usage_perc") == 0.75
    assert value(f, "vllm:request_success", "_total", finished_reason="length") == 1
    assert value(f, "vllm:cache_config_info", num_gpu_blocks="8") == 1


def test_registries_are_independent_and_valid_before_any_step():
    a = PrometheusStatLogger("a", registry=CollectorRegistry())
    b = PrometheusStatLogger("b", registry=CollectorRegistry())
    a.record(SchedulerStats(num_running_reqs=5), None)
    fa, fb = families(a), families(b)
    assert value(fa, "kvfleet:num_requests_running") == 5
    assert value(fb, "kvfleet:num_requests_running") == 0
    # token histograms wait for max_model_len; nothing else is missing
    assert "kvfleet:request_prompt_tokens" not in fb and "kvfleet:time_to_first_token_seconds" in fb


def test_vllm_request_phase_iteration_and_param_histograms():
    """vLLM's request_{queue,prefill,decode,inference}_time_seconds, iteration_tokens_total (a
    histogram), request_params_n (once per user request) and request_params_max_tokens."""
    lg = PrometheusStatLogger("m", max_model_len=512)
    fin = [FinishedRequestStats("stop", 1.5, 0.25, 20, 7, prefill_time=0.5, decode_time=0.75, inference_time=1.25,
                                max_tokens=16, n=None),
           FinishedRequestStats("length", 1.6, 0.25, 20, 16, prefill_time=0.5, decode_time=0.85, inference_time=1.35,
                                max_tokens=16, n=2)]  # fmt: skip
    lg.record(None, IterationStats(num_prompt_tokens=40, num_generation_tokens=2, finished_requests=fin))
    lg.record(None, IterationStats(num_generation_tokens=2))
    lg.record(None, IterationStats())  # an abort's stats: no step
    f = families(lg)
    assert value(f, "kvfleet:request_prefill_time_seconds", "_sum") == pytest.approx(1.0)
    assert value(f, "kvfleet:request_decode_time_seconds", "_sum") == pytest.approx(1.6)
    assert value(f, "kvfleet:request_inference_time_seconds", "_count") == 2
    assert bucket_bounds(f, "kvfleet:request_decode_time_seconds") == list(REQUEST_LATENCY_BUCKETS)
    assert value(f, "kvfleet:iteration_tokens_total", "_count") == 2
    assert value(f, "kvfleet:iteration_tokens_total", "_bucket", le="64.0") == 2
    assert value(f, "kvfleet:iteration_tokens_total", "_bucket", le="32.0") == 1
    assert bucket_bounds(f, "kvfleet:iteration_tokens_total") == list(ITERATION_TOKENS_BUCKETS)
    assert value(f, "kvfleet:request_params_n", "_count") == 1 and value(f, "kvfleet:request_params_n", "_sum") == 2
    assert bucket_bounds(f, "kvfleet:request_params_n") == [1, 2, 5, 10, 20]
    assert value(f, "kvfleet:request_params_max_tokens", "_sum") == 32
    assert bucket_bounds(f, "kvfleet:request_params_max_tokens") == build_1_2_5_buckets(512)
    assert "kvfleet:gpu_cache_usage_perc" not in f  # the alias is vllm:'s only


def test_kv_pull_counters():
    lg = PrometheusStatLogger("m", max_model_len=512)
    lg.record(None, IterationStats(num_pulled_tokens=64))
    lg.record(None, IterationStats(num_pulled_tokens=32, kv_pull_failures=["digest", "digest", "http"]))
    f = families(lg)
    assert value(f, "kvfleet:kv_pull_tokens", "_total", model_name="m") == 96
    assert value(f, "kvfleet:kv_pull_failures", "_total", reason="digest") == 2
    assert value(f, "kvfleet:kv_pull_failures", "_total", reason="http") == 1
    assert value(f, "kvfleet:prompt_tokens", "_total") == 0  # pulled tokens are not computed ones
    lg.record(None, IterationStats(num_disk_loaded_tokens=16, kv_disk_bytes=5000))
    f = families(lg)
    assert value(f, "kvfleet:kv_disk_load_tokens", "_total") == 16
    assert value(f, "kvfleet:kv_disk_usage_bytes") == 5000
    vllm_only = families(PrometheusStatLogger("m", prefixes=("vllm:",), max_model_len=512))
    assert not [n for n in vllm_only if n.startswith("kvfleet:")]
