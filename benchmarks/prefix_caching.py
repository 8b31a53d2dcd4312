"""Prefix caching on a shared-system-prompt workload: TTFT and output throughput with the
cache on vs off, in one process on the same machine (issue 5's benchmark).

Workload: one system prompt of ``--system-tokens`` tokens, ``--num-requests`` short
questions behind it, all submitted at once, greedy, ``--output-len`` tokens each
(ignore_eos, so both runs do the same work). The first request of the "on" run finds the
cache cold, like a freshly started server; nothing is warmed up beforehand.

    python benchmarks/prefix_caching.py                 # 1,000-token system prompt, 64 questions
    python benchmarks/prefix_caching.py --num-requests 16 --system-tokens 500

TTFT is arrival to first token (seconds); output throughput is output tokens / wall time.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from kvfleet.runtime.bench.metrics import summarize
from kvfleet.runtime.config import EngineConfig
from kvfleet.runtime.engine.llm_engine import LLMEngine
from kvfleet.runtime.sampling_params import SamplingParams
from kvfleet.runtime.worker.model_loader import load_model

TOPICS = ["rivers", "prime numbers", "volcanoes", "bread", "owls", "chess", "copper", "tides",
          "glaciers", "violins", "bees", "comets", "maple trees", "lighthouses", "salt", "kites"]


def build_prompts(tokenizer, system_tokens: int, num_requests: int) -> list[list[int]]:
    text = ("You are a helpful, careful assistant for a science museum. Answer visitors' questions "
            "accurately and briefly, in plain language, without jargon. ") * 200
    system = tokenizer(text, add_special_tokens=False)["input_ids"][:system_tokens]
    prompts = []
    for i in range(num_requests):
        question = f"\nVisitor {i}: Tell me one surprising fact about {TOPICS[i % len(TOPICS)]}.\nAssistant:"
        prompts.append(system + tokenizer(question, add_special_tokens=False)["input_ids"])
    return prompts


def run(loaded, prompts, caching: bool, output_len: int, args) -> dict:
    config = EngineConfig(enable_prefix_caching=caching, max_num_seqs=args.max_num_seqs,
                          max_num_batched_tokens=args.max_num_batched_tokens)
    engine = LLMEngine(config, loaded=loaded)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    start = time.monotonic()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params, arrival_time=start)
    ttft, outputs = [], {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
                ttft.append(out.metrics.first_token_time - out.metrics.arrival_time)
    wall = time.monotonic() - start
    num_out = sum(len(o.outputs[0].token_ids) for o in outputs.values())
    cached = sum(o.num_cached_tokens for o in outputs.values())
    return {"ttft": summarize(ttft, [50, 99]), "throughput": num_out / wall, "wall": wall,
            "cached_tokens": cached, "tokens": {k: o.outputs[0].token_ids for k, o in outputs.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--system-tokens", type=int, default=1000)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    args = parser.parse_args()

    loaded = load_model(None, dtype="float32", device="cpu")
    prompts = build_prompts(loaded.tokenizer, args.system_tokens, args.num_requests)
    off = run(loaded, prompts, False, args.output_len, args)
    on = run(loaded, prompts, True, args.output_len, args)
    same = off["tokens"] == on["tokens"]
    print(f"workload: {args.num_requests} requests, {args.system_tokens}-token shared system prompt, "
          f"{args.output_len} output tokens each, all at once; default model, fp32, {os.cpu_count()} CPUs")
    print(f"{'':>22}{'cache off':>12}{'cache on':>12}{'on/off':>10}")
    for label, key in (("TTFT p50 (s)", "p50"), ("TTFT p99 (s)", "p99")):
        a, b = off["ttft"][key], on["ttft"][key]
        print(f"{label:>22}{a:>12.3f}{b:>12.3f}{b / a:>10.3f}")
    ratio = on["throughput"] / off["throughput"]
    print(f"{'output tok/s':>22}{off['throughput']:>12.1f}{on['throughput']:>12.1f}{ratio:>10.2f}")
    print(f"{'prompt tokens cached':>22}{off['cached_tokens']:>12}{on['cached_tokens']:>12}")
    print(f"greedy outputs identical on/off: {same}")


if __name__ == "__main__":
    main()
