"""The OpenAI server against huge prompts and bodies, plus the small API routes around it.

- a real uvicorn server (in this process, in a thread, on a loopback port) whose engine is the
  real AsyncLLMEngine on the session's model: ``/health`` answers while a multi-MB prompt is
  being tokenized (the tokenizer is held by a pass-through spy until ``/health`` has
  answered, so a tokenizer running on the event loop would hang the probe and fail the test),
  tokenization is serialized on one thread, a body over ``max_request_body_size`` is a 413
  without being read, a prompt certainly longer than ``max_model_len`` tokens is a 400
  without being tokenized, lone surrogates are a 400 naming the field, ``HEAD`` probes (and
  ``HEAD`` on every ``GET`` route), ``GET /v1/models/{model}`` through the official ``openai``
  client, and token-id prompts decoded only for ``echo``, on the tokenizer thread.

Tests that load the model or start a server are marked ``slow``.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from types import SimpleNamespace

import httpx
import openai
import pytest
import uvicorn

from kvfleet.runtime.config import EngineConfig
from kvfleet.runtime.engine.async_llm import AsyncLLMEngine
from kvfleet.runtime.entrypoints.openai import logprobs as openai_logprobs
from kvfleet.runtime.entrypoints.openai.api_server import create_app
from kvfleet.runtime.entrypoints.openai.serve_args import ServerSettings, parse_serve_args

MODEL = "SmolLM2-135M-Instruct"
MAX_LEN = 8192
"""The model's whole context, so that a multi-MB prompt is still under the length bound."""
KV_CACHE = 384 * 1024**2
"""Holds MAX_LEN tokens (46080 bytes per token for SmolLM2-135M in fp32)."""
L_SMOLLM2 = 81
"""The longest SmolLM2 token: "\\n" and 80 spaces (the length bound's unit, test_tokenizer_bounds.py)."""
BIG = 100_000
"""Texts at least this long are "big" for the tokenizer spy."""

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see tests/conftest.py


@pytest.fixture(scope="module")
def tok(smollm2):
    return smollm2.tokenizer


# ----------------------------------------------------------------------------- a real server


class LiveServer:
    """``kvfleet``'s app served by a real uvicorn on a loopback port, in a thread."""

    def __init__(self, app, server: uvicorn.Server, thread: threading.Thread):
        self.app = app
        self.state = app.state.kvfleet
        self.server = server
        self.thread = thread
        self.port = server.servers[0].sockets[0].getsockname()[1]
        self.base = f"http://127.0.0.1:{self.port}"
        self.http = httpx.Client(base_url=self.base, timeout=120)


@contextmanager
def live_server(smollm2, config: EngineConfig, settings: ServerSettings | None = None, factory=None, ready=True):
    def real_engine(cfg: EngineConfig, stat_loggers: list) -> AsyncLLMEngine:
        return AsyncLLMEngine(cfg, stat_loggers, loaded=smollm2)

    app = create_app(config, settings or ServerSettings(), engine_factory=factory or real_engine)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)  # no signal handlers off the main thread
    thread.start()
    wait_until(lambda: server.started or not thread.is_alive(), "uvicorn to start", timeout=60)
    assert server.started, "uvicorn did not start"
    live = LiveServer(app, server, thread)
    try:
        if ready:
            wait_until(lambda: live.http.get("/ready").status_code == 200, "the engine to load")
        yield live
    finally:
        live.http.close()
        server.should_exit = True
        thread.join(60)


def wait_until(predicate: Callable[[], bool], what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


@pytest.fixture(scope="module")
def server(smollm2):
    """max_model_len 8192 (the model's context), default limits."""
    with live_server(smollm2, EngineConfig(kv_cache_memory=KV_CACHE, max_model_len=MAX_LEN)) as live:
        yield live


class Call:
    """One HTTP request in its own thread (httpx blocks until the whole response is there)."""

    def __init__(self, live: LiveServer, path: str, body: dict):
        self.response: httpx.Response | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(live, path, body), daemon=True)
        self.thread.start()

    def _run(self, live: LiveServer, path: str, body: dict) -> None:
        try:
            self.response = httpx.post(live.base + path, json=body, timeout=300)
        except BaseException as exc:
            self.error = exc

    def result(self, timeout: float = 300) -> httpx.Response:
        self.thread.join(timeout)
        assert self.response is not None, f"no response within {timeout} s ({self.error!r})"
        return self.response


