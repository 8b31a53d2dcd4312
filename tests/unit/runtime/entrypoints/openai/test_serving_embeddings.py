"""Token-budget groups of the inputs and the base64 encoding OpenAI's SDK decodes."""

from __future__ import annotations

import base64

import numpy as np

from kvfleet.runtime.entrypoints.openai.serving_embeddings import _encode, _groups


def test_groups_keep_order_and_budget():
    seqs = [[1] * 3, [2] * 3, [3] * 5, [4] * 9, [5]]
    groups = _groups(seqs, 6)
    assert [s for g in groups for s in g] == seqs
    assert [sum(map(len, g)) for g in groups] == [6, 5, 9, 1]  # a longer sequence goes alone


def test_base64_is_little_endian_float32():
    v = [0.5, -1.25, 3.0]
    assert _encode(v, "float") == v
    assert np.frombuffer(base64.b64decode(_encode(v, "base64")), dtype="<f4").tolist() == v
