"""HTTP contract of the OpenAI server, in process, against the REAL engine.

Every app here is ``create_app(...)`` with an ``engine_factory`` that builds the real
:class:`~kvfleet.runtime.engine.async_llm.AsyncLLMEngine` on the session's loaded default model
(SmolLM2-135M-Instruct, the ``smollm2`` fixture: loaded once, each engine gets its own small
KV cache), driven through FastAPI's TestClient. Status codes, OpenAI error bodies, SSE
framing, usage counts, 429 back-pressure, the API key, the probes, /metrics and
/reset_prefix_cache are checked exactly:

- expected texts are the engine's own greedy (or seeded) output for the same request, from
  an ``LLM`` over a separate ``LLMEngine`` on the same loaded model (``reference``), or the
  non-streamed answer for a streamed one;
- token counts come from the real tokenizer;
- queues are made with ``max_num_seqs=1`` and long requests (ended by the engine's own
  ``abort``), or by holding the real engine's forward pass (``held_forward``) so that a burst
  arrives before any output;
- engine faults are provoked by breaking the real engine (its model runner raising, its
  detokenizer raising for one request), never by a fake engine.

tests/e2e/test_server.py checks the same server as a subprocess with the official client.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from kvfleet.runtime.config import EngineConfig
from kvfleet.runtime.engine.async_llm import AsyncLLMEngine
from kvfleet.runtime.engine.detokenizer import IncrementalDetokenizer
from kvfleet.runtime.engine.llm_engine import LLMEngine
from kvfleet.runtime.entrypoints.openai.api_server import create_app
from kvfleet.runtime.entrypoints.openai.serve_args import ServerSettings
from kvfleet.runtime.llm import LLM
from kvfleet.runtime.sampling_params import SamplingParams

MODEL = "SmolLM2-135M-Instruct"
KV_CACHE = 32 * 1024**2
"""Bytes of KV cache per engine (45 blocks of 16 tokens for SmolLM2-135M in fp32)."""
MAX_LEN = 64
"""max_model_len of the module's shared app (small, so that limits are cheap to reach)."""
HI = [{"role": "user", "content": "hi"}]

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see tests/conftest.py


def engine_config(**kw) -> EngineConfig:
    return EngineConfig(**{"kv_cache_memory": KV_CACHE, "max_model_len": MAX_LEN, **kw})


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def start(smollm2):
    """``start(config, settings, factory, ready)``: a context manager serving an app whose
    engine is the real AsyncLLMEngine on the shared model; yields its TestClient with
    ``.state`` (the ServerState) and ``.engine`` (once loaded)."""

    @contextmanager
    def start(config: EngineConfig | None = None, settings: ServerSettings | None = None, factory=None, ready=True):
        def real_engine(cfg: EngineConfig, stat_loggers: list) -> AsyncLLMEngine:
            return AsyncLLMEngine(cfg, stat_loggers, loaded=smollm2)

        app = create_app(config or engine_config(), settings or ServerSettings(), engine_factory=factory or real_engine)
        with TestClient(app) as c:
            c.state = app.state.kvfleet
            c.calls = []
            try:
                if ready:
                    wait_ready(c)
                yield c
            finally:  # no request in flight when the app shuts down (even after a failed check)
                for call in c.calls:
                    call.thread.join(120)

    return start


@pytest.fixture(scope="module")
def client(start):
    """The module's shared app (default settings, max_model_len 64)."""
    with start() as c:
        yield c


@pytest.fixture(scope="module")
def tok(smollm2):
    return smollm2.tokenizer


@pytest.fixture(scope="module")
def reference(smollm2):
    """``reference(prompts, **sampling)`` / ``reference.chat(messages, **sampling)``: the
    engine's own outputs for the same request, from a separate LLMEngine on the same loaded
    model (memoized)."""
    llm = LLM.from_engine(LLMEngine(engine_config(max_model_len=256), loaded=smollm2))
    cache: dict = {}

    class Reference:
        def __call__(self, prompts, **params):
            key = ("generate", json.dumps(prompts), json.dumps(params, sort_keys=True))
            if key not in cache:
                cache[key] = llm.generate(prompts, SamplingParams(**params), use_tqdm=False)
            return cache[key]

        def chat(self, messages, **params):
            key = ("chat", json.dumps(messages), json.dumps(params, sort_keys=True))
            if key not in cache:
                cache[key] = llm.chat(messages, SamplingParams(**params), use_tqdm=False)
            return cache[key]

        def text(self, prompt, max_tokens: int) -> str:
            """Greedy text of one completion prompt."""
            return self(prompt, temperature=0, max_tokens=max_tokens)[0].outputs[0].text

        def chat_text(self, messages, max_tokens: int) -> str:
            return self.chat(messages, temperature=0, max_tokens=max_tokens)[0].outputs[0].text

    return Reference()


