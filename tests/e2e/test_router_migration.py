"""End to end (issue 27): streams that survive their replica. Two real `kvfleet serve` replicas
(the default model, ``--drain-handoff-grace 0.5``) behind `kvfleet router`; streams share a long
system prompt so the router sends them to one replica, which is then SIGKILLed (or SIGTERMed)
mid-stream. Every client stream must end with ``[DONE]``, the full token count, ``finish_reason:
length`` and the text of an uninterrupted run: greedy chat, seeded sampled chat, a ``json_schema``
chat (valid JSON) and an ``n = 2`` completion; then a greedy completion across a drain hand-off;
then the router's own SIGTERM drain (a second router over one of the replicas): its stream
completes, a new request is refused, the process exits 0. Short streams (64 tokens) keep the
module within the CI budget.
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
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.serve import free_port, start_serve, stop_serve

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
SERVE_ARGS = ["--max-model-len", "512", "--kv-cache-memory", "64MiB", "--drain-handoff-grace", "0.5"]
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
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env={"PYTHONSAFEPATH": "1", "PATH": ""})
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
    router, base = start_router(["--endpoints", ",".join(urls), "--probe-interval", "0.2", "--min-capacity", "8"], tmp / "router.log")
    state = {"procs": procs, "urls": urls, "ports": ports, "base": base, "tmp": tmp}
    yield state
    router.terminate()
    router.wait(20)
    for proc in state["procs"]:
        stop_serve(proc)


def disrupt_mid_stream(fleet, requests: dict, sig: signal.Signals) -> dict:
    """Run ``requests`` at once; after 20 chunks of the first, send ``sig`` to its replica; restart it."""
    started = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
        futures = {name: pool.submit(read_stream, fleet["base"], *req, started if i == 0 else None)
                   for i, (name, req) in enumerate(requests.items())}
        assert started.wait(60)
        victim = 0 if _serving(fleet) == fleet["urls"][0] else 1
        fleet["procs"][victim].send_signal(sig)
        results = {name: f.result() for name, f in futures.items()}
    for name, result in results.items():  # the shared prefix sent them all to the victim: all migrated
        assert result["replica"] == fleet["urls"][victim], name
    fleet["procs"][victim].wait(30)
    fleet["procs"][victim] = start_serve(SERVE_ARGS, fleet["tmp"] / f"r{victim}b.log", port=fleet["ports"][victim])[0]
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


def test_sigterm_drain_hands_streams_off(fleet):
    req = {"greedy": ("/v1/completions", {"model": MODEL, "stream": True, "max_tokens": 3 * MAX, "ignore_eos": True,
                                          "temperature": 0, "stream_options": {"include_usage": True},
                                          "prompt": f"system\n{SYSTEM}\nuser\nThe dragon said"})}
    reference = read_stream(fleet["base"], *req["greedy"])
    t0 = time.monotonic()
    result = disrupt_mid_stream(fleet, req, signal.SIGTERM)["greedy"]
    check(result, reference)
    assert result["usage"]["completion_tokens"] == 3 * MAX and result["finish"] == {0: "length"}
    assert time.monotonic() - t0 < 90
    drained = scrape(fleet["base"]).get(("kvfleet:router_migrations_total", (("reason", "drain"),)), 0)
    assert drained >= 1


def test_router_sigterm_lets_its_stream_finish_refuses_new_requests_and_exits_0(fleet):
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
