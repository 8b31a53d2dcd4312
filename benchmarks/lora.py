"""Throughput of a mixed LoRA batch vs the base model alone (issue 17; a benchmark, not a test).

    nice -n 10 python benchmarks/lora.py                 # C=32, rank 8, 0 / 1 / 4 adapters
    nice -n 10 python benchmarks/lora.py --json benchmarks/results/lora-cpu.json

The default model, fp32, eager. ``--concurrency`` requests at once (prompts of ``--prompt-len``
tokens, ``--max-tokens`` new tokens each, greedy, EOS ignored), in one ``LLM.generate`` call:

- ``base alone``: an engine without ``--enable-lora`` (the reference);
- ``k adapters`` (k = 0, 1, 4): one engine with ``--enable-lora --max-loras 4 --max-lora-rank R``
  whose requests are spread round robin over k random rank-R PEFT adapters of every attention
  and MLP projection (k = 0: all base requests, the cost of the wrapped layers alone).

Prints output tokens/s and the ratio to the base alone (target: >= 0.8 with 4 adapters). The
adapters are written here in PEFT's file format from random tensors (no download).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from kvfleet.runtime.bench.machine import cpu_description


def write_adapter(path: Path, targets: dict[str, tuple[int, int]], rank: int, seed: int) -> None:
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, (d_in, d_out) in targets.items():
        tensors[f"base_model.model.{name}.lora_A.weight"] = torch.randn(rank, d_in, generator=g) / d_in**0.5
        tensors[f"base_model.model.{name}.lora_B.weight"] = torch.randn(d_out, rank, generator=g) * 0.01
    path.mkdir(parents=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    leaves = sorted({n.rsplit(".", 1)[-1] for n in targets})
    (path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": leaves, "bias": "none"}))


def run(llm, prompts, params, loras) -> dict:
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
    dt = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"seconds": round(dt, 2), "output_tokens": tokens, "tok_s": round(tokens / dt, 1)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--adapters", type=int, nargs="+", default=[0, 1, 4])
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)

    import torch

    from kvfleet.runtime.config import EngineConfig
    from kvfleet.runtime.engine.llm_engine import LLMEngine
    from kvfleet.runtime.llm import LLM
    from kvfleet.runtime.sampling_params import SamplingParams
    from kvfleet.runtime.worker.model_loader import load_model
    from kvfleet.runtime.worker.quantization import decoder_linears

    loaded = load_model(None, dtype="float32", device="cpu")
    vocab = loaded.tokenizer.vocab_size
    prompts = [[(i * 7919 + j * 104729) % (vocab - 1) + 1 for j in range(a.prompt_len)] for i in range(a.concurrency)]
    params = SamplingParams(temperature=0, max_tokens=a.max_tokens, ignore_eos=True)
    common = dict(dtype="float32", device="cpu", max_num_seqs=a.concurrency, kv_cache_memory=512 * 2**20,
                  enable_prefix_caching=False)
    results: dict = {"cpu": cpu_description(), "threads": torch.get_num_threads(), "args": vars(a), "runs": {}}

    base = LLM.from_engine(LLMEngine(EngineConfig(**common), loaded=loaded))  # before the layers are wrapped
    run(base, prompts[:2], SamplingParams(max_tokens=2), None)  # warm-up
    results["runs"]["base alone"] = run(base, prompts, params, None)
    print(f"base alone: {results['runs']['base alone']}", flush=True)
    del base

    targets = {n: (m.in_features, m.out_features) for n, m in decoder_linears(loaded.model).items()}
    with tempfile.TemporaryDirectory() as tmp:
        names = []
        for i in range(max(a.adapters)):
            write_adapter(Path(tmp) / f"a{i}", targets, a.rank, seed=i)
            names.append(f"a{i}")
        config = EngineConfig(**common, enable_lora=True, max_loras=max(4, max(a.adapters)), max_lora_rank=a.rank,
                              lora_modules=[f"{n}={Path(tmp) / n}" for n in names])
        llm = LLM.from_engine(LLMEngine(config, loaded=loaded))
        run(llm, prompts[:2], SamplingParams(max_tokens=2), names[:2] or None)  # warm-up
        for k in a.adapters:
            loras = [names[i % k] for i in range(a.concurrency)] if k else None
            r = run(llm, prompts, params, loras)
            r["vs_base"] = round(r["tok_s"] / results["runs"]["base alone"]["tok_s"], 3)
            results["runs"][f"{k} adapters"] = r
            print(f"{k} adapters: {r}", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
