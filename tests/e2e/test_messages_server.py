"""Tools with the OpenAI SDK's defaults and Anthropic's ``/v1/messages`` (official ``anthropic``
SDK) against one real ``kvfleet serve`` started with no tool flags (the default model)."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest
from support.serve import start_serve, stop_serve

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
GREEDY = {"temperature": 0}  # this SDK has no sampling arguments: they go in the body
ASK = "What is the weather in Paris? Use the get_weather tool."


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("messages") / "server.log"
    proc, base = start_serve(["--dtype", "float32", "--num-blocks", "64"], log)
    yield base, log
    stop_serve(proc)


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server[0], api_key="none", max_retries=0, timeout=300)


def test_openai_tools_round_trip_with_sdk_defaults(server):
    base, log = server
    assert "tool_choice auto: parser hermes (the chat template does not render tools" in log.read_text()
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=300)
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                               "parameters": WEATHER}}]
    messages = [{"role": "user", "content": ASK}]
    # The SDK's defaults (tools, no tool_choice: auto) on a flagless server: answered, and read by
    # the detected parser (the 135M model answers in text here; it never chooses a call itself).
    auto = client.chat.completions.create(model=MODEL, messages=messages, tools=tools, temperature=0, max_tokens=30)
    assert auto.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert auto.choices[0].message.content or auto.choices[0].message.tool_calls
    # A call the model makes (required: the tool grammar), its result, then the final answer with defaults.
    first = client.chat.completions.create(model=MODEL, messages=messages, tools=tools, tool_choice="required",
                                           parallel_tool_calls=False, temperature=0, max_tokens=60)
    msg = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls", msg
    call = msg.tool_calls[0]
    assert call.function.name == "get_weather" and "city" in json.loads(call.function.arguments)
    messages += [msg.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": '{"temperature_c": 21, "sky": "clear"}'}]
    final = client.chat.completions.create(model=MODEL, messages=messages, tools=tools, temperature=0, max_tokens=40)
    assert final.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert final.choices[0].message.content or final.choices[0].message.tool_calls
    assert final.usage.prompt_tokens > first.usage.prompt_tokens


def test_messages_text(claude):
    msg = claude.messages.create(model=MODEL, max_tokens=16, system="You are terse.", extra_body=GREEDY,
                                 messages=[{"role": "user", "content": "Name a colour."}])
    assert msg.type == "message" and msg.role == "assistant" and msg.content[0].type == "text"
    assert msg.content[0].text and msg.stop_reason in ("end_turn", "max_tokens")
    assert msg.usage.input_tokens > 5 and 0 < msg.usage.output_tokens <= 16
    short = claude.messages.create(model=MODEL, max_tokens=3, messages=[{"role": "user", "content": "Tell a story."}])
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 3


def test_messages_stream_adds_up(claude):
    kwargs = dict(model=MODEL, max_tokens=24, extra_body=GREEDY, messages=[{"role": "user", "content": [
        {"type": "text", "text": "Count from one to five."}]}], system=[{"type": "text", "text": "Be brief."}])
    with claude.messages.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and kinds[-2] == "message_delta"
    assert {"content_block_start", "content_block_delta", "content_block_stop"} <= set(kinds)
    whole = claude.messages.create(**kwargs)
    assert final.content[0].text == whole.content[0].text
    assert final.usage.input_tokens == whole.usage.input_tokens
    assert events[0].message.usage.input_tokens == whole.usage.input_tokens > 5  # known from message_start on
    assert final.usage.output_tokens == whole.usage.output_tokens and final.stop_reason == whole.stop_reason


def test_messages_tool_use_round_trip(claude):
    tools = [{"name": "get_weather", "description": "Weather of a city", "input_schema": WEATHER}]
    messages = [{"role": "user", "content": ASK}]
    first = claude.messages.create(model=MODEL, max_tokens=60, extra_body=GREEDY, tools=tools, messages=messages,
                                   tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert first.stop_reason == "tool_use"
    use = [b for b in first.content if b.type == "tool_use"][0]
    assert use.name == "get_weather" and isinstance(use.input.get("city"), str) and use.id.startswith("toolu_")
    with claude.messages.stream(model=MODEL, max_tokens=60, extra_body=GREEDY, tools=tools, messages=messages,
                                tool_choice={"type": "any", "disable_parallel_tool_use": True}) as stream:
        streamed = stream.get_final_message()
    assert [b.model_dump() for b in streamed.content if b.type == "tool_use"][0]["input"] == use.input
    messages += [{"role": "assistant", "content": [b.model_dump() for b in first.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                               "content": "21 C and clear"}]}]
    final = claude.messages.create(model=MODEL, max_tokens=30, extra_body=GREEDY, tools=tools, messages=messages,
                                   tool_choice={"type": "none"})
    assert final.stop_reason in ("end_turn", "max_tokens") and final.content[0].type == "text"
    assert final.usage.input_tokens > first.usage.input_tokens


def test_messages_stop_sequences(claude):
    kwargs = dict(model=MODEL, max_tokens=40, extra_body=GREEDY, messages=[{"role": "user", "content": "Count: 1, 2, 3,"}])
    free = claude.messages.create(**kwargs).content[0].text
    assert free, "needs some text to stop in"
    stop = free.strip()[len(free.strip()) // 2:][:2]
    msg = claude.messages.create(stop_sequences=[stop], **kwargs)
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == stop
    assert stop not in msg.content[0].text if msg.content else True


@pytest.mark.parametrize("body,word", [
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
    ({"model": MODEL, "max_tokens": 0, "messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
    ({"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], "thinking": {}}, "thinking"),
    ({"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}],
      "tool_choice": {"type": "tool", "name": "nope"}, "tools": [{"name": "f", "input_schema": {}}]}, "nope"),
])
def test_messages_bad_input_is_anthropic_400(server, claude, body, word):
    r = httpx.post(server[0] + "/v1/messages", json=body, timeout=60)
    assert r.status_code == 400
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error" and word in err["error"]["message"]
    if "max_tokens" not in body:
        return
    with pytest.raises(anthropic.BadRequestError) as exc:
        claude.messages.create(**body)
    assert exc.value.status_code == 400 and exc.value.body["error"]["type"] == "invalid_request_error"
