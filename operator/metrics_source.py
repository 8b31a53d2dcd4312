"""Where the autoscaler and the tuner read the runtime pods' live metrics.

Two sources, one result (:class:`kvfleet.operator.pod_metrics.MetricsAggregate`):
:class:`PodScraper` (``spec.autoscaling.metrics.source: pods``, the default) GETs each ready
pod's ``/metrics`` concurrently (port and path: :func:`metrics_url`); :class:`PrometheusSource`
(``source: prometheus``) makes one instant query for the same series, by ``pod`` label.

Pods that are not ready are not read and are listed as such; a ready pod whose read fails is
left out of the sums and listed with the reason. A source that fails as a whole raises
:class:`MetricsSourceError` (the policy then holds the replica count). See docs/autoscaling.md.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterable, Mapping
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvfleet.operator import spec_view
from kvfleet.operator.pod_metrics import MetricsAggregate, PodMetrics, aggregate
from kvfleet.operator.spec_enums import MetricsSource

METRICS_PORT_ANNOTATION = "kvfleet.io/metrics-port"
DEFAULT_PORT = 8000
DEFAULT_TIMEOUT = 5.0
"""Seconds for one pod's scrape or one Prometheus query."""
PREFIXES = ("kvfleet:", "vllm:")
"""Series prefixes read, in order of preference (``vllm:`` from ``--metrics-compat vllm``)."""

# exposition sample name (after the prefix) -> PodMetrics field
_FIELDS = {
    "num_requests_waiting": "num_requests_waiting",
    "num_requests_running": "num_requests_running",
    "kv_cache_usage_perc": "kv_cache_usage",
    "num_preemptions_total": "num_preemptions_total",
    "prompt_tokens_total": "prompt_tokens_total",
    "generation_tokens_total": "generation_tokens_total",
    "request_prompt_tokens_sum": "request_prompt_tokens_sum",
    "request_prompt_tokens_count": "request_prompt_tokens_count",
    "request_generation_tokens_sum": "request_generation_tokens_sum",
    "request_generation_tokens_count": "request_generation_tokens_count",
    "kv_disk_usage_bytes": "kv_disk_bytes",
}
_REQUIRED = ("num_requests_waiting", "num_requests_running", "kv_cache_usage_perc")


class MetricsSourceError(Exception):
    """The source as a whole could not be read (e.g. Prometheus unreachable)."""


def _fold(pod: str, values: Mapping[str, list[float]]) -> PodMetrics:
    """Series values (sample name without prefix -> values over label sets) -> PodMetrics.
    Raises ValueError when a required gauge is missing."""
    missing = [m for m in _REQUIRED if m not in values]
    if missing:
        raise ValueError("series missing: " + ", ".join(missing))
    kwargs: dict[str, float] = {}
    for sample, field in _FIELDS.items():
        vs = values.get(sample)
        if vs:
            # One model per pod: sum over label sets, except a fraction (take the max).
            kwargs[field] = max(vs) if field == "kv_cache_usage" else sum(vs)
    return PodMetrics(pod=pod, **kwargs)


def parse_metrics(pod: str, text: str) -> PodMetrics:
    """Parse a runtime's ``/metrics`` text (Prometheus exposition format) into PodMetrics.

    Series are summed over their label sets (``model_name``, ``finished_reason``).
    ``kvfleet:`` series are preferred; ``vllm:`` ones are used when no ``kvfleet:`` series
    exist. Raises ValueError when the text does not parse or the queue/running/KV-usage
    gauges are missing (not a kvfleet runtime).
    """
    by_prefix: dict[str, dict[str, list[float]]] = {p: {} for p in PREFIXES}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                for prefix in PREFIXES:
                    if sample.name.startswith(prefix):
                        by_prefix[prefix].setdefault(sample.name[len(prefix):], []).append(float(sample.value))
    except Exception as exc:  # the parser raises ValueError, TypeError, IndexError...
        raise ValueError(f"unparsable exposition: {exc}") from exc
    values = next((v for v in by_prefix.values() if v), {})
    return _fold(pod, values)


def pod_name(pod: Mapping[str, Any]) -> str:
    return (pod.get("metadata") or {}).get("name", "?")


def pod_is_ready(pod: Mapping[str, Any]) -> bool:
    """Running, not being deleted, with an IP and the ``Ready`` condition True."""
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    if meta.get("deletionTimestamp") or status.get("phase") != "Running" or not status.get("podIP"):
        return False
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or ())


def metrics_url(pod: Mapping[str, Any]) -> str:
    """The URL a pod's metrics are read from (see the module docstring for the order)."""
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    ann = meta.get("annotations") or {}
    port: Any = ann.get(METRICS_PORT_ANNOTATION)
    if port is None:
        for c in (pod.get("spec") or {}).get("containers") or ():
            for p in c.get("ports") or ():
                if p.get("name") in ("http", "metrics") and port is None:
                    port = p.get("containerPort")
    if port is None:
        port = ann.get("prometheus.io/port", DEFAULT_PORT)
    path = ann.get("prometheus.io/path", "/metrics")
    scheme = ann.get("prometheus.io/scheme", "http")
    host = status.get("podIP", "")
    if ":" in host:  # IPv6
        host = f"[{host}]"
    return f"{scheme}://{host}:{int(port)}{path if path.startswith('/') else '/' + path}"


def split_pods(pods: Iterable[Mapping[str, Any]]) -> tuple[list[Mapping[str, Any]], list[str]]:
    """(ready pods, names of the others)."""
    ready, not_ready = [], []
    for pod in pods:
        (ready.append(pod) if pod_is_ready(pod) else not_ready.append(pod_name(pod)))
    return ready, not_ready


