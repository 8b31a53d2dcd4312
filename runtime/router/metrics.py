"""The router's own Prometheus metrics (``GET /metrics`` of ``kvfleet router``).

Names use the runtime's ``kvfleet:`` prefix and prometheus-client's suffixes:

- ``kvfleet:router_requests_total{endpoint, outcome}``: finished requests. outcome: ``success``
  (the replica's answer passed through, 2xx/3xx), ``error_status`` (a 4xx/5xx from the replica
  passed through), ``stream_error`` (the replica failed after the first byte: the client sees the
  stream cut), ``migration_failed`` (a migratable stream broke and could not move on: it ended
  with a ``migration_failed`` error event), ``migrated`` (the replica a stream left),
  ``client_disconnect``, ``retried`` (connect error or 503 before the first byte; the
  request went on to another replica), ``upstream_error`` (502: the replica failed before
  answering, not retried), and with ``endpoint=""``: ``rejected`` (429, hold queue full),
  ``timeout`` (503, held past ``--pending-timeout``), ``unauthorized`` (401 at the router).
- ``kvfleet:router_pending_requests``: requests held while no replica is available (the
  operator's autoscaler scales from zero on it).
- ``kvfleet:router_in_flight_requests``: requests sent to a replica and not finished.
- ``kvfleet:router_routing_decisions_total{decision}``: ``hit`` (the prefix's own replica),
  ``spill`` (the next one on the ring: the own one was over its bounded load or unavailable),
  ``fallback`` (no prefix key, or least-load / round-robin routing).
- ``kvfleet:router_upstream_latency_seconds{endpoint}``: histogram, request sent until the
  replica's response headers (for a stream: its first byte).
- ``kvfleet:router_endpoints{state}``: endpoints ``available``, ``ejected``, ``not_ready``.
- ``kvfleet:router_prefill_legs_total{outcome}``: prefill/decode disaggregation's prefill legs
  (:mod:`.disagg`): ``success`` (the decode leg pulls the blocks), ``retried`` (a prefill replica
  failed; the leg went to another), ``colocated`` (no prefill replica could: the decode replica
  computes the prompt).
- ``kvfleet:router_kv_events_refused_total{reason}``: KV event publishers refused
  (:mod:`kvfleet.runtime.kv_events.auth`): ``not_fleet`` (the fleet's CURVE handshake failed: a
  plaintext publisher or another key; one per attempt), ``malformed`` (a message that is no batch).
- ``kvfleet:router_kv_index_blocks{endpoint}``: with precise prefix routing, the KV blocks the
  router's index holds for each replica (from its KV events); ``-1`` while the replica's state is
  stale (no snapshot yet, or a ``seq`` gap). What the index knows, so a test or an operator can
  wait for a replica's events to arrive instead of sleeping.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvfleet.runtime.router.endpoints import EndpointPool

CONTENT_TYPE = CONTENT_TYPE_LATEST
PREFIX = "kvfleet:"
PENDING = PREFIX + "router_pending_requests"
IN_FLIGHT = PREFIX + "router_in_flight_requests"
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class RouterMetrics:
    """The series above, in their own registry (one per app)."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.requests = Counter(PREFIX + "router_requests", "Requests finished by the router, by replica and outcome.",
                                ["endpoint", "outcome"], registry=r)
        self.pending = Gauge(PENDING, "Requests held while no replica is available.", registry=r)
        self.in_flight = Gauge(IN_FLIGHT, "Requests sent to a replica and not finished.", registry=r)
        self.decisions = Counter(PREFIX + "router_routing_decisions", "Routing decisions: hit, spill, fallback.",
                                 ["decision"], registry=r)
        self.upstream_latency = Histogram(PREFIX + "router_upstream_latency_seconds",
                                          "Seconds from sending a request to the replica's response headers.",
                                          ["endpoint"], buckets=LATENCY_BUCKETS, registry=r)
        self.endpoints = Gauge(PREFIX + "router_endpoints", "Endpoints by state.", ["state"], registry=r)
        self.migrations = Counter(PREFIX + "router_migrations", "Streams moved to another replica mid-stream, "
                                  "by reason (upstream_error, upstream_closed, drain).", ["reason"], registry=r)
        self.migrated_tokens = Counter(PREFIX + "router_migrated_tokens", "Delivered output tokens replayed "
                                       "on the replica a stream migrated to.", registry=r)
        self.kv_peer_hints = Counter(PREFIX + "router_kv_peer_hints", "Requests sent with an x-kvfleet-kv-peer hint "
                                     "(--kv-peer-hint: another replica caches a longer prefix).", registry=r)
        self.prefill_legs = Counter(PREFIX + "router_prefill_legs", "Prefill legs of disaggregated requests, by "
                                    "outcome: success, retried, colocated.", ["outcome"], registry=r)
        self.kv_events_refused = Counter(PREFIX + "router_kv_events_refused", "KV event publishers refused: "
                                         "not_fleet (per handshake), malformed (per message).",
                                         ["reason"], registry=r)
        self.kv_index_blocks = Gauge(PREFIX + "router_kv_index_blocks", "KV blocks the router's index holds per "
                                     "replica (precise routing); -1 while the replica's state is stale.",
                                     ["endpoint"], registry=r)
        for decision in ("hit", "spill", "fallback"):
            self.decisions.labels(decision)

    def exposition(self, pool: EndpointPool, pending: int, in_flight: int,
                   kv_index_blocks: dict[str, int] | None = None) -> bytes:
        """Text format 0.0.4 after refreshing the gauges from ``pool`` (and, with precise routing,
        ``kv_index_blocks``: endpoint -> blocks held, -1 if stale)."""
        counts = {"available": 0, "ejected": 0, "not_ready": 0}
        for ep in pool:
            state = "not_ready" if not ep.ready else "ejected" if pool.is_ejected(ep) else "available"
            counts[state] += 1
        for state, n in counts.items():
            self.endpoints.labels(state).set(n)
        self.pending.set(pending)
        self.in_flight.set(in_flight)
        self.kv_index_blocks.clear()
        for endpoint, blocks in (kv_index_blocks or {}).items():
            self.kv_index_blocks.labels(endpoint).set(blocks)
        return generate_latest(self.registry)
