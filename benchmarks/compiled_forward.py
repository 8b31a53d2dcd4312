"""Eager vs compiled forward (issue 14), the default model on this machine (a benchmark, not a test).

    python benchmarks/compiled_forward.py --dtype float32 --mode eager compiled
    python benchmarks/compiled_forward.py --dtype bfloat16 --mode compiled --json out.json

For each mode, one engine in this process: its construction time (the compiled one includes the
warm-up); then ``--rounds`` rounds, the modes interleaved in each (so a busy machine slows them
alike), of one stream (a 128-token prompt, 256 new tokens, greedy, EOS ignored) and ``--batch``
requests at once (prompts of 128-384 tokens, 64-128 new tokens): output tok/s, and dynamo's graph /
recompile counts. The greedy tokens of the one stream are compared between modes.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from kvfleet.runtime.bench.machine import cpu_description


def build(mode: str, args) -> dict:
    """One engine for ``mode`` (eager or compiled), with its start-up time and compile counts."""
    import torch

    from kvfleet.runtime.config import EngineConfig
    from kvfleet.runtime.engine.llm_engine import LLMEngine
    from kvfleet.runtime.llm import LLM
    from kvfleet.runtime.worker.compilation import compile_counts

    t0 = time.perf_counter()
    engine = LLMEngine(EngineConfig(dtype=args.dtype, device=args.device, enforce_eager=(mode == "eager"),
                                    compile_sizes=args.compile_sizes, max_num_seqs=max(64, args.batch)))
    start_s = time.perf_counter() - t0
    compiled = engine.runner.compiled
    rec = dict(mode=mode, dtype=args.dtype, engine_start_s=round(start_s, 1),
               warmup_s=round(compiled.warmup_seconds if compiled else 0.0, 1),
               compile_sizes=compiled.compile_sizes if compiled else None,
               counts_after_warmup=compile_counts(), threads=torch.get_num_threads(), rounds=[])
    print(json.dumps(rec), flush=True)
    return dict(rec=rec, llm=LLM.from_engine(engine), vocab=engine.runner.vocab_size)


def measure(run: dict, args, round_no: int) -> None:
    """One round on ``run``'s engine: the one stream, then ``--batch`` requests at once (the same
    seeded prompts for every mode and round)."""
    from kvfleet.runtime.sampling_params import SamplingParams
    from kvfleet.runtime.worker.compilation import compile_counts

    llm, rng = run["llm"], random.Random(0)
    stream_prompt = [rng.randrange(100, run["vocab"]) for _ in range(128)]
    t = time.perf_counter()
    out = llm.generate([stream_prompt], SamplingParams(temperature=0, max_tokens=args.stream_tokens,
                                                       ignore_eos=True), use_tqdm=False)[0]
    stream_s = time.perf_counter() - t
    stream_tokens = list(out.outputs[0].token_ids)
    prompts = [[rng.randrange(100, run["vocab"]) for _ in range(rng.randrange(128, 385))] for _ in range(args.batch)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randrange(64, 129), ignore_eos=True) for _ in prompts]
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False) if args.batch else []
    batch_s = time.perf_counter() - t
    batch_out = sum(len(o.outputs[0].token_ids) for o in outs)
    r = dict(round=round_no, stream_tok_s=round(len(stream_tokens) / stream_s, 2), stream_s=round(stream_s, 2),
             batch=args.batch, batch_output_tokens=batch_out, batch_prompt_tokens=sum(map(len, prompts)),
             batch_tok_s=round(batch_out / batch_s, 1) if batch_s and batch_out else None, batch_s=round(batch_s, 1),
             counts=compile_counts(), load_average=os.getloadavg()[0])
    print(json.dumps(dict(mode=run["rec"]["mode"], **r)), flush=True)
    run["rec"]["rounds"].append(r)
    run["rec"]["stream_tokens"] = stream_tokens


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--mode", nargs="+", default=["eager", "compiled"], choices=["eager", "compiled"])
    ap.add_argument("--batch", type=int, default=48)
    ap.add_argument("--stream-tokens", type=int, default=256)
    ap.add_argument("--compile-sizes", default=None, help="static graph sizes, e.g. 1,2,4,8 (default: the engine's)")
    ap.add_argument("--rounds", type=int, default=2, help="measurement rounds, the modes interleaved in each")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    print(f"CPU: {cpu_description()}; load average {os.getloadavg()}", flush=True)
    runs = [build(m, args) for m in args.mode]
    for i in range(args.rounds):
        for run in runs:
            measure(run, args, i)
    recs = [run["rec"] for run in runs]
    if len(recs) == 2:
        a, b = recs[0]["stream_tokens"], recs[1]["stream_tokens"]
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        print(f"one stream: greedy tokens agree on the first {same} of {len(a)}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(cpu=cpu_description(), argv=sys.argv[1:], runs=recs), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
