"""HTTP contract of the OpenAI server against a scripted engine (fast; no model).

The scripted engine has AsyncLLMEngine's interface and produces a known text one
character-token per step, so that every status code, error body, SSE framing rule and usage
count can be checked exactly. The same contracts are checked against the real model in
tests/test_server_e2e.py.
"""

from __future__ import annotations

import asyncio
import json
import threading

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from kvfleet.runtime.api_server import create_app
from kvfleet.runtime.config import EngineConfig
from kvfleet.runtime.outputs import CompletionOutput, Logprob, RequestOutput
from kvfleet.runtime.serve_args import ServerSettings
from kvfleet.runtime.stats import FinishedRequestStats, IterationStats, SchedulerStats

REPLY = "Hello world! The capital of France is Paris. "
MODEL = "SmolLM2-135M-Instruct"


class CharTokenizer:
    """One token per character (id = code point); a toy chat template."""

    chat_template = "{{ messages }}"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)

    def __len__(self) -> int:
        return 4096

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True, continue_final_message=False, **kw):
        for m in messages:
            if m["role"] not in ("system", "user", "assistant"):
                raise ValueError(f"unknown role {m['role']!r}")
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


class ScriptedEngine:
    """AsyncLLMEngine's interface; output i of a request spells REPLY from offset i."""

    def __init__(self, config: EngineConfig, stat_loggers=()):
        self.config = config
        self.stat_loggers = list(stat_loggers)
        self.tokenizer = CharTokenizer()
        self.max_model_len = config.max_model_len or 256
        self.is_running = False
        self.errored = False
        self.dead_error = None
        self.forced_waiting = 0
        self.running: set[str] = set()
        self.aborted: set[str] = set()
        self.calls: list[dict] = []
        self.resets = 0
        self.step_delay = 0.001

        class Core:
            vocab_size = 4096

            @staticmethod
            def cache_config_info():
                return {"block_size": "16", "num_blocks": "64", "gpu_memory_utilization": "0.9"}

        self.engine = Core()

    @property
    def num_waiting(self) -> int:
        return self.forced_waiting

    @property
    def num_running(self) -> int:
        return len(self.running)

    async def start(self):
        self.is_running = True

    async def shutdown(self):
        self.is_running = False

    async def reset_prefix_cache(self):
        self.resets += 1
        return True

    async def abort(self, request_id: str):
        self.aborted.add(request_id)

    def _record(self, finished=()):
        for lg in self.stat_loggers:
            lg.record(SchedulerStats(len(self.running), self.forced_waiting, 0.1 * len(self.running)), IterationStats(
                num_generation_tokens=len(self.running), finished_requests=list(finished)))

    async def generate(self, prompt, params, request_id, *, priority=0, tenant=None):
        if isinstance(prompt, str):
            prompt = self.tokenizer.encode(prompt)
        if params.temperature > 1.5:
            raise ValueError("temperature too high for the scripted engine")
        self.calls.append(dict(prompt=prompt, params=params, request_id=request_id, priority=priority, tenant=tenant))
        n = params.n
        outs = [CompletionOutput(index=i, text="", token_ids=[], logprobs=[] if params.logprobs is not None else None)
                for i in range(n)]
        self.running.add(request_id)
        try:
            step = 0
            while not all(o.finished for o in outs):
                await asyncio.sleep(self.step_delay)
                if request_id in self.aborted:
                    for o in outs:
                        o.finish_reason = o.finish_reason or "abort"
                    break
                for i, o in enumerate(outs):
                    if o.finished:
                        continue
                    ch = REPLY[(i + step) % len(REPLY)]
                    o.token_ids.append(ord(ch))
                    if o.logprobs is not None:
                        d = {ord(ch): Logprob(-0.5, 1, ch)}
                        for r in range(2, params.logprobs + 2):
                            d.setdefault(ord("a") + r, Logprob(-1.0 * r, r, chr(ord("a") + r)))
                        o.logprobs.append(d)
                    full = "".join(chr(t) for t in o.token_ids)
                    hit = next((s for s in params.stop if s in full), None)
                    if hit is not None:
                        o.text = full[: full.index(hit)]
                        o.finish_reason, o.stop_reason = "stop", hit
                    else:
                        # hold back a suffix that could still become a stop string
                        hold = max((k for s in params.stop for k in range(1, len(s)) if full.endswith(s[:k])), default=0)
                        o.text = full[: len(full) - hold]
                        if len(o.token_ids) >= params.max_tokens:
                            o.text, o.finish_reason = full, "length"
                step += 1
                if "FAIL" in self.tokenizer.decode(prompt) and step == 2:  # post-processing error
                    for o in outs:
                        o.finish_reason = "abort"
                    yield RequestOutput(request_id, None, list(prompt), outs, finished=True,
                                        extra={"error": "ValueError: detokenizer exploded"})
                    return
                finished = all(o.finished for o in outs)
                self._record([FinishedRequestStats(o.finish_reason, 0.1, 0.0, len(prompt), len(o.token_ids))
                              for o in outs] if finished else ())
                yield RequestOutput(request_id, None, list(prompt),
                                    [CompletionOutput(o.index, o.text, list(o.token_ids), None,
                                                      list(o.logprobs) if o.logprobs is not None else None,
                                                      o.finish_reason, o.stop_reason) for o in outs],
                                    finished=finished)
        finally:
            self.running.discard(request_id)


