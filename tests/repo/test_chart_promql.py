"""The PromQL the chart ships (Grafana dashboard panels, prometheus-adapter rule) is valid
for Prometheus's own parser (`promtool check rules`), and reads series that the runtime
really exports (kvfleet.runtime.metrics, rendered to the exposition format)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from support.paths import ROOT

FILES = ROOT / "charts" / "kvfleet" / "files"

# Grafana's variables, as Grafana substitutes them before the query reaches Prometheus.
GRAFANA_VARS = {"$__rate_interval": "1m", "$namespace": ".*", "$inferenceservice": "llama|qwen"}


@pytest.fixture(scope="session")
def promtool() -> str:
    found = shutil.which("promtool")
    if found:
        return found
    message = "promtool is not installed (Debian package `prometheus`, installed by `bash .ci/setup --test`)"
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(message + " -- required in CI", pytrace=False)
    pytest.skip(message)


def dashboard() -> dict:
    return json.loads((FILES / "grafana-dashboard.json").read_text())


def grafana(expr: str) -> str:
    for var, value in GRAFANA_VARS.items():
        expr = expr.replace(var, value)
    assert "$" not in expr, f"unsubstituted Grafana variable in {expr}"
    return expr


def dashboard_exprs() -> list[str]:
    exprs = [t["expr"] for p in dashboard()["panels"] for t in p["targets"]]
    # Template variables: label_values(<series selector>, <label>) -> the selector.
    for var in dashboard()["templating"]["list"]:
        if var["type"] == "query":
            m = re.fullmatch(r"label_values\((.+), *([a-zA-Z_]\w*)\)", var["query"]["query"])
            assert m, var["query"]["query"]
            exprs.append(m.group(1))
    return [grafana(e) for e in exprs]


def adapter_exprs() -> list[str]:
    """The adapter rules' queries, expanded the way prometheus-adapter expands them for
    `GET .../namespaces/llm/pods/*/kvfleet_num_requests_waiting` (Go templates over << >>)."""
    out = []
    for rule in yaml.safe_load((FILES / "prometheus-adapter-rules.yaml").read_text())["rules"]:
        series = re.match(r"^([a-zA-Z_:][\w:]*)", rule["seriesQuery"]).group(1)
        assert re.fullmatch(rule["name"]["matches"], series)
        expanded = (rule["metricsQuery"]
                    .replace("<<.Series>>", series)
                    .replace("<<.LabelMatchers>>", 'namespace="llm",pod=~"llama-0|llama-1"')
                    .replace("<<.GroupBy>>", "pod"))
        assert "<<" not in expanded, expanded
        out += [rule["seriesQuery"], expanded]
    return out


def check_with_promtool(promtool: str, exprs: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    rules = {"groups": [{"name": "kvfleet-chart", "rules": [
        {"record": f"kvfleet_chart:expr_{i}", "expr": e} for i, e in enumerate(exprs)]}]}
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump(rules, width=1000))
    return subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)


def test_dashboard_and_adapter_promql_parse(promtool, tmp_path):
    exprs = dashboard_exprs() + adapter_exprs()
    proc = check_with_promtool(promtool, exprs, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(exprs)} rules found" in proc.stdout


def test_promtool_check_rejects_broken_promql(promtool, tmp_path):
    # The check above can fail: a broken query is an error.
    proc = check_with_promtool(promtool, ["histogram_quantile(0.9, sum by (le) (rate(x_bucket[1m]))"], tmp_path)
    assert proc.returncode != 0


def exported_series() -> set[str]:
    from prometheus_client import generate_latest

    from kvfleet.runtime.metrics import PrometheusStatLogger

    text = generate_latest(PrometheusStatLogger("smollm2").registry).decode()
    return {re.match(r"[^{ ]+", line).group(0) for line in text.splitlines() if line and not line.startswith("#")}


def test_every_series_the_chart_reads_is_exported_by_the_runtime():
    exported = exported_series()
    used = set()
    for expr in dashboard_exprs() + adapter_exprs():
        used |= set(re.findall(r"kvfleet:[a-zA-Z_:0-9]+", expr))
    assert used, "no kvfleet: series found in the chart's queries"
    assert used <= exported, f"series the runtime does not export: {sorted(used - exported)}"
    # The autoscaling metric is the queue depth.
    assert "kvfleet:num_requests_waiting" in used