# ----------------------------------------------------------------------------- helpers


def wait_ready(c: TestClient, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while c.get("/ready").status_code != 200:
        assert time.monotonic() < deadline, f"server never became ready: {c.get('/health').text}"
        time.sleep(0.02)
    c.engine = c.state.engine


def wait_until(predicate: Callable[[], bool], what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def in_thread(fn, *args) -> threading.Thread:
    t = threading.Thread(target=fn, args=args, daemon=True)
    t.start()
    return t


class Call:
    """``POST path`` in its own thread (a TestClient call blocks until the whole response
    is there), so that a test can wait for it with a deadline."""

    def __init__(self, c: TestClient, path: str, body: dict):
        self.response = None
        self.thread = in_thread(self._run, c, path, body)
        c.calls.append(self)

    def _run(self, c: TestClient, path: str, body: dict) -> None:
        self.response = c.post(path, json=body)

    def result(self, timeout: float = 120.0):
        self.thread.join(timeout)
        assert self.response is not None, f"no response within {timeout} s"
        return self.response


@contextmanager
def held_forward(engine: AsyncLLMEngine, timeout: float = 120.0):
    """Hold the real engine's forward passes until the yielded event is set (or ``timeout``
    passed): the step in progress waits inside the model runner, so requests submitted
    meanwhile produce no output."""
    gate = threading.Event()
    runner = engine.engine.runner
    real = runner.execute_model

    def held(*args, **kwargs):
        gate.wait(timeout)
        return real(*args, **kwargs)

    runner.execute_model = held
    try:
        yield gate
    finally:
        gate.set()
        del runner.execute_model  # the class's method again


@contextmanager
def recorded_requests(engine: AsyncLLMEngine):
    """The scheduler requests the real engine receives (a pass-through spy)."""
    scheduler = engine.engine.scheduler
    seen: list = []
    real = scheduler.add_request

    def add_request(request):
        seen.append(request)
        return real(request)

    scheduler.add_request = add_request
    try:
        yield seen
    finally:
        del scheduler.add_request


def assert_error(resp, status: int, param: str | None = "__any__"):
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    if param != "__any__":
        assert body["error"]["param"] == param, body
    return body["error"]


def sse_events(resp) -> list:
    """Parse an SSE body strictly: only `data: ...` events separated by blank lines."""
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"].startswith("text/event-stream")
    text = resp.text
    assert text.endswith("\n\n")
    events = []
    for block in text.split("\n\n")[:-1]:
        assert block.startswith("data: "), block
        payload = block[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def _families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def counter(c: TestClient, family: str, **labels) -> float:
    """Value of ``<family>_total`` (model_name = the served model, plus ``labels``)."""
    fam = _families(c.get("/metrics").text)[family]
    want = {"model_name": MODEL, **labels}
    values = [s.value for s in fam.samples
              if s.name == family + "_total" and all(s.labels.get(k) == v for k, v in want.items())]  # fmt: skip
    assert len(values) == 1, (family, labels, fam.samples)
    return values[0]


# ----------------------------------------------------------------------------- probes


def test_ready_is_503_while_loading_and_health_is_200(start, smollm2, reference):
    release = threading.Event()

    def slow_load(cfg, stat_loggers):  # the real engine, whose load finishes when released
        assert release.wait(120)
        return AsyncLLMEngine(cfg, stat_loggers, loaded=smollm2)

    try:
        with start(factory=slow_load, ready=False) as c:
            r = c.get("/ready")
            assert r.status_code == 503 and r.json() == {"status": "loading"}
            assert c.get("/health").status_code == 200
            r = c.post("/v1/completions", json={"prompt": "hi"})
            assert assert_error(r, 503)["code"] == "model_loading" and r.headers["retry-after"] == "5"
            release.set()
            wait_ready(c)
            assert c.get("/health").json() == {"status": "ok"}
            r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "temperature": 0})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == reference.text("hi", 2)
    finally:
        release.set()


def test_failed_load_makes_health_and_ready_503():
    """The default engine factory (no injection) on a model that does not exist."""
    app = create_app(EngineConfig(model="/nonexistent/model.gguf", kv_cache_memory=KV_CACHE), ServerSettings())
    fatal = []
    app.state.kvfleet.on_fatal = lambda: fatal.append(1)
    with TestClient(app) as c:
        wait_until(lambda: c.get("/health").status_code == 503, "the failed load", timeout=60)
        assert "/nonexistent/model.gguf" in c.get("/health").json()["error"]
        assert c.get("/ready").status_code == 503
        assert assert_error(c.post("/v1/completions", json={"prompt": "hi"}), 503)["code"] == "engine_dead"
        assert fatal == [1]


def test_dead_engine_loop_makes_health_503(start, reference):
    with start() as c:
        assert c.get("/health").status_code == 200
        ok = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "temperature": 0})
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == reference.text("hi", 2)

        def broken(*args, **kwargs):
            raise RuntimeError("CUDA error: an illegal memory access was encountered (simulated)")

        c.engine.engine.runner.execute_model = broken  # the engine loop dies at its next step
        err = assert_error(c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}), 503)
        assert err["code"] == "engine_dead" and "illegal memory access" in err["message"]
        assert c.engine.errored
        health = c.get("/health")
        assert health.status_code == 503 and "illegal memory access" in health.json()["error"]
        assert c.get("/ready").status_code == 503
        assert assert_error(c.post("/v1/completions", json={"prompt": "hi"}), 503)["code"] == "engine_dead"
        r = c.post("/v1/chat/completions", json={"messages": HI, "stream": True})
        assert assert_error(r, 503)["type"] == "service_unavailable"
        assert _families(c.get("/metrics").text)  # the exposition still parses