def make_client(settings: ServerSettings | None = None, config: EngineConfig | None = None, factory=None):
    engines = []

    def default_factory(cfg, stat_loggers):
        e = ScriptedEngine(cfg, stat_loggers)
        engines.append(e)
        return e

    app = create_app(config or EngineConfig(), settings or ServerSettings(), engine_factory=factory or default_factory)
    return app, engines


@pytest.fixture()
def client():
    app, engines = make_client()
    with TestClient(app) as c:
        wait_ready(c)
        c.engine = engines[0]
        yield c


def wait_ready(c: TestClient, timeout: float = 10.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while c.get("/ready").status_code != 200:
        assert time.monotonic() < deadline, "server never became ready"
        time.sleep(0.01)


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
    text = resp.text
    assert text.endswith("\n\n")
    events = []
    for block in text.split("\n\n")[:-1]:
        assert block.startswith("data: "), block
        payload = block[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


# ----------------------------------------------------------------------------- probes


def test_ready_is_503_while_loading_and_health_is_200():
    release = threading.Event()

    def slow_factory(cfg, stat_loggers):
        assert release.wait(10)
        return ScriptedEngine(cfg, stat_loggers)

    app, _ = make_client(factory=slow_factory)
    with TestClient(app) as c:
        assert c.get("/ready").status_code == 503
        assert c.get("/health").status_code == 200
        assert_error(c.post("/v1/completions", json={"prompt": "hi"}), 503)
        release.set()
        wait_ready(c)
        assert c.get("/health").json() == {"status": "ok"}
        assert c.post("/v1/completions", json={"prompt": "hi"}).status_code == 200


def test_failed_load_makes_health_and_ready_503():
    def broken(cfg, stat_loggers):
        raise RuntimeError("no weights")

    app, _ = make_client(factory=broken)
    fatal = []
    app.state.kvfleet.on_fatal = lambda: fatal.append(1)
    with TestClient(app) as c:
        import time

        for _ in range(500):
            if c.get("/health").status_code == 503:
                break
            time.sleep(0.01)
        assert c.get("/health").status_code == 503
        assert c.get("/ready").status_code == 503
        assert fatal == [1]


def test_dead_engine_loop_makes_health_503(client):
    assert client.get("/health").status_code == 200
    client.engine.errored = True
    assert client.get("/health").status_code == 503
    assert client.get("/ready").status_code == 503
    assert_error(client.post("/v1/completions", json={"prompt": "hi"}), 503)


# ----------------------------------------------------------------------------- auth


def test_api_key_guards_v1_routes_only():
    app, engines = make_client(settings=ServerSettings(api_key="s3cret"))
    with TestClient(app) as c:
        wait_ready(c)
        for method, path, body in [
            ("get", "/v1/models", None),
            ("post", "/v1/completions", {"prompt": "hi"}),
            ("post", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
            ("post", "/reset_prefix_cache", None),
        ]:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
                r = getattr(c, method)(path, json=body, headers=headers) if body else getattr(c, method)(path, headers=headers)
                err = assert_error(r, 401)
                assert err["code"] == "invalid_api_key"
            ok = {"Authorization": "Bearer s3cret"}
            r = getattr(c, method)(path, json=body, headers=ok) if body else getattr(c, method)(path, headers=ok)
            assert r.status_code == 200, (path, r.text)
        assert engines[0].resets == 1
        for path in ("/health", "/ready", "/metrics"):
            assert c.get(path).status_code == 200


# ----------------------------------------------------------------------------- bad input


BAD_COMPLETIONS = [
    (b'{"prompt": "hi", ', 400, None),  # malformed JSON
    (b"\xff\xfe{}", 400, None),  # not UTF-8
    (b'["prompt"]', 400, None),  # not an object
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
    (b'{"prompt": "hi", "max_tokens": 300}', 400, "max_tokens"),  # 2 + 300 > 256
    (b'{"prompt": "hi", "echo": true}', 400, "echo"),
    (b'{"prompt": "hi", "suffix": "x"}', 400, "suffix"),
    (b'{"prompt": "hi", "best_of": 3}', 400, "best_of"),
    (b'{"prompt": "hi", "logit_bias": {"5": 1.0}}', 400, "logit_bias"),
    (b'{"prompt": "hi", "logprobs": 21}', 400, "logprobs"),
    (b'{"prompt": "", "max_tokens": 2}', 400, "prompt"),
    (b'{"prompt": [], "max_tokens": 2}', 400, "prompt"),
    (b'{"prompt": [1, 99999], "max_tokens": 2}', 400, "prompt"),
    (b'{"prompt": "hi", "stream_options": {"include_usage": true}}', 400, "stream_options"),
    (b'{"prompt": "hi", "temperature": 1.9}', 400, None),  # the engine's own ValueError
    (b'{"prompt": "hi", "model": "gpt-4"}', 404, "model"),
]


@pytest.mark.parametrize("body,status,param", BAD_COMPLETIONS)
def test_bad_completion_requests(client, body, status, param):
    r = client.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
    assert_error(r, status, param if param is not None else "__any__")
    good = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
    assert good.status_code == 200 and good.json()["choices"][0]["text"] == REPLY[:3]


BAD_CHATS = [
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, 400, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "messages"),
    ({"messages": "hi"}, 400, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10_000}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3}, 400, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 30}, 400, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, 400, "tools"),
    ({"messages": [{"role": "user", "content": "hi"}], "presence_penalty": 3}, 400, "presence_penalty"),
    ({"messages": [{"role": "user", "content": "hi"}], "stop": 5}, 400, "stop"),
    ({"messages": [{"role": "user", "content": "x" * 300}]}, 400, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}], "model": "nope"}, 404, "model"),
    ({"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"tokenize": True}}, 400,
     "chat_template_kwargs"),
]


