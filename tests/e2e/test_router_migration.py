"""End to end (issue 27): streams that survive their replica. Two real `kvfleet serve` replicas
(the default model, ``--drain-handoff-grace 2``) behind `kvfleet router`; streams share a long
system prompt so the router sends them to one replica, which is then SIGKILLed (or SIGTERMed)
mid-stream and restarted in the background. Every client stream must end with the full token
count, ``finish_reason: length`` and the text of an uninterrupted run of the same requests.

- Short (64 tokens, raw SSE: ``[DONE]``, no ``kvfleet_*`` field leaks): greedy chat, seeded sampled
  chat, a ``json_schema`` chat and an ``n = 2`` completion, one SIGKILL.
- The issue's sizes, through the official ``openai`` SDK: 6 greedy 300-token chat streams plus a
  seeded sampled one, a ``json_schema`` one (valid JSON, greedy: identical) and an ``n = 2`` one
  (both choices complete), SIGKILL after ~50 tokens; the 6 greedy ones again with SIGTERM, handed
  off after the 2 s drain grace (``migrations_total{reason="drain"}`` counts all 6).
- The router's own SIGTERM drain (a second router over one replica): its stream completes, a new
  request is refused, the process exits 0.
"""

from __future__ import annotations

import concurrent.futures
import json
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.serve import bare_env, free_port, start_serve, stop_serve

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
SERVE_ARGS = ["--max-model-len", "512", "--kv-cache-memory", "192MiB", "--drain-handoff-grace", "2"]
MAX = 64
SYSTEM = ("You are a patient storyteller for a library's reading hour. " * 6).strip()
SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string"},
    "chapters": {"type": "array", "items": {"type": "string"}, "minItems": 5, "maxItems": 5}},
    "required": ["title", "chapters"]}


def start_router(args: list[str], log, available: int = 2) -> tuple[subprocess.Popen, str]:
    """`kvfleet router --port <free> *args`, waiting until ``available`` endpoints are."""
    port = free_port()
    cmd = [sys.executable, "-m", "kvfleet.runtime.cli", "router", "--host", "127.0.0.1", "--port", str(port), *args]
    with open(log, "wb") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=bare_env())
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()
        try:
            r = httpx.get(base + "/ready", timeout=2)
            if r.status_code == 200 and r.json()["available"] >= available:
                return proc, base
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    proc.kill()
    pytest.fail(f"router not ready:\n{log.read_text()}")


def scrape(base: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for fam in text_string_to_metric_families(httpx.get(base + "/metrics", timeout=10).text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def chat(question: str, **extra) -> tuple[str, dict]:
    return "/v1/chat/completions", {
        "model": MODEL, "stream": True, "max_tokens": MAX, "ignore_eos": True,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}], **extra}


REQUESTS = {
    "greedy": chat("Tell me a story about a dragon.", temperature=0),
    "seeded": chat("Tell me a story about a fox.", temperature=0.9, top_p=0.95, seed=11),
    "json": chat("Describe a book as JSON.", temperature=0,
                 response_format={"type": "json_schema", "json_schema": {"name": "book", "schema": SCHEMA}}),
    "n2": ("/v1/completions", {"model": MODEL, "stream": True, "max_tokens": MAX, "ignore_eos": True, "n": 2,
                               "temperature": 0.8, "seed": 5, "stream_options": {"include_usage": True},
                               "prompt": f"system\n{SYSTEM}\nuser\nTell me a story.\nassistant\n"}),
}