@contextmanager
def tokenizer_spy(tokenizer, hold_first_big: bool = False):
    """Record every ``tokenizer.encode`` call on a big text (its thread, and how many ran at
    once); with ``hold_first_big`` the first one waits (at most 120 s) for ``spy.release``.
    A pass-through: the real ``encode`` does the work. Restored on exit."""
    real = tokenizer.encode
    spy = SimpleNamespace(calls=[], threads=[], active=0, most_active=0, entered=threading.Event(),
                          release=threading.Event())
    lock = threading.Lock()

    def encode(text, *args, **kwargs):
        if not isinstance(text, str) or len(text) < BIG:
            return real(text, *args, **kwargs)
        with lock:
            spy.calls.append(len(text))
            spy.threads.append(threading.current_thread().name)
            spy.active += 1
            spy.most_active = max(spy.most_active, spy.active)
            first = len(spy.calls) == 1
        try:
            if first and hold_first_big:
                spy.entered.set()
                spy.release.wait(120)
            return real(text, *args, **kwargs)
        finally:
            with lock:
                spy.active -= 1

    tokenizer.encode = encode
    try:
        yield spy
    finally:
        spy.release.set()
        del tokenizer.encode  # the class's method again


def assert_error(resp: httpx.Response, status: int, param: str | None = "__any__") -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    if param != "__any__":
        assert body["error"]["param"] == param, body
    return body["error"]


