"""The routing algorithms' registry (kvfleet.runtime.router.routing): one enum, one class per
name, the CLI's choices and the CRD's enum generated from it, and the protocol every algorithm
keeps (each algorithm's own behaviour through the Picker: ../test_picker.py, ../test_precise.py)."""

from __future__ import annotations

import collections

import pytest

from kvfleet.operator import crd_schema
from kvfleet.runtime.router import routing
from kvfleet.runtime.router.routing import ALGORITHMS, NAMES, Algorithm, Candidate, Params
from kvfleet.runtime.router.settings import parse_args

KEYS = [f"http://10.0.0.{i}:8000" for i in range(1, 5)]


def test_every_name_has_one_class_that_names_itself():
    assert set(ALGORITHMS) == set(Algorithm)
    for name, cls in ALGORITHMS.items():
        assert cls.name is name and isinstance(cls.summary, str) and cls.summary
    assert NAMES == ("prefix-hash", "precise-prefix-cache", "least-load", "round-robin")
    assert [a for a in Algorithm if routing.reads_kv_events(a)] == [Algorithm.PRECISE_PREFIX_CACHE]


def test_cli_choices_and_crd_enum_come_from_the_enum():
    schema = crd_schema.ROUTER["properties"]["algorithm"]
    assert schema["enum"] == list(NAMES) and schema["default"] == routing.DEFAULT == "precise-prefix-cache"
    for a in Algorithm:
        assert a.value in schema["description"]
        settings = parse_args(["--endpoints", "http://a:1", "--routing-algorithm", a.value], environ={})
        assert settings.routing_algorithm is a
    assert parse_args(["--endpoints", "http://a:1"], environ={}).routing_algorithm is routing.DEFAULT
    with pytest.raises(SystemExit):
        parse_args(["--endpoints", "http://a:1", "--routing-algorithm", "random"], environ={})


def test_unknown_names_and_bad_knobs_are_clear_errors():
    with pytest.raises(ValueError, match="unknown routing algorithm 'random'; one of prefix-hash"):
        routing.create("random")
    with pytest.raises(ValueError, match="load_factor"):
        Params(load_factor=0.5)
    with pytest.raises(ValueError, match="virtual_nodes"):
        Params(virtual_nodes=0)


@pytest.mark.parametrize("name", list(Algorithm))
def test_each_algorithm_picks_only_among_the_candidates(name):
    algo = routing.create(name, Params(min_capacity=1))
    cands = [Candidate(KEYS[0], in_flight=2), Candidate(KEYS[2]), Candidate(KEYS[3], foreign=1.0)]
    seen = collections.Counter()
    for i in range(60):
        d = algo.pick(cands, f"prefix {i % 7}" if i % 2 else None, ring_keys=KEYS,
                      cached_blocks={KEYS[2]: i % 3} if i % 5 == 0 else None)
        assert d.key in {c.key for c in cands} and d.decision in (routing.HIT, routing.SPILL, routing.FALLBACK)
        seen[d.key] += 1
    if name == Algorithm.ROUND_ROBIN:
        assert set(seen.values()) == {20}
    if name == Algorithm.LEAST_LOAD:
        assert set(seen) == {KEYS[2]}


def test_instances_are_independent():
    a, b = routing.create("round-robin"), routing.create("round-robin")
    cands = [Candidate(k) for k in KEYS[:2]]
    assert [a.pick(cands, None).key for _ in range(3)] == [KEYS[0], KEYS[1], KEYS[0]]
    assert b.pick(cands, None).key == KEYS[0]
