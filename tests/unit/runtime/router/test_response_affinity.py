"""Stored Responses-API responses: which request needs which, the bounded id -> replica map."""

from __future__ import annotations

from kvfleet.runtime.router.response_affinity import ResponseAffinity, wanted_response_id


def test_wanted_response_id():
    assert wanted_response_id("GET", "/v1/responses/resp_1", None) == "resp_1"
    assert wanted_response_id("DELETE", "/v1/responses/resp_1", None) == "resp_1"
    assert wanted_response_id("POST", "/v1/responses", {"previous_response_id": "resp_2"}) == "resp_2"
    assert wanted_response_id("POST", "/v1/responses", {"input": "x"}) is None
    assert wanted_response_id("POST", "/v1/chat/completions", {"previous_response_id": "r"}) is None


def test_lru_bound():
    a = ResponseAffinity(size=2)
    a.record("r1", "http://a")
    a.record("r2", "http://b")
    a.record(None, "http://c")
    assert a.replica("r1") == "http://a"
    a.record("r3", "http://c")
    assert a.replica("r1") is None and a.replica("r3") == "http://c" and a.replica(None) is None
