"""Against a REAL Prometheus server (Debian's ``prometheus``, on loopback, temp storage)
scraping the runtime's real exposition (kvfleet.runtime.metrics served by
prometheus-client's HTTP server):

* the chart's prometheus-adapter rule: its ``seriesQuery`` finds the runtime's series and
  its ``metricsQuery``, expanded the way the adapter expands it (``<<.Series>>``,
  ``<<.LabelMatchers>>``, ``<<.GroupBy>>``), is accepted by the server and returns each
  pod's queue depth under the name the HPA asks for;
* the operator's PrometheusSource reads the same numbers.

Skipped with the reason when the ``prometheus`` binary is absent, except in CI (CI=true),
where that fails: ``.ci/setup --test`` installs it.
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import time

import httpx
import pytest
import yaml
from support.paths import ROOT
from support.prometheus import prometheus_binary, serve_registry
from support.serve import free_port

from kvfleet.operator.hpa import HPA_METRIC
from kvfleet.operator.metrics_source import MetricsSourceError, PrometheusSource
from kvfleet.runtime.core.sched.output import SchedulerStats
from kvfleet.runtime.metrics import PrometheusStatLogger

RULES = ROOT / "charts" / "kvfleet" / "files" / "prometheus-adapter-rules.yaml"
NAMESPACE = "llm"
PODS = {"llama-0": (3, 0.5), "llama-1": (7, 0.9)}  # pod -> (waiting, KV usage)


@pytest.fixture(scope="module")
def runtimes():
    """Two runtime metric endpoints (real stat loggers after one engine step each)."""
    servers, ports = [], {}
    for pod, (waiting, kv) in PODS.items():
        logger = PrometheusStatLogger("smollm2")
        logger.record(SchedulerStats(num_running_reqs=2, num_waiting_reqs=waiting, kv_cache_usage=kv,
                                     num_preemptions=1), None)
        server = serve_registry(logger.registry)
        servers.append(server)
        ports[pod] = server.server_address[1]
    yield ports
    for server in servers:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def prometheus(runtimes, tmp_path_factory):
    """A Prometheus server scraping the runtimes every second, with the ``namespace`` and
    ``pod`` labels that Kubernetes service discovery relabelling would attach."""
    binary = prometheus_binary()
    work = tmp_path_factory.mktemp("prometheus")
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [{
            "job_name": "kvfleet-runtime",
            "static_configs": [{"targets": [f"127.0.0.1:{port}"], "labels": {"namespace": NAMESPACE, "pod": pod}}
                               for pod, port in runtimes.items()],
        }],
    }
    (work / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    log = open(work / "prometheus.log", "wb")
    proc = subprocess.Popen([binary, f"--config.file={work / 'prometheus.yml'}",
                             f"--storage.tsdb.path={work / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:  # ready, and both targets scraped at least once
            assert proc.poll() is None, (work / "prometheus.log").read_text()[-3000:]
            try:
                r = httpx.get(f"{url}/api/v1/query", params={"query": "count(kvfleet:num_requests_waiting)"}, timeout=2)
                if r.status_code == 200 and r.json()["data"]["result"] and r.json()["data"]["result"][0]["value"][1] == "2":
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "Prometheus did not scrape the runtimes within 60 s"
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def query(url: str, promql: str) -> dict:
    return httpx.get(f"{url}/api/v1/query", params={"query": promql}, timeout=5).json()


def expand(template: str, series: str, matchers: str, group_by: str) -> str:
    """prometheus-adapter's metricsQuery expansion (Go text/template with << >> delimiters)."""
    out = (template.replace("<<.Series>>", series).replace("<<.LabelMatchers>>", matchers)
           .replace("<<.GroupBy>>", group_by))
    assert "<<" not in out, f"unexpanded adapter template variable in {out}"
    return out


def test_adapter_rule_against_a_real_prometheus(prometheus):
    rules = yaml.safe_load(RULES.read_text())["rules"]
    rule = next(r for r in rules if r["name"]["as"] == HPA_METRIC)
    # seriesQuery: what the adapter lists with /api/v1/series to discover metrics.
    r = httpx.get(f"{prometheus}/api/v1/series", params={"match[]": rule["seriesQuery"]}, timeout=5).json()
    assert r["status"] == "success", r
    series_names = {s["__name__"] for s in r["data"]}
    assert series_names == {"kvfleet:num_requests_waiting"}
    pods = {s["pod"] for s in r["data"]}
    assert pods == set(PODS)
    (series,) = series_names
    assert re.search(rule["name"]["matches"], series)
    assert re.sub(rule["name"]["matches"], rule["name"]["as"], series) == HPA_METRIC
    assert set(rule["resources"]["overrides"]) == {"namespace", "pod"}
    # metricsQuery, as the adapter runs it for GET .../namespaces/llm/pods/*/kvfleet_num_requests_waiting.
    promql = expand(rule["metricsQuery"], series, f'namespace="{NAMESPACE}",pod=~"llama-0|llama-1"', "pod")
    r = query(prometheus, promql)
    assert r["status"] == "success", r
    values = {s["metric"]["pod"]: float(s["value"][1]) for s in r["data"]["result"]}
    assert values == {pod: waiting for pod, (waiting, _) in PODS.items()}


def test_the_server_rejects_an_unexpanded_rule(prometheus):
    """Control: a query that still holds adapter template syntax is a parse error, so the
    test above would catch a rule the adapter could not expand into valid PromQL."""
    r = query(prometheus, "max by (<<.GroupBy>>) (kvfleet:num_requests_waiting{<<.LabelMatchers>>})")
    assert r["status"] == "error" and r["errorType"] == "bad_data"


def ready_pod(name: str) -> dict:
    return {"metadata": {"name": name},
            "status": {"phase": "Running", "podIP": "10.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]}}


def test_prometheus_source_reads_the_pods(prometheus):
    src = PrometheusSource(prometheus, NAMESPACE)
    pods = [ready_pod("llama-0"), ready_pod("llama-1"), ready_pod("llama-2")]  # llama-2: no series
    agg = asyncio.run(src.read(pods, now=1000.0))
    assert {p.pod: p.num_requests_waiting for p in agg.pods} == {"llama-0": 3, "llama-1": 7}
    assert agg.queue_depth == 10 and agg.running == 4
    assert agg.kv_cache_usage == pytest.approx(0.7)
    assert {p.pod: p.num_preemptions_total for p in agg.pods} == {"llama-0": 1, "llama-1": 1}
    assert [name for name, _ in agg.failed] == ["llama-2"]
    # Another namespace: nothing matches, every pod is reported.
    agg = asyncio.run(PrometheusSource(prometheus, "other").read(pods[:1], now=1000.0))
    assert agg.pods == () and agg.failed[0][0] == "llama-0"


def test_prometheus_source_down_raises():
    src = PrometheusSource(f"http://127.0.0.1:{free_port()}", NAMESPACE, timeout=1.0)
    with pytest.raises(MetricsSourceError):
        asyncio.run(src.read([ready_pod("a")], now=0.0))
