"""Soak: a real ``kvfleet serve`` (the default model, loopback) under a bounded, mixed load
for a bounded time, then the checks that it came back to rest (issue 18's soak).

The load, ``--concurrency`` workers for ``--duration`` seconds, each picking at random:

* chat, streamed or not, ``n`` 1-3, with stop strings (checked: no choice's text contains one);
* completions, streamed or not, ``n`` 1-4, stop strings, a list of two prompts now and then;
* a hang-up: a stream read for a few chunks, then the connection closed mid-stream;
* a bad request (wrong types, out-of-range values, unsupported fields, invalid JSON):
  a 400 is expected, anything else is counted as a failure.

Every streamed answer must end with ``data: [DONE]`` and carry every choice index; every
non-streamed one must have ``n`` choices. At the end (after waiting up to 60 s for the
server to settle) the script asserts and prints: nothing running or waiting and KV cache
usage ~0 (from ``/metrics``), no 5xx and no other failure, and the server's RSS (sampled
every ``--rss-interval`` s; first, after the warm-up, last, max), plus request counts by
outcome. Exit status 1 when a check fails.

    nice -n 5 .venv/bin/python benchmarks/soak.py                      # 10 minutes, 8 workers
    .venv/bin/python benchmarks/soak.py --duration 60 --concurrency 4  # a quick one
    .venv/bin/python benchmarks/soak.py --url http://127.0.0.1:8000 --pid 1234   # a running server

A benchmark script, not a test: it needs minutes. ``--json PATH`` writes the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import platform
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

MODEL = "SmolLM2-135M-Instruct"
TOPICS = ["rivers", "prime numbers", "volcanoes", "bread", "owls", "chess", "copper", "tides",
          "glaciers", "violins", "bees", "comets", "maple trees", "lighthouses", "salt", "kites"]
STOPS = [["\n\n"], ["."], [", "], ["the", "The"], ["!"]]
BAD_BODIES: list[tuple[str, Any]] = [
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": "5"}),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "n": 0}),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": -1}),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "logit_bias": {"not-a-token": 5}}),  # keys: token ids
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "suffix": "x"}),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "logprobs": 99}),
    ("/v1/completions", {"model": MODEL, "prompt": [[-5, 3]]}),
    ("/v1/chat/completions", {"model": MODEL, "messages": "not a list"}),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": [{}]}),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "top_p": 2}),
    ("/v1/completions", b"{not json"),
    ("/v1/chat/completions", b"\xff\xfe{}"),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Stats:
    def __init__(self) -> None:
        self.outcomes: collections.Counter[str] = collections.Counter()
        self.failures: list[str] = []
        self.status: collections.Counter[int] = collections.Counter()
        self.tokens = 0

    def fail(self, kind: str, what: str) -> None:
        self.outcomes[f"{kind}: FAILED"] += 1
        if len(self.failures) < 50:
            self.failures.append(f"{kind}: {what}")


def _question(rng: random.Random) -> str:
    return f"Tell me {rng.choice(['one', 'two', 'three'])} facts about {rng.choice(TOPICS)}."


def _check_stop(texts: list[str], stop: list[str]) -> str | None:
    for t in texts:
        for s in stop:
            if s in t:
                return f"stop string {s!r} in output {t[:80]!r}"
    return None


async def _stream(client: httpx.AsyncClient, path: str, body: dict, n_choices: int, stop: list[str],
                  kind: str, stats: Stats, hang_up_after: int | None = None) -> None:
    texts: dict[int, str] = collections.defaultdict(str)
    chunks = 0
    done = False
    async with client.stream("POST", path, json=body) as r:
        stats.status[r.status_code] += 1
        if r.status_code != 200:
            await r.aread()
            stats.fail(kind, f"HTTP {r.status_code}: {r.text[:200]}")
            return
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                done = True
                break
            event = json.loads(data)
            if "error" in event:
                stats.fail(kind, f"error event {event['error']}")
                return
            for choice in event.get("choices") or []:
                delta = choice.get("delta", {}).get("content") if "delta" in choice else choice.get("text")
                texts[choice["index"]] += delta or ""
            chunks += 1
            if hang_up_after is not None and chunks >= hang_up_after:
                break  # leaving the block closes the connection mid-stream
    if hang_up_after is not None:
        stats.outcomes["hang-up"] += 1
        return
    if not done:
        stats.fail(kind, "stream ended without [DONE]")
    elif sorted(texts) != list(range(n_choices)):
        stats.fail(kind, f"choices {sorted(texts)} != {n_choices}")
    elif problem := _check_stop(list(texts.values()), stop):
        stats.fail(kind, problem)
    else:
        stats.outcomes[kind] += 1


async def _plain(client: httpx.AsyncClient, path: str, body: dict, n_choices: int, stop: list[str], kind: str,
                 stats: Stats) -> None:
    r = await client.post(path, json=body)
    stats.status[r.status_code] += 1
    if r.status_code != 200:
        stats.fail(kind, f"HTTP {r.status_code}: {r.text[:200]}")
        return
    out = r.json()
    choices = out["choices"]
    texts = [c["message"]["content"] or "" if "message" in c else c["text"] for c in choices]
    stats.tokens += out["usage"]["completion_tokens"]
    if len(choices) != n_choices:
        stats.fail(kind, f"{len(choices)} choices, wanted {n_choices}")
    elif problem := _check_stop(texts, stop):
        stats.fail(kind, problem)
    else:
        stats.outcomes[kind] += 1


async def one_request(client: httpx.AsyncClient, rng: random.Random, stats: Stats, max_tokens: int) -> None:
    roll = rng.random()
    stop = rng.choice(STOPS)
    tokens = rng.randint(4, max_tokens)
    temperature = rng.choice([0.0, 0.7, 1.0])
    if roll < 0.10:  # a bad request: must be a 400
        path, body = rng.choice(BAD_BODIES)
        kw = {"content": body, "headers": {"Content-Type": "application/json"}} if isinstance(body, bytes) \
            else {"json": body}
        r = await client.post(path, **kw)
        stats.status[r.status_code] += 1
        if r.status_code == 400 and "error" in r.json():
            stats.outcomes["bad request: 400"] += 1
        else:
            stats.fail("bad request", f"HTTP {r.status_code} for {body!r}: {r.text[:200]}")
        return
    if roll < 0.20:  # a client that hangs up mid-stream
        n = rng.randint(1, 3)
        body = {"model": MODEL, "messages": [{"role": "user", "content": _question(rng)}], "n": n,
                "max_tokens": max_tokens * 2, "temperature": 0.8, "stream": True, "ignore_eos": True}
        await _stream(client, "/v1/chat/completions", body, n, [], "hang-up", stats,
                      hang_up_after=rng.randint(1, 6))
        return
    streamed = rng.random() < 0.5
    if roll < 0.60:
        n = rng.randint(1, 3)
        body = {"model": MODEL, "messages": [{"role": "user", "content": _question(rng)}], "n": n,
                "max_tokens": tokens, "temperature": temperature, "stop": stop, "stream": streamed}
        if streamed and rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
        path, kind = "/v1/chat/completions", "chat"
    else:
        n = rng.randint(1, 4)
        prompts = [f"Q: {_question(rng)}\nA:" for _ in range(2 if rng.random() < 0.2 else 1)]
        body = {"model": MODEL, "prompt": prompts if len(prompts) > 1 else prompts[0], "n": n,
                "max_tokens": tokens, "temperature": temperature, "stop": stop, "stream": streamed,
                "seed": rng.randint(0, 1000)}
        n *= len(prompts)
        path, kind = "/v1/completions", "completion"
    kind += f"{' stream' if streamed else ''} n={'>1' if n > 1 else '1'}"
    if streamed:
        await _stream(client, path, body, n, stop, kind, stats)
    else:
        await _plain(client, path, body, n, stop, kind, stats)


async def worker(base: str, seed: int, deadline: float, stats: Stats, max_tokens: int) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=base, timeout=httpx.Timeout(300.0, connect=10.0)) as client:
        while time.monotonic() < deadline:
            try:
                await one_request(client, rng, stats, max_tokens)
            except (httpx.HTTPError, json.JSONDecodeError, KeyError) as exc:
                stats.fail("transport", repr(exc))


def rss_mib(proc: psutil.Process) -> float:
    """RSS of the server and its children (tensor-parallel workers, none by default), MiB."""
    total = proc.memory_info().rss
    for child in proc.children(recursive=True):
        try:
            total += child.memory_info().rss
        except psutil.Error:
            pass
    return total / 2**20


async def sample_rss(proc: psutil.Process, interval: float, samples: list[tuple[float, float]], t0: float,
                     stop: asyncio.Event) -> None:
    while not stop.is_set():
        samples.append((time.monotonic() - t0, rss_mib(proc)))
        try:
            await asyncio.wait_for(stop.wait(), interval)
        except TimeoutError:
            pass
    samples.append((time.monotonic() - t0, rss_mib(proc)))


def scrape(base: str) -> dict[str, float]:
    """``{sample name + labels: value}`` of the kvfleet: series."""
    text = httpx.get(base + "/metrics", timeout=30).text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.startswith("kvfleet:"):
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
                out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def start_server(args: argparse.Namespace, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "kvfleet.runtime.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--log-level", "warning", *args.serve_arg]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONSAFEPATH": "1", "TOKENIZERS_PARALLELISM": "false"}
    fh = open(log, "wb")  # kept open for the server's lifetime
    proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while True:
        if proc.poll() is not None:
            sys.exit(f"server exited with {proc.returncode}:\n{log.read_text(errors='replace')[-3000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            sys.exit("server not ready in 600 s")
        try:
            if httpx.get(base + "/ready", timeout=5).status_code == 200:
                return proc, base
        except httpx.TransportError:
            pass
        time.sleep(0.2)


async def soak(args: argparse.Namespace, base: str, proc: psutil.Process) -> dict[str, Any]:
    stats = Stats()
    samples: list[tuple[float, float]] = []
    t0 = time.monotonic()
    stop = asyncio.Event()
    sampler = asyncio.create_task(sample_rss(proc, args.rss_interval, samples, t0, stop))
    deadline = t0 + args.duration
    progress_every = max(30.0, args.duration / 20)

    async def progress() -> None:
        while time.monotonic() < deadline:
            await asyncio.sleep(progress_every)
            done = sum(stats.outcomes.values())
            print(f"  {time.monotonic() - t0:6.0f} s: {done} requests, {len(stats.failures)} failures, "
                  f"RSS {samples[-1][1]:.0f} MiB", flush=True)

    reporter = asyncio.create_task(progress())
    await asyncio.gather(*(worker(base, args.seed * 1000 + i, deadline, stats, args.max_tokens)
                           for i in range(args.concurrency)))
    load_s = time.monotonic() - t0
    reporter.cancel()

    # settle: aborted hang-ups and the last requests leave the engine
    settle_start = time.monotonic()
    while True:
        m = scrape(base)
        idle = (m.get("kvfleet:num_requests_running", 1) == 0 and m.get("kvfleet:num_requests_waiting", 1) == 0
                and m.get("kvfleet:kv_cache_usage_perc", 1) <= args.max_kv_usage)
        if idle or time.monotonic() - settle_start > 60:
            break
        await asyncio.sleep(0.5)
    settle_s = time.monotonic() - settle_start
    stop.set()
    await sampler
    health = httpx.get(base + "/health", timeout=10).status_code
    ready = httpx.get(base + "/ready", timeout=10).status_code

    warm = next((rss for t, rss in samples if t >= args.warmup), samples[-1][1])
    rss = {"first": samples[0][1], "after_warmup": warm, "last": samples[-1][1],
           "max": max(r for _, r in samples), "samples": len(samples)}
    success = {k.split("=")[1].rstrip("}"): v for k, v in m.items()
               if k.startswith("kvfleet:request_success_total{")}
    fivexx = sum(c for code, c in stats.status.items() if code >= 500)
    checks = {
        "nothing running": m.get("kvfleet:num_requests_running") == 0,
        "nothing waiting": m.get("kvfleet:num_requests_waiting") == 0,
        f"KV cache usage <= {args.max_kv_usage}": m.get("kvfleet:kv_cache_usage_perc", 1) <= args.max_kv_usage,
        "no 5xx": fivexx == 0,
        "no failed request": not stats.failures,
        f"RSS growth after warm-up <= {args.max_rss_growth_mib} MiB": rss["last"] - warm <= args.max_rss_growth_mib,
        "/health and /ready 200": health == 200 and ready == 200,
    }
    return {
        "duration_s": round(load_s, 1), "settle_s": round(settle_s, 1), "concurrency": args.concurrency,
        "requests": sum(stats.outcomes.values()), "outcomes": dict(sorted(stats.outcomes.items())),
        "http_status": {str(k): v for k, v in sorted(stats.status.items())}, "failures": stats.failures,
        "completion_tokens_non_streamed": stats.tokens,
        "metrics_at_end": {
            "num_requests_running": m.get("kvfleet:num_requests_running"),
            "num_requests_waiting": m.get("kvfleet:num_requests_waiting"),
            "kv_cache_usage_perc": m.get("kvfleet:kv_cache_usage_perc"),
            "request_success_total": success,
            "generation_tokens_total": m.get("kvfleet:generation_tokens_total"),
            "prompt_tokens_total": m.get("kvfleet:prompt_tokens_total"),
            "num_preemptions_total": m.get("kvfleet:num_preemptions_total"),
        },
        "rss_mib": {k: round(v, 1) if isinstance(v, float) else v for k, v in rss.items()},
        "rss_trace_mib": [(round(t), round(r, 1)) for t, r in samples[:: max(1, len(samples) // 40)]],
        "checks": checks,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--duration", type=float, default=600, help="seconds of load (default 600)")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight at most (default 8)")
    p.add_argument("--max-tokens", type=int, default=32, help="largest max_tokens of a request (default 32)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--url", help="soak a running server instead of starting one (needs --pid for RSS)")
    p.add_argument("--pid", type=int, help="the running server's process id (with --url)")
    p.add_argument("--serve-arg", action="append", default=[], help="an extra `kvfleet serve` argument")
    p.add_argument("--rss-interval", type=float, default=5.0, help="seconds between RSS samples (default 5)")
    p.add_argument("--warmup", type=float, default=60.0, help="RSS growth is counted from this second on")
    p.add_argument("--max-rss-growth-mib", type=float, default=256.0)
    p.add_argument("--max-kv-usage", type=float, default=0.01, help="KV cache usage counted as ~0")
    p.add_argument("--json", type=Path, help="write the figures to this file")
    args = p.parse_args()

    server = None
    logdir = Path(tempfile.mkdtemp(prefix="kvfleet-soak-"))
    if args.url:
        if not args.pid:
            p.error("--url needs --pid")
        base, pid = args.url.rstrip("/"), args.pid
    else:
        t = time.monotonic()
        server, base = start_server(args, logdir / "server.log")
        pid = server.pid
        print(f"kvfleet serve ready at {base} in {time.monotonic() - t:.0f} s (log {logdir / 'server.log'})")
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    print(f"soak: {args.duration:.0f} s, concurrency {args.concurrency}, {os.cpu_count()} CPUs ({cpu}), "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)
    try:
        result = asyncio.run(soak(args, base, psutil.Process(pid)))
    finally:
        if server is not None:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                server.kill()
    result["cpu"] = f"{os.cpu_count()} x {cpu}"
    result["command"] = " ".join(sys.argv)
    if server is not None:
        result["server_exit_code"] = server.returncode
    print(json.dumps({k: v for k, v in result.items() if k != "rss_trace_mib"}, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    failed = [name for name, ok in result["checks"].items() if not ok]
    for name, ok in result["checks"].items():
        print(f"{'PASS' if ok else 'FAIL'}  {name}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
