"""``kvfleet bench compare``: one workload, several ways of serving it, on this machine.

For each concurrency level C (``--concurrency 8,32,64``) the same requests (random
token-id prompts, exact output lengths, greedy, EOS ignored) go through each system of
:mod:`kvfleet.runtime.bench.systems` (kvfleet's engine, transformers ``generate()`` on
static batches, transformers' continuous batching) with at most C requests in flight.
Reported per level: output token throughput (the workload's output tokens / wall time,
tokens/s), p99 e2e latency and mean TTFT, beside the compute roofline
(:mod:`kvfleet.runtime.bench.roofline`); then a KV-memory report (paged allocation vs
per-request reservation vs static padded batches). ``--output-json`` / ``--plot`` save it.

Definitions and results: docs/benchmarks.md, ``kvfleet bench compare``.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from datetime import UTC, datetime

import numpy as np

from kvfleet.runtime.bench.datasets import make_workload, parse_range, sample_lengths
from kvfleet.runtime.bench.machine import cpu_description
from kvfleet.runtime.bench.roofline import (
    ModelShape,
    Roofline,
    kv_memory_report,
    measure_matmul_flops,
    model_linear_weights,
    roofline,
    static_batch_flops,
)
from kvfleet.runtime.bench.systems import SYSTEM_LABELS, SYSTEMS, RunResult, build_runners

# --------------------------------------------------------------------------- report


def format_level_table(runs: list[RunResult], roof: Roofline | None = None) -> str:
    """Markdown table of one concurrency level with ratios to kvfleet."""
    ref = next((r for r in runs if r.system == "kvfleet" and not r.error), None)
    lines = [
        "| system | output tok/s | p99 e2e (s) | mean TTFT (s) | wall (s) | kvfleet speed-up "
        "| kvfleet p99 / system p99 |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in runs:
        if r.error and not r.report.get("completed"):
            lines.append(f"| {SYSTEM_LABELS.get(r.system, r.system)} | failed: {r.error} | | | | | |")
            continue
        tps, p99 = r.output_throughput, r.p99_e2e_s
        speed = f"{ref.output_throughput / tps:.2f}x" if ref and tps else "-"
        lat = f"{ref.p99_e2e_s / p99:.2f}" if ref and p99 else "-"
        note = f" ({r.error})" if r.error else ""
        lines.append(
            f"| {SYSTEM_LABELS.get(r.system, r.system)}{note} | {tps:.1f} | {p99:.2f} "
            f"| {r.report['mean_ttft_ms'] / 1e3:.2f} | {r.duration:.1f} | {speed} | {lat} |"
        )
    if roof is not None:
        share = f"kvfleet at {ref.output_throughput / roof.output_tokens_per_s:.0%} of it" if ref else ""
        lines.append(
            f"| compute roofline: {roof.gflop:.0f} GFLOP at {roof.peak_gflops_per_s:.0f} GFLOP/s "
            f"| {roof.output_tokens_per_s:.1f} | | | {roof.seconds:.1f} | {share} | |"
        )
    return "\n".join(lines)


def format_kv_table(rows: list[dict]) -> str:
    lines = [
        "| KV allocation | slots allocated | real tokens | share of slots holding real tokens | slots per sequence "
        "| max concurrent sequences in the budget |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['scheme']} | {r['allocated_slots']} | {r['real_tokens']} | {r['utilization']:.1%} "
            f"| {r['slots_per_seq']:.0f} | {r['max_concurrent_seqs']} |"
        )
    return "\n".join(lines)


def plot_compare(levels: dict[int, list[RunResult]], roofs: dict[int, Roofline], path: str, title: str) -> None:
    """Output tokens/s and p99 e2e latency per concurrency level and system, to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cs = sorted(levels)
    systems = [s for s in SYSTEMS if any(r.system == s for c in cs for r in levels[c])]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / max(len(systems), 1)
    x = np.arange(len(cs))
    for k, s in enumerate(systems):
        tps = [next((r.output_throughput for r in levels[c] if r.system == s), 0.0) for c in cs]
        p99 = [next((r.p99_e2e_s for r in levels[c] if r.system == s), 0.0) for c in cs]
        axes[0].bar(x + k * width, tps, width, label=SYSTEM_LABELS[s])
        axes[1].bar(x + k * width, p99, width, label=SYSTEM_LABELS[s])
    if roofs:
        axes[0].plot(
            x + width * (len(systems) - 1) / 2,
            [roofs[c].output_tokens_per_s if c in roofs else np.nan for c in cs],
            "k_",
            markersize=40,
            label="compute roofline",
        )
    for ax, ylabel in (
        (axes[0], "output tokens/s (higher is better)"),
        (axes[1], "p99 e2e latency, s (lower is better)"),
    ):
        ax.set_xticks(x + width * (len(systems) - 1) / 2, [f"C={c}" for c in cs])
        ax.set_ylabel(ylabel)
        ax.grid(True, axis="y", alpha=0.3)
    axes[0].legend(fontsize=8, loc="upper left")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------- CLI


