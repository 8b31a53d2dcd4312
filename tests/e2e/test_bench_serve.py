"""``kvfleet bench serve`` against a real ``kvfleet serve`` (default model, free local port):
a handful of streamed requests produce a complete JSON report whose figures agree with
the server's own counts."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import pytest
from support.serve import start_serve, stop_serve

pytestmark = pytest.mark.slow

API_KEY = "sk-kvfleet-bench"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("bench_server") / "server.log"
    proc, base = start_serve(["--kv-cache-memory", "256MiB", "--max-model-len", "2048", "--log-level", "warning"],
                             log, env={"KVFLEET_API_KEY": API_KEY})
    try:
        yield base
    finally:
        stop_serve(proc)


def _generation_tokens(base: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    for fam in text_string_to_metric_families(httpx.get(base + "/metrics", timeout=30).text):
        if fam.name == "kvfleet:generation_tokens":
            return sum(s.value for s in fam.samples if s.name.endswith("_total"))
    raise KeyError("kvfleet:generation_tokens")


def _bench(base: str, tmp_path, *extra: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "kvfleet.runtime.cli", "bench", "serve", "--base-url", base, "--api-key", API_KEY,
           "--output-json", str(out), "--disable-tqdm", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, json.loads(out.read_text())


def test_random_completions_report_is_complete_and_consistent(server, tmp_path):
    before = _generation_tokens(server)
    plot = tmp_path / "serve.png"
    proc, doc = _bench(server, tmp_path, "--num-prompts", "6", "--input-len", "32", "--output-len", "8",
                       "--range-ratio", "0.5", "--ignore-eos", "--max-concurrency", "3", "--seed", "7",
                       "--goodput", "ttft:60000", "tpot:60000", "--percentiles", "50,90,99", "--plot", str(plot))
    for key in ("completed", "failed", "duration", "total_input_tokens", "total_output_tokens", "request_throughput",
                "output_throughput", "total_token_throughput", "request_goodput", "slo_attainment"):
        assert doc[key] is not None, key
    for name in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p50", "p90", "p99"):
            assert doc[f"{stat}_{name}_ms"] > 0, (stat, name)
    assert doc["completed"] == 6 and doc["failed"] == 0
    reqs = doc["requests"]
    # --ignore-eos: every request produced exactly max_tokens, one streamed chunk per token
    from kvfleet.runtime.bench import datasets as ds
    from kvfleet.runtime.bench.serve import load_tokenizer

    expected = [r.expected_output_len for r in ds.random_dataset(load_tokenizer(None), 6, 32, 8, 0.5, seed=7)]
    assert [r["output_tokens"] for r in reqs] == expected
    assert all(len(r["chunk_times"]) == r["output_tokens"] for r in reqs)
    assert doc["total_output_tokens"] == sum(expected)
    # the server counted the same tokens (plus the 4-token warm-up request)
    assert _generation_tokens(server) - before == sum(expected) + 4
    assert all(16 <= r["prompt_len"] <= 48 for r in reqs)  # the server's prompt_tokens, no BOS added
    for r in reqs:
        assert r["ttft"] <= r["latency"] <= doc["duration"]
        assert r["tpot"] == pytest.approx((r["latency"] - r["ttft"]) / (r["output_tokens"] - 1))
    assert doc["output_throughput"] == pytest.approx(sum(expected) / doc["duration"])
    assert doc["request_goodput"] == pytest.approx(6 / doc["duration"])  # SLOs of 60 s: every request is good
    assert "Serving Benchmark Result" in proc.stdout and "P99 ITL (ms):" in proc.stdout
    assert plot.stat().st_size > 10_000


def test_chat_shared_prefix_with_poisson_arrivals(server, tmp_path):
    _, doc = _bench(server, tmp_path, "--endpoint", "chat", "--dataset-name", "shared-prefix", "--prefix-len", "64",
                    "--input-len", "16", "--output-len", "4", "--ignore-eos", "--num-prompts", "4",
                    "--request-rate", "8", "--goodput", "ttft:0")
    assert doc["completed"] == 4 and doc["endpoint"] == "chat"
    assert doc["total_output_tokens"] == 16
    # the chat template wraps system prompt + user text: more than the raw 80 tokens
    assert all(r["prompt_len"] > 80 for r in doc["requests"])
    starts = sorted(r["start_time"] for r in doc["requests"])
    assert starts[-1] > starts[0]  # Poisson arrivals, not all at once
    assert doc["request_goodput"] == 0 and doc["slo_attainment"] == 0  # a 0 ms TTFT SLO is never met


def test_wrong_api_key_is_reported_not_crashed(server, tmp_path):
    out = tmp_path / "r.json"
    proc = subprocess.run(
        [sys.executable, "-m", "kvfleet.runtime.cli", "bench", "serve", "--base-url", server, "--api-key", "wrong",
         "--model", "SmolLM2-135M-Instruct", "--num-prompts", "2", "--output-len", "2", "--disable-tqdm",
         "--output-json", str(out)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert proc.returncode != 0
    assert "401" in proc.stdout + proc.stderr