def _error(exc: BaseException) -> str:
    if isinstance(exc, httpx.HTTPStatusError):
        return f"HTTP {exc.response.status_code}"
    text = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {text}" if text != type(exc).__name__ else text


class PodScraper:
    """Read every ready pod's ``/metrics`` directly.

    ``client``: an ``httpx.AsyncClient`` to reuse (one is made per :meth:`read` otherwise).
    ``timeout``: seconds per pod.
    """

    def __init__(self, client: httpx.AsyncClient | None = None, timeout: float = DEFAULT_TIMEOUT):
        self._client = client
        self._timeout = timeout

    async def _one(self, client: httpx.AsyncClient, pod: Mapping[str, Any]) -> PodMetrics:
        response = await client.get(metrics_url(pod), timeout=self._timeout)
        response.raise_for_status()
        return parse_metrics(pod_name(pod), response.text)

    async def read(self, pods: Iterable[Mapping[str, Any]], now: float,
                   previous: MetricsAggregate | None = None) -> MetricsAggregate:
        """Scrape the ready pods among ``pods`` (pod dicts as the API returns them).

        ``now`` (seconds since the epoch) stamps the aggregate; ``previous`` gives the
        preemption rate. Never raises for a pod's failure: it is listed in ``failed``.
        """
        ready, not_ready = split_pods(pods)
        client = self._client or httpx.AsyncClient()
        try:
            results = await asyncio.gather(*(self._one(client, p) for p in ready), return_exceptions=True)
        finally:
            if self._client is None:
                await client.aclose()
        ok, failed = [], []
        for pod, result in zip(ready, results):
            if isinstance(result, PodMetrics):
                ok.append(result)
            elif isinstance(result, Exception):
                failed.append((pod_name(pod), _error(result)))
            else:  # CancelledError and the like: not ours to swallow
                raise result
        return aggregate(now, ok, failed=failed, not_ready=not_ready, previous=previous)


class PrometheusSource:
    """Read the pods' series from a Prometheus server (HTTP API ``/api/v1/query``).

    ``url``: base URL (``http://prometheus.monitoring:9090``). ``namespace``: the pods'
    namespace, matched on the ``namespace_label``; pods are matched on ``pod_label``. The
    values are the latest samples Prometheus holds (staleness: 5 minutes by default).
    """

    def __init__(self, url: str, namespace: str, *, client: httpx.AsyncClient | None = None,
                 timeout: float = DEFAULT_TIMEOUT, pod_label: str = "pod", namespace_label: str = "namespace"):
        self.url = url.rstrip("/")
        self.namespace = namespace
        self._client = client
        self._timeout = timeout
        self.pod_label = pod_label
        self.namespace_label = namespace_label

    def query_for(self, pod_names: Iterable[str], prefix: str = "kvfleet:") -> str:
        """The PromQL instant-vector selector for ``pod_names`` (all series one read needs)."""
        names = "|".join(re.escape(s) for s in sorted(_FIELDS))
        pods = "|".join(re.escape(p) for p in sorted(pod_names))
        esc = lambda s: s.replace("\\", "\\\\").replace('"', '\\"')
        return (f'{{__name__=~"{esc(re.escape(prefix))}({esc(names)})",'
                f'{self.namespace_label}="{esc(self.namespace)}",{self.pod_label}=~"{esc(pods)}"}}')

    async def read(self, pods: Iterable[Mapping[str, Any]], now: float,
                   previous: MetricsAggregate | None = None) -> MetricsAggregate:
        """Query Prometheus for the ready pods among ``pods``. A ready pod without series
        is listed in ``failed``. Raises MetricsSourceError when Prometheus cannot be
        queried or answers with an error."""
        ready, not_ready = split_pods(pods)
        names = [pod_name(p) for p in ready]
        values: dict[str, dict[str, list[float]]] = {n: {} for n in names}
        if names:
            client = self._client or httpx.AsyncClient()
            try:
                response = await client.get(f"{self.url}/api/v1/query", params={"query": self.query_for(names)},
                                            timeout=self._timeout)
                body = response.json()
            except (httpx.HTTPError, ValueError) as exc:
                raise MetricsSourceError(f"Prometheus at {self.url}: {_error(exc)}") from exc
            finally:
                if self._client is None:
                    await client.aclose()
            if response.status_code != 200 or body.get("status") != "success":
                raise MetricsSourceError(f"Prometheus at {self.url}: HTTP {response.status_code}: "
                                         f"{body.get('errorType')}: {body.get('error')}")
            for series in body["data"]["result"]:
                labels = series["metric"]
                pod = labels.get(self.pod_label)
                if pod in values:
                    metric = labels["__name__"].split(":", 1)[1]
                    values[pod].setdefault(metric, []).append(float(series["value"][1]))
        ok, failed = [], []
        for name in names:
            try:
                ok.append(_fold(name, values[name]))
            except ValueError as exc:
                failed.append((name, f"Prometheus: {exc}"))
        return aggregate(now, ok, failed=failed, not_ready=not_ready, previous=previous)


def make_source(autoscaling: spec_view.Autoscaling, namespace: str,
                client: httpx.AsyncClient | None = None) -> PodScraper | PrometheusSource:
    """The source the view's ``spec.autoscaling.metrics`` asks for. Raises ValueError for
    ``source: prometheus`` without ``prometheusUrl``."""
    m = autoscaling.metrics
    if m is not None and m.source == MetricsSource.PROMETHEUS:
        if not m.prometheus_url:
            raise ValueError("autoscaling.metrics.source is prometheus but prometheusUrl is not set")
        return PrometheusSource(m.prometheus_url, namespace, client=client)
    return PodScraper(client=client)
