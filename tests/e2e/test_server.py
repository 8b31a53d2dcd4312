"""End to end: `kvfleet serve` as a real subprocess with the default model (SmolLM2-135M-Instruct),
driven by the official `openai` client, raw HTTP and a client process that gets killed.

One server for the whole module (model load: seconds once the converted checkpoint is cached).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.serve import free_port

pytestmark = pytest.mark.slow

API_KEY = "sk-kvfleet-test"
MODEL = "SmolLM2-135M-Instruct"
CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]


class Server:
    def __init__(self, port: int, proc: subprocess.Popen, log: Path):
        self.port = port
        self.proc = proc
        self.log = log
        self.base = f"http://127.0.0.1:{port}"
        self.http = httpx.Client(base_url=self.base, timeout=60, headers={"Authorization": f"Bearer {API_KEY}"})
        self.ready_statuses: list[int] = []
        self.metrics_before_first_request = ""

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base + "/v1", api_key=API_KEY, max_retries=0, timeout=120, **kw)

    def metrics(self) -> dict[str, dict[tuple, float]]:
        """Parse /metrics strictly; {family: {(sample name, sorted labels): value}}."""
        text = httpx.get(self.base + "/metrics", timeout=30).text
        out: dict[str, dict[tuple, float]] = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                out.setdefault(fam.name, {})[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return out

    def logs(self) -> str:
        return self.log.read_text(errors="replace")[-5000:]


def metric(m, family, sample=None, **labels) -> float:
    sample = sample or family
    want = {"model_name": MODEL, **labels}
    for (name, lbls), v in m[family].items():
        d = dict(lbls)
        if name == sample and all(d.get(k) == val for k, val in want.items()):
            return v
    raise KeyError((family, sample, labels))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    # options from all three sources, as in a pod: the operator's ConfigMap file, env, flags
    config = log.parent / "kvfleet.yaml"
    config.write_text("max-model-len: 2048\nkv_cache_memory: 256MiB\nmetrics_compat: vllm\nport: 1\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "KVFLEET_API_KEY": API_KEY, "KVFLEET_CONFIG": str(config),
           "KVFLEET_PORT": "2", "TOKENIZERS_PARALLELISM": "false"}  # fmt: skip
    cmd = [sys.executable, "-m", "kvfleet.runtime.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--log-level", "warning"]  # fmt: skip
    with open(log, "wb") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env)
    srv = Server(port, proc, log)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, f"server exited with {proc.returncode}:\n{srv.logs()}"
            assert time.monotonic() < deadline, f"server not ready in time:\n{srv.logs()}"
            try:
                status = httpx.get(srv.base + "/ready", timeout=5).status_code
            except httpx.TransportError:
                time.sleep(0.05)
                continue
            srv.ready_statuses.append(status)
            if status == 200:
                break
            time.sleep(0.05)
        srv.metrics_before_first_request = httpx.get(srv.base + "/metrics", timeout=30).text
        yield srv
    finally:
        srv.http.close()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# ----------------------------------------------------------------------------- probes and metrics


def test_probes_and_metrics_before_first_request(server):
    assert 503 in server.ready_statuses, "the server should listen (and say 503) while the model loads"
    assert server.ready_statuses[-1] == 200
    assert httpx.get(server.base + "/health").status_code == 200
    fams = {f.name: f for f in text_string_to_metric_families(server.metrics_before_first_request)}
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "request_success",
                 "time_to_first_token_seconds", "request_prompt_tokens", "cache_config_info"):  # fmt: skip
        assert "kvfleet:" + name in fams, name
    info = fams["kvfleet:cache_config_info"].samples[0].labels
    assert info["model_name"] == MODEL and int(info["num_blocks"]) > 0 and info["block_size"] == "16"
    # --metrics-compat vllm (from the config file): the same series under vLLM's names
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "cache_config_info"):
        assert [s.value for s in fams["vllm:" + name].samples] == [s.value for s in fams["kvfleet:" + name].samples]
    assert fams["vllm:cache_config_info"].samples[0].labels["num_gpu_blocks"] == info["num_blocks"]
    # /health, /ready, /metrics are open; /v1 is not
    assert httpx.get(server.base + "/v1/models").status_code == 401


def test_models_and_auth_with_openai_client(server):
    models = server.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].max_model_len == 2048  # from the config file
    bad = openai.OpenAI(base_url=server.base + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as exc:
        bad.chat.completions.create(model=MODEL, messages=CAPITAL, max_tokens=4)
    assert exc.value.status_code == 401 and exc.value.body["code"] == "invalid_api_key"
    with pytest.raises(openai.NotFoundError):
        server.client().chat.completions.create(model="gpt-4o", messages=CAPITAL, max_tokens=4)
    server.metrics()


# ----------------------------------------------------------------------------- answers


def test_capital_of_france_greedy_chat(server):
    client = server.client()
    resp = client.chat.completions.create(model=MODEL, messages=CAPITAL, max_tokens=32, temperature=0,
                                          logprobs=True, top_logprobs=2)  # fmt: skip
    choice = resp.choices[0]
    assert "Paris" in choice.message.content, choice.message.content
    assert choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    # exact usage: one logprob entry per generated token; prompt = the chat template's tokens
    assert resp.usage.completion_tokens == len(choice.logprobs.content)
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in choice.logprobs.content)
    # greedy: the chosen token is the top-1 alternative
    assert all(t.token == t.top_logprobs[0].token for t in choice.logprobs.content)
    assert "".join(t.token for t in choice.logprobs.content).startswith(choice.message.content[:5])

    stream = client.chat.completions.create(model=MODEL, messages=CAPITAL, max_tokens=32, temperature=0, stream=True,
                                            stream_options={"include_usage": True})  # fmt: skip
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == resp.usage.model_dump()
    body = [c for c in chunks if c.choices]
    assert [c.choices[0].finish_reason for c in body[:-1]] == [None] * (len(body) - 1)
    assert body[-1].choices[0].finish_reason == choice.finish_reason
    assert "".join(c.choices[0].delta.content or "" for c in body) == choice.message.content
    server.metrics()


def test_stream_equals_non_stream_with_multi_token_stop(server):
    client = server.client()
    prompt = "The three primary colors are"
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0)
    text = full.choices[0].text
    assert full.usage.completion_tokens == 40 or full.choices[0].finish_reason == "stop"
    # a stop string spanning several tokens, taken from the middle of the greedy text
    words = text.split()
    assert len(words) >= 6, text
    stop = " ".join(words[3:5])
    stop_tokens = client.completions.create(model=MODEL, prompt=stop, max_tokens=1).usage.prompt_tokens
    assert stop_tokens >= 2, f"{stop!r} should span several tokens"
    expected = text[: text.index(stop)]
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0, stop=[stop])
    assert plain.choices[0].text == expected
    assert plain.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0, stop=[stop],
                                         stream=True, stream_options={"include_usage": True})  # fmt: skip
    chunks = list(streamed)
    pieces = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(pieces) == expected
    assert not any(stop in p for p in pieces)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == plain.usage.prompt_tokens
    server.metrics()


def test_n2_seed_logprobs_and_token_prompts(server):
    client = server.client()
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=1.0, seed=1234, n=2, logprobs=3)
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # seeded: reproducible
    assert a.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in a.choices)
    for c in a.choices:
        assert len(c.logprobs.token_logprobs) == len(c.logprobs.tokens) == len(c.logprobs.top_logprobs)
        assert all(1 <= len(top) <= 4 for top in c.logprobs.top_logprobs)
        assert c.logprobs.text_offset[0] == 0
    # token-id prompts: exact prompt usage
    ids = [[504, 3458, 282, 4649], [504, 3458]]
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=3, temperature=0)
    assert r.usage.prompt_tokens == 6 and len(r.choices) == 2
    # streaming n=2: each choice gets its own finish chunk
    s = list(client.completions.create(**{**kw, "stream": True}))
    finishes = [(c.choices[0].index, c.choices[0].finish_reason) for c in s if c.choices[0].finish_reason]
    assert sorted(i for i, _ in finishes) == [0, 1]  # one final chunk per choice
    texts = {i: "".join(c.choices[0].text for c in s if c.choices[0].index == i) for i in (0, 1)}
    assert [texts[0], texts[1]] == [c.text for c in a.choices]
    server.metrics()


# ----------------------------------------------------------------------------- concurrency


def test_32_concurrent_streaming_clients(server):
    seen_running: list[float] = []
    stop_polling = threading.Event()

    def poll():
        while not stop_polling.is_set():
            try:
                seen_running.append(metric(server.metrics(), "kvfleet:num_requests_running"))
            except Exception:
                pass
            time.sleep(0.05)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()

    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, str]:
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Count from {i} to {i + 5}."}],
            max_tokens=16, temperature=0, stream=True,
        )  # fmt: skip
        text, finish = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
        return text, finish

    async def run():
        async with openai.AsyncOpenAI(base_url=server.base + "/v1", api_key=API_KEY, max_retries=0, timeout=300) as c:
            return await asyncio.gather(*(one(c, i) for i in range(32)))

    try:
        results = asyncio.run(run())
    finally:
        stop_polling.set()
        poller.join(5)
    assert len(results) == 32
    assert all(text and finish in ("stop", "length") for text, finish in results), results
    assert max(seen_running) > 1, seen_running
    m = server.metrics()
    assert metric(m, "kvfleet:num_requests_running") == 0
    assert metric(m, "kvfleet:kv_cache_usage_perc") == 0


KILLED_CLIENT = r"""
import json, sys, httpx
body = {"model": sys.argv[2], "prompt": "Write a very long story about a dragon.", "max_tokens": 1500,
        "temperature": 0, "ignore_eos": True, "stream": True}