# ----------------------------------------------------------------------------- auth


def test_api_key_guards_v1_routes_only(start, tok):
    ok = {"Authorization": "Bearer s3cret"}
    bad_headers = ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"})
    with start(settings=ServerSettings(api_key="s3cret")) as c:
        for method, path, body in [
            ("get", "/v1/models", None),
            ("post", "/v1/completions", {"prompt": "hi", "max_tokens": 1}),
            ("post", "/v1/chat/completions", {"messages": HI, "max_tokens": 1}),
            ("post", "/reset_prefix_cache", None),
        ]:
            for headers in bad_headers:
                call = getattr(c, method)
                r = call(path, json=body, headers=headers) if body else call(path, headers=headers)
                err = assert_error(r, 401)
                assert err["code"] == "invalid_api_key" and r.headers["www-authenticate"] == "Bearer"
            r = getattr(c, method)(path, json=body, headers=ok) if body else getattr(c, method)(path, headers=ok)
            assert r.status_code == 200, (path, r.text)
        for path in ("/health", "/ready", "/metrics"):
            assert c.get(path).status_code == 200

        # /reset_prefix_cache really resets, and only with the key: a prompt of 3 full
        # blocks is found in the prefix cache until an authorised reset drops it.
        prompt = "one two three four five six seven eight nine ten " * 5
        assert len(tok.encode(prompt)) >= 48

        def hits_of_one_request() -> float:
            before = counter(c, "kvfleet:prefix_cache_hits")
            r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1}, headers=ok)
            assert r.status_code == 200, r.text
            return counter(c, "kvfleet:prefix_cache_hits") - before

        hits_of_one_request()
        assert hits_of_one_request() >= 32
        for headers in bad_headers:
            assert_error(c.post("/reset_prefix_cache", headers=headers), 401)
        assert hits_of_one_request() >= 32
        assert c.post("/reset_prefix_cache", headers=ok).json() == {"reset": True}
        assert hits_of_one_request() == 0


# ----------------------------------------------------------------------------- bad input


