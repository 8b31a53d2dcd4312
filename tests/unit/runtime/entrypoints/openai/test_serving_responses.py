"""``/v1/responses``: the bounded store of responses (LRU eviction, 404s); on the real engine, in
process, with the official ``openai`` SDK: the translation of the chat path's typed result (text,
usage, streamed or not) and an engine failure mid-stream as ``error`` + ``response.failed``."""

from __future__ import annotations

import json

import openai
import pytest
from support.in_process import serving_app

from kvfleet.runtime.engine.detokenizer import IncrementalDetokenizer
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


# ----------------------------------------------------------------------------- on the real engine


ASK = {"model": "SmolLM2-135M-Instruct", "input": "Count to five.", "instructions": "Be brief.",
       "max_output_tokens": 10, "temperature": 0}


@pytest.fixture(scope="module")
def app(smollm2):
    with serving_app(smollm2) as client:
        yield client


def prompt_tokens(tokenizer) -> int:
    messages = [{"role": "system", "content": ASK["instructions"]}, {"role": "user", "content": ASK["input"]}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return len(tokenizer.encode(text, add_special_tokens=False))


@pytest.mark.slow
@pytest.mark.usefixtures("one_torch_thread")
def test_usage_and_text_from_the_chat_paths_typed_result(app, smollm2):
    """The response's usage is the chat path's, the same streamed or not, and equals the chat endpoint's."""
    client = openai.OpenAI(base_url=str(app.base_url) + "/v1", api_key="none", http_client=app, max_retries=0)
    whole = client.responses.create(**ASK)
    expected = prompt_tokens(smollm2.tokenizer)
    assert whole.usage.input_tokens == expected and 0 < whole.usage.output_tokens <= 10
    assert whole.usage.total_tokens == expected + whole.usage.output_tokens
    events = list(client.responses.create(**ASK, stream=True))
    final = events[-1].response
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert final.output_text == whole.output_text and final.usage == whole.usage
    assert [e.sequence_number for e in events] == list(range(len(events)))
    chat = client.chat.completions.create(model=ASK["model"], max_completion_tokens=10, temperature=0, messages=[
        {"role": "system", "content": ASK["instructions"]}, {"role": "user", "content": ASK["input"]}])
    assert chat.choices[0].message.content == whole.output_text
    assert (chat.usage.prompt_tokens, chat.usage.completion_tokens) == (expected, whole.usage.output_tokens)


@pytest.mark.slow
@pytest.mark.usefixtures("one_torch_thread")
def test_engine_failure_mid_stream_is_error_then_failed(app, monkeypatch):
    def exploding_update(self, *args, **kwargs):
        raise ValueError("detokenizer exploded")

    monkeypatch.setattr(IncrementalDetokenizer, "update", exploding_update)  # the real engine, broken
    r = app.post("/v1/responses", json={**ASK, "stream": True})
    monkeypatch.undo()
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(block.split("\ndata: ", 1)[1]) for block in r.text.split("\n\n") if block]
    assert [e["type"] for e in events] == ["response.created", "response.in_progress", "error", "response.failed"]
    assert "detokenizer exploded" in events[2]["message"] and events[2]["code"] == "internal_error"
    failed = events[3]["response"]
    assert failed["status"] == "failed" and failed["error"]["message"] == events[2]["message"]
    assert app.get("/health").status_code == 200


@pytest.mark.slow
@pytest.mark.usefixtures("one_torch_thread")
def test_a_400_names_the_responses_field_not_the_chat_one(app):
    """max_output_tokens over the context and a bad text.format schema: the 400 names the field sent."""
    r = app.post("/v1/responses", json={**ASK, "max_output_tokens": 10**8})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "max_output_tokens", err
    assert "max_output_tokens" in err["message"] and "max_completion_tokens" not in err["message"]
    bad = {"type": "json_schema", "name": "x", "schema": {"type": "bogus"}}
    r = app.post("/v1/responses", json={**ASK, "text": {"format": bad}})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "text.format" and err["message"].startswith("text.format:"), err
    assert app.post("/v1/responses", json=ASK).status_code == 200
