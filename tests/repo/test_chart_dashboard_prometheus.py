"""The Grafana dashboard's queries against a REAL Prometheus server (Debian's `prometheus`,
loopback, temporary storage) scraping two runtime pods' real exposition
(kvfleet.runtime.metrics, fed engine steps while the test runs): every panel query, with
Grafana's variables substituted as Grafana does, returns data, and the numbers are the ones
the pods export (queue depth summed, KV usage averaged, replicas counted, TTFT/ITL quantiles
within the observed range). The template variables' label queries find the namespace and
the InferenceService. The scrape config attaches the labels the chart's PodMonitor does
(`namespace`, `pod`, and `inferenceservice` from the pod label).
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import threading
import time

import httpx
import pytest
import yaml
from support.paths import ROOT
from support.prometheus import prometheus_binary, serve_registry
from support.serve import free_port

from kvfleet.runtime.core.sched.output import SchedulerStats
from kvfleet.runtime.engine.stats import IterationStats
from kvfleet.runtime.metrics import PrometheusStatLogger

pytestmark = pytest.mark.slow

DASHBOARD = ROOT / "charts" / "kvfleet" / "files" / "grafana-dashboard.json"
NAMESPACE, ISVC = "llm", "chat"
PODS = {"chat-0": (3, 0.5), "chat-1": (7, 0.9)}  # pod -> (waiting, KV usage)
TTFT, ITL = 0.3, 0.04  # seconds, observed on every step


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory):
    binary = prometheus_binary()
    stop = threading.Event()
    servers, loggers, ports = [], {}, {}
    for pod in PODS:
        logger = loggers[pod] = PrometheusStatLogger("smollm2")
        server = serve_registry(logger.registry)
        servers.append(server)
        ports[pod] = server.server_address[1]

    def engine_steps():  # what an engine under load reports, every 100 ms
        while not stop.is_set():
            for pod, (waiting, kv) in PODS.items():
                loggers[pod].record(
                    SchedulerStats(num_running_reqs=4, num_waiting_reqs=waiting, kv_cache_usage=kv, num_preemptions=1),
                    IterationStats(num_prompt_tokens=100, num_generation_tokens=8,
                                   time_to_first_tokens=[TTFT], inter_token_latencies=[ITL] * 4))
            stop.wait(0.1)

    threading.Thread(target=engine_steps, daemon=True).start()
    work = tmp_path_factory.mktemp("prometheus")
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [{
            "job_name": "kvfleet-runtime",
            "static_configs": [{"targets": [f"127.0.0.1:{port}"],
                                "labels": {"namespace": NAMESPACE, "pod": pod, "inferenceservice": ISVC}}
                               for pod, port in ports.items()],
        }],
    }
    (work / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    log = open(work / "prometheus.log", "wb")
    proc = subprocess.Popen([binary, f"--config.file={work / 'prometheus.yml'}", f"--storage.tsdb.path={work / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:  # at least 5 scrapes of both pods, so that rate() over 10 s has samples
            assert proc.poll() is None, (work / "prometheus.log").read_text()[-3000:]
            try:
                r = httpx.get(f"{url}/api/v1/query", timeout=2,
                              params={"query": "min(count_over_time(kvfleet:num_requests_waiting[1m]))"}).json()
                if r["data"]["result"] and float(r["data"]["result"][0]["value"][1]) >= 5:
                    break
            except (httpx.HTTPError, KeyError, ValueError):
                pass
            assert time.monotonic() < deadline, "Prometheus did not scrape the pods within 60 s"
            time.sleep(0.5)
        yield url
    finally:
        stop.set()
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        for server in servers:
            server.shutdown()
            server.server_close()


def grafana(expr: str) -> str:
    """Grafana's substitution: multi-value variables become regex alternations."""
    out = (expr.replace("$__rate_interval", "10s").replace("$namespace", NAMESPACE)
           .replace("$inferenceservice", ISVC))
    assert "$" not in out, out
    return out


def panels() -> list[dict]:
    return json.loads(DASHBOARD.read_text())["panels"]


def query(url: str, promql: str) -> list[dict]:
    r = httpx.get(f"{url}/api/v1/query", params={"query": promql}, timeout=5).json()
    assert r["status"] == "success", (promql, r)
    return r["data"]["result"]


def values_by_title(url: str) -> dict[str, list[tuple[str, float]]]:
    out = {}
    for panel in panels():
        out[panel["title"]] = []
        for target in panel["targets"]:
            result = query(url, grafana(target["expr"]))
            assert result, f"panel {panel['title']!r}: no data for {target['expr']}"
            for series in result:
                assert series["metric"].get("inferenceservice") == ISVC, (panel["title"], series["metric"])
                out[panel["title"]].append((target["legendFormat"], float(series["value"][1])))
    return out


def test_every_panel_query_returns_the_pods_numbers(prometheus):
    got = values_by_title(prometheus)
    for title, values in got.items():
        for legend, value in values:
            assert not math.isnan(value), (title, legend)
    assert got["Queue depth (waiting requests)"] == [("{{inferenceservice}}", 10.0)]
    assert got["Running requests"] == [("{{inferenceservice}}", 8.0)]
    assert got["Replicas"] == [("{{inferenceservice}}", 2.0)]
    kv = dict(got["KV cache usage"])
    assert kv["{{inferenceservice}} mean"] == pytest.approx(0.7) and kv["{{inferenceservice}} max"] == pytest.approx(0.9)
    # Every observation was TTFT=0.3 s / ITL=0.04 s: each quantile lies in the bucket holding it.
    for _, value in got["Time to first token (TTFT)"]:
        assert 0.25 <= value <= 0.5
    for _, value in got["Inter-token latency (ITL)"]:
        assert 0.025 <= value <= 0.05
    throughput = dict(got["Token throughput"])
    assert throughput["{{inferenceservice}} output"] > 0 and throughput["{{inferenceservice}} prompt"] > 0
    # 100 prompt tokens for every 8 output tokens, on both pods.
    ratio = throughput["{{inferenceservice}} prompt"] / throughput["{{inferenceservice}} output"]
    assert ratio == pytest.approx(12.5, rel=0.2)
    assert dict(got["Preemptions"])["{{inferenceservice}}"] > 0


def test_template_variables_find_the_namespace_and_the_inferenceservice(prometheus):
    variables = {v["name"]: v for v in json.loads(DASHBOARD.read_text())["templating"]["list"]}
    for name, expected in (("namespace", NAMESPACE), ("inferenceservice", ISVC)):
        m = re.fullmatch(r"label_values\((.+), *(\w+)\)", variables[name]["query"]["query"])
        match, label = grafana(m.group(1)), m.group(2)
        r = httpx.get(f"{prometheus}/api/v1/label/{label}/values", params={"match[]": match}, timeout=5).json()
        assert r["status"] == "success" and r["data"] == [expected], r


def test_a_wrong_inferenceservice_selects_nothing(prometheus):
    """Control: the panels really filter on the variables (no data for another name)."""
    expr = panels()[0]["targets"][0]["expr"].replace("$__rate_interval", "10s").replace("$namespace", NAMESPACE)
    assert query(prometheus, expr.replace("$inferenceservice", "other")) == []