BAD_COMPLETIONS = [
    (b'{"prompt": "hi", ', 400, None),  # malformed JSON
    (b"\xff\xfe{}", 400, None),  # not UTF-8
    (b'["prompt"]', 400, None),  # not an object
    (b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, None),  # nested past the recursion limit
    (b'{"max_tokens": 5}', 400, "prompt"),  # missing prompt
    (b'{"prompt": 5}', 400, "prompt"),  # wrong type
    (b'{"prompt": "hi", "max_tokens": "5"}', 400, "max_tokens"),
    (b'{"prompt": "hi", "max_tokens": 0}', 400, "max_tokens"),
    (b'{"prompt": "hi", "max_tokens": -3}', 400, "max_tokens"),
    (b'{"prompt": "hi", "temperature": -0.1}', 400, "temperature"),
    (b'{"prompt": "hi", "top_p": 0}', 400, "top_p"),
    (b'{"prompt": "hi", "top_p": 1.5}', 400, "top_p"),
    (b'{"prompt": "hi", "n": 0}', 400, "n"),
    (b'{"prompt": "hi", "n": 1.5}', 400, "n"),
    (b'{"prompt": "hi", "n": 129}', 400, "n"),
    (b'{"prompt": null}', 400, "prompt"),
    (b'{"prompt": "hi", "max_tokens": 300}', 400, "max_tokens"),  # 1 + 300 > max_model_len 64
    (b'{"prompt": "hi", "prompt_logprobs": 21}', 400, "prompt_logprobs"),
    (b'{"prompt": "hi", "suffix": "x"}', 400, "suffix"),
    (b'{"prompt": "hi", "best_of": 3}', 400, "best_of"),
    (b'{"prompt": "hi", "logit_bias": {"x": 1.0}}', 400, "logit_bias"),  # keys are token ids
    (b'{"prompt": "hi", "logit_bias": {"5": 101}}', 400, "logit_bias"),  # OpenAI's range: [-100, 100]
    (b'{"prompt": "hi", "logit_bias": {"99999": 1}}', 400, "logit_bias"),  # vocabulary: 49152
    (b'{"prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "strin"}}}}',
     400, "response_format"),
    (b'{"prompt": "hi", "logprobs": 21}', 400, "logprobs"),
    (b'{"prompt": "", "max_tokens": 2}', 400, "prompt"),
    (b'{"prompt": [], "max_tokens": 2}', 400, "prompt"),
    (b'{"prompt": [1, 99999], "max_tokens": 2}', 400, "prompt"),  # vocabulary: 49152
    (b'{"prompt": "hi", "stream_options": {"include_usage": true}}', 400, "stream_options"),
    (b'{"prompt": "hi", "model": "gpt-4"}', 404, "model"),
    # the router's resume (docs/routing.md): one list per choice, vocabulary ids, fewer than max_tokens
    (b'{"prompt": "hi", "max_tokens": 3, "kvfleet_resume": {"output_token_ids": [[1], [2]]}}', 400, "kvfleet_resume"),
    (b'{"prompt": "hi", "max_tokens": 3, "kvfleet_resume": {"output_token_ids": [[99999]]}}', 400, "kvfleet_resume"),
    (b'{"prompt": "hi", "max_tokens": 3, "kvfleet_resume": {"output_token_ids": [[1, 2, 3]]}}', 400, "kvfleet_resume"),
]


@pytest.mark.parametrize("body,status,param", BAD_COMPLETIONS)
def test_bad_completion_requests(client, reference, body, status, param):
    r = client.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
    assert_error(r, status, param if param is not None else "__any__")
    good = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "temperature": 0})
    assert good.status_code == 200 and good.json()["choices"][0]["text"] == reference.text("hi", 3)


