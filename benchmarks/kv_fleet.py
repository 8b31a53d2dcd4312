"""One KV cache for the fleet (issue 29): char-prefix CHWBL vs precise prefix routing vs precise
routing + peer KV pull, over three real ``kvfleet serve`` replicas behind ``kvfleet router``,
with a scale-up in the middle of each workload.

    PYTHONSAFEPATH=1 python benchmarks/kv_fleet.py                   # the full run (~5 min, 2 cores)
    PYTHONSAFEPATH=1 python benchmarks/kv_fleet.py --repeats 2       # docs/benchmarks.md's table (~9 min)
    PYTHONSAFEPATH=1 python benchmarks/kv_fleet.py --smoke           # 1-2 requests per phase

For each workload and router mode a fresh fleet: replicas 0 and 1 start (the default model,
``--kv-events-config`` on every replica in every mode, so the replicas do the same work and only
the routing differs; ``--kv-transfer-config`` only in ``precise+pull``), then the router with
``--endpoints`` naming all three replicas (the third is not running yet: the router probes it as
not ready). Phase 1 runs half the requests on two replicas; then the third replica starts (the
scale-up: the router finds it ready at its next probe, and its KV events at the subscriber's next
retry), and phase 2 runs the other half on three. The client pauses while the third replica
starts (this machine's two cores would otherwise also time its model load), so TTFT and
throughput are of the requests only. Modes (router options; in all of them also
``--load-factor 1 --min-capacity 1``, a tight bound: see ``ROUTER_ARGS``):

- ``char-prefix``: ``--routing-algorithm prefix-hash`` (CHWBL on the first 256 characters);
- ``precise``: ``--routing-algorithm precise-prefix-cache`` (the replicas' KV events);
- ``precise+pull``: the same plus ``--kv-peer-hint``; replicas with ``--kv-transfer-config``.

Workloads (streamed chat completions, greedy, ``--max-tokens`` with ``ignore_eos``):

- ``chat``: ``--conversations`` conversations of ``--turns`` turns, all at once, each turn's prompt
  the whole conversation so far (growing prefixes); phase 1 the first half of the turns;
- ``system-prompt``: one ~1,500-token system prompt (``--system-words``) and ``--questions``
  short questions at ``--concurrency``; phase 1 the first half of the questions, its first one
  alone (the prompt is cached somewhere before the load arrives).

Reported per (workload, mode): TTFT p50/p99 (request sent -> first content chunk) over both
phases, output token throughput (completion tokens / time spent in the two phases), prefill
tokens the fleet computed (``kvfleet:prompt_tokens_total``), tokens pulled from peers, the router's
decisions. A markdown table goes to stdout (with the CPU model), JSON and a PNG plot to
``--out-dir`` (default ``benchmarks/results/``, git-ignored). Ports ``--base-port`` .. +3 are fixed
so that every mode draws the same CHWBL ring.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
MODEL = "SmolLM2-135M-Instruct"
WORDS = ("river mountain policy customer refund shipping order account password invoice warranty delivery "
         "support ticket manager product quality service contract payment balance report schedule").split()
EVENTS = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:0"})
TRANSFER = json.dumps({"kv_connector": "PeerPullConnector", "kv_role": "kv_both"})
MODES = {
    "char-prefix": (["--routing-algorithm", "prefix-hash"], False),
    "precise": (["--routing-algorithm", "precise-prefix-cache"], False),
    "precise+pull": (["--routing-algorithm", "precise-prefix-cache", "--kv-peer-hint"], True),
}
"""mode -> (router options, replicas pull)."""
ROUTER_ARGS = ["--probe-interval", "0.5", "--load-factor", "1", "--min-capacity", "1"]
"""In every mode: a tight bound, so the new replica takes its share of the load once it is ready (with
the defaults, 1.25 and 4, the two old replicas absorb this benchmark's few requests in flight and
precise routing leaves the new replica idle: measured, see docs/benchmarks.md)."""
SERVE_ARGS = "--max-model-len 2048 --kv-cache-memory 256MiB --max-num-batched-tokens 2048"


# ---------------------------------------------------------------- processes

def spawn(args: list[str], port: int, log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONSAFEPATH": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    with open(log, "wb") as fh:
        return subprocess.Popen([sys.executable, "-m", "kvfleet.runtime.cli", *args, "--host", "127.0.0.1",
                                 "--port", str(port)], stdout=fh, stderr=subprocess.STDOUT, env=env)


def wait_ready(base: str, proc: subprocess.Popen, timeout: float = 600, available: int | None = None) -> None:
    """Until ``GET /ready`` is 200 (and, for the router, ``available`` replicas are)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{base} exited ({proc.returncode}); see its log")
        try:
            r = httpx.get(base + "/ready", timeout=2)
            if r.status_code == 200 and (available is None or r.json().get("available", 0) >= available):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"{base} not ready in {timeout} s")


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def warm_up(base: str) -> None:
    """One tiny request straight to a replica (first-request costs), sharing no block with the workloads."""
    httpx.post(base + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2},
               timeout=300).raise_for_status()


