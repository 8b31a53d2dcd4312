"""What every routing algorithm shares: the one enum of their names (:class:`Algorithm`), the
candidates it chooses among (:class:`Candidate`), its answer (:class:`Decision`), its knobs
(:class:`Params`), the small protocol each algorithm implements (:class:`RoutingAlgorithm`), and
the pieces two of them use (:func:`hash64`, :func:`capacity`). Pure: no I/O, no clocks.

Load of an endpoint (:attr:`Candidate.load`): the requests this router has in flight to it (exact
and immediate) plus the *foreign* requests its last ``/metrics`` scrape showed: its
``num_requests_running + num_requests_waiting`` minus what this router had in flight to it at that
moment (other router replicas' and direct traffic). Subtracting the router's own share at scrape
time keeps a scrape up to one probe interval old from counting requests that have finished since.
"""

from __future__ import annotations

import enum
import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol


class Algorithm(enum.StrEnum):
    """The routing algorithms by name: ``--routing-algorithm``'s choices and the CRD's
    ``spec.router.algorithm`` enum are generated from this one list."""

    PREFIX_HASH = "prefix-hash"
    PRECISE_PREFIX_CACHE = "precise-prefix-cache"
    LEAST_LOAD = "least-load"
    ROUND_ROBIN = "round-robin"


DEFAULT = Algorithm.PRECISE_PREFIX_CACHE
"""The router's and the CRD's default algorithm."""

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


@dataclass(frozen=True)
class Params:
    """The knobs of the algorithms (each reads the ones it needs).

    Attributes:
        load_factor: CHWBL's ``c`` (>= 1; 1.25 as KubeAI's default): how far above the mean load
            one endpoint may go before its prefixes spill to the next endpoint on the ring.
        virtual_nodes: ring points per endpoint.
        min_capacity: an endpoint with fewer requests than this in flight never spills (1: the
            paper's bound alone).
    """

    load_factor: float = 1.25
    virtual_nodes: int = 100
    min_capacity: int = 1

    def __post_init__(self) -> None:
        if self.load_factor < 1:
            raise ValueError("load_factor must be >= 1")
        if self.virtual_nodes < 1:
            raise ValueError("virtual_nodes must be >= 1")


class RoutingAlgorithm(Protocol):
    """One routing algorithm: built from :class:`Params`, asked once per request.

    ``reads_kv_events``: the algorithm needs the replicas' KV events (the router subscribes to
    them and the operator turns them on in the replicas); ``summary``: one line for the CLI's
    help and the CRD's description.
    """

    name: ClassVar[Algorithm]
    reads_kv_events: ClassVar[bool]
    summary: ClassVar[str]

    def __init__(self, params: Params) -> None: ...

    def pick(self, candidates: Sequence[Candidate], prefix_key: str | None, *,
             ring_keys: Sequence[str], cached_blocks: dict[str, int] | None) -> Decision:
        """Choose one of ``candidates`` (non-empty). ``ring_keys``: every known endpoint (the
        candidates and those briefly unavailable); ``cached_blocks``: endpoint key -> leading
        prompt blocks it caches (None: unknown)."""
        ...


def hash64(data: str) -> int:
    """64-bit hash of a string (BLAKE2b, 8-byte digest): stable across processes and restarts,
    unlike Python's salted ``hash``, so every router replica draws the same ring."""
    return int.from_bytes(hashlib.blake2b(data.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "big")


def capacity(total_load: float, n: int, load_factor: float, min_capacity: int = 1) -> int:
    """CHWBL's bound: the most load one of ``n`` endpoints may carry once the new request is
    placed, ``ceil(load_factor * (total_load + 1) / n)``, and never below ``min_capacity``
    (kvfleet's floor: a continuous-batching replica takes a few more requests almost for free, so
    spilling a prefix at a handful in flight would only lose its cache hits)."""
    return max(1, min_capacity, math.ceil(load_factor * (total_load + 1) / n))