BAD_CHATS = [
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, 400, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "messages"),
    ({"messages": "hi"}, 400, "messages"),
    ({"messages": HI, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ({"messages": HI, "max_tokens": 10_000}, 400, "max_tokens"),
    ({"messages": HI, "top_logprobs": 3}, 400, "top_logprobs"),
    ({"messages": HI, "logprobs": True, "top_logprobs": 30}, 400, "top_logprobs"),
    ({"messages": HI, "tools": [{"type": "function"}]}, 400, "tools"),
    ({"messages": HI, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "any"}, 400,
     "tool_choice"),  # auto itself works with no flags (test_tools_auto_needs_no_flags)
    ({"messages": HI, "structured_outputs": {"regex": "[a-"}}, 400, "structured_outputs"),
    ({"messages": HI, "presence_penalty": 3}, 400, "presence_penalty"),
    ({"messages": HI, "stop": 5}, 400, "stop"),
    ({"messages": [{"role": "user", "content": "hello " * 100}]}, 400, "messages"),  # > 64 tokens
    ({"messages": HI, "model": "nope"}, 404, "model"),
    ({"messages": HI, "chat_template_kwargs": {"tokenize": True}}, 400, "chat_template_kwargs"),
]


@pytest.mark.parametrize("body,status,param", BAD_CHATS)
def test_bad_chat_requests(client, reference, body, status, param):
    assert_error(client.post("/v1/chat/completions", json=body), status, param)
    good = client.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 4, "temperature": 0})
    assert good.status_code == 200 and good.json()["choices"][0]["message"]["content"] == reference.chat_text(HI, 4)


def test_tools_auto_needs_no_flags(client):
    """The OpenAI SDK's default (tools, no tool_choice) on a server started with no tool flags:
    the default model's template renders no tools, so ``hermes`` is detected (see tool_calls).
    The tool prompt outgrows this app's 64-token context: the request passes the tool checks and
    is refused for its length (a 200 round trip: tests/e2e/test_messages_server.py)."""
    body = {"messages": HI, "max_tokens": 4, "temperature": 0,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert client.app.state.kvfleet.tool_parser == "hermes"


def test_engine_rejection_is_400_and_does_not_disturb_the_request_it_collides_with(client, reference):
    """The engine's own ValueError (here: a client-chosen request_id already in flight) is a
    400, and the request that holds the id finishes untouched (it is not aborted)."""
    body = {"prompt": "hi", "max_tokens": 4, "temperature": 0, "request_id": "same-id"}
    # The first request's forward pass is held (for at most 10 s) while the second arrives.
    with held_forward(client.engine, timeout=10) as gate:
        first = Call(client, "/v1/completions", body)
        wait_until(lambda: client.state.admitted == 1, "the first request to be submitted")
        t0 = time.monotonic()
        err = assert_error(client.post("/v1/completions", json=body), 400)
        assert "already in use" in err["message"] and err["param"] == "request_id"
        assert time.monotonic() - t0 < 5, "the rejection waited for the engine"
        gate.set()
    assert first.result().status_code == 200, first.result().text
    choice = first.result().json()["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == (reference.text("hi", 4), "length")


def test_unknown_route_and_method_use_the_error_shape(client):
    assert assert_error(client.get("/v1/nothing"), 404)["code"] == "not_found"
    assert assert_error(client.get("/v1/completions"), 405)["code"] == "method_not_allowed"


# ----------------------------------------------------------------------------- back-pressure


def test_queue_full_gives_429(start, reference):
    """max_num_seqs=1: one long request runs, the next ones wait in the scheduler; with
    max_queue_len=2 a request arriving while 1 waits is accepted, while 2 wait it gets 429."""
    config = engine_config(max_num_seqs=1, max_model_len=512)
    with start(config=config, settings=ServerSettings(max_queue_len=2)) as c:
        engine = c.engine
        long = {"prompt": "hi", "max_tokens": 500, "ignore_eos": True, "temperature": 0}
        try:
            a = Call(c, "/v1/completions", {**long, "request_id": "long-a"})
            wait_until(lambda: engine.num_running == 1 and c.state.admitted == 1, "request a to run")
            b = Call(c, "/v1/completions", {**long, "request_id": "long-b"})
            wait_until(lambda: engine.num_waiting == 1, "request b to wait")
            short = Call(c, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "temperature": 0})  # 1 waits: accepted
            wait_until(lambda: engine.num_waiting == 2, "the short request to wait")

            r = Call(c, "/v1/completions", {"prompt": "hi", "max_tokens": 1}).result(timeout=30)
            err = assert_error(r, 429)
            assert err["code"] == "queue_full" and err["type"] == "rate_limit_error"
            assert "2 requests are waiting" in err["message"] and r.headers["retry-after"] == "1"
            assert engine.num_waiting == 2 and engine.num_running == 1  # the refused request never reached the engine

            c.portal.call(engine.abort, "long-a-0")  # b runs, the short one still waits
            wait_until(lambda: engine.num_waiting == 1 and engine.num_running == 1, "request b to run")
        finally:  # end the long requests whatever happened
            for request_id in ("long-a-0", "long-b-0"):
                c.portal.call(engine.abort, request_id)
        for call in (a, b):
            assert call.result().status_code == 200, call.result().text
            assert call.result().json()["choices"][0]["finish_reason"] == "abort"
        assert short.result().status_code == 200, short.result().text
        assert short.result().json()["choices"][0]["text"] == reference.text("hi", 2)
        assert (engine.num_waiting, engine.num_running, c.state.admitted) == (0, 0, 0)
        assert c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}).status_code == 200