def read_stream(base: str, path: str, body: dict, started: threading.Event | None = None) -> dict:
    """One streamed request: text and finish reason per choice, the ids/created seen, usage, errors."""
    out = {"text": {}, "finish": {}, "ids": set(), "usage": None, "errors": [], "done": False, "replica": None}
    with httpx.stream("POST", base + path, json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        out["replica"] = r.headers.get("x-kvfleet-replica")
        chunks = 0
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                out["done"] = True
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                out["errors"].append(chunk["error"])
                continue
            assert not any(k.startswith("kvfleet") for c in chunk["choices"] for k in c), chunk
            out["ids"].add((chunk["id"], chunk["created"]))
            out["usage"] = chunk.get("usage") or out["usage"]
            for c in chunk["choices"]:
                piece = c["delta"].get("content") if "delta" in c else c.get("text")
                out["text"][c["index"]] = out["text"].get(c["index"], "") + (piece or "")
                if c.get("finish_reason"):
                    out["finish"][c["index"]] = c["finish_reason"]
            chunks += 1
            if started is not None and chunks >= 20:
                started.set()
    return out


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("migration")
    ports = [free_port(), free_port()]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        procs = list(pool.map(lambda i: start_serve(SERVE_ARGS, tmp / f"r{i}.log", port=ports[i])[0], range(2)))
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    # prefix-hash: every stream of a disruption on one replica needs the char-prefix ring's affinity
    # (the default precise routing spreads them over both once both cache the shared prompt: ties)
    router, base = start_router(["--endpoints", ",".join(urls), "--probe-interval", "0.2", "--min-capacity", "16",
                                 "--routing-algorithm", "prefix-hash"], tmp / "router.log")
    restarter = concurrent.futures.ThreadPoolExecutor(1)
    state = {"procs": procs, "urls": urls, "ports": ports, "base": base, "tmp": tmp, "restarter": restarter,
             "restarting": None}
    yield state
    router.terminate()
    if state["restarting"] is not None:
        victim, future = state["restarting"]
        state["procs"][victim] = future.result()
    restarter.shutdown()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # each drains ~2 s: stop them (and the router) at once
        list(pool.map(stop_serve, state["procs"]))
    router.wait(20)


def _restart_when_gone(fleet, victim: int) -> None:
    """In the background: wait for the signalled replica to exit, start it again at its address
    (its model load overlaps the migrated streams); :func:`ready_fleet` joins it."""
    def restart() -> subprocess.Popen:
        fleet["procs"][victim].wait(30)
        log = fleet["tmp"] / f"r{victim}-{time.monotonic_ns()}.log"
        return start_serve(SERVE_ARGS, log, port=fleet["ports"][victim])[0]
    fleet["restarting"] = (victim, fleet["restarter"].submit(restart))


def ready_fleet(fleet) -> None:
    """Both replicas up (a restart under way joined) and available at the router, so that the
    shared prefix sends every stream of a disruption to one of them."""
    if fleet["restarting"] is not None:
        victim, future = fleet["restarting"]
        fleet["restarting"] = None
        fleet["procs"][victim] = future.result()
    deadline = time.monotonic() + 60
    while httpx.get(fleet["base"] + "/ready", timeout=5).json()["available"] < 2:
        assert time.monotonic() < deadline, "the router does not see both replicas"
        time.sleep(0.1)


def disrupt_mid_stream(fleet, requests: dict, sig: signal.Signals, read=read_stream) -> dict:
    """Run ``requests`` at once (each with ``read``); once the first has streamed a while (20
    chunks; ``read_sdk_stream``: ``AT`` tokens), send ``sig`` to its replica; restart it."""
    ready_fleet(fleet)
    started = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
        futures = {name: pool.submit(read, fleet["base"], *req, started if i == 0 else None)
                   for i, (name, req) in enumerate(requests.items())}
        assert started.wait(60)
        victim = 0 if _serving(fleet) == fleet["urls"][0] else 1
        fleet["procs"][victim].send_signal(sig)
        _restart_when_gone(fleet, victim)
        results = {name: f.result() for name, f in futures.items()}
    for name, result in results.items():  # the shared prefix sent them all to the victim: all migrated
        assert result["replica"] == fleet["urls"][victim], name
    return results


def _serving(fleet) -> str:
    """The replica with a request running (its /metrics)."""
    for url in fleet["urls"]:
        text = httpx.get(url + "/metrics", timeout=5).text
        for line in text.splitlines():
            if line.startswith("kvfleet:num_requests_running") and float(line.split()[-1]) > 0:
                return url
    pytest.fail("no replica is running a request")


def check(result: dict, reference: dict) -> None:
    assert result["done"] and not result["errors"], result
    assert len(result["ids"]) == 1, result["ids"]
    assert result["finish"] == reference["finish"]
    assert result["usage"] == reference["usage"]
    assert result["text"] == reference["text"]


def test_sigkill_mid_stream_every_stream_completes_identically(fleet):
    with concurrent.futures.ThreadPoolExecutor(len(REQUESTS)) as pool:
        reference = dict(zip(REQUESTS, pool.map(lambda r: read_stream(fleet["base"], *r), REQUESTS.values())))
    before = scrape(fleet["base"])
    results = disrupt_mid_stream(fleet, REQUESTS, signal.SIGKILL)
    for name, result in results.items():
        check(result, reference[name])
        if name != "json":
            n = 2 if name == "n2" else 1
            assert result["finish"] == {i: "length" for i in range(n)} and result["usage"]["completion_tokens"] == MAX * n
    json.loads(results["json"]["text"][0])  # valid JSON (it may end before MAX: the grammar's end)
    after = scrape(fleet["base"])
    moved = sum(v for (k, labels), v in after.items() if k == "kvfleet:router_migrations_total")
    moved -= sum(v for (k, labels), v in before.items() if k == "kvfleet:router_migrations_total")
    assert moved >= 1


def test_router_sigterm_lets_its_stream_finish_refuses_new_requests_and_exits_0(fleet):
    ready_fleet(fleet)
    log = fleet["tmp"] / "router-drain.log"
    proc, base = start_router(["--endpoints", fleet["urls"][0], "--shutdown-timeout", "60",
                               "--probe-interval", "0.2"], log, available=1)
    body = {"model": MODEL, "stream": True, "max_tokens": 3 * MAX, "ignore_eos": True, "temperature": 0,
            "stream_options": {"include_usage": True}, "prompt": "Once upon a time"}
    started = threading.Event()
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            stream = pool.submit(read_stream, base, "/v1/completions", body, started)
            assert started.wait(60), log.read_text()
            proc.send_signal(signal.SIGTERM)
            # the listener stays open while the stream runs (and >= 2 s): a new request gets a retryable 503
            refused = httpx.post(base + "/v1/completions", json={**body, "stream": False, "stream_options": None},
                                 timeout=10)
            assert refused.status_code == 503 and refused.headers["retry-after"] == "1", refused.text
            assert refused.json()["error"]["code"] == "shutting_down"
            assert httpx.get(base + "/ready", timeout=5).status_code == 503
            result = stream.result(timeout=120)
        assert result["done"] and not result["errors"], result
        assert result["finish"] == {0: "length"} and result["usage"]["completion_tokens"] == 3 * MAX
        assert proc.wait(30) == 0, log.read_text()
        assert "drained in" in log.read_text()
        with pytest.raises(httpx.TransportError):  # gone: nothing listens any more
            httpx.get(base + "/ready", timeout=5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


# --- the full sizes: 300-token streams through the official OpenAI SDK, disrupted after ~50 tokens ---

FULL = 300
AT = 50  # tokens the first stream has received when its replica is signalled
TOPICS = ["a dragon", "a lighthouse keeper", "a lost key", "a clockmaker", "a river otter", "a snowstorm"]
LONG_SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 40},
    "chapters": {"type": "array", "minItems": 5, "maxItems": 5,
                 "items": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                                            "summary": {"type": "string", "maxLength": 80}},
                           "required": ["name", "summary"]}}},
    "required": ["title", "chapters"]}


