"""Benchmark `kvfleet router`: prefix-hash vs round-robin routing over 2-3 real `kvfleet serve`
replicas, shared-prefix and random workloads, plus the router's own added latency on loopback.

    PYTHONSAFEPATH=1 nice -n 10 python benchmarks/router.py --replicas 3 --out benchmarks/results/router-cpu.json

Starts the replicas (the default model) and one router per algorithm, then for each
(workload, algorithm): ``--requests`` streamed chat completions at ``--concurrency``; reports
TTFT p50/p99 (request sent -> first content chunk), request throughput, output token throughput,
and the replicas' prefix-cache hit rate over the run. Workloads: ``shared-prefix`` (``--prefixes``
system prompts of ~``--prefix-words`` words, each followed by a short question) and ``random``
(every prompt different from its first word). Added latency: ``GET /v1/models`` (answered by the
replica at once) ``--overhead-requests`` times straight to a replica and through the router,
interleaved; the p50/p99 difference is the router's own cost per request.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
WORDS = ("river mountain policy customer refund shipping order account password invoice warranty delivery "
         "support ticket manager product quality service contract payment balance report schedule").split()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(args: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "PYTHONSAFEPATH": "1", "HF_HUB_OFFLINE": "1"}
    with open(log, "wb") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "kvfleet.runtime.cli", *args, "--host", "127.0.0.1",
                                 "--port", str(port)], stdout=fh, stderr=subprocess.STDOUT, env=env)
    return proc, f"http://127.0.0.1:{port}"


def wait_ready(base: str, proc: subprocess.Popen, timeout: float = 600, key: str | None = None, want=None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{base} exited")
        try:
            r = httpx.get(base + "/ready", timeout=2)
            if r.status_code == 200 and (key is None or r.json().get(key) == want):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"{base} not ready")


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))] if xs else float("nan")


def prompts(workload: str, n: int, prefixes: int, prefix_words: int, seed: int) -> list[list[dict]]:
    rng = random.Random(seed)
    systems = [f"[desk {seed}-{i}] " + " ".join(rng.choice(WORDS) for _ in range(prefix_words))
               for i in range(prefixes)]
    out = []
    # shared-prefix: every prefix equally often, in random order (a fixed i % prefixes order would
    # hand round robin perfect affinity whenever the prefix count is a multiple of the replicas)
    order = [i % prefixes for i in range(n)]
    rng.shuffle(order)
    for i in range(n):
        if workload == "shared-prefix":
            system = systems[order[i]]
        else:
            system = f"[{seed}-{i}] " + " ".join(rng.choice(WORDS) for _ in range(prefix_words))
        out.append([{"role": "system", "content": system}, {"role": "user", "content": f"Question {i}: what now?"}])
    return out


async def one(http: httpx.AsyncClient, base: str, messages: list[dict], max_tokens: int) -> tuple[float, int]:
    body = {"model": "SmolLM2-135M-Instruct", "messages": messages, "max_tokens": max_tokens, "stream": True,
            "temperature": 0, "ignore_eos": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, tokens = None, 0
    async with http.stream("POST", base + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if ttft is None and any((c.get("delta") or {}).get("content") for c in chunk.get("choices") or []):
                ttft = time.perf_counter() - t0
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return (ttft if ttft is not None else time.perf_counter() - t0), tokens


def prefix_hits(replicas: list[str]) -> tuple[float, float]:
    hits = queries = 0.0
    for base in replicas:
        for line in httpx.get(base + "/metrics", timeout=10).text.splitlines():
            if line.startswith("kvfleet:prefix_cache_hits_total"):
                hits += float(line.rsplit(" ", 1)[1])
            elif line.startswith("kvfleet:prefix_cache_queries_total"):
                queries += float(line.rsplit(" ", 1)[1])
    return hits, queries


async def run_load(base: str, work: list[list[dict]], concurrency: int, max_tokens: int) -> dict:
    queue = list(enumerate(work))
    ttfts, tokens = [], 0
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=concurrency + 4)) as http:
        async def worker():
            nonlocal tokens
            while queue:
                _, messages = queue.pop(0)
                ttft, n = await one(http, base, messages, max_tokens)
                ttfts.append(ttft)
                tokens += n
        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        duration = time.perf_counter() - t0
    return {"requests": len(ttfts), "duration_s": round(duration, 2),
            "ttft_p50_ms": round(1000 * pct(ttfts, 50), 1), "ttft_p99_ms": round(1000 * pct(ttfts, 99), 1),
            "request_throughput": round(len(ttfts) / duration, 3),
            "output_token_throughput": round(tokens / duration, 2)}


def overhead(replica: str, router: str, n: int) -> dict:
    direct, routed = [], []
    with httpx.Client(timeout=10) as http:
        for _ in range(20):  # warm both connection pools
            http.get(replica + "/v1/models")
            http.get(router + "/v1/models")
        for _ in range(n):
            for base, out in ((replica, direct), (router, routed)):
                t0 = time.perf_counter()
                http.get(base + "/v1/models").raise_for_status()
                out.append(time.perf_counter() - t0)
    return {"requests": n, "direct_p50_ms": round(1000 * pct(direct, 50), 3),
            "router_p50_ms": round(1000 * pct(routed, 50), 3),
            "added_p50_ms": round(1000 * (pct(routed, 50) - pct(direct, 50)), 3),
            "added_p99_ms": round(1000 * (pct(routed, 99) - pct(direct, 99)), 3),
            "added_mean_ms": round(1000 * (statistics.mean(routed) - statistics.mean(direct)), 3)}


def main() -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the replicas in `finally` too
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=6)
    ap.add_argument("--prefixes", type=int, default=6)
    ap.add_argument("--prefix-words", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--overhead-requests", type=int, default=300)
    ap.add_argument("--serve-args", default="--max-model-len 1024 --kv-cache-memory 128MiB")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--logs", type=Path, default=Path("/tmp/kvfleet-router-bench"))
    args = ap.parse_args()
    args.logs.mkdir(parents=True, exist_ok=True)
    procs = []
    try:
        replicas = [spawn(["serve", *args.serve_args.split()], args.logs / f"replica{i}.log")
                    for i in range(args.replicas)]
        procs += [p for p, _ in replicas]
        for p, base in replicas:
            wait_ready(base, p)
        urls = [b for _, b in replicas]
        routers = {}
        for algo in ("prefix-hash", "round-robin"):
            p, base = spawn(["router", "--endpoints", ",".join(urls), "--routing-algorithm", algo],
                            args.logs / f"router-{algo}.log")
            procs.append(p)
            wait_ready(base, p, key="available", want=len(urls))
            routers[algo] = base
        result = {"replicas": args.replicas, "concurrency": args.concurrency, "requests": args.requests,
                  "prefixes": args.prefixes, "prefix_words": args.prefix_words, "max_tokens": args.max_tokens,
                  "cpu": os.uname().machine, "runs": []}
        seed = 0
        for workload in ("shared-prefix", "random"):
            for algo, base in routers.items():
                seed += 1
                work = prompts(workload, args.requests, args.prefixes, args.prefix_words, seed)
                h0, q0 = prefix_hits(urls)
                row = asyncio.run(run_load(base, work, args.concurrency, args.max_tokens))
                h1, q1 = prefix_hits(urls)
                row.update(workload=workload, algorithm=algo,
                           prefix_cache_hit_rate=round((h1 - h0) / max(1.0, q1 - q0), 3))
                print(json.dumps(row), flush=True)
                result["runs"].append(row)
        result["router_overhead"] = overhead(urls[0], routers["prefix-hash"], args.overhead_requests)
        print(json.dumps(result["router_overhead"]), flush=True)
        if args.out:
            args.out.write_text(json.dumps(result, indent=2) + "\n")
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