def test_burst_beyond_the_queue_limit_gets_429_before_any_output(start, reference):
    """A burst that arrives within one engine step is bounded by what will wait for a slot: with
    max_num_seqs=2 and max_queue_len=2 the engine's first forward pass is held while four requests
    arrive (two will run, two wait; the scheduler has not even queued them all): all four are
    accepted, the fifth gets 429."""
    with start(config=engine_config(max_num_seqs=2), settings=ServerSettings(max_queue_len=2)) as c:
        body = {"prompt": "hi", "max_tokens": 1, "temperature": 0}
        with held_forward(c.engine) as gate:  # released on the way out, whatever happened
            burst = [Call(c, "/v1/completions", body) for _ in range(4)]
            wait_until(lambda: c.state.admitted == 4, "four submitted requests")
            assert c.engine.num_waiting < 4  # only the server's own count is at the limit
            err = assert_error(Call(c, "/v1/completions", body).result(timeout=30), 429)
            assert "2 requests are waiting" in err["message"]
            gate.set()
        assert [call.result().status_code for call in burst] == [200] * 4
        assert [call.result().json()["choices"][0]["text"] for call in burst] == [reference.text("hi", 1)] * 4
        assert c.state.admitted == 0
        assert c.post("/v1/completions", json=body).status_code == 200


# ----------------------------------------------------------------------------- responses


def test_explicit_nulls_mean_defaults(client, reference, tok):
    seed = 1
    nulls = {"prompt": "hi", "n": None, "temperature": None, "ignore_eos": None, "min_tokens": None, "stop": None,
             "max_tokens": 3, "seed": seed}  # fmt: skip
    sampled = reference("hi", temperature=1.0, seed=seed, max_tokens=3)[0].outputs[0].text
    assert sampled != reference.text("hi", 3)  # so that a null temperature taken as 0 would show
    r = client.post("/v1/completions", json=nulls)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == sampled
    # max_tokens null: up to max_model_len
    prompt = "hello " * 50
    body = {"prompt": prompt, "max_tokens": None, "ignore_eos": True, "temperature": 0}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == MAX_LEN - len(tok.encode(prompt))
    assert r.json()["choices"][0]["finish_reason"] == "length"


def test_engine_request_error_is_500_not_a_silent_abort(client, reference, monkeypatch):
    def exploding_update(self, *args, **kwargs):
        raise ValueError("detokenizer exploded")

    # the real engine, broken for these requests
    monkeypatch.setattr(IncrementalDetokenizer, "update", exploding_update)
    err = assert_error(client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 8}), 500)
    assert err["code"] == "internal_error" and "detokenizer exploded" in err["message"]
    events = sse_events(client.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 8, "stream": True}))
    assert events[-1] == "[DONE]"
    assert "detokenizer exploded" in events[-2]["error"]["message"]
    monkeypatch.undo()
    assert client.get("/health").status_code == 200  # one failed request is not a dead engine
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == reference.text("hi", 2)


