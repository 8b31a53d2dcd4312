"""The autoscaler's metrics source: the runtime's real exposition (kvfleet.runtime.metrics)
parsed with prometheus-client's parser, and pods scraped over real HTTP (some failing)."""

from __future__ import annotations

import asyncio
import http.server
import threading
import time

import pytest
from support.serve import free_port

from kvfleet.operator import crd_schema, spec_view
from kvfleet.operator.metrics_source import (
    METRICS_PORT_ANNOTATION,
    PodScraper,
    make_source,
    metrics_url,
    parse_metrics,
    pod_is_ready,
)
from kvfleet.operator.policy import AutoscalingConfig, decide_scale
from kvfleet.runtime.core.sched.output import SchedulerStats
from kvfleet.runtime.engine.stats import FinishedRequestStats, IterationStats
from kvfleet.runtime.metrics import PrometheusStatLogger, exposition


def runtime_exposition(waiting=3, running=2, kv=0.5, preemptions=4, prefixes=("kvfleet:",), finished=()):
    """What a runtime's /metrics returns after one engine step with these numbers."""
    logger = PrometheusStatLogger("smollm2", prefixes=prefixes)
    logger.log_engine_initialized(2048, {"block_size": 16, "num_blocks": 100, "gpu_memory_utilization": 0.9})
    logger.record(
        SchedulerStats(num_running_reqs=running, num_waiting_reqs=waiting, kv_cache_usage=kv,
                       num_preemptions=preemptions),
        IterationStats(num_prompt_tokens=100, num_generation_tokens=7,
                       finished_requests=[FinishedRequestStats("stop", 1.0, 0.1, p, g) for p, g in finished]),
    )
    return exposition(logger.registry).decode()


def test_parse_the_runtime_exposition():
    m = parse_metrics("p", runtime_exposition(finished=[(100, 20), (300, 40)]))
    assert (m.num_requests_waiting, m.num_requests_running, m.kv_cache_usage) == (3, 2, 0.5)
    assert (m.num_preemptions_total, m.prompt_tokens_total, m.generation_tokens_total) == (4, 100, 7)
    assert (m.request_prompt_tokens_sum, m.request_prompt_tokens_count) == (400, 2)
    assert (m.request_generation_tokens_sum, m.request_generation_tokens_count) == (60, 2)


def test_parse_vllm_names_and_prefers_kvfleet():
    m = parse_metrics("p", runtime_exposition(waiting=5, prefixes=("vllm:",)))
    assert m.num_requests_waiting == 5
    both = runtime_exposition(waiting=5, prefixes=("kvfleet:", "vllm:"))
    assert parse_metrics("p", both).num_requests_waiting == 5  # not 10: one prefix only


@pytest.mark.parametrize("text", ["", "# HELP x y\nx 1\n", "kvfleet:num_requests_waiting{ 1\n", "<html>503</html>"])
def test_parse_rejects_what_is_not_a_runtime(text):
    with pytest.raises(ValueError):
        parse_metrics("p", text)


