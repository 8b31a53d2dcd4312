"""Grammar cost of structured outputs (issue 15): a benchmark, not a test.

    nice -n 10 python benchmarks/structured_output.py --batch 1 16 --tokens 24 --json out.json

Engine level (``LLMEngine`` on the default model, no server). Two measurements:

1. Decode step time at each ``--batch`` size, ``json_schema`` vs ``none``: ``B`` requests of one
   prompt, ``--tokens`` new tokens each (a schema whose output cannot end before that: an array of
   at least 64 short strings, so both runs end by ``max_tokens``); the mean time of the steps in
   which all ``B`` requests decode, and the part of each constrained step spent filling and applying
   the token bitmask (``StructuredOutputManager.apply_bitmask``, timed inside the step). The two
   kinds alternate ``--repeats`` times, so a machine whose load changes hurts both alike.
2. Time to first token of one constrained request: with the xgrammar ``TokenizerInfo`` not yet
   built (the first structured request an engine sees), with a schema never seen (cold compile),
   and the same schema again (cached); and the compile alone (``grammar_init(spec).result()``),
   cold and cached. Each schema is made unique by a random property name. On a loaded machine the
   TTFTs differ by the prefill's noise; the compile times are the grammar's share.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from kvfleet.runtime.bench.machine import cpu_description

LONG_SCHEMA = {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 64}


def person_schema(tag: str) -> dict:
    return {"type": "object", "properties": {
        f"name_{tag}": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string",
                                                                                        "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"]}},
        "required": [f"name_{tag}", "age", "role", "tags", "address"]}  # fmt: skip




def decode_steps(engine, batch: int, tokens: int, constrained: bool, ids: iter) -> dict:
    from kvfleet.runtime.sampling_params import SamplingParams, StructuredOutputsParams

    prompt = engine.tokenizer.encode("List some short words as a JSON array:")
    spec = StructuredOutputsParams(json=LONG_SCHEMA) if constrained else None
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, structured_outputs=spec)
    for _ in range(batch):
        engine.add_request(f"r{next(ids)}", prompt, params)
    mask_time = [0.0]
    apply = engine.structured_output.apply_bitmask

    def timed(logits, requests):
        t = time.perf_counter()
        n = apply(logits, requests)
        mask_time[0] += time.perf_counter() - t
        return n

    engine.structured_output.apply_bitmask = timed
    steps, masks = [], []
    try:
        while engine.has_unfinished_requests():
            running_decode = engine.num_running == batch and engine.num_waiting == 0
            mask_time[0] = 0.0
            t = time.perf_counter()
            engine.step()
            if running_decode and engine.num_running == batch:
                steps.append(time.perf_counter() - t)
                masks.append(mask_time[0])
    finally:
        engine.structured_output.apply_bitmask = apply
    return {"steps": len(steps), "step_ms": 1e3 * statistics.mean(steps), "mask_ms": 1e3 * statistics.mean(masks)}


def ttft(engine, spec, rid: str) -> float:
    from kvfleet.runtime.sampling_params import SamplingParams

    prompt = engine.tokenizer.encode("Describe a person as JSON:")
    t = time.perf_counter()
    engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=1, structured_outputs=spec))
    while engine.has_unfinished_requests():
        engine.step()
    return 1e3 * (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import itertools

    import torch

    from kvfleet.runtime.config import EngineConfig
    from kvfleet.runtime.engine.llm_engine import LLMEngine
    from kvfleet.runtime.sampling_params import StructuredOutputsParams

    engine = LLMEngine(EngineConfig(dtype=args.dtype, max_num_seqs=max(args.batch)))
    ids = itertools.count()
    rng = random.Random()
    result: dict = {"cpu": cpu_description(), "threads": torch.get_num_threads(), "load_avg": os.getloadavg(),
                    "dtype": args.dtype, "tokens": args.tokens, "ttft_ms": {}, "decode": {}}  # fmt: skip
    spec = StructuredOutputsParams(json=person_schema(f"{rng.randrange(10**9)}"))
    result["ttft_ms"]["first_with_tokenizer_info"] = ttft(engine, spec, "t0")
    cold, cached = [], []
    ttft(engine, None, "warm")  # the unconstrained path warmed too
    for i in range(3):
        spec = StructuredOutputsParams(json=person_schema(f"{rng.randrange(10**9)}"))
        cold.append(ttft(engine, spec, f"c{i}"))
        cached.append(ttft(engine, spec, f"h{i}"))
    result["ttft_ms"]["cold_compile"] = statistics.median(cold)
    result["ttft_ms"]["cached"] = statistics.median(cached)
    result["ttft_ms"]["none"] = statistics.median(ttft(engine, None, f"n{i}") for i in range(3))
    compile_cold, compile_cached = [], []
    for _ in range(5):
        spec = StructuredOutputsParams(json=person_schema(f"{rng.randrange(10**9)}"))
        t = time.perf_counter()
        engine.structured_output.grammar_init(spec).result()
        compile_cold.append(1e3 * (time.perf_counter() - t))
        t = time.perf_counter()
        engine.structured_output.grammar_init(spec).result()
        compile_cached.append(1e3 * (time.perf_counter() - t))
    result["compile_ms"] = {"cold": statistics.median(compile_cold), "cached": statistics.median(compile_cached)}
    for batch in args.batch:
        runs: dict[str, list[dict]] = {"none": [], "json_schema": []}
        for _ in range(args.repeats):
            for kind in ("none", "json_schema"):
                runs[kind].append(decode_steps(engine, batch, args.tokens, kind == "json_schema", ids))
        none = statistics.mean(r["step_ms"] for r in runs["none"])
        constrained = statistics.mean(r["step_ms"] for r in runs["json_schema"])
        mask = statistics.mean(r["mask_ms"] for r in runs["json_schema"])
        result["decode"][str(batch)] = {"none_step_ms": none, "json_schema_step_ms": constrained,
                                        "bitmask_ms": mask, "slowdown": constrained / none - 1,
                                        "bitmask_share": mask / constrained, "runs": runs}  # fmt: skip
        print(f"batch {batch:3d}: step {none:7.2f} ms none, {constrained:7.2f} ms json_schema "
              f"({100 * (constrained / none - 1):+.1f} %); bitmask {mask:.2f} ms ({100 * mask / constrained:.1f} % "
              "of the step)", flush=True)
    t = result["ttft_ms"]
    print(f"TTFT: first structured request {t['first_with_tokenizer_info']:.0f} ms, cold compile "
          f"{t['cold_compile']:.0f} ms, cached {t['cached']:.0f} ms, unconstrained {t['none']:.0f} ms; compile alone "
          f"{result['compile_ms']['cold']:.1f} ms cold, {result['compile_ms']['cached']:.3f} ms cached")
    result["load_avg_after"] = os.getloadavg()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