def add_arguments(p) -> None:
    p.add_argument("--model", default=None, help="checkpoint dir, .gguf or hub id (default: SmolLM2-135M-Instruct)")
    p.add_argument("--concurrency", default="8,32,64", help="comma-separated concurrency levels (default %(default)s)")
    p.add_argument(
        "--num-prompts", type=int, default=None, help="requests per level (default: the level's concurrency)"
    )
    p.add_argument("--input-len-range", default="16:256", help="prompt tokens MIN:MAX, uniform (default %(default)s)")
    p.add_argument("--output-len-range", default="16:128", help="output tokens MIN:MAX, uniform (default %(default)s)")
    p.add_argument(
        "--length-dist",
        choices=["uniform", "lognormal"],
        default="uniform",
        help="uniform over the ranges, or lognormal (heavy-tailed like ShareGPT) with median sqrt(MIN*MAX), clipped",
    )
    p.add_argument("--sigma", type=float, default=1.0, help="shape of --length-dist lognormal")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"subset of {','.join(SYSTEMS)}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument(
        "--max-num-batched-tokens", type=int, default=None, help="kvfleet token budget per step (default: the engine's)"
    )
    p.add_argument(
        "--kv-cache-memory", type=int, default=None, help="KV budget, bytes (default: the engine's CPU default)"
    )
    p.add_argument(
        "--max-model-len", type=int, default=None, help="for the KV report (default: the model's context length)"
    )
    p.add_argument(
        "--kv-report-requests", type=int, default=1000, help="requests in the KV-memory report's mixed workload"
    )
    p.add_argument("--prefill-tokens", type=int, default=512, help="rows of the prefill-shaped matmul timing")
    p.add_argument("--output-json", default=None)
    p.add_argument("--plot", default=None, help="PNG: tokens/s and p99 latency per level")
    p.add_argument("--disable-tqdm", action="store_true")


def _levels_and_systems(args) -> tuple[list[int], list[str]]:
    """The concurrency levels and systems asked for; ValueError for bad ones."""
    levels = sorted({int(c) for c in str(args.concurrency).split(",") if c.strip()})
    if not levels or levels[0] < 1:
        raise ValueError("concurrency levels must be integers >= 1")
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        raise ValueError(f"unknown systems {sorted(unknown)}; choose from {SYSTEMS}")
    return levels, systems


def _measure_peaks(hf_model, prefill_tokens: int, levels: list[int]) -> tuple[float, dict[int, float]]:
    """The fp32 matmul FLOP/s at ``prefill_tokens`` rows, and at each level's rows."""
    print("measuring matmul FLOP/s on the model's shapes ...")
    peak_fps = measure_matmul_flops(
        model_linear_weights(hf_model, include_lm_head=False), prefill_tokens, min_seconds=0.3, repeats=5
    )
    decode_fps = {
        c: measure_matmul_flops(model_linear_weights(hf_model), c, min_seconds=0.3, repeats=3) for c in levels
    }
    print(
        f"matmul: {peak_fps / 1e9:.1f} GFLOP/s at {prefill_tokens} rows; "
        + ", ".join(f"{v / 1e9:.1f} at {c}" for c, v in decode_fps.items())
    )
    return peak_fps, decode_fps


def _run_level(c, wl, systems, runners, roof, shape, args, in_range, out_range) -> list[RunResult]:
    """Every system on workload ``wl`` at concurrency ``c``; prints the level's table."""
    from tqdm import tqdm

    runs = []
    for s in systems:
        bar = tqdm(total=len(wl), desc=f"C={c} {s}", unit="req", disable=args.disable_tqdm)
        try:
            run = runners[s](wl, c, bar)
        except Exception as exc:  # one failing system must not lose the others' figures
            run = RunResult(s, c, 0.0, error=f"{type(exc).__name__}: {exc}")
        bar.close()
        runs.append(run)
    print(
        f"\n### {len(wl)} requests, concurrency {c}, {args.length_dist} lengths: "
        f"prompts {in_range[0]}-{in_range[1]} tokens (total {sum(wl.prompt_lens)}), "
        f"outputs {out_range[0]}-{out_range[1]} tokens (total {sum(wl.output_lens)})\n"
    )
    print(format_level_table(runs, roof))
    waste = static_batch_flops(wl.prompt_lens, wl.output_lens, c, shape) / 1e9
    print(
        f"\nstatic batches of {c} compute {waste:.0f} GFLOP, {waste / roof.gflop:.2f}x the workload's "
        f"{roof.gflop:.0f} GFLOP (padding and past-the-end tokens)"
    )
    return runs


