"""``POST /v1/messages`` on the real engine, in process, with the official ``anthropic`` SDK:
``usage.input_tokens`` is the prompt's token count in a message and in a stream (from
``message_start`` on, before the first chunk), the stream adds up to the message, and an engine
failure mid-stream is Anthropic's ``error`` event; ``messages.count_tokens`` gives the same count."""

from __future__ import annotations

import json

import anthropic
import pytest
from support.in_process import serving_app

from kvfleet.runtime.engine.detokenizer import IncrementalDetokenizer
from kvfleet.runtime.entrypoints.anthropic.protocol import MessagesRequest

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

MODEL = "SmolLM2-135M-Instruct"
ASK = {"model": MODEL, "max_tokens": 12, "system": "Be brief.",
       "messages": [{"role": "user", "content": "Count from one to five."}]}
GREEDY = {"temperature": 0}  # this SDK has no sampling arguments: they go in the body


@pytest.fixture(scope="module")
def app(smollm2):
    with serving_app(smollm2) as client:
        yield client


@pytest.fixture(scope="module")
def claude(app):
    return anthropic.Anthropic(base_url=str(app.base_url), api_key="none", http_client=app, max_retries=0)


def prompt_tokens(tokenizer, body: dict) -> int:
    """The prompt's tokens as the chat template renders the translated request."""
    chat = MessagesRequest.model_validate(body).to_chat()
    text = tokenizer.apply_chat_template(chat.template_messages(), tokenize=False, add_generation_prompt=True)
    return len(tokenizer.encode(text, add_special_tokens=False))


def test_input_tokens_in_message_and_stream(claude, smollm2):
    expected = prompt_tokens(smollm2.tokenizer, ASK)
    whole = claude.messages.create(**ASK, extra_body=GREEDY)
    assert whole.usage.input_tokens == expected and 0 < whole.usage.output_tokens <= 12
    with claude.messages.stream(**ASK, extra_body=GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_message()
    start = events[0]
    assert start.type == "message_start"
    assert start.message.usage.input_tokens == expected and start.message.usage.output_tokens == 0
    delta = [e for e in events if e.type == "message_delta"][0]
    assert delta.usage.input_tokens == expected and delta.usage.output_tokens == whole.usage.output_tokens
    assert final.content[0].text == whole.content[0].text and final.stop_reason == whole.stop_reason
    assert final.usage.input_tokens == expected


def test_count_tokens_is_the_input_tokens_of_the_same_request(claude, smollm2):
    tools = [{"name": "get_weather", "description": "The weather in a city.",
              "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]
    ask = {k: v for k, v in ASK.items() if k != "max_tokens"}
    counted = claude.messages.count_tokens(**ask)
    assert counted.input_tokens == prompt_tokens(smollm2.tokenizer, ASK)
    with_tools = claude.messages.count_tokens(**ask, tools=tools)
    assert with_tools.input_tokens == claude.messages.create(**ASK, tools=tools, extra_body=GREEDY).usage.input_tokens
    assert with_tools.input_tokens > counted.input_tokens
    with pytest.raises(anthropic.NotFoundError) as e:  # an unknown model: Anthropic's error shape
        claude.messages.count_tokens(**{**ask, "model": "no-such-model"})
    assert e.value.body["error"]["type"] == "not_found_error"


def test_engine_failure_mid_stream_is_an_error_event(app, monkeypatch):
    def exploding_update(self, *args, **kwargs):
        raise ValueError("detokenizer exploded")

    monkeypatch.setattr(IncrementalDetokenizer, "update", exploding_update)  # the real engine, broken
    r = app.post("/v1/messages", json={**ASK, **GREEDY, "stream": True})
    monkeypatch.undo()
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [block.split("\n") for block in r.text.split("\n\n") if block]
    kinds = [lines[0].removeprefix("event: ") for lines in events]
    assert kinds == ["message_start", "error"], kinds
    error = json.loads(events[-1][1].removeprefix("data: "))
    assert error["error"]["type"] == "api_error" and "detokenizer exploded" in error["error"]["message"]
    assert app.get("/health").status_code == 200  # one failed request is not a dead engine
