"""``round-robin``: each candidate in turn, whatever its load or cache (a baseline for
comparison). Every request is a ``fallback``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from kvfleet.runtime.router.routing.base import FALLBACK, Algorithm, Candidate, Decision, Params


class RoundRobin:
    """The next candidate of the list, cycling."""

    name = Algorithm.ROUND_ROBIN
    reads_kv_events = False
    summary = "each replica in turn (for comparison)"

    def __init__(self, params: Params | None = None) -> None:
        self._rr = itertools.count()

    def pick(self, candidates: Sequence[Candidate], prefix_key: str | None, *,
             ring_keys: Sequence[str] = (), cached_blocks: dict[str, int] | None = None) -> Decision:
        return Decision(candidates[next(self._rr) % len(candidates)].key, FALLBACK)