def sdk_chat(question: str, **extra) -> tuple[str, dict]:
    """A streamed chat request as ``openai`` SDK arguments (300 tokens, EOS ignored, usage at the end)."""
    return "chat", {"model": MODEL, "stream": True, "max_tokens": FULL, "stream_options": {"include_usage": True},
                    "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
                    "extra_body": {"ignore_eos": True}, **extra}


GREEDY6 = {f"greedy{i}": sdk_chat(f"Tell me a story about {topic}.", temperature=0) for i, topic in enumerate(TOPICS)}
MIXED = {
    "seeded": sdk_chat("Tell me a story about a fox.", temperature=0.9, top_p=0.95, seed=11),
    "json": sdk_chat("Describe a long book as JSON.", temperature=0, response_format={
        "type": "json_schema", "json_schema": {"name": "book", "schema": LONG_SCHEMA}}),
    "n2": sdk_chat("Tell me a story about a garden.", temperature=0.8, seed=5, n=2),
}


def read_sdk_stream(base: str, kind: str, kwargs: dict, started: threading.Event | None = None) -> dict:
    """One streamed chat request through the official ``openai`` SDK (no retries: a resent request
    would hide a cut). Same result shape as :func:`read_stream`; an error event raises ``APIError``."""
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=180)
    out = {"text": {}, "finish": {}, "ids": set(), "usage": None, "errors": [], "done": False, "replica": None}
    assert kind == "chat"
    tokens = 0
    with client.chat.completions.with_streaming_response.create(**kwargs) as response:
        out["replica"] = response.headers.get("x-kvfleet-replica")
        for chunk in response.parse():
            out["ids"].add((chunk.id, chunk.created))
            if chunk.usage is not None:
                out["usage"] = chunk.usage.model_dump(exclude_none=True)
            for c in chunk.choices:
                assert not any(k.startswith("kvfleet") for k in (c.model_extra or {})), c
                out["text"][c.index] = out["text"].get(c.index, "") + (c.delta.content or "")
                tokens += bool(c.delta.content) and c.index == 0
                if c.finish_reason:
                    out["finish"][c.index] = c.finish_reason
            if started is not None and tokens >= AT:
                started.set()
    # the SDK consumes ``[DONE]`` itself; the usage chunk is the last one the server sends before it
    out["done"] = out["usage"] is not None
    return out


