"""``--chat-template`` (vLLM's option: a template or a file holding one, replacing the tokenizer's)
and a request's own ``chat_template`` field, on the real default model."""

from __future__ import annotations

import time

import pytest
from fastapi.testclient import TestClient

from kvfleet.runtime.config import EngineConfig
from kvfleet.runtime.engine.async_llm import AsyncLLMEngine
from kvfleet.runtime.entrypoints.openai.api_server import create_app
from kvfleet.runtime.entrypoints.openai.serve_args import ServerSettings, parse_serve_args, read_chat_template

PLAIN = "{% for m in messages %}{{ m['content'] }}|{% endfor %}"
pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see tests/conftest.py


def test_the_option_takes_a_template_or_a_file_and_refuses_a_broken_one(tmp_path):
    f = tmp_path / "plain.jinja"
    f.write_text(PLAIN)
    assert parse_serve_args(["--chat-template", str(f)], environ={}).server.chat_template == PLAIN
    assert parse_serve_args(["--chat-template", PLAIN], environ={}).server.chat_template == PLAIN
    with pytest.raises(ValueError, match=r"cannot read the file .*missing\.jinja"):
        read_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="not a valid Jinja template"):
        read_chat_template("{% for m in messages %}")
    assert ServerSettings().chat_template is None


@pytest.fixture(scope="module")
def client(smollm2):
    def factory(cfg, stat_loggers):
        return AsyncLLMEngine(cfg, stat_loggers, loaded=smollm2)

    original = smollm2.tokenizer.chat_template  # the server sets its template on the shared tokenizer
    app = create_app(EngineConfig(kv_cache_memory=64 << 20, max_model_len=128), ServerSettings(chat_template=PLAIN),
                     engine_factory=factory)
    with TestClient(app) as c:
        for _ in range(600):
            if c.get("/ready").status_code == 200:
                break
            time.sleep(0.2)
        try:
            yield c
        finally:
            smollm2.tokenizer.chat_template = original


def _prompt_tokens(client, **extra) -> int:
    body = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 1, "temperature": 0, **extra}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens"]


def test_the_servers_template_replaces_the_tokenizers_and_a_request_may_bring_its_own(client, smollm2):
    tok = smollm2.tokenizer
    assert _prompt_tokens(client) == len(tok.encode("hello there|"))
    own = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"
    assert _prompt_tokens(client, chat_template=own) == len(tok.encode("<<hello there>>"))
    bad = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                   "chat_template": "{% if %}"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages", bad.text
    assert _prompt_tokens(client) == len(tok.encode("hello there|"))  # the server keeps its template


def test_tokenize_renders_a_requests_own_template_as_chat_does(client):
    own = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"
    messages = [{"role": "user", "content": "hello there"}]
    r = client.post("/tokenize", json={"messages": messages, "chat_template": own})
    assert r.status_code == 200, r.text
    assert r.json()["count"] == _prompt_tokens(client, chat_template=own)
    assert r.json()["count"] != client.post("/tokenize", json={"messages": messages}).json()["count"]
    bad = client.post("/tokenize", json={"messages": messages, "chat_template": "{% if %}"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages", bad.text


def test_chat_template_kwargs_may_not_replace_the_messages(client):
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                 "chat_template_kwargs": {"messages": []}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs", r.text
