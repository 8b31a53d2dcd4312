"""Production hardening of the server (issue 18): bursts below capacity, drain on SIGTERM, a hung
engine, the termination log on out-of-memory.

Bursts, drains and the load-time OOM run against `kvfleet serve` as a subprocess with the default
model (tests/support/serve.py); the hung engine and the mid-run OOM against the real AsyncLLMEngine in
process, whose forward pass a test holds or breaks.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from fastapi.testclient import TestClient
from support.serve import start_serve, stop_serve

from kvfleet.runtime.config import EngineConfig
from kvfleet.runtime.engine.async_llm import AsyncLLMEngine
from kvfleet.runtime.entrypoints.openai.api_server import create_app
from kvfleet.runtime.entrypoints.openai.serve_args import ServerSettings

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

SMALL = ["--max-model-len", "1024", "--kv-cache-memory", "256MiB", "--log-level", "warning"]


def _stream(base: str, max_tokens: int, started: threading.Event | None = None) -> list:
    """One streamed completion; its events (``[DONE]`` included), or the exception that ended it."""
    events: list = []
    body = {"prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
            "stream": True}  # fmt: skip
    try:
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=120) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if line.startswith("data: "):
                    payload = line[len("data: "):]
                    events.append(payload if payload == "[DONE]" else json.loads(payload))
                    if started is not None:
                        started.set()
    except Exception as exc:  # reported by the test
        events.append(exc)
    return events


# ----------------------------------------------------------------------------- bursts


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One ``kvfleet serve`` for the burst test and then the drain test, which ends it with SIGTERM
    (they ran on a server each before; the drain test starts one when run alone)."""
    proc, base = start_serve(["--max-queue-len", "4", "--shutdown-timeout", "60", *SMALL],
                             tmp_path_factory.mktemp("serve") / "serve.log")
    yield proc, base
    stop_serve(proc)


def test_burst_below_capacity_is_never_refused(server):
    """128 sequence slots, --max-queue-len 4: 12 requests at once on an idle server all run (none
    waits for a slot), twice in a row. Before, requests submitted but not yet scheduled counted as
    waiting and 4-7 of them got 429."""
    proc, base = server
    assert proc.poll() is None
    body = {"prompt": "Count to ten:", "max_tokens": 16, "temperature": 0}
    for _ in range(2):
        with ThreadPoolExecutor(12) as pool:
            responses = list(pool.map(lambda _: httpx.post(base + "/v1/completions", json=body, timeout=120),
                                      range(12)))  # fmt: skip
        assert [r.status_code for r in responses] == [200] * 12, [r.text for r in responses if r.status_code != 200]
        assert len({r.json()["choices"][0]["text"] for r in responses}) == 1


# ----------------------------------------------------------------------------- drain


def test_sigterm_drains_in_flight_streams_then_exits(server):
    """8 streams in flight + SIGTERM: /ready is 503 at once, a new request gets a retryable 503 in
    OpenAI's shape (the listener is still open), all 8 streams finish, the process exits by itself."""
    proc, base = server
    assert proc.poll() is None
    try:
        started = [threading.Event() for _ in range(8)]
        with ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(_stream, base, 48, s) for s in started]
            assert all(s.wait(120) for s in started), "streams did not start"
            proc.send_signal(signal.SIGTERM)
            t0 = time.monotonic()
            ready = httpx.get(base + "/ready", timeout=5)
            assert ready.status_code == 503 and time.monotonic() - t0 < 2, ready.text
            r = httpx.post(base + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=10)
            assert r.status_code == 503, r.text
            err = r.json()["error"]
            assert err["code"] == "shutting_down" and err["type"] == "service_unavailable"
            assert r.headers["retry-after"].isdigit()
            assert httpx.get(base + "/health", timeout=5).status_code == 200  # alive: no restart mid-drain
            results = [f.result(timeout=180) for f in futures]
        for events in results:
            assert events[-1] == "[DONE]", events[-3:]
            chunks = [e for e in events[:-1] if isinstance(e, dict)]
            assert "error" not in chunks[-1], chunks[-1]
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert proc.wait(30) in (0, -signal.SIGTERM)
    finally:
        stop_serve(proc)


def test_shutdown_timeout_bounds_the_drain(tmp_path):
    """A stream that would outlast --shutdown-timeout is ended (error event, [DONE]) when it runs out,
    and the process exits soon after: not before the timeout, not much after it."""
    proc, base = start_serve(["--shutdown-timeout", "3", *SMALL], tmp_path / "serve.log")
    try:
        started = threading.Event()
        with ThreadPoolExecutor(1) as pool:
            future = pool.submit(_stream, base, 1000, started)
            assert started.wait(120)
            proc.send_signal(signal.SIGTERM)
            t0 = time.monotonic()
            proc.wait(60)
            took = time.monotonic() - t0
            events = future.result(timeout=60)
        assert 2.5 < took < 20, took
        assert events[-1] == "[DONE]" and "error" in events[-2], events[-3:]
        assert events[-2]["error"]["type"] == "service_unavailable"
    finally:
        stop_serve(proc)


# ----------------------------------------------------------------------------- hung engine


def _app(smollm2, engines: list, **settings):
    def factory(config, stat_loggers):
        engines.append(AsyncLLMEngine(config, stat_loggers, loaded=smollm2))
        return engines[-1]

    config = EngineConfig(kv_cache_memory=128 * 1024**2, max_model_len=2048, max_num_batched_tokens=64)
    return create_app(config, ServerSettings(**settings), engine_factory=factory)