@pytest.mark.parametrize("body,status,param", BAD_CHATS)
def test_bad_chat_requests(client, body, status, param):
    assert_error(client.post("/v1/chat/completions", json=body), status, param)
    good = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert good.status_code == 200 and good.json()["choices"][0]["message"]["content"] == REPLY[:4]


def test_unknown_route_and_method_use_the_error_shape(client):
    assert_error(client.get("/v1/nothing"), 404)
    assert_error(client.get("/v1/completions"), 405)


def test_queue_full_gives_429(tmp_path):
    app, engines = make_client(settings=ServerSettings(max_queue_len=2))
    with TestClient(app) as c:
        wait_ready(c)
        engines[0].forced_waiting = 2
        err = assert_error(c.post("/v1/completions", json={"prompt": "hi"}), 429)
        assert err["code"] == "queue_full"
        engines[0].forced_waiting = 1
        assert c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_burst_beyond_the_queue_limit_gets_429_before_any_output():
    """Requests submitted but without output yet count as waiting, so a burst that arrives
    within one engine step is bounded too."""
    app, engines = make_client(settings=ServerSettings(max_queue_len=2))
    with TestClient(app) as c:
        wait_ready(c)
        engines[0].step_delay = 0.3  # first output only after 0.3 s
        results: list[int] = []

        def post():
            results.append(c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}).status_code)

        threads = [threading.Thread(target=post) for _ in range(2)]
        for t in threads:
            t.start()
        import time

        deadline = time.monotonic() + 5
        while app.state.kvfleet.pending < 2:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        err = assert_error(c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}), 429)
        assert "2 requests are waiting" in err["message"]
        for t in threads:
            t.join(10)
        assert results == [200, 200]
        assert app.state.kvfleet.pending == 0
        assert c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}).status_code == 200