with httpx.stream("POST", sys.argv[1] + "/v1/completions", json=body, timeout=120,
                  headers={"Authorization": "Bearer " + sys.argv[3]}) as r:
    for line in r.iter_lines():
        if line.startswith("data: "):
            print("CHUNK", flush=True)
"""


def test_killed_client_aborts_its_request(server):
    before = server.metrics()
    aborts_before = metric(before, "kvfleet:request_success", "kvfleet:request_success_total", finished_reason="abort")
    proc = subprocess.Popen([sys.executable, "-c", KILLED_CLIENT, server.base, MODEL, API_KEY],
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        for _ in range(5):  # a few chunks: the request is running
            assert proc.stdout.readline().startswith("CHUNK")
        m = server.metrics()
        assert metric(m, "kvfleet:num_requests_running") == 1
        assert metric(m, "kvfleet:kv_cache_usage_perc") > 0
        proc.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        proc.wait(10)
        while True:
            m = server.metrics()
            done = (
                metric(m, "kvfleet:num_requests_running") == 0
                and metric(m, "kvfleet:request_success", "kvfleet:request_success_total", finished_reason="abort")
                == aborts_before + 1
            )
            if done or time.monotonic() - killed_at > 1.0:
                break
            time.sleep(0.02)
        elapsed = time.monotonic() - killed_at
        assert done, f"request not aborted within a second of the kill ({elapsed:.2f} s)"
        assert metric(m, "kvfleet:num_requests_waiting") == 0
        assert metric(m, "kvfleet:kv_cache_usage_perc") == 0, "a KV block stayed allocated"
    finally:
        if proc.poll() is None:
            proc.kill()
    # the engine keeps serving
    r = server.client().completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0)
    assert r.usage.completion_tokens == 4


def test_valid_extreme_parameters_are_served(server):
    client = server.client()
    r = client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=4, temperature=2.0, top_p=0.01, seed=2**70, presence_penalty=2,
        frequency_penalty=-2, logprobs=20,
        extra_body={"top_k": 10**9, "min_p": 1.0, "repetition_penalty": 100.0, "stop_token_ids": [10**9],
                    "min_tokens": 4, "priority": -5, "user": "tenant-x"},
    )  # fmt: skip
    assert r.usage.completion_tokens == 4 and r.choices[0].finish_reason == "length"
    assert all(len(top) <= 21 for top in r.choices[0].logprobs.top_logprobs)
    assert httpx.get(server.base + "/health").status_code == 200
    server.metrics()


# ----------------------------------------------------------------------------- bad input


BAD = [
    ("/v1/completions", b'{"model": "M", "prompt": "hi", ', 400),
    ("/v1/completions", b'\xff\xfe{"model": "M"}', 400),
    ("/v1/completions", b'{"model": "M", "prompt": "hi", "max_tokens": "ten"}', 400),
    ("/v1/completions", b'{"model": "M", "prompt": 17}', 400),
    ("/v1/completions", b'{"model": "M", "prompt": "hi", "max_tokens": 0}', 400),
    ("/v1/completions", b'{"model": "M", "prompt": "hi", "max_tokens": -1}', 400),
    ("/v1/completions", b'{"model": "M", "prompt": "hi", "temperature": -1}', 400),
    ("/v1/completions", b'{"model": "M", "prompt": "hi", "top_p": 0}', 400),
    ("/v1/completions", b'{"model": "M", "prompt": "hi", "top_p": 1.01}', 400),
    ("/v1/completions", b'{"model": "M", "prompt": "hi", "n": 0}', 400),
    ("/v1/completions", b'{"model": "M", "prompt": "hi", "max_tokens": 2048}', 400),
    ("/v1/completions", b'{"model": "M", "prompt": "hi", "prompt_logprobs": -1}', 400),
    ("/v1/completions", b'{"model": "M", "prompt": "hi", "suffix": "!"}', 400),
    ("/v1/completions", b'{"model": "M", "prompt": [1, 999999999]}', 400),
    ("/v1/completions", b'{"model": "nope", "prompt": "hi"}', 404),
    ("/v1/chat/completions", b'{"model": "M", "messages": [{"role": "user", "content": 5}]}', 400),
    ("/v1/chat/completions", b'{"model": "M", "messages": [{"role": "user", "content": "hi"}], "n": -2}', 400),
    ("/v1/chat/completions", b'{"model": "M", "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}', 400),
    ("/v1/chat/completions", b'{"model": "M", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}', 400),
    ("/v1/chat/completions", b"null", 400),
]


def test_bad_inputs_get_their_status_and_do_not_disturb(server):
    for path, body, status in BAD:
        r = server.http.post(path, content=body.replace(b'"M"', json.dumps(MODEL).encode()),
                             headers={"Content-Type": "application/json"})  # fmt: skip
        assert r.status_code == status, (body, r.status_code, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], r.text
        good = server.http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
        assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 2, good.text
    assert server.proc.poll() is None
    m = server.metrics()
    assert metric(m, "kvfleet:num_requests_running") == 0


def test_reset_prefix_cache_and_final_metrics(server):
    assert server.http.post("/reset_prefix_cache").json() == {"reset": True}
    assert httpx.post(server.base + "/reset_prefix_cache").status_code == 401
    # KV events are on with no flag (a router discovers their endpoint here); the reset removed every block
    snap = server.http.get("/kv_events/snapshot")
    assert snap.status_code == 200, snap.text
    assert snap.json()["block_hashes"] == [] and str(snap.json()["endpoint"]).startswith("tcp://"), snap.text
    assert httpx.get(server.base + "/kv_events/snapshot").status_code == 401
    m = server.metrics()
    assert metric(m, "kvfleet:kv_cache_usage_perc") == 0
    assert metric(m, "kvfleet:prompt_tokens", "kvfleet:prompt_tokens_total") > 0
    assert metric(m, "kvfleet:generation_tokens", "kvfleet:generation_tokens_total") > 0
    assert metric(m, "kvfleet:prefix_cache_queries", "kvfleet:prefix_cache_queries_total") > 0
    assert metric(m, "kvfleet:time_to_first_token_seconds", "kvfleet:time_to_first_token_seconds_count") > 0
    assert metric(m, "kvfleet:request_success", "kvfleet:request_success_total", finished_reason="stop") > 0
    assert metric(m, "kvfleet:request_success", "kvfleet:request_success_total", finished_reason="length") > 0


def test_failed_model_load_exits_1_with_options_from_config_and_env(tmp_path):
    cfg = tmp_path / "kvfleet.yaml"
    cfg.write_text("model: /nonexistent/model.gguf\nblock-size: 32\nhost: 127.0.0.1\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "KVFLEET_CONFIG": str(cfg), "KVFLEET_PORT": "0"}
    done = subprocess.run([sys.executable, "-m", "kvfleet.runtime.cli", "serve", "--log-level", "warning"],
                          env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 1, done.stderr[-3000:]
    assert "/nonexistent/model.gguf" in done.stderr
    bad = subprocess.run([sys.executable, "-m", "kvfleet.runtime.cli", "serve", "--block-size", "huge"],
                         env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert bad.returncode == 2 and "--block-size='huge'" in bad.stderr


def test_engine_loop_death_turns_health_and_requests_to_503(smollm2):
    """The real AsyncLLMEngine in-process: when its loop dies, /health and /ready say 503 (a
    liveness probe restarts the pod) and requests get a 503 error body, not a hang."""
    from fastapi.testclient import TestClient

    from kvfleet.runtime.config import EngineConfig
    from kvfleet.runtime.engine.async_llm import AsyncLLMEngine
    from kvfleet.runtime.entrypoints.openai.api_server import create_app
    from kvfleet.runtime.entrypoints.openai.serve_args import ServerSettings

    engines = []

    def factory(config, stat_loggers):
        engines.append(AsyncLLMEngine(config, stat_loggers, loaded=smollm2))
        return engines[0]

    app = create_app(EngineConfig(kv_cache_memory=32 * 1024**2), ServerSettings(), engine_factory=factory)
    with TestClient(app) as c:
        deadline = time.monotonic() + 120
        while c.get("/ready").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        ok = c.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2, "temperature": 0})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2

        def broken_step():
            raise RuntimeError("CUDA error: an illegal memory access was encountered (simulated)")

        engines[0].engine.step = broken_step
        r = c.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2})
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "engine_dead"
        assert c.get("/health").status_code == 503
        assert c.get("/ready").status_code == 503
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "stream": True})
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
        assert list(text_string_to_metric_families(c.get("/metrics").text))
