"""``/kv_blocks``' hash list: a comma-separated query or a JSON list of 16-byte hex hashes; anything
else is a 400 in OpenAI's error shape naming ``block_hashes`` (issue 29)."""

from __future__ import annotations

import pytest

from kvfleet.runtime.entrypoints.openai.errors import APIError
from kvfleet.runtime.entrypoints.openai.serving_kv_blocks import MAX_BLOCKS, parse_hashes

A, B = "ab" * 16, "01" * 16


def test_query_and_list_forms():
    assert parse_hashes(f"{A},{B}") == [bytes.fromhex(A), bytes.fromhex(B)]
    assert parse_hashes([A]) == [bytes.fromhex(A)]
    assert parse_hashes("") == [] and parse_hashes([]) == []


@pytest.mark.parametrize("value", ["zz", [A[:-2]], [1], None, {"a": A}, [A] * (MAX_BLOCKS + 1)])
def test_bad_hash_lists_are_a_400(value):
    with pytest.raises(APIError) as exc:
        parse_hashes(value)
    assert exc.value.status == 400 and exc.value.body.error.param == "block_hashes"
