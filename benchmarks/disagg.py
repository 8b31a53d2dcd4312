"""Prefill/decode disaggregation vs colocated replicas (issue 43): inter-token latency (ITL) of
streaming decodes while long prompts keep arriving, on the same total cores.

Two real ``kvfleet serve`` replicas of one thread each (``OMP_NUM_THREADS=1``), each pinned to its
own core (``taskset``), behind ``kvfleet router``:

- colocated: ``--endpoints A,B`` (least load): each replica prefills the long prompts it gets
  between the decode steps of its streams;
- P/D: ``--prefill-endpoints P --endpoints D --prefill-min-prompt-chars 1000``: every long prompt
  is computed on P, its blocks pulled by D, which computes one prompt token of it and decodes; the
  streams' short prompts are computed on D directly.

Workload, the same for both, for ``--seconds``: ``--streams`` clients each streaming requests of a
short prompt and ``--decode-tokens`` greedy tokens back to back, and one client sending a distinct
``--long-words``-word prompt (``max_tokens`` 4) every ``--long-every`` seconds. Reported: the ITL
percentiles of the streams (gaps between consecutive streamed tokens; the first token's wait is
TTFT, reported apart), the long prompts' TTFT, tokens streamed. On a shared 2-core machine the
numbers move from run to run: compare the two modes of one run only.

    python benchmarks/disagg.py                          # SmolLM2-135M, 60 s a mode
    python benchmarks/disagg.py --seconds 30 --serve-args "--model /path/to/model"
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import httpx

WORDS = ("river mountain policy customer refund shipping order account password invoice warranty delivery "
         "support ticket manager product quality service contract payment balance report schedule").split()
TRANSFER = json.dumps({"kv_connector": "PeerPullConnector", "kv_role": "kv_both"})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(base: str, proc: subprocess.Popen, log: str, key: str = "available", want: int = 0) -> None:
    for _ in range(2400):
        if proc.poll() is not None:
            raise RuntimeError(f"{base} exited; see {log}")
        try:
            r = httpx.get(base + "/ready", timeout=2)
            if r.status_code == 200 and (not want or r.json().get(key, 0) >= want):
                return
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    raise RuntimeError(f"{base} not ready; see {log}")


def start_serve(log: str, core: int, extra: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONSAFEPATH": "1", "OMP_NUM_THREADS": "1"}
    pin = ["taskset", "-c", str(core)] if shutil.which("taskset") else []
    proc = subprocess.Popen([*pin, sys.executable, "-m", "kvfleet.runtime.cli", "serve", "--host", "127.0.0.1",
                             "--port", str(port), "--kv-transfer-config", TRANSFER, *extra],
                            stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=env)
    return proc, f"http://127.0.0.1:{port}"


def start_router(log: str, args: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "PYTHONSAFEPATH": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "kvfleet.runtime.cli", "router", "--host", "127.0.0.1", "--port",
                             str(port), "--routing-algorithm", "least-load", "--no-kv-peer-hint", *args],
                            stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=env)
    return proc, f"http://127.0.0.1:{port}"


def stream(base: str, prompt: str, max_tokens: int) -> list[float]:
    """Arrival times of each streamed token chunk (the request's send time first)."""
    times = [time.perf_counter()]
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]" and json.loads(line[6:])["choices"]:
                times.append(time.perf_counter())
    return times


def run_mode(base: str, args) -> dict:
    stop = time.monotonic() + args.seconds
    itl: list[float] = []
    ttft: list[float] = []
    long_ttft: list[float] = []
    tokens = [0]
    lock = threading.Lock()

    def streams(i: int) -> None:
        n = 0
        while time.monotonic() < stop:
            prompt = f"Stream {i} request {n}: tell me about the " + " ".join(WORDS[i:i + 8])
            t = stream(base, prompt, args.decode_tokens)
            with lock:
                ttft.append(t[1] - t[0])
                itl.extend(b - a for a, b in zip(t[1:], t[2:]))
                tokens[0] += len(t) - 1
            n += 1

    def long_prompts() -> None:
        n = 0
        while time.monotonic() < stop:
            t0 = time.monotonic()
            words = " ".join(WORDS[(n * 5 + j * 3) % len(WORDS)] for j in range(args.long_words))
            t = stream(base, f"Document {n} ({time.time_ns()}): {words}\nSummary:", 4)
            long_ttft.append(t[1] - t[0])
            n += 1
            time.sleep(max(0.0, args.long_every - (time.monotonic() - t0)))

    threads = [threading.Thread(target=streams, args=(i,)) for i in range(args.streams)]
    threads.append(threading.Thread(target=long_prompts))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    q = statistics.quantiles(itl, n=100) if len(itl) > 1 else [float("nan")] * 99
    return {"itl_p50_ms": q[49] * 1e3, "itl_p99_ms": q[98] * 1e3, "itl_max_ms": max(itl, default=0) * 1e3,
            "stream_ttft_p50_ms": statistics.median(ttft) * 1e3 if ttft else None,
            "long_prompts": len(long_ttft), "long_ttft_p50_s": statistics.median(long_ttft) if long_ttft else None,
            "tokens_streamed": tokens[0], "tokens_per_s": tokens[0] / args.seconds}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=60)
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--long-words", type=int, default=1200)
    p.add_argument("--long-every", type=float, default=3.0)
    p.add_argument("--serve-args", default="--max-model-len 4096 --kv-cache-memory 256MiB",
                   help="extra kvfleet serve options of both replicas")
    p.add_argument("--modes", default="colocated,pd")
    p.add_argument("--prefill-min-prompt-chars", type=int, default=1000,
                   help="P/D: shorter prompts (the streams') skip the prefill leg (router option)")
    args = p.parse_args()
    logs = tempfile.mkdtemp(prefix="disagg-bench-")
    results = {}
    for mode in args.modes.split(","):
        procs = [start_serve(f"{logs}/{mode}-replica{i}.log", i % (os.cpu_count() or 1), args.serve_args.split())
                 for i in range(2)]
        (_, a), (_, b) = procs
        flags = (["--endpoints", f"{a},{b}"] if mode == "colocated" else
                 ["--prefill-endpoints", a, "--endpoints", b,
                  "--prefill-min-prompt-chars", str(args.prefill_min_prompt_chars)])
        router = start_router(f"{logs}/{mode}-router.log", flags)
        try:
            for (proc, base), i in zip(procs, range(2)):
                wait_ready(base, proc, f"{logs}/{mode}-replica{i}.log")
            wait_ready(router[1], router[0], f"{logs}/{mode}-router.log", want=1)
            for _, base in procs:
                stream(base, "warm up", 2)
            results[mode] = run_mode(router[1], args)
            print(mode, json.dumps(results[mode], indent=1), flush=True)
        finally:
            for proc, _ in [*procs, router]:
                proc.terminate()
            for proc, _ in [*procs, router]:
                proc.wait(60)
    print(json.dumps({"config": vars(args), "cpu": cpu_name(), "results": results}, indent=1))


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown"


if __name__ == "__main__":
    main()