def test_completion_usage_choices_and_logprobs(client, reference, tok):
    body = {"prompt": ["ab", "cde"], "n": 2, "max_tokens": 5, "logprobs": 2, "user": "team-a", "priority": 3,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    with recorded_requests(client.engine) as seen:
        r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "text_completion" and out["model"] == MODEL
    ref = reference(["ab", "cde"], n=2, max_tokens=5, logprobs=2, temperature=0, ignore_eos=True)
    ref_choices = [c for o in ref for c in o.outputs]
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in out["choices"]] == [c.text for c in ref_choices]
    assert out["choices"][0]["text"] != out["choices"][2]["text"]
    assert all(c["finish_reason"] == "length" for c in out["choices"])
    prompt_tokens = len(tok.encode("ab")) + len(tok.encode("cde"))
    assert out["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 20, "total_tokens": prompt_tokens + 20}

    lp, want = out["choices"][1]["logprobs"], ref_choices[1]
    assert lp["tokens"] == [tok.decode([t]) for t in want.token_ids]
    assert lp["token_logprobs"] == pytest.approx([want.logprobs[j][t].logprob for j, t in enumerate(want.token_ids)],
                                                 abs=1e-3)  # fmt: skip
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:j]) for j in range(5)]
    assert all(len(top) == 2 for top in lp["top_logprobs"])  # ranks <= 2
    # greedy: the sampled token is the most likely one
    assert all(max(top.values()) == pytest.approx(x, abs=1e-6)
               for top, x in zip(lp["top_logprobs"], lp["token_logprobs"]))  # fmt: skip

    seen = sorted(seen, key=lambda req: req.request_id)
    assert {(req.tenant, req.priority) for req in seen} == {("team-a", 3)}
    assert [req.prompt_token_ids for req in seen] == [tok.encode("ab")] * 2 + [tok.encode("cde")] * 2


