"""Peer KV pull vs recompute (issue 29): time to first token of a prompt whose long prefix another
replica caches, when this replica computes it and when it pulls it (``x-kvfleet-kv-peer``).

Two real ``kvfleet serve`` replicas with ``--kv-transfer-config``, A and B, on this machine. For
each of ``--rounds`` distinct prefixes of ``--prefix-words`` words: A computes prefix + question
(the recompute time), then B answers prefix + another question with the hint naming A (the pull:
fetching the blocks over HTTP, checking and installing them, then the suffix). Requests are
sequential, greedy, ``max_tokens=1``, so latency ~ TTFT.

    python benchmarks/kv_pull.py                        # 3 rounds of ~1,500-token prefixes
    python benchmarks/kv_pull.py --prefix-words 3000 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

WORDS = ("river mountain policy customer refund shipping order account password invoice warranty delivery "
         "support ticket manager product quality service contract payment balance report schedule").split()
TRANSFER = json.dumps({"kv_connector": "PeerPullConnector", "kv_role": "kv_both"})


def start(log: str, extra: list[str]) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONSAFEPATH": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "kvfleet.runtime.cli", "serve", "--host", "127.0.0.1", "--port",
                             str(port), "--kv-transfer-config", TRANSFER, *extra],
                            stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    for _ in range(1200):
        try:
            if httpx.get(base + "/ready", timeout=2).status_code == 200:
                return proc, base
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    raise RuntimeError(f"{base} not ready; see {log}")


def ask(base: str, prompt: str, peer: str | None = None) -> tuple[float, dict]:
    headers = {"x-kvfleet-kv-peer": peer} if peer else {}
    t0 = time.perf_counter()
    r = httpx.post(base + "/v1/completions", json={"prompt": prompt, "max_tokens": 1, "temperature": 0},
                   headers=headers, timeout=600)
    r.raise_for_status()
    return time.perf_counter() - t0, r.json()["usage"]


def metric(base: str, name: str) -> float:
    return sum(float(line.split()[-1]) for line in httpx.get(base + "/metrics", timeout=10).text.splitlines()
               if line.startswith(name))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prefix-words", type=int, default=1480)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--serve-args", default="--max-model-len 8192 --kv-cache-memory 512MiB",
                   help="extra kvfleet serve options of both replicas")
    args = p.parse_args()
    logs = tempfile.mkdtemp(prefix="kv-pull-bench-")
    procs = [start(f"{logs}/replica{i}.log", args.serve_args.split()) for i in range(2)]
    (_, a), (_, b) = procs
    try:
        ask(a, "warm up")
        ask(b, "warm up")
        rows = []
        for r in range(args.rounds):
            prefix = f"[{r}] " + " ".join(WORDS[(i * 7 + r) % len(WORDS)] for i in range(args.prefix_words)) + "\n"
            recompute, usage = ask(a, prefix + "Question one?")
            pulled_before = metric(b, "kvfleet:kv_pull_tokens_total")
            pull, _ = ask(b, prefix + "Question two?", peer=a)
            pulled = metric(b, "kvfleet:kv_pull_tokens_total") - pulled_before
            rows.append((usage["prompt_tokens"], recompute, pull, pulled))
            print(f"round {r}: prompt {usage['prompt_tokens']} tokens; recompute {recompute:.3f} s, "
                  f"pull {pull:.3f} s ({pulled:.0f} tokens pulled)", flush=True)
        print(f"median: recompute {statistics.median(x[1] for x in rows):.3f} s, "
              f"pull {statistics.median(x[2] for x in rows):.3f} s, "
              f"speed-up {statistics.median(x[1] / x[2] for x in rows):.1f}x")
    finally:
        for proc, _ in procs:
            proc.send_signal(signal.SIGTERM)
        for proc, _ in procs:
            proc.wait(60)


if __name__ == "__main__":
    main()