def _kv_report(args, hf_model, shape, in_range, out_range, max_level: int) -> list:
    """The KV memory table of ``--kv-report-requests`` sampled requests (printed, returned)."""
    from kvfleet.runtime.config import DEFAULT_KV_CACHE_MEMORY

    max_len = args.max_model_len or int(getattr(hf_model.config, "max_position_embeddings", 0) or 2048)
    budget = args.kv_cache_memory or DEFAULT_KV_CACHE_MEMORY
    kv_p, kv_o = sample_lengths(
        args.kv_report_requests, in_range, out_range, args.seed + 7, args.length_dist, args.sigma
    )
    kv_rows = kv_memory_report(kv_p, kv_o, args.block_size, max_len, shape.kv_bytes_per_token(4), budget, max_level)
    print(
        f"\n### KV memory: {args.kv_report_requests} requests, {args.length_dist} lengths, "
        f"prompts {in_range[0]}-{in_range[1]}, outputs {out_range[0]}-{out_range[1]} tokens; "
        f"{shape.kv_bytes_per_token(4)} KV bytes per token (fp32), budget {budget / 2**30:.2f} GiB = "
        f"{budget // shape.kv_bytes_per_token(4)} token slots\n"
    )
    print(format_kv_table(kv_rows))
    return kv_rows


def main(args) -> int:
    """Run ``kvfleet bench compare`` with parsed arguments; returns the exit status."""
    import torch

    from kvfleet.runtime.bench.serve import source_revision
    from kvfleet.runtime.worker.model_loader import load_model, resolve_model_path

    levels, systems = _levels_and_systems(args)
    in_range, out_range = parse_range(args.input_len_range), parse_range(args.output_len_range)
    if args.threads:
        torch.set_num_threads(args.threads)
    started = datetime.now(UTC)
    print(
        f"kvfleet bench compare on {cpu_description()}, torch {torch.__version__} "
        f"with {torch.get_num_threads()} threads, "
        f"{started:%Y-%m-%d %H:%M} UTC, kvfleet {source_revision() or 'outside git'}"
    )

    model_path, model_name = resolve_model_path(args.model)
    loaded = load_model(model_path, dtype="float32", device="cpu")
    hf_model, tok = loaded.model, loaded.tokenizer
    shape = ModelShape.from_config(hf_model.config)
    pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    special = getattr(tok, "all_special_ids", []) or []
    n_max = max(args.num_prompts or c for c in levels)
    full = make_workload(n_max, in_range, out_range, shape.vocab_size, special, args.seed, args.length_dist, args.sigma)
    peak_fps, decode_fps = _measure_peaks(hf_model, args.prefill_tokens, levels)

    runners = build_runners(systems, hf_model, pad, model_path, args)
    by_level: dict[int, list[RunResult]] = {}
    roofs: dict[int, Roofline] = {}
    for c in levels:
        wl = full.take(args.num_prompts or c)
        roofs[c] = roofline(wl, shape, peak_fps, decode_fps[c])
        by_level[c] = _run_level(c, wl, systems, runners, roofs[c], shape, args, in_range, out_range)
    kv_rows = _kv_report(args, hf_model, shape, in_range, out_range, max(levels))

    if args.output_json:
        doc = {
            "date": started.isoformat(timespec="seconds"),
            "cpu": cpu_description(),
            "kvfleet_revision": source_revision(),
            "torch_threads": torch.get_num_threads(),
            "model": model_name,
            "args": {k: v for k, v in vars(args).items()},
            "matmul_gflops_per_s": {
                f"rows_{args.prefill_tokens}": peak_fps / 1e9,
                **{f"rows_{c}": v / 1e9 for c, v in decode_fps.items()},
            },
            "levels": {
                str(c): {
                    "roofline": asdict(roofs[c]),
                    "runs": [
                        {"system": r.system, "duration": r.duration, "error": r.error, **r.report} for r in by_level[c]
                    ],
                }
                for c in levels
            },
            "kv_memory": kv_rows,
        }
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1, default=str)
        print(f"wrote {args.output_json}")
    if args.plot:
        plot_compare(by_level, roofs, args.plot, f"{model_name}, fp32, {cpu_description()}")
        print(f"wrote {args.plot}")
    failed = [r for rs in by_level.values() for r in rs if r.error]
    return 1 if failed else 0
