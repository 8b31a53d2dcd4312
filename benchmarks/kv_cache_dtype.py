"""The fused CPU decode step with a float32 against a bf16 KV cache, A/B in one process.

::

    python benchmarks/kv_cache_dtype.py [--rows 48] [--context 160 512] [--rounds 12] [--steps 5]

Loads the default model as the engine does (``LLMEngine``, ``dtype auto``), takes its fused
decoder's weights (:class:`kvfleet.kernels.cpu_decoder.DecoderWeights`) and builds two fused
decoders over them that differ only in their KV caches: float32 and bfloat16, random keys and
values, each row its own scattered blocks. Per context length it alternates the two for
``--rounds`` rounds of ``--steps`` decode steps (``--rows`` rows, every row at that context;
nothing written: slots -1), so that the machine's load drifts over both alike, and prints the
median per round of the C step's phases (``FusedDecoder.profile``, ms per step). On a shared
machine whole-run numbers (``step_profile.py w48``) moved 1.7x between identical runs; this
alternation is the comparison that survives it.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def decoders(kv_dtypes, blocks: int):
    """One :class:`FusedDecoder` per cache dtype over the default model's weights."""
    import torch

    from kvfleet.kernels.cpu_decoder import FusedDecoder
    from kvfleet.runtime.config import EngineConfig
    from kvfleet.runtime.engine.llm_engine import LLMEngine

    eng = LLMEngine(EngineConfig(num_blocks=8, kv_cache_dtype="float32"))
    base = eng.runner.cpu_decode._fused.weights
    gen = torch.Generator().manual_seed(0)
    out = {}
    for dtype in kv_dtypes:
        layers = []
        for layer in base.layers:
            shape = (blocks, *layer.k_cache.shape[1:])
            kc = torch.randn(shape, generator=gen).to(dtype)
            vc = torch.randn(shape, generator=gen).to(dtype)
            layers.append(dataclasses.replace(layer, k_cache=kc, v_cache=vc))
        out[dtype] = FusedDecoder(dataclasses.replace(base, layers=layers))
    return eng, out


def main() -> None:
    import torch

    from kvfleet.runtime.bench.machine import cpu_description

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=48)
    ap.add_argument("--context", type=int, nargs="+", default=[160, 512])
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    dtypes = (torch.float32, torch.bfloat16)
    bs = 16
    width = (max(args.context) + bs - 1) // bs
    blocks = args.rows * width + 1
    eng, fused = decoders(dtypes, blocks)
    H, D = fused[dtypes[0]].hidden, fused[dtypes[0]].weights.head_size
    print(f"CPU: {cpu_description()}, torch threads {torch.get_num_threads()}, load average "
          f"{os.getloadavg()[0]:.1f}; {args.rows} rows, {args.rounds} rounds x {args.steps} steps per dtype")
    gen = torch.Generator().manual_seed(1)
    tables = torch.randperm(blocks - 1, generator=gen)[: args.rows * width].view(args.rows, width).to(torch.int32)
    for ctx in args.context:
        lens = torch.full((args.rows,), ctx, dtype=torch.int32)
        slots = torch.full((args.rows,), -1, dtype=torch.int64)
        cos, sin = torch.ones(args.rows, D), torch.zeros(args.rows, D)
        x = torch.randn(args.rows, H, generator=gen)
        per: dict = {d: [] for d in dtypes}
        for _ in range(args.rounds):
            for d in dtypes:
                f = fused[d]
                f.profile()
                for _ in range(args.steps):
                    f.step(x.clone(), cos, sin, slots, tables, lens)
                per[d].append(f.profile())
        print(f"\ncontext {ctx}: median of the rounds, ms per step")
        print("| KV cache | attention | whole C step |\n|---|---:|---:|")
        for d in dtypes:
            att = statistics.median(p["attention"] for p in per[d])
            total = statistics.median(sum(v for k, v in p.items() if k != "steps") for p in per[d])
            print(f"| {str(d).removeprefix('torch.')} | {att:.2f} | {total:.2f} |")
    eng.shutdown()


if __name__ == "__main__":
    main()
