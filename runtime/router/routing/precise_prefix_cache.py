"""``precise-prefix-cache`` (llm-d's "precise prefix-cache scorer"): the replica caching the
longest prefix of the prompt's KV blocks, within CHWBL's bound.

The caller passes, per candidate, how many leading blocks of the request's prompt it caches (from
the replicas' KV events, :mod:`kvfleet.runtime.router.kv_index`; the router's
:class:`~kvfleet.runtime.router.precise.PrecisePicker` fills them in). Among the candidates within
CHWBL's bound the one with the most cached blocks wins (ties: least load, then the CHWBL ring
order); a ``hit`` when that candidate also holds the most blocks of all candidates, a ``spill``
when a fuller one was over its bound. When no candidate caches any block of the prompt (or no
events arrived: ``cached_blocks`` None) the request is placed by ``prefix-hash``, so new prefixes
still spread.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvfleet.runtime.router.routing.base import HIT, SPILL, Algorithm, Candidate, Decision, Params, hash64
from kvfleet.runtime.router.routing.prefix_hash import PrefixHash


class PrecisePrefixCache:
    """Most cached blocks within the bound; ``prefix-hash`` when nothing is cached."""

    name = Algorithm.PRECISE_PREFIX_CACHE
    reads_kv_events = True
    summary = ("the replica caching the longest prefix of the prompt's KV blocks, from the replicas' KV events, "
               "within CHWBL's bound (replicas without events: as prefix-hash)")

    def __init__(self, params: Params | None = None) -> None:
        self.prefix_hash = PrefixHash(params)
        self.ring = self.prefix_hash.ring

    def pick(self, candidates: Sequence[Candidate], prefix_key: str | None, *,
             ring_keys: Sequence[str] = (), cached_blocks: dict[str, int] | None = None) -> Decision:
        if not cached_blocks or not any(cached_blocks.values()):
            return self.prefix_hash.pick(candidates, prefix_key, ring_keys=ring_keys)
        bound = self.prefix_hash.bound(candidates)
        ring_rank = {}
        if prefix_key is not None:
            self.ring.update(ring_keys or [c.key for c in candidates])
            ring_rank = {k: i for i, k in enumerate(self.ring.walk(hash64(prefix_key)))}
        fits = [c for c in candidates if c.load + 1 <= bound] or list(candidates)
        best = max(fits, key=lambda c: (cached_blocks.get(c.key, 0), -c.load, -ring_rank.get(c.key, 0)))
        top = max(cached_blocks.get(c.key, 0) for c in candidates)
        return Decision(best.key, HIT if cached_blocks.get(best.key, 0) == top else SPILL)