def test_explicit_nulls_mean_defaults(client):
    r = client.post("/v1/completions", json={"prompt": "hi", "n": None, "temperature": None, "ignore_eos": None,
                                             "min_tokens": None, "stop": None, "max_tokens": 3})  # fmt: skip
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == REPLY[:3]
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": None})  # null: up to max_model_len
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 256 - 2


def test_engine_request_error_is_500_not_a_silent_abort(client):
    err = assert_error(client.post("/v1/completions", json={"prompt": "FAIL", "max_tokens": 8}), 500)
    assert "detokenizer exploded" in err["message"]
    events = sse_events(client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "FAIL"}], "max_tokens": 8, "stream": True}))  # fmt: skip
    assert events[-1] == "[DONE]"
    assert "detokenizer exploded" in events[-2]["error"]["message"]
    assert client.get("/health").status_code == 200  # one failed request is not a dead engine
    assert client.post("/v1/completions", json={"prompt": "ok", "max_tokens": 2}).status_code == 200


# ----------------------------------------------------------------------------- responses


def test_completion_usage_choices_and_logprobs(client):
    r = client.post("/v1/completions", json={"prompt": ["ab", "cde"], "n": 2, "max_tokens": 5, "logprobs": 2,
                                             "user": "team-a", "priority": 0})  # fmt: skip
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == MODEL
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in body["choices"]] == [REPLY[0:5], REPLY[1:6]] * 2
    assert all(c["finish_reason"] == "length" for c in body["choices"])
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 20, "total_tokens": 25}
    lp = body["choices"][1]["logprobs"]
    assert lp["tokens"] == list(REPLY[1:6])
    assert lp["token_logprobs"] == [-0.5] * 5
    assert lp["text_offset"] == [0, 1, 2, 3, 4]
    assert all(len(t) == 2 for t in lp["top_logprobs"])  # ranks <= 2
    assert {c["tenant"] for c in client.engine.calls} == {"team-a"}
    assert [c["prompt"] for c in client.engine.calls] == [[97, 98], [99, 100, 101]]


def test_token_id_prompts(client):
    r = client.post("/v1/completions", json={"prompt": [[72, 105], [33]], "max_tokens": 2})
    assert r.status_code == 200
    assert r.json()["usage"]["prompt_tokens"] == 3
    assert [c["prompt"] for c in client.engine.calls] == [[72, 105], [33]]


def test_stop_string_non_stream_and_stream_agree(client):
    req = {"prompt": "q", "max_tokens": 40, "stop": ["capital of"]}
    plain = client.post("/v1/completions", json=req).json()["choices"][0]
    assert plain["text"] == "Hello world! The " and plain["finish_reason"] == "stop"
    assert plain["stop_reason"] == "capital of"
    events = sse_events(client.post("/v1/completions", json={**req, "stream": True}))
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert "".join(c["choices"][0]["text"] for c in chunks) == plain["text"]
    assert [c["choices"][0]["finish_reason"] for c in chunks][:-1] == [None] * (len(chunks) - 1)
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert all("usage" not in c for c in chunks)


