"""The router's routing algorithms, one module each (KubeAI's ``balance_*.go``), behind one enum.

- :mod:`.base`: :class:`Algorithm` (the one list of names: ``kvfleet router --routing-algorithm``'s
  choices and the CRD's ``spec.router.algorithm`` enum are generated from it), the candidates,
  the decision, the knobs and the :class:`RoutingAlgorithm` protocol;
- :mod:`.prefix_hash`, :mod:`.precise_prefix_cache`, :mod:`.least_load`, :mod:`.round_robin`:
  one class each.

:data:`ALGORITHMS` maps each name to its class, found by the naming rule (``least-load`` is the
class of :mod:`.least_load` whose ``name`` is ``Algorithm.LEAST_LOAD``); :func:`create` builds
one. A new algorithm is its module and its enum member (plus its test, its row in
docs/routing.md and the regenerated CRD files). Pure and stdlib-only: the operator imports this
package for the CRD's enum.
"""

from __future__ import annotations

import importlib

from kvfleet.runtime.router.routing.base import (
    DEFAULT,
    FALLBACK,
    HIT,
    SPILL,
    Algorithm,
    Candidate,
    Decision,
    Params,
    RoutingAlgorithm,
    capacity,
    hash64,
)
from kvfleet.runtime.router.routing.least_load import LeastLoad
from kvfleet.runtime.router.routing.precise_prefix_cache import PrecisePrefixCache
from kvfleet.runtime.router.routing.prefix_hash import HashRing, PrefixHash
from kvfleet.runtime.router.routing.round_robin import RoundRobin


def _classes() -> dict[Algorithm, type[RoutingAlgorithm]]:
    """Each member's class: the class of module ``<name with _ for ->`` whose ``name`` is it."""
    out = {}
    for algorithm in Algorithm:
        module = importlib.import_module(f"{__name__}.{algorithm.value.replace('-', '_')}")
        found = [c for c in vars(module).values() if isinstance(c, type) and getattr(c, "name", None) is algorithm]
        if len(found) != 1:
            raise ImportError(f"{module.__name__} must define one class named {algorithm!r}, found {found}")
        out[algorithm] = found[0]
    return out


ALGORITHMS: dict[Algorithm, type[RoutingAlgorithm]] = _classes()
"""Every algorithm's class by its name, found by the module naming rule (``precise-prefix-cache`` ->
:mod:`.precise_prefix_cache`)."""

NAMES: tuple[str, ...] = tuple(a.value for a in Algorithm)
"""The names as plain strings, in the enum's order (CLI choices, the CRD's enum)."""


def describe() -> str:
    """Every algorithm and its summary, the default first (the CLI's help, the CRD's description)."""
    order = [DEFAULT, *(a for a in Algorithm if a != DEFAULT)]
    return "; ".join(f"{a.value}{' (default)' if a == DEFAULT else ''}: {ALGORITHMS[a].summary}" for a in order)


def parse(name: str) -> Algorithm:
    """``name`` as an :class:`Algorithm`.

    Raises: ValueError naming the valid choices.
    """
    try:
        return Algorithm(name)
    except ValueError:
        raise ValueError(f"unknown routing algorithm {name!r}; one of {', '.join(NAMES)}") from None


def create(name: str, params: Params | None = None) -> RoutingAlgorithm:
    """A fresh instance of the algorithm ``name`` (its own ring and counters)."""
    return ALGORITHMS[parse(name)](params or Params())


def reads_kv_events(name: str) -> bool:
    """Whether the algorithm ``name`` routes on the replicas' KV events."""
    return ALGORITHMS[parse(name)].reads_kv_events


__all__ = ["ALGORITHMS", "DEFAULT", "FALLBACK", "HIT", "NAMES", "SPILL", "Algorithm", "Candidate", "Decision",
           "HashRing", "LeastLoad", "Params", "PrecisePrefixCache", "PrefixHash", "RoundRobin", "RoutingAlgorithm",
           "capacity", "create", "describe", "hash64", "parse", "reads_kv_events"]
