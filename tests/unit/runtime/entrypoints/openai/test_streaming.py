"""The one SSE writer (``streaming.sse_response``) over the typed chunks of the real engine, in
process: the router's ``kvfleet_token_ids`` ride on the chunk models (every delta's token ids,
held-back tokens in router-only ``kvfleet.token_ids`` chunks) and are absent unless asked for;
the typed stream of ``OpenAIServingChat.chat`` knows its prompt's tokens before the first chunk."""

from __future__ import annotations

import json
from typing import ClassVar

import pytest
from support.in_process import serving_app

from kvfleet.runtime.entrypoints.openai import protocol as P
from kvfleet.runtime.entrypoints.openai.streaming import ChunkStream

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

HI = [{"role": "user", "content": "Say hello in French."}]


@pytest.fixture(scope="module")
def app(smollm2):
    with serving_app(smollm2) as client:
        yield client


def events(resp) -> list:
    assert resp.status_code == 200, resp.text
    blocks = [b for b in resp.text.split("\n\n") if b]
    assert blocks[-1] == "data: [DONE]" and all(b.startswith("data: ") for b in blocks)
    return [json.loads(b[len("data: "):]) for b in blocks[:-1]]


@pytest.mark.parametrize("route,body,text_of", [
    ("/v1/completions", {"prompt": "The capital of France is"}, lambda c: c.get("text", "")),
    ("/v1/chat/completions", {"messages": HI}, lambda c: c.get("delta", {}).get("content") or ""),
])
def test_router_token_ids_ride_on_the_chunks_only_when_asked(app, smollm2, route, body, text_of):
    body = {**body, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "stream": True}
    plain = events(app.post(route, json=body))
    assert "kvfleet_token_ids" not in json.dumps(plain) and "kvfleet.token_ids" not in json.dumps(plain)
    routed = events(app.post(route, json={**body, "kvfleet_token_ids": True}))
    ids: list[int] = []
    for chunk in routed:
        for choice in chunk["choices"]:
            ids += choice.get("kvfleet_token_ids", [])
        if chunk.get("object") == "kvfleet.token_ids":
            assert all(c["kvfleet_text_held"] is True for c in chunk["choices"])
    assert len(ids) == 12
    text = "".join(text_of(c) for chunk in plain for c in chunk["choices"])
    assert smollm2.tokenizer.decode(ids) == text
    assert "".join(text_of(c) for ch in routed for c in ch["choices"]) == text  # the same text, ids beside it


def test_typed_chat_stream_knows_its_prompt_and_ends_with_usage(app, smollm2):
    import asyncio

    chat = app.app.state.serving_chat
    body = P.ChatCompletionRequest.model_validate({"messages": HI, "max_tokens": 5, "temperature": 0, "stream": True,
                                                   "stream_options": {"include_usage": True}})

    class NoClient:  # the typed API needs only the connection to watch; this one never leaves
        headers: ClassVar[dict] = {}

        async def receive(self):
            await asyncio.sleep(3600)

    async def run():
        stream = await chat.chat(body, NoClient())
        assert isinstance(stream, ChunkStream) and stream.include_usage
        chunks = [c async for c in stream]
        return stream.prompt_tokens, chunks

    prompt_tokens, chunks = app.portal.call(run)
    text = smollm2.tokenizer.apply_chat_template(HI, tokenize=False, add_generation_prompt=True)
    assert prompt_tokens == len(smollm2.tokenizer.encode(text, add_special_tokens=False))
    assert all(isinstance(c, P.ChatCompletionStreamResponse) for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].choices == []
    assert chunks[-1].usage.prompt_tokens == prompt_tokens and chunks[-1].usage.completion_tokens == 5
