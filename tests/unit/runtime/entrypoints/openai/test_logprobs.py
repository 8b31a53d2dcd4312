"""Log-probabilities as response bodies (kvfleet.runtime.entrypoints.openai.logprobs), through the
real app and engine: ``return_tokens_as_token_ids`` (vLLM's flag and request field) names every
token of ``logprobs`` / ``top_logprobs`` ``"token_id:{id}"``, the same tokens and values as
the text form (within 1e-4: the second request may reuse the first's cached prefix); a request's
own field overrides the server's."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from kvfleet.runtime.entrypoints.openai.api_server import create_app
from kvfleet.runtime.entrypoints.openai.serve_args import ServerSettings, parse_serve_args
from unit.runtime.entrypoints.openai.test_api_server import engine_config, wait_ready

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see tests/conftest.py

PROMPT = {"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0, "logprobs": 2}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0, "logprobs": True,
        "top_logprobs": 2}


@pytest.fixture(scope="module")
def tok(smollm2):
    return smollm2.tokenizer


@pytest.fixture(scope="module")
def client(smollm2):
    from kvfleet.runtime.engine.async_llm import AsyncLLMEngine

    app = create_app(engine_config(), ServerSettings(return_tokens_as_token_ids=True),
                     engine_factory=lambda cfg, loggers: AsyncLLMEngine(cfg, loggers, loaded=smollm2))
    with TestClient(app) as c:
        c.state = app.state.kvfleet
        wait_ready(c)
        yield c


def post(client, path: str, body: dict) -> dict:
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["logprobs"]


def test_the_server_flag_names_completion_tokens_by_id(client, tok):
    as_ids = post(client, "/v1/completions", PROMPT)
    as_text = post(client, "/v1/completions", {**PROMPT, "return_tokens_as_token_ids": False})
    ids = [int(t.removeprefix("token_id:")) for t in as_ids["tokens"]]
    assert all(t.startswith("token_id:") for t in as_ids["tokens"])
    assert [tok.decode([i]) for i in ids] == as_text["tokens"]
    assert as_ids["token_logprobs"] == pytest.approx(as_text["token_logprobs"], abs=1e-4)
    for top_ids, top_text in zip(as_ids["top_logprobs"], as_text["top_logprobs"]):
        named = {tok.decode([int(k.removeprefix("token_id:"))]): v for k, v in top_ids.items()}
        assert named == pytest.approx(top_text, abs=1e-4)


def test_chat_logprobs_name_tokens_by_id_with_their_bytes(client, tok):
    as_ids = post(client, "/v1/chat/completions", CHAT)["content"]
    as_text = post(client, "/v1/chat/completions", {**CHAT, "return_tokens_as_token_ids": False})["content"]
    for a, b in zip(as_ids, as_text, strict=True):
        assert tok.decode([int(a["token"].removeprefix("token_id:"))]) == b["token"]
        assert a["bytes"] == list(a["token"].encode()) and a["logprob"] == pytest.approx(b["logprob"], abs=1e-4)
        assert [t["token"] for t in a["top_logprobs"]] and all(
            t["token"].startswith("token_id:") for t in a["top_logprobs"])


def test_the_flag_is_a_serve_option():
    assert parse_serve_args(["--return-tokens-as-token-ids"], environ={}).server.return_tokens_as_token_ids is True
    assert parse_serve_args([], environ={}).server.return_tokens_as_token_ids is False
    on = {"KVFLEET_RETURN_TOKENS_AS_TOKEN_IDS": "true"}
    assert parse_serve_args([], environ=on).server.return_tokens_as_token_ids is True
