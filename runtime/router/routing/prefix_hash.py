"""``prefix-hash``: prefix affinity by consistent hashing with bounded loads (CHWBL) on the
prompt's character prefix key (:mod:`kvfleet.runtime.router.prefix_key`).

CHWBL is Mirrokni, Thorup and Zadimoghaddam, "Consistent Hashing with Bounded Loads" (SODA
2018), as KubeAI applies it to LLM prefix caching: every endpoint owns ``virtual_nodes`` points
on a 64-bit hash ring; a request's prefix key hashes to a point and walks clockwise to the first
endpoint whose load after taking the request stays within ``ceil(load_factor * (total + 1) / n)``
(the paper's capacity, with ``total`` the load of all ``n`` candidates; never below
``min_capacity``: :func:`~.base.capacity`). The owner of the first point is the *affinity*
endpoint: picking it is a ``hit``; walking past it because it is full is a ``spill`` (a hot
prefix spreads instead of melting one replica); a request without a prefix key is routed by
least load, a ``fallback``.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from kvfleet.runtime.router.routing.base import (
    HIT,
    SPILL,
    Algorithm,
    Candidate,
    Decision,
    Params,
    capacity,
    hash64,
)
from kvfleet.runtime.router.routing.least_load import LeastLoad


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


class PrefixHash:
    """CHWBL on the prefix key; least load without one."""

    name = Algorithm.PREFIX_HASH
    reads_kv_events = False
    summary = "CHWBL prefix affinity on the prompt's characters, over least load"

    def __init__(self, params: Params | None = None) -> None:
        self.params = params or Params()
        self.ring = HashRing(self.params.virtual_nodes)
        self.least_load = LeastLoad(self.params)

    def bound(self, candidates: Sequence[Candidate]) -> int:
        """The most load one candidate may carry once this request is placed."""
        return capacity(sum(c.load for c in candidates), len(candidates), self.params.load_factor,
                        self.params.min_capacity)

    def pick(self, candidates: Sequence[Candidate], prefix_key: str | None, *,
             ring_keys: Sequence[str] = (), cached_blocks: dict[str, int] | None = None) -> Decision:
        if prefix_key is None:
            return self.least_load.pick(candidates, None)
        self.ring.update(ring_keys or [c.key for c in candidates])
        by_key = {c.key: c for c in candidates}
        bound = self.bound(candidates)
        first = True
        for key in self.ring.walk(hash64(prefix_key)):
            cand = by_key.get(key)
            if cand is not None and cand.load + 1 <= bound:
                return Decision(key, HIT if first else SPILL)
            first = False
        # every candidate is at its bound (only when loads are very uneven): least load
        return Decision(self.least_load.least_loaded(candidates).key, SPILL)
