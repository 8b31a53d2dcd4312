"""Weight-only quantization, measured: memory, accuracy and speed of fp32, bf16, int8, int4.

For every variant (``fp32``, ``bf16``, ``int8``, ``int4``; a quantized one's activations in
``--quant-dtype``, default float32; ``+compiled`` appended runs it with ``enforce_eager=False``,
``+kvf32`` / ``+kvbf16`` with ``kv_cache_dtype`` float32 / bfloat16, e.g. ``fp32+kvbf16``;
``--kv-cache-dtype`` sets it for every variant) on the default model (SmolLM2-135M-Instruct) through the engine:

- memory: weight bytes of the replica (``LoadedModel.weight_bytes``: parameters and buffers
  as stored, tied tensors once);
- accuracy: greedy-token agreement with the bf16 variant on a fixed prompt set (8 prompts x 32
  tokens, EOS ignored): the share of positions with the same token, and the mean length of the
  common prefix; perplexity of a fixed text (public domain, below) from the engine's prompt
  logprobs;
- speed: one stream (128-token prompt, 256 new tokens, EOS ignored: output tok/s) and 48
  requests at once (prompts 16-420 tokens, outputs 16-148, fixed seed; ~10.6k prompt / ~3.9k
  output tokens as issue 14's throughput workload: output tok/s over the wall time).

Usage (not a test; minutes per variant on 2 shared cores; docs/performance.md has the
reduced flags of the last run):

    PYTHONSAFEPATH=1 nice -n 5 .venv/bin/python benchmarks/quantization.py \\
        --json benchmarks/results/quantization-cpu.json

Prints a markdown table (docs/performance.md, "Weight-only quantization").
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from kvfleet.runtime.bench.machine import cpu_description
from kvfleet.runtime.config import EngineConfig
from kvfleet.runtime.engine.llm_engine import LLMEngine
from kvfleet.runtime.llm import LLM
from kvfleet.runtime.sampling_params import SamplingParams
from kvfleet.runtime.worker.model_loader import load_model

PROMPTS = [
    "Hello, my name is",
    "The capital of France is a city that",
    "def fibonacci(n):\n    ",
    "Write a short poem about the sea. " * 3,
    "List three colours: red, green, and then",
    "In 1492, Columbus sailed " + "across the ocean blue and " * 12,
    "Q: What is 2 + 2? Answer briefly, then explain why.\nA:",
    "The history of the Roman Empire spans many centuries. " * 10,
]
AGREE_TOKENS = 32
"""Default tokens per prompt of the agreement set (``--agree-tokens``)."""

# The opening of the United States Declaration of Independence (1776, public domain).
TEXT = (
    "When in the Course of human events, it becomes necessary for one people to dissolve the political "
    "bands which have connected them with another, and to assume among the powers of the earth, the "
    "separate and equal station to which the Laws of Nature and of Nature's God entitle them, a decent "
    "respect to the opinions of mankind requires that they should declare the causes which impel them to "
    "the separation. We hold these truths to be self-evident, that all men are created equal, that they "
    "are endowed by their Creator with certain unalienable Rights, that among these are Life, Liberty and "
    "the pursuit of Happiness. That to secure these rights, Governments are instituted among Men, deriving "
    "their just powers from the consent of the governed, That whenever any Form of Government becomes "
    "destructive of these ends, it is the Right of the People to alter or to abolish it, and to institute "
    "new Government, laying its foundation on such principles and organizing its powers in such form, as "
    "to them shall seem most likely to effect their Safety and Happiness. Prudence, indeed, will dictate "
    "that Governments long established should not be changed for light and transient causes; and "
    "accordingly all experience hath shewn, that mankind are more disposed to suffer, while evils are "
    "sufferable, than to right themselves by abolishing the forms to which they are accustomed."
)


def variant_config(name: str, quant_dtype: str, kv_cache_dtype: str = "auto") -> dict:
    base, *modes = name.split("+")
    cfg: dict = {"device": "cpu", "kv_cache_memory": 1024**3, "max_num_batched_tokens": 2048,
                 "kv_cache_dtype": {"kvf32": "float32", "kvbf16": "bfloat16"}.get(
                     next((m for m in modes if m.startswith("kv")), ""), kv_cache_dtype)}
    if base in ("fp32", "bf16"):
        cfg["dtype"] = {"fp32": "float32", "bf16": "bfloat16"}[base]
    else:
        cfg.update(dtype=quant_dtype, quantization=base)
    if "compiled" in modes:
        cfg["enforce_eager"] = False
    return cfg


def greedy(llm: LLM, prompts, max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def perplexity(llm: LLM) -> float:
    out = llm.generate([TEXT], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    ids = out.prompt_token_ids
    lps = [entry[tok].logprob for tok, entry in zip(ids[1:], out.prompt_logprobs[1:], strict=True)]
    return math.exp(-sum(lps) / len(lps))


def throughput_workload(vocab: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, vocab - 100) for _ in range(rng.randint(16, 420))] for _ in range(48)]
    outputs = [rng.randint(16, 148) for _ in range(48)]
    return prompts, outputs


def measure(name: str, args) -> dict:
    cfg = variant_config(name, args.quant_dtype, args.kv_cache_dtype)
    t0 = time.monotonic()
    loaded = load_model(None, dtype=cfg["dtype"], device="cpu", quantization=cfg.get("quantization"))
    engine = LLMEngine(EngineConfig(**cfg), loaded=loaded)
    startup = time.monotonic() - t0
    llm = LLM.from_engine(engine)
    row = {"variant": name, "config": cfg, "weight_bytes": loaded.weight_bytes, "startup_s": round(startup, 1)}
    print(f"{name}: started in {startup:.1f} s", file=sys.stderr, flush=True)
    row["greedy"] = greedy(llm, PROMPTS, args.agree_tokens)
    row["perplexity"] = perplexity(llm)
    print(f"{name}: accuracy done at {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
    rng = random.Random(1)
    stream_prompt = [rng.randrange(100, engine.vocab_size - 100) for _ in range(128)]
    greedy(llm, [stream_prompt[:16]], 8)  # warm
    t = time.monotonic()
    greedy(llm, [stream_prompt], args.stream_tokens)
    row["one_stream_tok_s"] = args.stream_tokens / (time.monotonic() - t)
    if not args.skip_throughput:
        prompts, outputs = throughput_workload(engine.vocab_size)
        prompts, outputs = prompts[: args.requests], outputs[: args.requests]
        row["throughput_requests"] = len(prompts)
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in outputs]
        t = time.monotonic()
        llm.generate(prompts, params, use_tqdm=False)
        row["throughput_tok_s"] = sum(outputs) / (time.monotonic() - t)
    engine.shutdown()
    print(f"{name}: {json.dumps({k: v for k, v in row.items() if k != 'greedy'})}", file=sys.stderr, flush=True)
    return row


def agreement(tokens: list[list[int]], ref: list[list[int]]) -> tuple[float, float]:
    same = sum(a == b for t, r in zip(tokens, ref, strict=True) for a, b in zip(t, r, strict=True))
    prefix = []
    for t, r in zip(tokens, ref, strict=True):
        n = 0
        while n < len(r) and t[n] == r[n]:
            n += 1
        prefix.append(n)
    return same / sum(len(r) for r in ref), sum(prefix) / len(prefix)


def print_table(rows: list[dict]) -> None:
    """The markdown table; agreement is against the bf16 row (else the first)."""
    ref = next((r["greedy"] for r in rows if r["variant"] == "bf16"), rows[0]["greedy"])
    fp32 = next((r["greedy"] for r in rows if r["variant"] == "fp32"), ref)
    print("| variant | weights MiB | token agreement with bf16 | common prefix (tokens) | agreement with fp32 | "
          "perplexity | one stream tok/s | requests at once: output tok/s |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        share, prefix = agreement(r["greedy"], ref)
        r["agreement_with_bf16"], r["common_prefix"] = share, prefix
        thr = f"{r['throughput_tok_s']:.1f} ({r['throughput_requests']})" if "throughput_tok_s" in r else "-"
        print(f"| {r['variant']} | {r['weight_bytes'] / 2**20:.0f} | {share:.0%} | {prefix:.1f} of "
              f"{len(r['greedy'][0])} | {agreement(r['greedy'], fp32)[0]:.0%} | "
              f"{r['perplexity']:.2f} | {r['one_stream_tok_s']:.1f} | {thr} |")  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", nargs="+", default=["fp32", "bf16", "int8", "int4"])
    p.add_argument("--quant-dtype", default="float32", help="activation dtype of the quantized variants")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="the KV cache dtype of variants without +kvf32 / +kvbf16")
    p.add_argument("--stream-tokens", type=int, default=256)
    p.add_argument("--skip-throughput", action="store_true")
    p.add_argument("--requests", type=int, default=48, help="the first N requests of the 48-request workload")
    p.add_argument("--agree-tokens", type=int, default=AGREE_TOKENS)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", help="write the results here")
    p.add_argument("--merge", nargs="+", metavar="JSON", help="print the table of earlier --json files (no run)")
    args = p.parse_args()
    if args.merge:
        rows = [r for path in args.merge for r in json.load(open(path))["rows"]]
        print_table(rows)
        return 0
    torch.set_num_threads(args.threads)
    rows = [measure(v, args) for v in args.variants]
    print(f"CPU: {cpu_description()}, torch {torch.__version__}, {args.threads} threads, load average "
          f"{os.getloadavg()[0]:.1f}; quantized variants' activations in {args.quant_dtype}")  # fmt: skip
    print_table(rows)
    if args.json:
        meta = {"cpu": cpu_description(), "torch": torch.__version__, "threads": args.threads,
                "loadavg": os.getloadavg(), "argv": sys.argv}  # fmt: skip
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
