"""End to end (issue 42): the defaults are the product. Three real `kvfleet serve` replicas started
with no fleet flag (only the test's sizes and a short `--shutdown-timeout`) behind `kvfleet router
--endpoints ...` with no other flag.

- **One copy of a shared prefix.** Ten requests share a ~1,500-token system prompt: one first,
  then nine at once, more than one replica's bound (`--min-capacity` 4), so the router spreads
  them. The fleet computes the prefix once: the replicas' `prompt_tokens_total` is one prefix plus
  the suffixes; the replicas the burst spilled to pulled it (`kv_pull_tokens_total`, the router's
  signed hints) instead of recomputing, with the same greedy text.
- **SIGTERM hands off every router stream at the shutdown timeout.** Six greedy 200-token chat
  streams through the router; the replica serving most of them gets SIGTERM. With
  `--shutdown-timeout 1` (shorter than the default hand-off grace, so the deadline itself stops the
  engine) no stream is cut: each ends with 200 tokens, `finish_reason: length` and the text of an
  uninterrupted run, and the router counts a `reason="drain"` migration per stream of the victim.
  The pause the client saw at the hand-off is printed (the measurement behind the default grace).
"""

from __future__ import annotations

import concurrent.futures
import json
import signal
import threading
import time

import httpx
import pytest
from support.serve import start_serve, stop_serve

from e2e.test_router import MODEL, WORDS, scrape, start_router, value, wait_for_router_index

pytestmark = pytest.mark.slow

SERVE_ARGS = ["--max-model-len", "2048", "--kv-cache-memory", "160MiB", "--max-num-batched-tokens", "2048",
              "--shutdown-timeout", "1"]
PREFIX = "You answer for the support desk. " + " ".join(WORDS[i % len(WORDS)] for i in range(1480)) + "\n"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("defaults")
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        replicas = list(pool.map(lambda i: start_serve(SERVE_ARGS, tmp / f"replica{i}.log"), range(3)))
    urls = [base for _, base in replicas]
    router, base = start_router(["--endpoints", ",".join(urls)], tmp / "router.log", 3)
    yield {"urls": urls, "procs": [p for p, _ in replicas], "router": base, "tmp": tmp}
    router.terminate()
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        list(pool.map(stop_serve, [p for p, _ in replicas]))
    router.wait(20)


def totals(urls, name: str) -> float:
    return sum(value(scrape(u), name) for u in urls)


