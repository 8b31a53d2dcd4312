"""Pipeline parallelism on this machine: greedy decode throughput of one process, pp=2 with one
micro-batch in flight, and pp=2 with two (the stages overlap), each in its own interpreter (one
parallel engine per process). Two groups of requests, the second sent while the first one's step
is in flight, so that with two micro-batches the groups take turns.

    python benchmarks/pipeline_overlap.py [--model PATH] [--requests 8] [--tokens 32]

Prints one JSON line per run: ``pp``, ``micro_batches``, output tokens, seconds, tokens/s, and
whether the tokens equal the one-process run's. On a shared 2-core machine the ratios are noisy:
take them from one run only.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def run(model: str | None, pp: int, depth: int, requests: int, tokens: int) -> dict:
    from kvfleet.runtime.config import EngineConfig
    from kvfleet.runtime.engine.llm_engine import LLMEngine
    from kvfleet.runtime.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model=model, device="cpu", dtype="float32", kv_cache_memory=256 * 2**20,
                                    pipeline_parallel_size=pp))
    engine.micro_batches.depth = depth
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    prompts = [f"Request {i}: write a short story about the number {i}." for i in range(requests)]
    engine.step()  # warm-up: an empty step
    t0 = time.perf_counter()
    for i in range(requests // 2):
        engine.add_request(str(i), prompts[i], params)
    final, steps = {}, 0
    while engine.has_unfinished_requests() or steps == 0:
        if steps == 1:
            for i in range(requests // 2, requests):
                engine.add_request(str(i), prompts[i], params)
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out.outputs[0].token_ids
        steps += 1
    seconds = time.perf_counter() - t0
    engine.shutdown()
    n = sum(len(t) for t in final.values())
    return {"pp": pp, "micro_batches": depth, "output_tokens": n, "seconds": round(seconds, 2),
            "tok_per_s": round(n / seconds, 1), "steps": steps,
            "tokens": {k: final[k] for k in sorted(final, key=int)}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # "pp,depth": one run in this process
    args = parser.parse_args()
    if args.one:
        pp, depth = map(int, args.one.split(","))
        print(json.dumps(run(args.model, pp, depth, args.requests, args.tokens)))
        return
    reference = None
    for pp, depth in ((1, 1), (2, 1), (2, 2)):
        cmd = [sys.executable, __file__, "--one", f"{pp},{depth}", "--requests", str(args.requests),
               "--tokens", str(args.tokens)] + (["--model", args.model] if args.model else [])
        out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONSAFEPATH": "1"})
        if out.returncode:
            sys.exit(out.stderr[-3000:])
        result = json.loads(out.stdout.strip().splitlines()[-1])
        reference = reference or result["tokens"]
        result["equal_to_one_process"] = result.pop("tokens") == reference
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
