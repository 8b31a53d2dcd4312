"""The probe loop: every ``interval`` seconds, ``GET /ready`` of every endpoint and, when ready,
``GET /metrics`` for its load gauges; results go to the :class:`~.endpoints.EndpointPool`.

Gauges read (the runtime's names, runtime/metrics.py; the ``vllm:`` names are accepted too, so
the router also balances vLLM replicas): ``num_requests_waiting``, ``num_requests_running``,
``kv_cache_usage_perc`` (summed over ``model_name`` series). While requests are held, or right
after new endpoints join, probes run every ``fast_interval`` seconds so that a replica that
becomes ready is used within a fraction of a second.
"""

from __future__ import annotations

import asyncio
import logging

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvfleet.runtime.router.endpoints import EndpointPool

logger = logging.getLogger("kvfleet.router")

GAUGES = {"num_requests_waiting": "waiting", "num_requests_running": "running", "kv_cache_usage_perc": "kv_cache_usage"}
PREFIXES = ("kvfleet:", "vllm:")


def parse_load(text: str) -> dict[str, float]:
    """``{"waiting", "running", "kv_cache_usage"}`` from a replica's metrics text (missing: absent)."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for prefix in PREFIXES:
            if family.name.startswith(prefix) and family.name[len(prefix):] in GAUGES:
                field = GAUGES[family.name[len(prefix):]]
                if field not in out or prefix == "kvfleet:":
                    out[field] = sum(s.value for s in family.samples)
    return out


class Prober:
    """Runs the probe loop for ``pool`` (start with :meth:`run` as a task).

    Args:
        pool: the endpoints.
        client: the HTTP client (its own: probes never wait behind proxied requests).
        interval: seconds between probe rounds.
        fast_interval: seconds between rounds while ``urgent()`` is true.
        urgent: ``() -> bool``; e.g. "requests are held".
        timeout: seconds one probe may take.
    """

    def __init__(self, pool: EndpointPool, client: httpx.AsyncClient, *, interval: float = 1.0,
                 fast_interval: float = 0.2, urgent=lambda: False, timeout: float = 2.0):
        self.pool = pool
        self.client = client
        self.interval = interval
        self.fast_interval = min(fast_interval, interval)
        self.urgent = urgent
        self.timeout = timeout
        self._kick = asyncio.Event()
        pool.on_added(self._kick.set)

    def kick(self) -> None:
        """Probe now (new endpoints, or a request started waiting)."""
        self._kick.set()

    async def probe_one(self, url: str) -> None:
        try:
            ready = (await self.client.get(url + "/ready", timeout=self.timeout)).status_code == 200
        except httpx.HTTPError:
            ready = False
        load: dict[str, float] = {}
        if ready:
            try:
                resp = await self.client.get(url + "/metrics", timeout=self.timeout)
                if resp.status_code == 200:
                    load = parse_load(resp.text)
            except (httpx.HTTPError, ValueError):
                logger.debug("metrics of %s unreadable", url, exc_info=True)
        self.pool.set_probe(url, ready, **load)

    async def probe_all(self) -> None:
        await asyncio.gather(*(self.probe_one(url) for url in self.pool.urls()))
        self.pool.end_ejections()

    async def run(self) -> None:
        while True:
            self._kick.clear()
            try:
                await self.probe_all()
            except Exception:  # never let one bad round end the loop
                logger.exception("probe round failed")
            wait = self.fast_interval if self.urgent() else self.interval
            try:
                await asyncio.wait_for(self._kick.wait(), wait)
            except TimeoutError:
                pass