def complete(base: str, question: str) -> tuple[str, str, int]:
    r = httpx.post(base + "/v1/completions", timeout=300, json={
        "model": MODEL, "prompt": PREFIX + question, "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    return body["choices"][0]["text"], r.headers.get("x-kvfleet-replica", base), body["usage"]["prompt_tokens"]


def test_three_replicas_and_a_router_with_no_flags_compute_one_copy_of_a_shared_prefix(fleet):
    urls, router = fleet["urls"], fleet["router"]
    first = complete(router, "Question 0: which river do you mean?")
    wait_for_router_index(router, first[1])  # the first replica's KV events reach the router (ZMQ, then the index)
    questions = [f"Question {i}: which {WORDS[i]} do you mean?" for i in range(1, 10)]
    with concurrent.futures.ThreadPoolExecutor(9) as pool:
        answers = list(pool.map(lambda q: complete(router, q), questions))
    prompt_len = first[2]
    served = {r for _, r, _ in [first, *answers]}
    computed = totals(urls, "kvfleet:prompt_tokens_total")
    pulled = totals(urls, "kvfleet:kv_pull_tokens_total")
    print(f"prompt {prompt_len} tokens, 10 requests on {len(served)} replicas: computed {computed:.0f} prefill "
          f"tokens, pulled {pulled:.0f}")
    assert prompt_len >= 1480
    # one prefix, then per request at most its suffix and the partial blocks either side of it
    assert computed <= prompt_len + 10 * (2 * 16 + 24), (computed, pulled, served)
    assert len(served) > 1, served  # the burst spilled past one replica's bound ...
    assert pulled >= (len(served) - 1) * (prompt_len - 3 * 16)  # ... and each other replica pulled the prefix
    assert value(scrape(router), "kvfleet:router_kv_peer_hints_total") >= len(served) - 1
    assert totals(urls, "kvfleet:kv_pull_failures_total") == 0
    assert totals(urls, "kvfleet:kv_peer_hints_refused_total") == 0  # every hint was the router's
    # the pulled prefix answers as the computed one did (asked directly: no hint)
    puller = next(u for u in served if u != first[1])
    assert complete(puller, "Question 0: which river do you mean?")[0] == first[0]


FULL = 200
TOPICS = ["a dragon", "a lighthouse keeper", "a lost key", "a clockmaker", "a river otter", "a snowstorm"]


def stream(base: str, topic: str, started: threading.Event | None = None) -> dict:
    """One greedy chat stream: its text, finish reason, usage, errors, the replica, and the
    longest pause between two chunks (with when it happened)."""
    body = {"model": MODEL, "stream": True, "max_tokens": FULL, "ignore_eos": True, "temperature": 0,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "system", "content": PREFIX[:600]},
                         {"role": "user", "content": f"Tell me a story about {topic}."}]}
    out = {"text": "", "finish": None, "usage": None, "errors": [], "done": False, "gap": 0.0, "gap_at": 0.0}
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=300) as r:
        assert r.status_code == 200, r.read()
        out["replica"] = r.headers.get("x-kvfleet-replica")
        last, chunks = time.monotonic(), 0
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            now = time.monotonic()
            if chunks > 1 and now - last > out["gap"]:
                out["gap"], out["gap_at"] = now - last, now
            last = now
            if line == "data: [DONE]":
                out["done"] = True
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                out["errors"].append(chunk["error"])
                continue
            out["usage"] = chunk.get("usage") or out["usage"]
            for c in chunk["choices"]:
                out["text"] += c["delta"].get("content") or ""
                out["finish"] = c.get("finish_reason") or out["finish"]
            chunks += 1
            if started is not None and chunks >= 30:
                started.set()
    return out


def test_a_sigtermed_replica_with_default_flags_hands_off_every_router_stream(fleet):
    router = fleet["router"]
    with concurrent.futures.ThreadPoolExecutor(len(TOPICS)) as pool:
        reference = list(pool.map(lambda t: stream(router, t), TOPICS))
    for ref in reference:
        assert ref["done"] and not ref["errors"] and ref["usage"]["completion_tokens"] == FULL, ref
    before = value(scrape(router), "kvfleet:router_migrations_total", reason="drain")
    started = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(len(TOPICS)) as pool:
        futures = [pool.submit(stream, router, t, started if i == 0 else None) for i, t in enumerate(TOPICS)]
        assert started.wait(120)
        running = {u: value(scrape(u), "kvfleet:num_requests_running") for u in fleet["urls"]}
        victim = max(running, key=running.get)
        signalled = time.monotonic()
        fleet["procs"][fleet["urls"].index(victim)].send_signal(signal.SIGTERM)
        results = [f.result() for f in futures]
    exited = fleet["procs"][fleet["urls"].index(victim)].wait(30)
    moved = value(scrape(router), "kvfleet:router_migrations_total", reason="drain") - before
    on_victim = sum(r["replica"] == victim for r in results)
    pauses = [r["gap"] for r in results if r["replica"] == victim]
    print(f"SIGTERM to {victim} ({on_victim} of {len(TOPICS)} streams there; exit status {exited}, "
          f"{time.monotonic() - signalled:.1f} s after the signal): {moved:.0f} drain migrations; the client's "
          f"longest pause per handed-off stream {', '.join(f'{p:.2f}' for p in sorted(pauses))} s")
    for result, ref in zip(results, reference):
        assert result["done"] and not result["errors"], result  # never cut
        assert result["finish"] == "length" and result["usage"]["completion_tokens"] == FULL
        assert result["text"] == ref["text"]
    assert on_victim >= 1 and moved >= on_victim