def test_chat_stream_framing_with_usage(client):
    req = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "n": 2, "stream": True,
           "stream_options": {"include_usage": True}, "logprobs": True, "top_logprobs": 1}  # fmt: skip
    r = client.post("/v1/chat/completions", json=req)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    *body, usage_chunk = chunks
    assert all(c["usage"] is None for c in body)
    assert usage_chunk["choices"] == []
    prompt_len = len("<user>hi\n<assistant>")
    assert usage_chunk["usage"] == {"prompt_tokens": prompt_len, "completion_tokens": 12, "total_tokens": prompt_len + 12}
    for idx in (0, 1):
        mine = [c["choices"][0] for c in body if c["choices"][0]["index"] == idx]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert all("role" not in ch["delta"] for ch in mine[1:])
        assert [ch["finish_reason"] for ch in mine[:-1]] == [None] * (len(mine) - 1)
        assert mine[-1]["finish_reason"] == "length" and mine[-1]["delta"] == {}
        text = "".join(ch["delta"].get("content") or "" for ch in mine)
        assert text == REPLY[idx: idx + 6]
        toks = [t for ch in mine if ch["logprobs"] for t in ch["logprobs"]["content"]]
        assert [t["token"] for t in toks] == list(REPLY[idx: idx + 6])
        assert all(len(t["top_logprobs"]) == 1 and t["bytes"] == list(t["token"].encode()) for t in toks)
    plain = client.post("/v1/chat/completions", json={**req, "stream": False, "stream_options": None}).json()
    assert [c["message"]["content"] for c in plain["choices"]] == [REPLY[0:6], REPLY[1:7]]
    assert plain["usage"] == usage_chunk["usage"]


def test_models_lists_the_served_name():
    app, _ = make_client(config=EngineConfig(served_model_name="chat-small"))
    with TestClient(app) as c:
        wait_ready(c)
        data = c.get("/v1/models").json()
        assert data["object"] == "list" and [m["id"] for m in data["data"]] == ["chat-small"]
        assert data["data"][0]["max_model_len"] == 256
        assert c.post("/v1/completions", json={"prompt": "x", "model": "chat-small", "max_tokens": 1}).status_code == 200
        assert_error(c.post("/v1/completions", json={"prompt": "x", "model": MODEL}), 404, "model")


# ----------------------------------------------------------------------------- metrics


def _families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_metrics_exposition_and_vllm_compat():
    app, _ = make_client(settings=ServerSettings(metrics_compat="vllm"))
    with TestClient(app) as c:
        wait_ready(c)
        before = _families(c.get("/metrics").text)
        for prefix in ("kvfleet:", "vllm:"):
            for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "num_preemptions",
                         "prompt_tokens", "generation_tokens", "request_success", "prefix_cache_queries",
                         "prefix_cache_hits", "time_to_first_token_seconds", "inter_token_latency_seconds",
                         "e2e_request_latency_seconds", "request_queue_time_seconds", "request_prompt_tokens",
                         "request_generation_tokens", "cache_config_info"):  # fmt: skip
                assert prefix + name in before, prefix + name
        info = before["kvfleet:cache_config_info"].samples[0].labels
        assert info == {"model_name": MODEL, "block_size": "16", "num_blocks": "64", "gpu_memory_utilization": "0.9"}
        assert not any(n.endswith("_created") for n in before)
        c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
        after = _families(c.get("/metrics").text)
        for prefix in ("kvfleet:", "vllm:"):
            ok = [s for s in after[prefix + "request_success"].samples
                  if s.name.endswith("_total") and s.labels["finished_reason"] == "length"]  # fmt: skip
            assert ok[0].value == 1 and ok[0].labels["model_name"] == MODEL
            gen = [s for s in after[prefix + "request_generation_tokens"].samples if s.name.endswith("_sum")]
            assert gen[0].value == 3
