"""The embeddings body: every ``input`` shape to a list of items; empty or too many is a 400."""

from __future__ import annotations

import pytest

from kvfleet.runtime.entrypoints.openai.protocol.common import ProtocolError
from kvfleet.runtime.entrypoints.openai.protocol.embeddings import MAX_INPUTS, EmbeddingRequest


@pytest.mark.parametrize(("inp", "items"), [("a", ["a"]), (["a", "b"], ["a", "b"]), ([1, 2], [[1, 2]]),
                                            ([[1], [2, 3]], [[1], [2, 3]])])
def test_inputs(inp, items):
    assert EmbeddingRequest(input=inp).inputs() == items


@pytest.mark.parametrize("inp", ["", [], ["a", ""], [[]], ["x"] * (MAX_INPUTS + 1)])
def test_bad_inputs(inp):
    with pytest.raises(ProtocolError) as info:
        EmbeddingRequest(input=inp).inputs()
    assert info.value.param == "input"