def pod(name, port=None, ready=True, ip="127.0.0.1", annotate=True, deleting=False):
    meta = {"name": name, "annotations": {METRICS_PORT_ANNOTATION: str(port)} if annotate and port else {}}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {
        "metadata": meta,
        "spec": {"containers": [{"name": "runtime", "ports": [{"name": "http", "containerPort": 8000}]}]},
        "status": {"phase": "Running" if ready else "Pending", "podIP": ip,
                   "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }


def test_pod_readiness_and_url():
    assert pod_is_ready(pod("a", 1)) and not pod_is_ready(pod("a", 1, ready=False))
    assert not pod_is_ready(pod("a", 1, deleting=True)) and not pod_is_ready(pod("a", 1, ip=""))
    assert metrics_url(pod("a", 9123)) == "http://127.0.0.1:9123/metrics"
    assert metrics_url(pod("a", annotate=False, ip="10.1.2.3")) == "http://10.1.2.3:8000/metrics"
    p = pod("a", annotate=False, ip="fd00::1")
    p["metadata"]["annotations"] = {"prometheus.io/path": "/m"}
    assert metrics_url(p) == "http://[fd00::1]:8000/m"


class _Server:
    """A real HTTP server on a free loopback port returning ``status`` and ``body``
    (after ``delay`` seconds)."""

    def __init__(self, body: str, status: int = 200, delay: float = 0.0):
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                time.sleep(outer.delay)
                data = outer.body.encode()
                self.send_response(outer.status)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                try:
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the slow server's client gave up (the timeout under test)

            def log_message(self, *args):
                pass

        self.body, self.status, self.delay = body, status, delay
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def servers():
    made = []
    yield lambda *a, **kw: made.append(_Server(*a, **kw)) or made[-1]
    for s in made:
        s.close()


def test_scrape_over_http_leaves_out_and_reports_failures(servers):
    good1 = servers(runtime_exposition(waiting=3, running=2, kv=0.5))
    good2 = servers(runtime_exposition(waiting=6, running=2, kv=1.0))
    http500 = servers("oops", status=500)
    garbage = servers("<html>hello</html>")
    slow = servers(runtime_exposition(), delay=3.0)
    pods = [pod("good1", good1.port), pod("good2", good2.port), pod("err", http500.port),
            pod("garbage", garbage.port), pod("slow", slow.port), pod("refused", free_port()),
            pod("starting", 1, ready=False)]
    t0 = time.monotonic()
    agg = asyncio.run(PodScraper(timeout=1.0).read(pods, now=1000.0))
    assert time.monotonic() - t0 < 2.5  # concurrent, bounded by the timeout
    assert [p.pod for p in agg.pods] == ["good1", "good2"]
    assert agg.queue_depth == 9 and agg.running == 4 and agg.kv_cache_usage == 0.75
    failed = dict(agg.failed)
    assert set(failed) == {"err", "garbage", "slow", "refused"}
    assert failed["err"] == "HTTP 500" and "unparsable" in failed["garbage"]
    assert "Timeout" in failed["slow"] and "Connect" in failed["refused"]
    assert agg.not_ready == ("starting",)
    status = agg.to_status()
    assert status["podsRead"] == 2 and len(status["failedPods"]) == 4 and status["notReadyPods"] == ["starting"]


def test_all_scrapes_failing_never_scales_down(servers):
    pods = [pod(f"p{i}", free_port()) for i in range(3)]
    agg = asyncio.run(PodScraper(timeout=1.0).read(pods, now=1000.0))
    assert agg.pods == () and len(agg.failed) == 3
    cfg = AutoscalingConfig.from_spec({"mode": "operator", "minReplicas": 0, "maxReplicas": 5,
                                       "scaleDown": {"stabilizationWindowSeconds": 0}})
    d = decide_scale(cfg, now=1000.0, current=3, ready=3, metrics=agg)
    assert d.replicas == 3 and d.reason == "MetricsUnavailable"


def test_preemption_rate_across_two_reads(servers):
    s = servers(runtime_exposition(preemptions=4))
    src = PodScraper(timeout=2.0)
    first = asyncio.run(src.read([pod("a", s.port)], now=100.0))
    s.body = runtime_exposition(preemptions=24)
    second = asyncio.run(src.read([pod("a", s.port)], now=110.0, previous=first))
    assert first.preemption_rate is None and second.preemption_rate == 2.0


def test_make_source():
    def auto(raw):
        return spec_view.section(crd_schema.AUTOSCALING, raw)

    assert isinstance(make_source(auto(None), "ns"), PodScraper)
    assert isinstance(make_source(auto({"metrics": {}}), "ns"), PodScraper)
    assert make_source(auto({"metrics": {"source": "prometheus", "prometheusUrl": "http://p:9090/"}}), "ns").url == "http://p:9090"
    with pytest.raises(ValueError):
        make_source(auto({"metrics": {"source": "prometheus"}}), "ns")
