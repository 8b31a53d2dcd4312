"""What the autoscaler reads from an InferenceService's routers: requests pending and in flight.

Scrapes the ``/metrics`` of each ready router pod (``kvfleet:router_pending_requests``,
``kvfleet:router_in_flight_requests``; runtime/router/metrics.py) with the autoscaler's HTTP
client and sums them into a :class:`~kvfleet.operator.policy.RouterLoad`; None when no router
pod could be read (the autoscaler then decides without it, as before the router existed).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvfleet.operator.metrics_source import metrics_url, pod_is_ready
from kvfleet.operator.policy import RouterLoad

PENDING = "kvfleet:router_pending_requests"
IN_FLIGHT = "kvfleet:router_in_flight_requests"


def parse_router_load(text: str) -> RouterLoad:
    """The two gauges from one router's metrics text (absent: 0).

    Raises: ValueError on text that is not the Prometheus format.
    """
    values = {PENDING: 0.0, IN_FLIGHT: 0.0}
    for family in text_string_to_metric_families(text):
        if family.name in values:
            values[family.name] = sum(s.value for s in family.samples)
    return RouterLoad(pending=values[PENDING], in_flight=values[IN_FLIGHT])


async def read_router_load(http: httpx.AsyncClient, pods: Iterable[Mapping[str, Any]],
                           timeout: float = 3.0) -> RouterLoad | None:
    """Sum over the ready router ``pods`` that answered; None when none did."""
    async def one(pod: Mapping[str, Any]) -> RouterLoad | None:
        try:
            resp = await http.get(metrics_url(pod), timeout=timeout)
            resp.raise_for_status()
            return parse_router_load(resp.text)
        except (httpx.HTTPError, ValueError):
            return None

    loads = [x for x in await asyncio.gather(*(one(p) for p in pods if pod_is_ready(p))) if x is not None]
    if not loads:
        return None
    return RouterLoad(pending=sum(x.pending for x in loads), in_flight=sum(x.in_flight for x in loads))