def _migrations(base: str) -> dict[str, float]:
    return {dict(labels)["reason"]: v for (k, labels), v in scrape(base).items()
            if k == "kvfleet:router_migrations_total"}


@pytest.fixture(scope="module")
def full_reference(fleet) -> dict:
    """Every full-size request at once, uninterrupted (one replica: the shared prefix sends them together)."""
    requests = {**GREEDY6, **MIXED}
    with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
        return dict(zip(requests, pool.map(lambda r: read_sdk_stream(fleet["base"], *r), requests.values())))


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["sigkill", "sigterm-drain-2s"])
def test_full_size_streams_survive_their_replica(fleet, full_reference, sig):
    """Issue 27 at its sizes: 6 greedy 300-token streams, and with the SIGKILL a seeded sampled one, a
    ``json_schema`` one and an ``n = 2`` one; after ~50 tokens their replica gets SIGKILL (or SIGTERM,
    hand-off after a 2 s drain grace): every stream completes with 300 tokens (the JSON: where its
    grammar ends), ``length``, the uninterrupted text (greedy, seeded, the JSON), valid JSON."""
    requests = {**GREEDY6, **MIXED} if sig == signal.SIGKILL else GREEDY6
    before = _migrations(fleet["base"])
    results = disrupt_mid_stream(fleet, requests, sig, read=read_sdk_stream)
    for name, result in results.items():
        check(result, full_reference[name])
        n = 2 if name == "n2" else 1
        if name != "json":
            assert result["finish"] == {i: "length" for i in range(n)}, name
            assert result["usage"]["completion_tokens"] == FULL * n, name
            assert all(result["text"][i] for i in range(n)), name
    after = _migrations(fleet["base"])
    moved = {r: after[r] - before.get(r, 0) for r in after if after[r] - before.get(r, 0)}
    if sig == signal.SIGTERM:  # every stream was handed off by the draining replica, none cut
        assert moved == {"drain": len(requests)}, moved
        return
    assert sum(moved.values()) == len(requests) and "drain" not in moved, moved  # each moved once
    book = json.loads(results["json"]["text"][0])
    assert len(book["chapters"]) == 5 and results["json"]["finish"] == {0: "stop"}
    assert results["json"]["usage"]["completion_tokens"] > 2 * AT  # it was still streaming at the kill