HI = {"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0, "ignore_eos": True}


@pytest.mark.slow
def test_health_answers_while_a_multi_megabyte_prompt_is_tokenized(server, tok):
    baseline = server.http.post("/v1/completions", json=HI)
    assert baseline.status_code == 200, baseline.text
    # 600k characters of 3-byte UTF-8 (3.6 MB as httpx's ASCII-escaped JSON): under the
    # length bound (81 * 8192 characters), so it is tokenized -- and then over max_model_len.
    big_prompt = "你好世界" * 150_000
    other_prompt = "漢字かな" * 150_000
    assert len(big_prompt) < L_SMOLLM2 * MAX_LEN
    with tokenizer_spy(tok, hold_first_big=True) as spy:
        big = Call(server, "/v1/completions", {"prompt": big_prompt, "max_tokens": None})
        assert spy.entered.wait(120), "the big prompt never reached the tokenizer"
        # the event loop is free while the tokenizer works on it
        health = server.http.get("/health", timeout=30)
        assert health.status_code == 200 and health.json() == {"status": "ok"}
        assert server.http.head("/health", timeout=30).status_code == 200
        assert server.http.get("/v1/models", timeout=30).json()["data"][0]["id"] == MODEL
        # a second big prompt queues behind the first: tokenization is serialized on one thread
        second = Call(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": other_prompt}]})
        wait_until(lambda: server.state.tokenizer_pool._work_queue.qsize() == 1, "the second prompt to queue")
        assert big.response is None and second.response is None and spy.calls == [len(big_prompt)]
        spy.release.set()
        err = assert_error(big.result(), 400, "prompt")
        chat_err = assert_error(second.result(), 400, "messages")
    assert err["code"] == chat_err["code"] == "context_length_exceeded"
    assert f"your prompt is {len(tok.encode(big_prompt))} tokens" in err["message"]
    assert len(spy.calls) == 2 and spy.most_active == 1
    assert all(name.startswith("kvfleet-tokenizer") for name in spy.threads), spy.threads
    after = server.http.post("/v1/completions", json=HI)
    assert after.status_code == 200 and after.json()["choices"][0]["text"] == baseline.json()["choices"][0]["text"]


@pytest.mark.slow
def test_prompt_certainly_over_max_model_len_is_400_untokenized(server, tok):
    over = "a" * (L_SMOLLM2 * (MAX_LEN - 1) + 1)  # at least 8192 tokens
    with tokenizer_spy(tok) as spy:
        err = assert_error(server.http.post("/v1/completions", json={"prompt": over, "max_tokens": 1}), 400, "prompt")
        assert err["code"] == "context_length_exceeded" and "at least 8192 tokens" in err["message"]
        err = assert_error(server.http.post("/v1/completions", json={"prompt": ["hi", over]}), 400, "prompt")
        chat = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": over}]}
        err = assert_error(server.http.post("/v1/chat/completions", json=chat), 400, "messages")
        assert err["code"] == "context_length_exceeded"
        assert spy.calls == []  # none of them was tokenized
        # characters the tokenizer drops do not count: this one is tokenized, and served
        dropped = {**HI, "prompt": "\x04" * (L_SMOLLM2 * MAX_LEN) + HI["prompt"]}
        r = server.http.post("/v1/completions", json=dropped)
        assert spy.calls == [len(dropped["prompt"])]
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(tok.encode(HI["prompt"]))
    plain = server.http.post("/v1/completions", json=HI).json()
    assert r.json()["choices"][0]["text"] == plain["choices"][0]["text"] and plain["choices"][0]["text"]
    # a token-id prompt that fills the context alone
    err = assert_error(server.http.post("/v1/completions", json={"prompt": [1] * MAX_LEN}), 400, "prompt")
    assert err["code"] == "context_length_exceeded"


def _raw_request(live: LiveServer, head: bytes, body: bytes) -> tuple[int, dict]:
    """Send ``head`` and ``body`` on a fresh connection; return the status and JSON body of the
    answer (read until the server closes or the declared length is there)."""
    with socket.create_connection(("127.0.0.1", live.port), timeout=60) as s:
        s.sendall(head + body)
        data = b""
        while b"\r\n\r\n" not in data:
            data += s.recv(65536)
        header, _, rest = data.partition(b"\r\n\r\n")
        length = int(next(line.split(b":")[1] for line in header.split(b"\r\n") if line.lower().startswith(b"content-length")))
        while len(rest) < length:
            rest += s.recv(65536)
    return int(header.split()[1]), json.loads(rest[:length])


@pytest.mark.slow
def test_body_over_the_limit_is_413_without_being_read(server):
    limit = server.state.settings.max_request_body_size
    assert limit == 32 * 1024**2  # the default
    # 1 GiB announced, 64 KiB sent: the answer comes without the rest
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1073741824\r\n\r\n")  # fmt: skip
    status, body = _raw_request(server, head, b'{"prompt": "' + b"a" * 65536)
    assert status == 413 and body["error"]["code"] == "request_too_large" and "1073741824" in body["error"]["message"]
    assert body["error"]["type"] == "invalid_request_error"

    # chunked (no Content-Length): refused once the chunks pass the limit
    def chunks():
        yield b'{"prompt": "'
        for _ in range(40):
            yield b"a" * 1024**2
        yield b'"}'

    r = server.http.post("/v1/chat/completions", content=chunks(), headers={"Content-Type": "application/json"})
    assert assert_error(r, 413)["code"] == "request_too_large"
    # exactly at the limit the body is read and parsed: this one is refused by the length bound
    pad = limit - len(json.dumps({"prompt": ""}))
    exact = json.dumps({"prompt": "a" * pad}).encode()
    assert len(exact) == limit
    r = server.http.post("/v1/completions", content=exact, headers={"Content-Type": "application/json"})
    assert assert_error(r, 400, "prompt")["code"] == "context_length_exceeded"
    r = server.http.post("/v1/completions", content=exact + b" ", headers={"Content-Type": "application/json"})
    assert assert_error(r, 413)["code"] == "request_too_large"
    assert server.http.post("/v1/completions", json=HI).status_code == 200


@pytest.mark.slow
@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/v1/completions", b'{"prompt": "a\\ud800b", "max_tokens": 2}', "prompt"),
        ("/v1/completions", b'{"prompt": ["ok", "\\udfff"], "max_tokens": 2}', "prompt"),
        ("/v1/completions", b'{"prompt": "hi", "stop": ["\\udc00"], "max_tokens": 2}', "stop"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x\\ud83d"}]}', "messages"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "\\ud800": 1}', None),
    ],
)
def test_lone_surrogate_is_400_naming_the_field(server, path, body, param):
    r = server.http.post(path, content=body, headers={"Content-Type": "application/json"})
    err = assert_error(r, 400, param)
    assert err["code"] == "invalid_encoding"
    assert "lone surrogate" in err["message"] and "not valid UTF-8" in err["message"], err
    # a surrogate *pair* is a character (U+1F600), and malformed JSON is still reported as such
    pair = server.http.post("/v1/completions", content=b'{"prompt": "\\ud83d\\ude00", "max_tokens": 2}',
                            headers={"Content-Type": "application/json"})  # fmt: skip
    assert pair.status_code == 200, pair.text
    bad = server.http.post("/v1/completions", content=b'{"prompt": "\\ud800', headers={"Content-Type": "application/json"})
    assert assert_error(bad, 400)["code"] == "invalid_json"


# ----------------------------------------------------------------------------- probes and models


@pytest.mark.slow
def test_head_probes_and_retrieve_model(smollm2):
    """HEAD /health and /ready (also while loading), and GET /v1/models/{model} through the
    official client, with an API key and a served name that holds a "/"."""
    release = threading.Event()

    def slow_load(cfg, stat_loggers):  # the real engine, whose load finishes when released
        assert release.wait(120)
        return AsyncLLMEngine(cfg, stat_loggers, loaded=smollm2)

    config = EngineConfig(kv_cache_memory=32 * 1024**2, max_model_len=256, served_model_name="org/chat-small")
    try:
        with live_server(smollm2, config, ServerSettings(api_key="k3y"), factory=slow_load, ready=False) as live:
            assert live.http.head("/ready").status_code == 503
            health = live.http.head("/health")
            assert health.status_code == 200 and health.content == b""
            release.set()
            wait_until(lambda: live.http.head("/ready").status_code == 200, "the engine to load")
            assert live.http.get("/ready").json() == {"status": "ready"}

            client = openai.OpenAI(base_url=live.base + "/v1", api_key="k3y", max_retries=0, timeout=60)
            card = client.models.retrieve("org/chat-small")
            assert (card.id, card.object, card.owned_by) == ("org/chat-small", "model", "kvfleet")
            assert card.model_dump()["max_model_len"] == 256
            assert [m.id for m in client.models.list()] == ["org/chat-small"]
            with pytest.raises(openai.NotFoundError) as info:
                client.models.retrieve("gpt-4")
            body = info.value.body
            body = body.get("error", body)  # the whole JSON or its "error" object, by client version
            assert body["code"] == "model_not_found" and body["param"] == "model" and "gpt-4" in body["message"]
            err = assert_error(live.http.get("/v1/models/gpt-4", headers={"Authorization": "Bearer k3y"}), 404, "model")
            assert err["type"] == "invalid_request_error"
            with pytest.raises(openai.AuthenticationError):
                openai.OpenAI(base_url=live.base + "/v1", api_key="wrong", max_retries=0).models.retrieve("org/chat-small")
            assert live.http.head("/health").status_code == 200
            # Every GET route answers HEAD (headers, no body), behind the key where GET is.
            key = {"Authorization": "Bearer k3y"}
            for path in ("/v1/models", "/v1/models/org/chat-small", "/metrics"):
                got, head = live.http.get(path, headers=key), live.http.head(path, headers=key)
                assert head.status_code == got.status_code == 200 and head.content == b"", path
                assert head.headers["content-type"] == got.headers["content-type"], path
            assert live.http.head("/v1/models/gpt-4", headers=key).status_code == 404
            assert live.http.head("/v1/models").status_code == 401
            assert live.http.head("/v1/completions", headers=key).status_code == 405  # POST routes stay POST
    finally:
        release.set()


@pytest.mark.slow
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_health_answers_while_a_response_body_is_built(server, monkeypatch, path):
    """Non-streamed bodies are built and encoded off the event loop: with echo, logprobs 20
    and n 16 on a 3,900-token prompt the body is 117 MB and took 76 s, /health stalled 6.5 s
    (n 128 makes it ~8x that). The builder is held by a pass-through spy until /health has
    answered, so a body built on the event loop would hang the probe and fail the test."""
    real = openai_logprobs.prompt_logprobs_body
    entered, release = threading.Event(), threading.Event()
    threads: list[str] = []

    def held(*args, **kwargs):
        threads.append(threading.current_thread().name)
        entered.set()
        assert release.wait(120)
        return real(*args, **kwargs)

    monkeypatch.setattr(openai_logprobs, "prompt_logprobs_body", held)
    if path == "/v1/completions":
        body = {"prompt": "The capital of France is", "echo": True, "logprobs": 2, "max_tokens": 0, "n": 3}
    else:
        body = {"messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 2, "max_tokens": 2, "n": 3}
    call = Call(server, path, body)
    try:
        assert entered.wait(120), "the response was never built"
        health = server.http.get("/health", timeout=30)
        assert health.status_code == 200 and call.response is None
    finally:
        release.set()
    r = call.result()
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert len(choices) == 3 and len(threads) == 1 and threads[0] != server.thread.name, threads
    if path == "/v1/completions":  # the echoed prompt's logprobs, built once, in every choice
        assert choices[0]["logprobs"]["top_logprobs"][1] and all(c["logprobs"] == choices[0]["logprobs"] for c in choices)
        assert all(c["prompt_logprobs"] == choices[0]["prompt_logprobs"] for c in choices)
    else:
        assert len(r.json()["prompt_logprobs"]) == r.json()["usage"]["prompt_tokens"]


@pytest.mark.slow
def test_streamed_echo_logprobs_are_built_once_per_prompt(server, monkeypatch):
    """Streamed ``echo`` + ``logprobs`` with n 3 over two prompts: each prompt's logprobs are
    built once (not once per choice) and every choice's first chunk carries them."""
    calls: list[int] = []
    real = openai_logprobs.echo_logprobs

    def counted(prompt_ids, *args, **kwargs):
        calls.append(len(prompt_ids))
        return real(prompt_ids, *args, **kwargs)

    monkeypatch.setattr(openai_logprobs, "echo_logprobs", counted)
    prompts = ["The capital of France is", "def add(a, b):"]
    body = {"prompt": prompts, "echo": True, "logprobs": 2, "max_tokens": 2, "n": 3, "temperature": 0, "stream": True}
    r = server.http.post("/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    first: dict[int, dict] = {}
    for e in events:
        for c in e["choices"]:
            first.setdefault(c["index"], c)
    assert sorted(first) == list(range(6)) and len(calls) == 2
    for idx, c in first.items():
        assert c["text"] == prompts[idx // 3] and c["logprobs"] == first[idx // 3 * 3]["logprobs"]
        assert c["logprobs"]["top_logprobs"][0] is None and len(c["logprobs"]["tokens"]) == calls[idx // 3]


@pytest.mark.slow
def test_token_id_prompts_are_decoded_only_for_echo_and_off_the_event_loop(server, tok):
    """A token-id prompt's text is needed only to echo it: without ``echo`` it is never
    decoded (a 32 MiB body of id lists took ~2.6 s to decode on the event loop), with
    ``echo`` it is decoded on the tokenizer thread."""
    ids = tok.encode("The capital of France is Paris. " * 40)
    real = tok.decode
    threads: list[str] = []

    def decode(token_ids, *args, **kwargs):  # pass-through; records whole-prompt decodes
        if len(token_ids) == len(ids):
            threads.append(threading.current_thread().name)
        return real(token_ids, *args, **kwargs)

    tok.decode = decode
    try:
        body = {"prompt": [ids, ids[:5]], "max_tokens": 2, "temperature": 0}
        plain = server.http.post("/v1/completions", json=body)
        assert plain.status_code == 200, plain.text
        assert threads == []
        echo = server.http.post("/v1/completions", json={**body, "echo": True})
        assert echo.status_code == 200, echo.text
        assert threads and all(name.startswith("kvfleet-tokenizer") for name in threads), threads
    finally:
        del tok.decode
    texts = [c["text"] for c in echo.json()["choices"]]
    assert texts == [real(ids) + plain.json()["choices"][0]["text"], real(ids[:5]) + plain.json()["choices"][1]["text"]]


# ----------------------------------------------------------------------------- the option


def test_max_request_body_size_option():
    assert parse_serve_args([], {}).server.max_request_body_size == 32 * 1024**2
    assert parse_serve_args([], {"KVFLEET_MAX_REQUEST_BODY_SIZE": "8MiB"}).server.max_request_body_size == 8 * 1024**2
    args = parse_serve_args(["--max-request-body-size", "1000"], {"KVFLEET_MAX_REQUEST_BODY_SIZE": "8MiB"})
    assert args.server.max_request_body_size == 1000 and args.sources["max_request_body_size"] == "cli"
    with pytest.raises(SystemExit):
        parse_serve_args(["--max-request-body-size", "0"], {})


def test_body_response_equals_the_whole_model_encoded_at_once():
    """``body_response`` splices the choices, encoded one by one, into the response's JSON: the
    bytes equal one ``model_dump_json`` call, even with ids and texts that spell the key."""
    from kvfleet.runtime.entrypoints.openai import protocol as P
    from kvfleet.runtime.entrypoints.openai.serving_engine import body_response

    tricky = '"choices":[]'
    lp = P.CompletionLogProbs(text_offset=[0, 1], token_logprobs=[None, -0.5], tokens=[tricky, "é"],
                              top_logprobs=[None, {tricky: -0.5, "😀": -9999.0}])  # fmt: skip
    plp = [None, {7: P.PromptLogprob(logprob=-0.5, rank=1, decoded_token=tricky)}]
    choices = [P.CompletionResponseChoice(index=i, text=tricky * i, logprobs=lp, finish_reason="length",
                                          prompt_logprobs=plp) for i in range(3)]  # fmt: skip
    for resp in (
        P.CompletionResponse(id=tricky, created=1, model=tricky, choices=choices, usage=P.UsageInfo(prompt_tokens=2)),
        P.CompletionResponse(id="cmpl-1", created=1, model="m", choices=[], usage=P.UsageInfo()),
        P.ChatCompletionResponse(id=tricky, created=1, model="m", usage=P.UsageInfo(), choices=[
            P.ChatCompletionResponseChoice(index=0, message=P.ChatResponseMessage(content=tricky), finish_reason="stop")]),
    ):  # fmt: skip
        r = body_response(resp)
        assert r.body == resp.model_dump_json().encode("utf-8") and r.media_type == "application/json"
        assert json.loads(r.body) == resp.model_dump(mode="json")
