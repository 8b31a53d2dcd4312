"""Anthropic Messages requests -> chat requests, stop reasons, error shape, the OpenAPI schema."""

import json

import pytest
from pydantic import ValidationError

from kvfleet.runtime.entrypoints.anthropic.protocol import MessagesRequest, error_body, stop_reason


def test_to_chat_translates_blocks_tools_and_sampling():
    req = MessagesRequest.model_validate({
        "model": "m", "max_tokens": 7, "system": [{"type": "text", "text": "Be brief."}],
        "stop_sequences": ["END"], "temperature": 0.5, "top_k": 3,
        "tools": [{"name": "f", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [{"type": "text", "text": "calling"},
                                              {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"a": 1}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "42",
                                          "is_error": True}, {"type": "text", "text": "so?"}]},
        ]})
    chat = req.to_chat()
    msgs = chat.template_messages()
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool", "user"]
    assert msgs[0]["content"] == "Be brief." and msgs[3] == {"role": "tool", "content": "Error: 42",
                                                             "tool_call_id": "toolu_1"}
    assert json.loads(msgs[2]["tool_calls"][0]["function"]["arguments"]) == {"a": 1}
    assert chat.stop == ["END"] and chat.max_tokens == 7 and chat.top_k == 3 and chat.temperature == 0.5
    assert chat.tool_choice == "required" and chat.parallel_tool_calls is False
    assert chat.tools[0]["function"]["parameters"] == {"type": "object"}


@pytest.mark.parametrize("patch", [{"max_tokens": None}, {"max_tokens": 0}, {"thinking": {"type": "enabled"}},
                                   {"temperature": 1.5}, {"messages": []}])
def test_refused(patch):
    body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}], **patch}
    body = {k: v for k, v in body.items() if v is not None}
    with pytest.raises(ValidationError):
        MessagesRequest.model_validate(body)


def test_stop_reasons_and_errors():
    assert stop_reason("tool_calls", None) == ("tool_use", None)
    assert stop_reason("length", None) == ("max_tokens", None)
    assert stop_reason("stop", "END") == ("stop_sequence", "END")
    assert stop_reason("stop", 2) == ("end_turn", None)
    assert error_body(404, "no") == {"type": "error", "error": {"type": "not_found_error", "message": "no"}}


def test_openapi_describes_messages():
    from kvfleet.runtime.entrypoints.openai.api_server import create_app

    op = create_app().openapi()["paths"]["/v1/messages"]["post"]
    schema = op["requestBody"]["content"]["application/json"]["schema"]
    assert {"model", "messages", "max_tokens"} <= set(schema["required"])
    assert "$ref" not in json.dumps(schema) and "tool_use" in json.dumps(schema)
