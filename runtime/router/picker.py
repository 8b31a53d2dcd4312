"""Which replica gets a request: the router's one entry to the routing algorithms
(:mod:`kvfleet.runtime.router.routing`, one module each: ``prefix-hash`` (CHWBL prefix affinity),
``precise-prefix-cache``, ``least-load``, ``round-robin``). Pure: no I/O, no clocks; callers pass
the candidates.

:class:`Picker` holds one algorithm instance (its ring and counters) and checks the call; the
names, the candidates and the decisions are re-exported from :mod:`.routing` for its callers.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvfleet.runtime.router.routing import (
    ALGORITHMS,
    FALLBACK,
    HIT,
    NAMES,
    SPILL,
    Algorithm,
    Candidate,
    Decision,
    HashRing,
    Params,
    capacity,
    create,
    hash64,
)

__all__ = ["ALGORITHMS", "FALLBACK", "HIT", "NAMES", "SPILL", "Algorithm", "Candidate", "Decision", "HashRing",
           "Picker", "capacity", "hash64"]


class Picker:
    """Chooses an endpoint for one request with one algorithm.

    Args:
        algorithm: an :class:`~.routing.Algorithm` (or its name).
        load_factor, virtual_nodes, min_capacity: the algorithms' knobs (:class:`~.routing.Params`).

    Raises: ValueError for an unknown algorithm or a knob out of range.
    """

    def __init__(self, algorithm: str = Algorithm.PREFIX_HASH, *, load_factor: float = 1.25,
                 virtual_nodes: int = 100, min_capacity: int = 1):
        self.impl = create(algorithm, Params(load_factor=load_factor, virtual_nodes=virtual_nodes,
                                             min_capacity=min_capacity))
        self.algorithm: Algorithm = self.impl.name
        self.load_factor = load_factor
        self.min_capacity = min_capacity

    @property
    def ring(self) -> HashRing | None:
        """The algorithm's hash ring (None for those without one)."""
        return getattr(self.impl, "ring", None)

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
        return self.impl.pick(candidates, prefix_key, ring_keys=ring_keys or [c.key for c in candidates],
                              cached_blocks=cached_blocks)
