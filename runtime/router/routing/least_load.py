"""``least-load``: the candidate with the least load (:attr:`~.base.Candidate.load`); ties go to
the lower ``kv_cache_usage_perc``, then round robin. Every request is a ``fallback``. The other
algorithms place the requests they have no affinity for with it."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from kvfleet.runtime.router.routing.base import FALLBACK, Algorithm, Candidate, Decision, Params


class LeastLoad:
    """Least load, ties by KV cache usage, then in turn."""

    name = Algorithm.LEAST_LOAD
    reads_kv_events = False
    summary = "least load (in flight + foreign requests), then KV cache usage"

    def __init__(self, params: Params | None = None) -> None:
        self._rr = itertools.count()

    def least_loaded(self, candidates: Sequence[Candidate]) -> Candidate:
        """The least loaded of ``candidates`` (non-empty)."""
        best = min((c.load, c.kv_cache_usage) for c in candidates)
        tied = [c for c in candidates if (c.load, c.kv_cache_usage) == best]
        return tied[next(self._rr) % len(tied)]

    def pick(self, candidates: Sequence[Candidate], prefix_key: str | None, *,
             ring_keys: Sequence[str] = (), cached_blocks: dict[str, int] | None = None) -> Decision:
        return Decision(self.least_loaded(candidates).key, FALLBACK)