def metric(base: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in httpx.get(base + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
    return total


# ---------------------------------------------------------------- requests

async def chat(http: httpx.AsyncClient, router: str, messages: list[dict], max_tokens: int,
               ttfts: list[float]) -> tuple[str, int]:
    """One streamed greedy chat completion; appends its TTFT; returns (text, completion tokens)."""
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "stream": True, "temperature": 0,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, parts, tokens = None, [], 0
    async with http.stream("POST", router + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            for c in chunk.get("choices") or []:
                text = (c.get("delta") or {}).get("content")
                if text:
                    ttft = time.perf_counter() - t0 if ttft is None else ttft
                    parts.append(text)
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    ttfts.append(ttft if ttft is not None else time.perf_counter() - t0)
    return "".join(parts), tokens


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


class ChatWorkload:
    """Multi-turn chats: every conversation runs its turns in order, all conversations at once."""

    name = "chat"

    def __init__(self, conversations: int, turns: int, turn_words: int, seed: int) -> None:
        rng = random.Random(seed)
        self.turns = turns
        self.users = [[f"[chat {seed}-{c} turn {t}] " + words(rng, turn_words) for t in range(turns)]
                      for c in range(conversations)]
        self.histories: list[list[dict]] = [
            [{"role": "system", "content": "You are a helpful assistant."}] for _ in range(conversations)]

    def phases(self) -> list[tuple[int, int]]:
        half = max(1, self.turns // 2)
        return [(0, half), (half, self.turns)]

    async def run(self, http, router: str, phase: tuple[int, int], max_tokens: int, ttfts: list[float]) -> int:
        async def conversation(c: int) -> int:
            produced = 0
            for t in range(*phase):
                self.histories[c].append({"role": "user", "content": self.users[c][t]})
                text, n = await chat(http, router, self.histories[c], max_tokens, ttfts)
                self.histories[c].append({"role": "assistant", "content": text})
                produced += n
            return produced
        return sum(await asyncio.gather(*(conversation(c) for c in range(len(self.users)))))


class SystemPromptWorkload:
    """One long shared system prompt, short questions, a closed loop at ``concurrency``."""

    name = "system-prompt"

    def __init__(self, questions: int, concurrency: int, system_words: int, seed: int) -> None:
        rng = random.Random(seed)
        self.system = f"[desk {seed}] You answer for the support desk. " + words(rng, system_words)
        self.questions = [f"Question {i}: which {rng.choice(WORDS)} do you mean?" for i in range(questions)]
        self.concurrency = concurrency

    def messages(self, i: int) -> list[dict]:
        return [{"role": "system", "content": self.system}, {"role": "user", "content": self.questions[i]}]

    def phases(self) -> list[tuple[int, int]]:
        half = max(1, len(self.questions) // 2)
        return [(0, half), (half, len(self.questions))]

    async def run(self, http, router: str, phase: tuple[int, int], max_tokens: int, ttfts: list[float]) -> int:
        queue = list(range(*phase))
        produced = 0
        if phase[0] == 0:  # the first request alone: the prompt is in one cache before the load arrives
            produced = (await chat(http, router, self.messages(queue.pop(0)), max_tokens, ttfts))[1]

        async def worker() -> None:
            nonlocal produced
            while queue:
                n = (await chat(http, router, self.messages(queue.pop(0)), max_tokens, ttfts))[1]
                produced += n  # (``produced += await ...`` would read ``produced`` before the await)
        await asyncio.gather(*(worker() for _ in range(self.concurrency)))
        return produced


# ---------------------------------------------------------------- one run

def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))] if xs else float("nan")


async def timed(run: Callable[[], Awaitable[int]]) -> tuple[int, float]:
    t0 = time.perf_counter()
    produced = await run()
    return produced, time.perf_counter() - t0


def run_one(workload, mode: str, args, logs: Path) -> dict:
    """A fresh fleet for ``workload`` under ``mode``: phase 1 on two replicas, scale-up, phase 2."""
    router_opts, pull = MODES[mode]
    serve = ["serve", *args.serve_args.split(), "--kv-events-config", EVENTS,
             *(["--kv-transfer-config", TRANSFER] if pull else [])]
    ports = [args.base_port + i for i in range(3)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    router = f"http://127.0.0.1:{args.base_port + 3}"
    tag = f"{workload.name}-{mode}"
    procs = [spawn(serve, ports[i], logs / f"{tag}-replica{i}.log") for i in range(2)]
    try:
        for p, base in zip(procs, urls):
            wait_ready(base, p)
            warm_up(base)
        procs.append(spawn(["router", "--endpoints", ",".join(urls), *router_opts, *ROUTER_ARGS],
                           args.base_port + 3, logs / f"{tag}-router.log"))
        wait_ready(router, procs[-1], available=2)
        time.sleep(1.0)  # the KV subscriber's snapshot reads and subscriptions
        ttfts: list[list[float]] = [[], []]
        produced, busy = 0, 0.0

        async def phase(i: int, span: tuple[int, int]) -> tuple[int, float]:
            async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=64)) as http:
                return await timed(lambda: workload.run(http, router, span, args.max_tokens, ttfts[i]))

        for i, span in enumerate(workload.phases()):
            if i == 1:  # the scale-up
                procs.insert(2, spawn(serve, ports[2], logs / f"{tag}-replica2.log"))
                wait_ready(urls[2], procs[2])
                warm_up(urls[2])
                wait_ready(router, procs[-1], available=3)
                time.sleep(args.join_wait)  # the router's KV subscriber retries a replica every 5 s
            n, seconds = asyncio.run(phase(i, span))
            produced, busy = produced + n, busy + seconds
        row = {"workload": workload.name, "mode": mode, "requests": len(ttfts[0]) + len(ttfts[1]),
               "ttft_p50_s": pct(ttfts[0] + ttfts[1], 50), "ttft_p99_s": pct(ttfts[0] + ttfts[1], 99),
               "ttft_p50_after_scale_up_s": pct(ttfts[1], 50), "output_tok_s": produced / busy,
               "busy_s": busy, "produced": produced, "ttfts_s": ttfts,
               "prefill_tokens": sum(metric(u, "kvfleet:prompt_tokens_total") for u in urls),
               "prefix_cache_hit_tokens": sum(metric(u, "kvfleet:prefix_cache_hits_total") for u in urls),
               "pulled_tokens": sum(metric(u, "kvfleet:kv_pull_tokens_total") for u in urls),
               "decisions": {d: metric(router, "kvfleet:router_routing_decisions_total", decision=d)
                             for d in ("hit", "spill", "fallback")},
               "peer_hints": metric(router, "kvfleet:router_kv_peer_hints_total"),
               "requests_per_replica": [metric(u, "kvfleet:request_success_total") - 1 for u in urls]}
        print(json.dumps({k: v for k, v in row.items() if k != "ttfts_s"}), flush=True)
        return row
    finally:
        stop(procs)


# ---------------------------------------------------------------- report

def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown CPU"
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    model = fields.get("Model name", "unknown CPU").strip()
    return f"{model}, {os.cpu_count()} cores"


def _mean(rs: list[dict], key: str) -> float:
    return sum(r[key] for r in rs) / len(rs)


def merge(runs: list[dict]) -> list[dict]:
    """One row per (workload, mode) over ``--repeats``: TTFTs pooled, throughput = all tokens / all
    busy time, counts averaged."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in runs:
        groups.setdefault((r["workload"], r["mode"]), []).append(r)
    rows = []
    for (workload, mode), rs in groups.items():
        first = [t for r in rs for t in r["ttfts_s"][0]]
        after = [t for r in rs for t in r["ttfts_s"][1]]
        rows.append({"workload": workload, "mode": mode, "repeats": len(rs), "requests": len(first) + len(after),
                     "ttft_p50_s": pct(first + after, 50), "ttft_p99_s": pct(first + after, 99),
                     "ttft_p50_after_scale_up_s": pct(after, 50),
                     "output_tok_s": sum(r["produced"] for r in rs) / sum(r["busy_s"] for r in rs),
                     "prefill_tokens": _mean(rs, "prefill_tokens"), "pulled_tokens": _mean(rs, "pulled_tokens"),
                     "requests_per_replica": [sum(r["requests_per_replica"][i] for r in rs) / len(rs)
                                              for i in range(3)],
                     "decisions": {d: sum(r["decisions"][d] for r in rs) / len(rs) for d in rs[0]["decisions"]}})
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| workload | mode | requests | TTFT p50 (s) | TTFT p99 (s) | TTFT p50 after scale-up (s) | "
             "output tok/s | prefill tokens computed | tokens pulled | requests per replica | hit / spill / fallback |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |"]
    for r in rows:
        d = r["decisions"]
        lines.append(f"| {r['workload']} | {r['mode']} | {r['requests']} | {r['ttft_p50_s']:.2f} | "
                     f"{r['ttft_p99_s']:.2f} | {r['ttft_p50_after_scale_up_s']:.2f} | {r['output_tok_s']:.1f} | "
                     f"{r['prefill_tokens']:.0f} | {r['pulled_tokens']:.0f} | "
                     f"{' / '.join(f'{n:.0f}' for n in r['requests_per_replica'])} | "
                     f"{d['hit']:.0f} / {d['spill']:.0f} / {d['fallback']:.0f} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    width = 0.8 / len(modes)
    for ax, key, label in zip(axes, ("ttft_p50_s", "ttft_p99_s", "output_tok_s"),
                              ("TTFT p50 (s)", "TTFT p99 (s)", "output tokens/s")):
        for j, mode in enumerate(modes):
            vals = [next((r[key] for r in rows if r["workload"] == w and r["mode"] == mode), 0) for w in workloads]
            bars = ax.bar([i + j * width for i in range(len(workloads))], vals, width, label=mode)
            ax.bar_label(bars, fmt="%.2f" if key != "output_tok_s" else "%.1f", fontsize=7)
        ax.set_xticks([i + width * (len(modes) - 1) / 2 for i in range(len(workloads))], workloads)
        ax.set_ylabel(label)
        ax.set_title(label)
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the fleet in `finally` too
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default="chat,system-prompt")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--conversations", type=int, default=6)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--turn-words", type=int, default=80, help="words of each user turn (~1.2 tokens a word)")
    ap.add_argument("--questions", type=int, default=24)
    ap.add_argument("--concurrency", type=int, default=6, help="system-prompt workload: requests in flight")
    ap.add_argument("--system-words", type=int, default=1480)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--join-wait", type=float, default=5.5,
                    help="seconds after the scale-up for the router's KV subscriber to reach the new replica")
    ap.add_argument("--serve-args", default=SERVE_ARGS)
    ap.add_argument("--base-port", type=int, default=18310)
    ap.add_argument("--repeats", type=int, default=1, help="runs of every (workload, mode), interleaved")
    ap.add_argument("--smoke", action="store_true", help="1-2 requests per phase: check that it runs")
    ap.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--logs", type=Path, default=Path("/tmp/kvfleet-kv-fleet-bench"))
    args = ap.parse_args()
    if args.smoke:
        args.conversations, args.turns, args.questions, args.concurrency = 1, 2, 2, 1
        args.system_words, args.max_tokens = 200, 4
    args.logs.mkdir(parents=True, exist_ok=True)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    makers = {"chat": lambda: ChatWorkload(args.conversations, args.turns, args.turn_words, seed=1),
              "system-prompt": lambda: SystemPromptWorkload(args.questions, args.concurrency, args.system_words,
                                                            seed=2)}
    runs = [run_one(makers[w](), mode, args, args.logs) for _ in range(args.repeats)
            for w in args.workloads.split(",") for mode in args.modes.split(",")]  # repeats interleaved
    rows = merge(runs)
    cpu = cpu_model()
    print(f"\nCPU: {cpu}\n\n{table(rows)}")
    stem = "kv_fleet-smoke" if args.smoke else "kv_fleet"
    (args.out_dir / f"{stem}.json").write_text(json.dumps({"cpu": cpu, "args": {
        k: str(v) for k, v in vars(args).items()}, "rows": rows, "runs": runs}, indent=2) + "\n")
    plot(rows, args.out_dir / f"{stem}.png", f"kvfleet: 3 replicas, scale-up 2 -> 3 mid-run; {cpu}")
    print(f"\nwrote {args.out_dir / (stem + '.json')} and {stem}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