def test_token_id_prompts(client, reference):
    with recorded_requests(client.engine) as seen:
        r = client.post("/v1/completions", json={"prompt": [[72, 105], [33]], "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 3
    assert [req.prompt_token_ids for req in sorted(seen, key=lambda req: req.request_id)] == [[72, 105], [33]]
    ref = reference([[72, 105], [33]], max_tokens=2, temperature=0)
    assert [c["text"] for c in r.json()["choices"]] == [o.outputs[0].text for o in ref]


def test_stop_string_non_stream_and_stream_agree(client, reference, tok):
    prompt = "The capital of France is"
    full = reference(prompt, temperature=0, max_tokens=24)[0].outputs[0]
    ids = full.token_ids
    # a stop string of two tokens from the middle of the greedy text (" answer is")
    k = next(i for i in range(3, len(ids) - 1) if tok.decode(ids[i: i + 1]).startswith(" ") and
             tok.decode(ids[i + 1: i + 2]).startswith(" "))  # fmt: skip
    before, stop = tok.decode(ids[:k]), tok.decode(ids[k: k + 2])
    assert full.text.find(stop) == len(before) > 0 and len(tok.encode(stop)) == 2
    req = {"prompt": prompt, "max_tokens": 24, "stop": [stop], "temperature": 0}
    plain = client.post("/v1/completions", json=req).json()["choices"][0]
    assert plain["text"] == before and plain["finish_reason"] == "stop"
    assert plain["stop_reason"] == stop
    events = sse_events(client.post("/v1/completions", json={**req, "stream": True}))
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert "".join(c["choices"][0]["text"] for c in chunks) == plain["text"]
    assert [c["choices"][0]["finish_reason"] for c in chunks][:-1] == [None] * (len(chunks) - 1)
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"][0]["stop_reason"] == stop
    assert all("usage" not in c for c in chunks)


def test_chat_stream_framing_with_usage(client, reference):
    seed = 1  # seeded sampling: the two choices differ, and each has its own reference text
    req = {"messages": HI, "max_tokens": 6, "n": 2, "stream": True, "stream_options": {"include_usage": True},
           "logprobs": True, "top_logprobs": 1, "temperature": 1.0, "seed": seed, "ignore_eos": True}  # fmt: skip
    ref = reference.chat(HI, n=2, max_tokens=6, temperature=1.0, seed=seed, ignore_eos=True, logprobs=1)[0]
    assert ref.outputs[0].text != ref.outputs[1].text
    r = client.post("/v1/chat/completions", json=req)
    events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == MODEL for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    *body, usage_chunk = chunks
    assert all(c["usage"] is None and len(c["choices"]) == 1 for c in body)
    assert usage_chunk["choices"] == []
    prompt_len = len(ref.prompt_token_ids)
    want_usage = {"prompt_tokens": prompt_len, "completion_tokens": 12, "total_tokens": prompt_len + 12}
    assert usage_chunk["usage"] == want_usage
    for idx in (0, 1):
        want = ref.outputs[idx]
        mine = [c["choices"][0] for c in body if c["choices"][0]["index"] == idx]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert all("role" not in ch["delta"] for ch in mine[1:])
        assert [ch["finish_reason"] for ch in mine[:-1]] == [None] * (len(mine) - 1)
        assert mine[-1]["finish_reason"] == "length" and mine[-1]["delta"] == {}
        assert "".join(ch["delta"].get("content") or "" for ch in mine) == want.text
        toks = [t for ch in mine if ch["logprobs"] for t in ch["logprobs"]["content"]]
        assert [t["token"] for t in toks] == [lps[t].decoded_token for lps, t in zip(want.logprobs, want.token_ids)]
        assert all(len(t["top_logprobs"]) == 1 and t["bytes"] == list(t["token"].encode()) for t in toks)
    plain = client.post("/v1/chat/completions", json={**req, "stream": False, "stream_options": None}).json()
    assert [c["message"]["content"] for c in plain["choices"]] == [o.text for o in ref.outputs]
    assert plain["usage"] == usage_chunk["usage"]


def test_models_lists_the_served_name(start):
    with start(config=engine_config(served_model_name="chat-small", max_model_len=256)) as c:
        data = c.get("/v1/models").json()
        assert data["object"] == "list" and [m["id"] for m in data["data"]] == ["chat-small"]
        assert data["data"][0]["max_model_len"] == 256
        r = c.post("/v1/completions", json={"prompt": "x", "model": "chat-small", "max_tokens": 1})
        assert r.status_code == 200 and r.json()["model"] == "chat-small"
        assert_error(c.post("/v1/completions", json={"prompt": "x", "model": MODEL}), 404, "model")


# ----------------------------------------------------------------------------- metrics


def test_metrics_exposition_and_vllm_compat(start, smollm2, tok):
    cfg = smollm2.model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    bytes_per_block = 2 * cfg.num_hidden_layers * 16 * cfg.num_key_value_heads * head_dim * 4  # K+V, fp32
    with start(settings=ServerSettings(metrics_compat="vllm")) as c:
        before = _families(c.get("/metrics").text)
        for prefix in ("kvfleet:", "vllm:"):
            for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "num_preemptions",
                         "prompt_tokens", "generation_tokens", "request_success", "prefix_cache_queries",
                         "prefix_cache_hits", "time_to_first_token_seconds", "inter_token_latency_seconds",
                         "e2e_request_latency_seconds", "request_queue_time_seconds", "request_prompt_tokens",
                         "request_generation_tokens", "cache_config_info"):  # fmt: skip
                assert prefix + name in before, prefix + name
        info = before["kvfleet:cache_config_info"].samples[0].labels
        assert info == {"model_name": MODEL, "block_size": "16", "num_blocks": str(KV_CACHE // bytes_per_block),
                        "gpu_memory_utilization": "0.9", "cache_dtype": "float32", "quantization": "none"}  # fmt: skip
        assert not any(n.endswith("_created") for n in before)
        r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        after = _families(c.get("/metrics").text)
        for prefix in ("kvfleet:", "vllm:"):
            ok = [s for s in after[prefix + "request_success"].samples
                  if s.name.endswith("_total") and s.labels["finished_reason"] == "length"]  # fmt: skip
            assert ok[0].value == 1 and ok[0].labels["model_name"] == MODEL
            gen = [s for s in after[prefix + "request_generation_tokens"].samples if s.name.endswith("_sum")]
            assert gen[0].value == 3
            prompt = [s for s in after[prefix + "request_prompt_tokens"].samples if s.name.endswith("_sum")]
            assert prompt[0].value == len(tok.encode("hi"))


def test_completion_top_logprobs_always_hold_the_sampled_token(client):
    # High-temperature seeded sampling picks tokens outside the top 1; like vLLM (and
    # OpenAI), each top_logprobs entry still lists the sampled token (up to logprobs + 1).
    body = {"prompt": "Hi", "max_tokens": 8, "logprobs": 1, "temperature": 1.8, "seed": 7, "ignore_eos": True}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    assert all(tok in top and 1 <= len(top) <= 2 for tok, top in zip(lp["tokens"], lp["top_logprobs"]))
    assert any(len(top) == 2 for top in lp["top_logprobs"]), "no token outside the top 1 was sampled"
