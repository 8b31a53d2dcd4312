"""The Responses body to a chat body: input items, tools, text.format; refused fields name themselves."""

from __future__ import annotations

import pytest

from kvfleet.runtime.entrypoints.openai.protocol.common import ProtocolError
from kvfleet.runtime.entrypoints.openai.protocol.responses import ResponsesRequest, input_messages


def test_items_become_chat_messages():
    msgs = input_messages([
        {"role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
        {"type": "function_call", "call_id": "c1", "name": "w", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "w", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
    ])
    assert msgs[0] == {"role": "user", "content": "weather?"}
    assert [c["id"] for c in msgs[1]["tool_calls"]] == ["c1", "c2"]
    assert msgs[2] == {"role": "tool", "tool_call_id": "c1", "content": "sunny"}


def test_chat_fields():
    body = ResponsesRequest(input="x", max_output_tokens=5, tools=[{"type": "function", "name": "f"}],
                            tool_choice={"type": "function", "name": "f"},
                            text={"format": {"type": "json_schema", "name": "n", "schema": {"type": "object"}}})
    f = body.chat_fields()
    assert f["max_completion_tokens"] == 5 and f["tools"] == [{"type": "function", "function": {"name": "f"}}]
    assert f["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert f["response_format"] == {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object"}}}


@pytest.mark.parametrize(("extra", "param"), [({"background": True}, "background"),
                                              ({"tools": [{"type": "file_search"}]}, "tools"),
                                              ({"reasoning": {"effort": "low"}}, "reasoning"),
                                              ({"truncation": "auto"}, "truncation")])
def test_refused(extra, param):
    with pytest.raises(ProtocolError) as info:
        ResponsesRequest(input="x", **extra).check_supported()
    assert info.value.param == param
