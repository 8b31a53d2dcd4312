"""The chat request's wire format (runtime/entrypoints/openai/protocol/chat.py): errors name the
chat request's own fields."""

from __future__ import annotations

import pytest

from kvfleet.runtime.entrypoints.openai.protocol import ChatCompletionRequest, ProtocolError


def test_an_out_of_range_top_logprobs_is_named_in_param_and_message():
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], logprobs=True, top_logprobs=30)
    with pytest.raises(ProtocolError) as exc:
        body.to_sampling_params(4)
    assert exc.value.param == "top_logprobs"
    assert str(exc.value).startswith("top_logprobs must be an integer in [0, 20]"), exc.value
