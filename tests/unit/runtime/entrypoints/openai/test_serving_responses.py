"""The bounded store of responses: LRU eviction, 404s."""

from __future__ import annotations

import pytest

from kvfleet.runtime.entrypoints.openai.errors import APIError
from kvfleet.runtime.entrypoints.openai.serving_responses import ResponseStore, Stored


def test_lru_bound_and_delete():
    store = ResponseStore(2)
    for rid in ("a", "b"):
        store.put(rid, Stored({"id": rid}, []))
    store.get("a")  # a is now the most recent
    store.put("c", Stored({"id": "c"}, []))
    assert store.find("b") is None and store.get("a").body["id"] == "a"
    store.delete("a")
    with pytest.raises(APIError) as info:
        store.get("a")
    assert info.value.status == 404
    off = ResponseStore(0)
    off.put("x", Stored({}, []))
    assert off.find("x") is None