def _wait(predicate, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_health_fails_while_the_engine_loop_is_stuck_in_a_step(smollm2):
    """The engine thread is alive but one step hangs: /health (and /ready) turn 503 once the step
    heartbeat is older than --engine-iteration-timeout, and 200 again when the step returns. A long
    prompt, prefilled in chunks of max_num_batched_tokens, never trips the bound."""
    engines: list = []
    with TestClient(_app(smollm2, engines, engine_iteration_timeout=5.0)) as c:
        _wait(lambda: c.get("/ready").status_code == 200, "the model")
        engine = engines[0]
        long_prompt = list(range(1000, 2000))  # 1000 tokens: 16 prefill chunks of 64 (~2 s each on a loaded CPU)
        done: list = []
        t = threading.Thread(target=lambda: done.append(c.post("/v1/completions", json={
            "prompt": long_prompt, "max_tokens": 2})), daemon=True)  # fmt: skip
        t.start()
        while t.is_alive():
            assert c.get("/health").status_code == 200
            time.sleep(0.05)
        assert done[0].status_code == 200, done[0].text

        gate = threading.Event()
        runner = engine.engine.runner
        real = runner.execute_model

        def stuck(*args, **kwargs):
            gate.wait(120)
            return real(*args, **kwargs)

        runner.execute_model = stuck
        try:
            t = threading.Thread(target=lambda: done.append(c.post("/v1/completions", json={
                "prompt": "hi", "max_tokens": 2})), daemon=True)  # fmt: skip
            t.start()
            t0 = time.monotonic()
            _wait(lambda: c.get("/health").status_code == 503, "/health to fail", timeout=60)
            assert time.monotonic() - t0 >= 4.5
            health = c.get("/health").json()
            assert health["status"] == "stalled" and "engine_iteration_timeout" in health["error"]
            assert c.get("/ready").status_code == 503
            assert engine.is_running and not engine.errored  # the loop is alive: only stuck
        finally:
            gate.set()
            del runner.execute_model
        t.join(60)
        assert done[1].status_code == 200, done[1].text
        _wait(lambda: c.get("/health").status_code == 200, "/health to recover")


# ----------------------------------------------------------------------------- out of memory


def test_out_of_memory_in_a_step_writes_the_termination_log(smollm2, tmp_path):
    """The engine loop dies of torch.OutOfMemoryError: the reason goes to the termination log (the
    operator's tuner reads "out of memory" there) and the server exits (on_fatal)."""
    import torch

    log = tmp_path / "termination-log"
    engines: list = []
    app = _app(smollm2, engines, termination_log=str(log))
    fatal: list = []
    app.state.kvfleet.on_fatal = lambda: fatal.append(1)
    with TestClient(app) as c:
        _wait(lambda: c.get("/ready").status_code == 200, "the model")

        def oom(*args, **kwargs):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")

        engines[0].engine.runner.execute_model = oom
        assert c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 503
        _wait(lambda: log.exists() and fatal, "the termination log")
        text = log.read_text()
        assert "out of memory" in text and "OutOfMemoryError" in text and "Tried to allocate" in text, text
        assert len(text) <= 4096


def test_out_of_memory_at_load_writes_the_termination_log(tmp_path):
    """A KV cache larger than the machine: `kvfleet serve` exits 1 and says why in the file
    KVFLEET_TERMINATION_LOG names (default /dev/termination-log, which the kubelet mounts)."""
    log = tmp_path / "termination-log"
    env = {"HF_HUB_OFFLINE": "1", "PYTHONSAFEPATH": "1", "KVFLEET_TERMINATION_LOG": str(log),
           "KVFLEET_KV_CACHE_MEMORY": "64TiB", "KVFLEET_PORT": "0", "KVFLEET_HOST": "127.0.0.1"}  # fmt: skip

    done = subprocess.run([sys.executable, "-m", "kvfleet.runtime.cli", "serve", "--log-level", "warning"],
                          env={**os.environ, **env}, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 1, done.stderr[-3000:]
    text = log.read_text()
    assert text.startswith("out of memory") and "can't allocate memory" in text, text


# ----------------------------------------------------------------------------- metrics parity


def test_vllm_metric_names_the_ecosystem_reads(smollm2):
    """The real engine behind /metrics with --metrics-compat vllm: per-request phase times,
    iteration_tokens_total, request_params_n / max_tokens and GIE's gpu_cache_usage_perc."""
    from prometheus_client.parser import text_string_to_metric_families

    engines: list = []
    with TestClient(_app(smollm2, engines, metrics_compat="vllm")) as c:
        _wait(lambda: c.get("/ready").status_code == 200, "the model")
        r = c.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 5, "n": 2, "ignore_eos": True})
        assert r.status_code == 200, r.text
        fams = {f.name: f for f in text_string_to_metric_families(c.get("/metrics").text)}

    def sample(name: str, suffix: str = "") -> float:
        return next(s.value for s in fams[name].samples if s.name == name + suffix)

    for phase in ("queue", "prefill", "decode", "inference"):
        assert sample(f"vllm:request_{phase}_time_seconds", "_count") == 2, phase
    assert sample("vllm:request_decode_time_seconds", "_sum") > 0
    assert sample("vllm:request_inference_time_seconds", "_sum") >= sample("vllm:request_decode_time_seconds", "_sum")
    assert sample("vllm:request_params_n", "_count") == 1 and sample("vllm:request_params_n", "_sum") == 2
    assert sample("vllm:request_params_max_tokens", "_sum") == 10
    generated = sample("vllm:generation_tokens", "_total")
    computed = sample("vllm:prompt_tokens", "_total")
    assert generated == 10 and sample("vllm:iteration_tokens_total", "_sum") == computed + generated
    assert sample("vllm:iteration_tokens_total", "_count") >= 5
    assert sample("vllm:gpu_cache_usage_perc") == sample("vllm:kv_cache_usage_perc")
