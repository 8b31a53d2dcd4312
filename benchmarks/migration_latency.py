"""Benchmark mid-stream migration (issue 27): what a client waits when the replica serving its
stream dies, and how that grows with the tokens already delivered (the router replays them on
the next replica: a prefill of prompt + N tokens).

    PYTHONSAFEPATH=1 nice -n 10 python benchmarks/migration_latency.py --delivered 32,128,256

Starts two real ``kvfleet serve`` replicas (the default model) and ``kvfleet router`` over them.
For each N in ``--delivered`` (``--repeats`` times): one greedy streamed completion of N + 16
tokens through the router, a prompt never sent before (no prefix-cache hit on the other replica);
when the client has read N chunks with text (about N tokens: the exact count the router replayed
is reported), the replica serving it (``x-kvfleet-replica``) is
SIGKILLed. Reported per N: the median inter-token latency before the break (ITL), the time from
the SIGKILL to the next token at the client (break -> next token: the chunk that ends the
stream's longest gap after the break, since chunks already sent still arrive at once), and the added latency
(that minus ITL: detection, the new connection, the replay prefill of prompt + N tokens and one
decode step), the tokens the router replayed (``kvfleet:router_migrated_tokens_total``), and,
for scale, the time a surviving replica takes to answer one token for a fresh prompt as long as
the replayed one (prompt + the delivered text; the replay's prefill share).
The killed replica is restarted before the next run. Prints a table with the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time
import uuid
from pathlib import Path

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from router import spawn, wait_ready  # benchmarks/router.py: start a process, wait for its /ready

from kvfleet.runtime.bench.machine import machine

PROMPT = "Write a long story about a lighthouse keeper and the sea."
AFTER = 16
"""Tokens asked for after the break (the stream must go on)."""
SERVE = ["serve", "--max-model-len", "512", "--kv-cache-memory", "64MiB"]


def migrated_tokens(router: str) -> float:
    for line in httpx.get(router + "/metrics", timeout=10).text.splitlines():
        if line.startswith("kvfleet:router_migrated_tokens_total "):
            return float(line.split()[-1])
    return 0.0


def one_run(router: str, replicas: dict[str, object], n: int) -> dict:
    """One stream SIGKILLed after ``n`` token chunks; the times around the break."""
    model = httpx.get(router + "/v1/models", timeout=10).json()["data"][0]["id"]
    body = {"model": model, "stream": True, "temperature": 0, "ignore_eos": True, "max_tokens": n + AFTER,
            "prompt": f"[{uuid.uuid4().hex[:8]}] {PROMPT}"}
    before = migrated_tokens(router)
    arrivals: list[float] = []
    delivered = ""
    t_break = victim = None
    done = False
    with httpx.stream("POST", router + "/v1/completions", json=body, timeout=300) as r:
        r.raise_for_status()
        victim = r.headers["x-kvfleet-replica"]
        for line in r.iter_lines():
            if line == "data: [DONE]":
                done = True
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise SystemExit(f"the stream ended with an error: {chunk['error']}")
            if not any(c.get("text") for c in chunk.get("choices") or []):
                continue  # usage, or a closing chunk carrying only finish_reason
            arrivals.append(time.perf_counter())
            if len(arrivals) <= n:
                delivered += chunk["choices"][0]["text"]
            if len(arrivals) == n:
                t_break = time.perf_counter()
                replicas[victim].send_signal(signal.SIGKILL)
    if not done or t_break is None or len(arrivals) <= n:  # a token whose text is held back sends no text
        raise SystemExit(f"stream incomplete: {len(arrivals)} text chunks of {n + AFTER} tokens, [DONE] {done}")
    gaps = [b - a for a, b in zip(arrivals[1:n], arrivals[2:n])]  # the first token's prefill left out
    # chunks already on their way when the replica died still arrive at once: the next token from
    # the new replica is the one that ends the stream's longest gap after the break
    resumed = max(range(n, len(arrivals)), key=lambda i: arrivals[i] - arrivals[i - 1])
    survivor = next(url for url in replicas if url != victim)
    prefill = prefill_time(survivor, model, f"[{uuid.uuid4().hex[:8]}] {PROMPT}{delivered}")
    return {"victim": victim, "itl": statistics.median(gaps), "break_to_next": arrivals[resumed] - t_break,
            "replayed": migrated_tokens(router) - before, **prefill}


def prefill_time(replica: str, model: str, prompt: str) -> dict:
    """A fresh prompt as long as the replayed one, one token, straight to a replica: the prefill's
    share of the break (TTFT of a non-streamed request, HTTP included)."""
    t0 = time.perf_counter()
    r = httpx.post(replica + "/v1/completions", timeout=120,
                   json={"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0})
    r.raise_for_status()
    return {"prefill": time.perf_counter() - t0, "prompt_tokens": r.json()["usage"]["prompt_tokens"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--delivered", default="32,128,256", help="tokens delivered before the break, comma-separated")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--workdir", type=Path, default=Path("benchmarks/results/migration"))
    args = ap.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    info = machine()
    replicas: dict[str, object] = {}
    for i in range(2):
        proc, base = spawn(SERVE, args.workdir / f"replica{i}.log")
        replicas[base] = proc
    router_proc = None
    try:
        for base, proc in replicas.items():
            wait_ready(base, proc)
        router_proc, router = spawn(["router", "--endpoints", ",".join(replicas), "--probe-interval", "0.2"],
                                    args.workdir / "router.log")
        wait_ready(router, router_proc, key="available", want=2)
        rows = []
        for n in (int(x) for x in args.delivered.split(",")):
            for _ in range(args.repeats):
                run = one_run(router, replicas, n)
                rows.append((n, run))
                replicas[run["victim"]].wait(30)  # restart the killed replica at its address
                replicas[run["victim"]] = restart(run["victim"], args.workdir)
                wait_ready(run["victim"], replicas[run["victim"]])
                wait_ready(router, router_proc, key="available", want=2)
        report(rows, info)
    finally:
        for proc in [router_proc, *replicas.values()]:
            if proc is not None and proc.poll() is None:
                proc.terminate()
                proc.wait(30)


def restart(base: str, workdir: Path):
    import subprocess

    port = base.rsplit(":", 1)[1]
    env = {**os.environ, "PYTHONSAFEPATH": "1", "HF_HUB_OFFLINE": "1"}
    with open(workdir / f"replica-{port}-restart.log", "wb") as fh:
        return subprocess.Popen([sys.executable, "-m", "kvfleet.runtime.cli", *SERVE, "--host", "127.0.0.1",
                                 "--port", port], stdout=fh, stderr=subprocess.STDOUT, env=env)


def report(rows: list[tuple[int, dict]], info: dict) -> None:
    print(f"\nCPU: {info['cpu']}; flags: {' '.join(info['flags'])}; "
          f"load average at start {info['load_average_start']:.2f}")
    print("| delivered N | tokens replayed | ITL before (ms) | break -> next token (ms) | added (ms) "
          "| prefill of as long a prompt (tokens, ms) |")
    print("|---:|---:|---:|---:|---:|---:|")
    for n, run in rows:
        print(f"| {n} | {run['replayed']:.0f} | {run['itl'] * 1e3:.1f} | {run['break_to_next'] * 1e3:.0f} | "
              f"{(run['break_to_next'] - run['itl']) * 1e3:.0f} | {run['prompt_tokens']}, {run['prefill'] * 1e3:.0f} |")


if __name__ == "__main__":
    main()
