"""Tensor parallelism on the fused C decoder vs transformers' modules (issue 40; a benchmark, not a test).

    nice -n 10 python benchmarks/tp_fused.py                      # TP=2, 1 and 16 requests
    nice -n 10 python benchmarks/tp_fused.py --concurrency 1 48 --json /tmp/tp-fused.json

The model: a random-weight Llama of SmolLM2-135M's sizes (30 layers, hidden 576, MLP 1536, vocabulary
49152, float32) but 8 query heads of 72 and 2 KV heads, so that 2 ranks split it (the default
SmolLM2-135M's 9 and 3 heads take 3); ``--model`` takes another checkpoint. Weights do not change
the cost of a step (greedy, EOS ignored). For each ``--concurrency`` C: C requests at once
(``--prompt-len`` prompt tokens, ``--max-tokens`` new tokens each) through ``LLMEngine`` steps, in
one invocation, each configuration in turn, ``--rounds`` rounds interleaved, the best of each:

- ``tp2 torch``: ``--tensor-parallel-size 2`` with ``$KVFLEET_CPU_DECODER=0`` (transformers' modules
  with their all-reduces: the path before this change);
- ``tp2 fused``: the same ranks, each running the fused C step on its shard, the all-reduces inside
  it (kernels/cpu_tp.h), the LM head on each rank's vocabulary rows, gathered;
- ``tp1 fused``: one process (the reference: on a 2-core machine two ranks have little to win).

Prints output tokens/s, the ratio of the fused TP run to the torch one, and the fused step's
milliseconds per step in its all-reduces (rank 0's ``tp`` profile phase: the wait for the other
rank included). ``--dtype float32`` on both sides (tensor parallelism keeps float32 shards).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from kvfleet.runtime.bench.machine import cpu_description

CONFIGS = ("tp2 torch", "tp2 fused", "tp1 fused")


def write_model(path: str) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=72, max_position_embeddings=2048,
                         tie_word_embeddings=True, rope_theta=100000.0)
    LlamaForCausalLM(config).save_pretrained(path)
    from kvfleet.runtime.worker.model_loader import resolve_model_path

    AutoTokenizer.from_pretrained(resolve_model_path(None)[0]).save_pretrained(path)   # SmolLM2's tokenizer


def run_config(name: str, model: str, concurrency: int, a) -> dict:
    from kvfleet.runtime.config import EngineConfig
    from kvfleet.runtime.engine.llm_engine import LLMEngine
    from kvfleet.runtime.sampling_params import SamplingParams

    os.environ["KVFLEET_CPU_DECODER"] = "0" if "torch" in name else "1"
    tp = 2 if name.startswith("tp2") else 1
    eng = LLMEngine(EngineConfig(model=model, tensor_parallel_size=tp, device="cpu", dtype="float32",
                                 max_num_seqs=max(concurrency, 8), kv_cache_memory=512 * 2**20))
    try:
        assert (eng.runner.cpu_decode is not None) == ("fused" in name), name
        params = SamplingParams(temperature=0, max_tokens=a.max_tokens, ignore_eos=True)
        prompts = [[(7 * i + 13 * r) % 40000 + 100 for i in range(a.prompt_len)] for r in range(concurrency)]
        eng.add_request("warm", prompts[0], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        eng.run_until_done()
        if eng.runner.cpu_decode is not None:
            eng.runner.cpu_decode.profile()   # reset
        for r, p in enumerate(prompts):
            eng.add_request(f"r{r}", p, params)
        t0 = time.perf_counter()
        out = eng.run_until_done()
        seconds = time.perf_counter() - t0
        tokens = sum(len(o.outputs[0].token_ids) for o in out.values())
        prof = eng.runner.cpu_decode.profile() if eng.runner.cpu_decode is not None else {}
        return {"tok_s": tokens / seconds, "seconds": seconds, "tp_ms_per_step": prof.get("tp", 0.0),
                "fused_steps": prof.get("steps", 0)}
    finally:
        eng.shutdown()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="a checkpoint (default: the random SmolLM2-sized Llama)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    p.add_argument("--threads", type=int, default=None, help="torch threads of this process (rank 0; its C pool's too)")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    if a.threads:
        import torch

        torch.set_num_threads(a.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model = a.model or os.path.join(tmp, "model")
        if a.model is None:
            write_model(model)
        results: dict[str, dict] = {}
        for c in a.concurrency:
            for _ in range(a.rounds):
                for name in a.configs:
                    got = run_config(name, model, c, a)
                    key = f"{name} C={c}"
                    if key not in results or got["tok_s"] > results[key]["tok_s"]:
                        results[key] = got
                    print(f"{key}: {got['tok_s']:.1f} tok/s (all-reduces {got['tp_ms_per_step']:.2f} ms/step)",
                          file=sys.stderr, flush=True)
    print(f"CPU: {cpu_description()}; load average {os.getloadavg()[0]:.1f}")
    for c in a.concurrency:
        row = {n: results.get(f"{n} C={c}", {}).get("tok_s") for n in a.configs}
        ratio = f"; fused/torch at TP=2 {row['tp2 fused'] / row['tp2 torch']:.2f}x" \
            if row.get("tp2 fused") and row.get("tp2 torch") else ""
        print(f"C={c}: " + ", ".join(f"{n} {v:.1f} tok/s" for n, v in row.items() if v) + f"{ratio}; fused "
              f"all-reduces {results.get(f'tp2 fused C={c}', {}).get('tp_ms_per_step', 0):.2f} ms/step")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"cpu": cpu_description(), "load": os.getloadavg()[0], "results": results, "args": vars(a)}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
