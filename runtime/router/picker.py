"""Which replica gets a request: prefix affinity by consistent hashing with bounded loads
(CHWBL), least load, or round robin. Pure: no I/O, no clocks; callers pass the candidates.

CHWBL is Mirrokni, Thorup and Zadimoghaddam, "Consistent Hashing with Bounded Loads" (SODA
2018), as KubeAI applies it to LLM prefix caching: every endpoint owns ``virtual_nodes`` points
on a 64-bit hash ring; a request's prefix key hashes to a point and walks clockwise to the first
endpoint whose load after taking the request stays within ``ceil(load_factor * (total + 1) / n)``
(the paper's capacity, with ``total`` the load of all ``n`` candidates; never below
``min_capacity``). The owner of the first
point is the *affinity* endpoint: picking it is a ``hit``; walking past it because it is full is a
``spill`` (a hot prefix spreads instead of melting one replica); a request without a prefix key
(or with ``least-load``) is routed by least load, a ``fallback``.

``precise-prefix-cache`` (llm-d's "precise prefix-cache scorer"): the caller passes, per
candidate, how many leading blocks of the request's prompt it caches (from the replicas' KV
events, :mod:`.kv_index`). Among the candidates within CHWBL's bound the one with the most cached
blocks wins (ties: least load, then the CHWBL ring order); a ``hit`` when that candidate also
holds the most blocks of all candidates, a ``spill`` when a fuller one was over its bound. When no
candidate caches any block of the prompt (or no events arrived: ``cached_blocks`` None) the
request is placed by the char-prefix CHWBL (``prefix-hash``), so new prefixes still spread.

Load of an endpoint (:attr:`Candidate.load`): the requests this router has in flight to it (exact
and immediate) plus the *foreign* requests its last ``/metrics`` scrape showed: its
``num_requests_running + num_requests_waiting`` minus what this router had in flight to it at that
moment (other router replicas' and direct traffic). Subtracting the router's own share at scrape
time keeps a scrape up to one probe interval old from counting requests that have finished since.
Ties in least load go to the lower ``kv_cache_usage_perc``, then round robin.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

ALGORITHMS = ("prefix-hash", "precise-prefix-cache", "least-load", "round-robin")
"""Values of ``--routing-algorithm``."""

HIT, SPILL, FALLBACK = "hit", "spill", "fallback"
"""Routing decisions (the ``decision`` label of ``kvfleet:router_routing_decisions_total``)."""


@dataclass(frozen=True)
class Candidate:
    """An endpoint that may take the request now.

    Attributes:
        key: stable identity on the hash ring (the endpoint's base URL).
        in_flight: requests this router has sent to it and not finished.
        foreign: requests at the replica not sent by this router, as of the last scrape (0 when unknown).
        kv_cache_usage: its ``kv_cache_usage_perc`` at the last scrape, 0..1 (0 when unknown).
    """

    key: str
    in_flight: int = 0
    foreign: float = 0.0
    kv_cache_usage: float = 0.0

    @property
    def load(self) -> float:
        return self.in_flight + self.foreign


@dataclass(frozen=True)
class Decision:
    """The chosen endpoint key and why (``hit``, ``spill`` or ``fallback``)."""

    key: str
    decision: str


def hash64(data: str) -> int:
    """64-bit hash of a string (BLAKE2b, 8-byte digest): stable across processes and restarts,
    unlike Python's salted ``hash``, so every router replica draws the same ring."""
    return int.from_bytes(hashlib.blake2b(data.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "big")


class HashRing:
    """The consistent-hash ring over endpoint keys, ``virtual_nodes`` points per endpoint.

    Rebuilt only when the set of keys changes (:meth:`update`); a lookup is one bisection plus a
    walk of at most ``len(points)`` steps.
    """

    def __init__(self, virtual_nodes: int = 100):
        if virtual_nodes < 1:
            raise ValueError("virtual_nodes must be >= 1")
        self.virtual_nodes = virtual_nodes
        self._keys: frozenset[str] = frozenset()
        self._points: list[int] = []
        self._owners: list[str] = []

    def update(self, keys: Sequence[str]) -> None:
        """Make the ring hold exactly ``keys`` (no-op when unchanged)."""
        new = frozenset(keys)
        if new == self._keys:
            return
        pairs = sorted((hash64(f"{k}#{i}"), k) for k in new for i in range(self.virtual_nodes))
        self._keys = new
        self._points = [p for p, _ in pairs]
        self._owners = [k for _, k in pairs]

    def walk(self, point: int):
        """Endpoint keys clockwise from ``point``, each once, the owner of ``point`` first."""
        if not self._points:
            return
        start = bisect.bisect_left(self._points, point) % len(self._points)
        seen: set[str] = set()
        for i in range(len(self._points)):
            owner = self._owners[(start + i) % len(self._points)]
            if owner not in seen:
                seen.add(owner)
                yield owner
                if len(seen) == len(self._keys):
                    return


def capacity(total_load: float, n: int, load_factor: float, min_capacity: int = 1) -> int:
    """CHWBL's bound: the most load one of ``n`` endpoints may carry once the new request is
    placed, ``ceil(load_factor * (total_load + 1) / n)``, and never below ``min_capacity``
    (kvfleet's floor: a continuous-batching replica takes a few more requests almost for free, so
    spilling a prefix at a handful in flight would only lose its cache hits)."""
    return max(1, min_capacity, math.ceil(load_factor * (total_load + 1) / n))


class Picker:
    """Chooses an endpoint for one request.

    Args:
        algorithm: one of :data:`ALGORITHMS`.
        load_factor: CHWBL's ``c`` (> 1; 1.25 as KubeAI's default): how far above the mean load
            one endpoint may go before its prefixes spill to the next endpoint on the ring.
        virtual_nodes: ring points per endpoint.
        min_capacity: an endpoint with fewer requests than this in flight never spills (1: the
            paper's bound alone).
    """

    def __init__(self, algorithm: str = "prefix-hash", *, load_factor: float = 1.25, virtual_nodes: int = 100,
                 min_capacity: int = 1):
        if algorithm not in ALGORITHMS:
            raise ValueError(f"unknown routing algorithm {algorithm!r}; one of {', '.join(ALGORITHMS)}")
        if load_factor < 1:
            raise ValueError("load_factor must be >= 1")
        self.algorithm = algorithm
        self.load_factor = load_factor
        self.min_capacity = min_capacity
        self.ring = HashRing(virtual_nodes)
        self._rr = itertools.count()

    def pick(self, candidates: Sequence[Candidate], prefix_key: str | None, *,
             ring_keys: Sequence[str] | None = None, cached_blocks: dict[str, int] | None = None) -> Decision:
        """Choose one of ``candidates`` (non-empty) for a request whose prefix key is ``prefix_key``.

        ``ring_keys`` are all known endpoints (default: the candidates): the ring is drawn over them,
        so an endpoint that is briefly unavailable (ejected, or already tried by this request)
        moves its prefixes to the next endpoint only, and they come back when it does.
        ``cached_blocks``: with ``precise-prefix-cache``, endpoint key -> leading prompt blocks
        it caches (None: no KV events; then as ``prefix-hash``).

        Raises: ValueError when ``candidates`` is empty.
        """
        if not candidates:
            raise ValueError("no candidates")
        if self.algorithm == "round-robin":
            return Decision(candidates[next(self._rr) % len(candidates)].key, FALLBACK)
        if self.algorithm == "precise-prefix-cache" and cached_blocks and any(cached_blocks.values()):
            return self._precise(candidates, cached_blocks, prefix_key, ring_keys or [c.key for c in candidates])
        if self.algorithm in ("prefix-hash", "precise-prefix-cache") and prefix_key is not None:
            return self._chwbl(candidates, prefix_key, ring_keys or [c.key for c in candidates])
        return Decision(self._least_loaded(candidates).key, FALLBACK)

    def _precise(self, candidates: Sequence[Candidate], cached_blocks: dict[str, int],
                 prefix_key: str | None, ring_keys: Sequence[str]) -> Decision:
        bound = capacity(sum(c.load for c in candidates), len(candidates), self.load_factor, self.min_capacity)
        ring_rank = {}
        if prefix_key is not None:
            self.ring.update(ring_keys)
            ring_rank = {k: i for i, k in enumerate(self.ring.walk(hash64(prefix_key)))}
        fits = [c for c in candidates if c.load + 1 <= bound] or list(candidates)
        best = max(fits, key=lambda c: (cached_blocks.get(c.key, 0), -c.load, -ring_rank.get(c.key, 0)))
        top = max(cached_blocks.get(c.key, 0) for c in candidates)
        return Decision(best.key, HIT if cached_blocks.get(best.key, 0) == top else SPILL)

    def _least_loaded(self, candidates: Sequence[Candidate]) -> Candidate:
        best = min((c.load, c.kv_cache_usage) for c in candidates)
        tied = [c for c in candidates if (c.load, c.kv_cache_usage) == best]
        return tied[next(self._rr) % len(tied)]

    def _chwbl(self, candidates: Sequence[Candidate], prefix_key: str, ring_keys: Sequence[str]) -> Decision:
        self.ring.update(ring_keys)
        by_key = {c.key: c for c in candidates}
        bound = capacity(sum(c.load for c in candidates), len(candidates), self.load_factor, self.min_capacity)
        first = True
        for key in self.ring.walk(hash64(prefix_key)):
            cand = by_key.get(key)
            if cand is not None and cand.load + 1 <= bound:
                return Decision(key, HIT if first else SPILL)
            first = False
        # every candidate is at its bound (only when loads are very uneven): least load
        return Decision(self._least_loaded(candidates).key, SPILL)
