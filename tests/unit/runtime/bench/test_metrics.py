"""Report maths of ``kvfleet bench`` on synthetic timings (vLLM benchmark_serving definitions)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvfleet.runtime.bench.metrics import (
    RequestResult,
    compute_metrics,
    format_report,
    is_good,
    parse_goodput,
    result_from_chunk_times,
    summarize,
    throughput_timeline,
)
from kvfleet.runtime.bench.serve import arrival_intervals


def _req(start, chunks, prompt_len=10, output_tokens=None):
    return result_from_chunk_times(start, chunks, prompt_len, len(chunks) if output_tokens is None else output_tokens)


def test_ttft_itl_e2e_tpot_from_chunk_times():
    r = _req(1.0, [1.5, 1.6, 1.8, 2.0])
    assert r.ttft == pytest.approx(0.5)
    assert r.itl == pytest.approx([0.1, 0.2, 0.2])
    assert r.latency == pytest.approx(1.0)
    # TPOT = (e2e - ttft) / (output_tokens - 1)
    assert r.tpot == pytest.approx(0.5 / 3)
    # TPOT uses the token count, not the chunk count: 4 chunks carrying 6 tokens
    assert _req(1.0, [1.5, 1.6, 1.8, 2.0], output_tokens=6).tpot == pytest.approx(0.5 / 5)
    # one output token: no TPOT, no ITL
    single = _req(0.0, [0.3])
    assert single.tpot is None and single.itl == [] and single.latency == pytest.approx(0.3)


def test_chunk_times_validation():
    with pytest.raises(ValueError):
        result_from_chunk_times(0.0, [], 1, 1)
    with pytest.raises(ValueError):
        result_from_chunk_times(0.0, [0.5, 0.4], 1, 2)
    with pytest.raises(ValueError):
        result_from_chunk_times(1.0, [0.5], 1, 1)


def test_percentiles_are_numpy_linear_interpolation():
    values = list(range(1, 101))  # 1..100
    s = summarize(values, (50, 90, 99, 99.9))
    assert s["mean"] == pytest.approx(50.5)
    assert s["median"] == pytest.approx(50.5)
    assert s["p50"] == pytest.approx(50.5)
    assert s["p90"] == pytest.approx(90.1)  # 1 + 0.90 * 99
    assert s["p99"] == pytest.approx(99.01)
    assert s["p99.9"] == pytest.approx(99.901)
    assert s["std"] == pytest.approx(np.std(values))
    assert summarize([], (99,)) == {"mean": 0.0, "median": 0.0, "std": 0.0, "p99": 0.0}


def test_compute_metrics_on_synthetic_run():
    results = [
        _req(0.0, [0.2, 0.3, 0.4, 0.5], prompt_len=100),  # ttft .2, tpot .1, itls .1 .1 .1, e2e .5
        _req(0.1, [0.5, 0.7, 1.1], prompt_len=50),  # ttft .4, tpot .3, itls .2 .4, e2e 1.0
        _req(0.2, [1.0], prompt_len=30),  # ttft .8, one token: no tpot
        RequestResult(success=False, prompt_len=999, output_tokens=7, error="HTTP 500"),
    ]
    m = compute_metrics(results, duration=2.0, percentiles=(50, 99))
    assert m["completed"] == 3 and m["failed"] == 1
    assert m["total_input_tokens"] == 180  # failed requests do not count
    assert m["total_output_tokens"] == 8
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["output_throughput"] == pytest.approx(4.0)
    assert m["total_token_throughput"] == pytest.approx(94.0)
    assert m["mean_ttft_ms"] == pytest.approx(1000 * (0.2 + 0.4 + 0.8) / 3)
    assert m["median_ttft_ms"] == pytest.approx(400)
    assert m["mean_tpot_ms"] == pytest.approx(200)  # (100 + 300) / 2: the 1-token request is left out
    itls = [0.1, 0.1, 0.1, 0.2, 0.4]  # pooled over requests
    assert m["mean_itl_ms"] == pytest.approx(1000 * np.mean(itls))
    assert m["p99_itl_ms"] == pytest.approx(1000 * np.percentile(itls, 99))
    assert m["mean_e2el_ms"] == pytest.approx(1000 * (0.5 + 1.0 + 0.8) / 3)
    assert m["p99_e2el_ms"] == pytest.approx(1000 * np.percentile([0.5, 1.0, 0.8], 99))
    assert m["request_goodput"] is None and m["slo_attainment"] is None
    with pytest.raises(ValueError):
        compute_metrics(results, duration=0)


def test_goodput_counts_requests_meeting_every_slo():
    results = [
        _req(0.0, [0.2, 0.3, 0.4, 0.5]),  # ttft 200 ms, tpot 100 ms
        _req(0.0, [0.4, 0.7, 1.0]),  # ttft 400 ms, tpot 300 ms
        _req(0.0, [0.8]),  # ttft 800 ms, tpot counts as 0
        RequestResult(success=False),
    ]
    m = compute_metrics(results, 2.0, goodput_slos_ms={"ttft": 500})
    assert m["request_goodput"] == pytest.approx(2 / 2.0)
    assert m["slo_attainment"] == pytest.approx(2 / 3)
    m = compute_metrics(results, 2.0, goodput_slos_ms={"ttft": 1000, "tpot": 100})
    assert m["request_goodput"] == pytest.approx(2 / 2.0)  # the 1-token request passes tpot
    m = compute_metrics(results, 2.0, goodput_slos_ms={"e2el": 700})
    assert m["request_goodput"] == pytest.approx(1 / 2.0)
    # the boundary passes (<=)
    assert is_good(results[0], {"ttft": 200.0, "tpot": 100.0})
    assert not is_good(results[0], {"ttft": 199.0})
    assert not is_good(results[3], {})


def test_parse_goodput():
    assert parse_goodput(["ttft:500", "TPOT:50", "e2el:2000.5"]) == {"ttft": 500.0, "tpot": 50.0, "e2el": 2000.5}
    assert parse_goodput(None) == {}
    for bad in (["ttft"], ["itl:5"], ["ttft:-1"], ["ttft:abc"], ["ttft:inf"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)


def test_throughput_timeline_conserves_tokens():
    results = [_req(0.0, [0.1, 0.6, 1.2, 2.5], output_tokens=8), _req(0.0, [1.1, 1.9]), RequestResult(success=False)]
    starts, tps = throughput_timeline(results, duration=3.0, bin_s=1.0)
    assert list(starts) == [0.0, 1.0, 2.0]
    # 8 tokens over 4 chunks = 2 per chunk; bins: [0,1): 2 chunks -> 4, [1,2): 1 chunk (4) + 2 chunks of 1 -> 4, [2,3): 2
    assert list(tps) == pytest.approx([4.0, 4.0, 2.0])
    assert (tps * 1.0).sum() == pytest.approx(10)


def test_arrival_intervals_poisson_and_gamma():
    assert not arrival_intervals(5, math.inf).any()
    gaps = arrival_intervals(20000, 4.0, 1.0, seed=1)
    assert gaps.mean() == pytest.approx(0.25, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)  # exponential: CV 1
    bursty = arrival_intervals(20000, 4.0, 0.25, seed=1)
    assert bursty.mean() == pytest.approx(0.25, rel=0.05)  # same rate
    assert bursty.std() / bursty.mean() == pytest.approx(2.0, rel=0.07)  # gamma: CV = 1/sqrt(shape)
    smooth = arrival_intervals(20000, 4.0, 4.0, seed=1)
    assert smooth.std() / smooth.mean() == pytest.approx(0.5, rel=0.05)
    assert (arrival_intervals(10, 2.0, seed=3) == arrival_intervals(10, 2.0, seed=3)).all()
    with pytest.raises(ValueError):
        arrival_intervals(3, 1.0, burstiness=0)


def test_format_report_has_every_metric():
    m = compute_metrics([_req(0.0, [0.2, 0.3])], 1.0, (50, 90, 99), {"ttft": 100})
    text = format_report(m, (50, 90, 99))
    for needle in ("Successful requests:", "Failed requests:", "Benchmark duration (s):", "Total input tokens:",
                   "Total generated tokens:", "Request throughput (req/s):", "Request goodput (req/s):",
                   "Output token throughput (tok/s):", "Total token throughput (tok/s):", "SLO attainment:"):
        assert needle in text
    for name in ("TTFT", "TPOT", "ITL", "E2EL"):
        for stat in ("Mean", "Median", "P90", "P99"):
            assert f"{stat} {name} (ms):" in text
