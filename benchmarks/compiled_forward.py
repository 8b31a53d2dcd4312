"""Eager vs compiled forward (issue 14), the default model on this machine (a benchmark, not a test).

    python benchmarks/compiled_forward.py --dtype float32 --mode eager compiled
    python benchmarks/compiled_forward.py --dtype bfloat16 --mode compiled --json out.json

For each mode, one engine: its construction time (the compiled one includes the warm-up), one
stream (a 128-token prompt, 256 new tokens, greedy, EOS ignored) and ``--batch`` requests at once
(prompts of 128-384 tokens, 64-128 new tokens), output tok/s, and dynamo's graph / recompile
counts after warm-up. The greedy tokens of the one stream are compared between modes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def run_mode(mode: str, args) -> dict:
    import torch

    from kvfleet.runtime.config import EngineConfig
    from kvfleet.runtime.engine.llm_engine import LLMEngine
    from kvfleet.runtime.llm import LLM
    from kvfleet.runtime.sampling_params import SamplingParams
    from kvfleet.runtime.worker.compilation import compile_counts

    t0 = time.perf_counter()
    engine = LLMEngine(EngineConfig(dtype=args.dtype, device=args.device, enforce_eager=(mode == "eager"),
                                    max_num_seqs=max(64, args.batch)))
    start_s = time.perf_counter() - t0
    llm = LLM.from_engine(engine)
    warm = engine.runner.compiled.warmup_seconds if engine.runner.compiled else 0.0
    after_warmup = compile_counts()
    rng = random.Random(0)
    vocab = engine.runner.vocab_size
    stream_prompt = [rng.randrange(100, vocab) for _ in range(128)]
    t = time.perf_counter()
    out = llm.generate([stream_prompt], SamplingParams(temperature=0, max_tokens=args.stream_tokens,
                                                       ignore_eos=True), use_tqdm=False)[0]
    stream_s = time.perf_counter() - t
    stream_tokens = list(out.outputs[0].token_ids)
    prompts = [[rng.randrange(100, vocab) for _ in range(rng.randrange(128, 385))] for _ in range(args.batch)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randrange(64, 129), ignore_eos=True) for _ in prompts]
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    batch_s = time.perf_counter() - t
    batch_out = sum(len(o.outputs[0].token_ids) for o in outs)
    rec = dict(mode=mode, dtype=args.dtype, engine_start_s=round(start_s, 1), warmup_s=round(warm, 1),
               stream_tok_s=round(len(stream_tokens) / stream_s, 2), stream_s=round(stream_s, 2),
               batch=args.batch, batch_output_tokens=batch_out, batch_prompt_tokens=sum(map(len, prompts)),
               batch_tok_s=round(batch_out / batch_s, 1), batch_s=round(batch_s, 1),
               counts_after_warmup=after_warmup, counts_end=compile_counts(), threads=torch.get_num_threads())
    print(json.dumps(rec), flush=True)
    rec["stream_tokens"] = stream_tokens
    return rec


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--mode", nargs="+", default=["eager", "compiled"], choices=["eager", "compiled"])
    ap.add_argument("--batch", type=int, default=48)
    ap.add_argument("--stream-tokens", type=int, default=256)
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    print(f"CPU: {cpu_model()}; load average {os.getloadavg()}", flush=True)
    recs = [run_mode(m, args) for m in args.mode]
    if len(recs) == 2:
        a, b = recs[0]["stream_tokens"], recs[1]["stream_tokens"]
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        print(f"one stream: greedy tokens agree on the first {same} of {len(a)}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(cpu=cpu_model(), argv=sys.argv[1:], runs=recs), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
