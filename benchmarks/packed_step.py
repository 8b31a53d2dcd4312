"""The fused decoder's one-row step (one stream's decode step, the C call alone) of a 4-bit
checkpoint served with no flags against its dequantized float32 model served with
``--quantization int4``, in one process, the decoders interleaved (best of ``--rounds`` x 5
steps each): on a shared machine a ratio of two processes run minutes apart moves with the load,
this one does not. Not a test::

    python benchmarks/packed_step.py [--format gptq-act] [--group 64] [--matmuls float32,amx] [--rounds 30] \
        [--rows 1,48]

The default model's float32 weights are quantized by the packed-checkpoint tests' reference
quantizer (tests/support/packed_writer.py), as in benchmarks/packed_speed.py (the engine-level
tok/s). Each engine is built as served (its CPU plan), then each matmul kind of ``--matmuls`` runs
every decoder on the same weights. Rows: the checkpoint's step; with act-order, the same step
without the input permutations (the same bytes, wrong numbers: the gather's cost); the
checkpoint's step without its LM head (the head's share); the checkpoint's step with its LM head
rounded to bf16 (the plan's storage on CPUs with native bf16); the float32 + ``--quantization int4``
step. ``--rows``: the step's rows (one stream, or 48 requests decoding at once: each row a token at
position 10 of its own sequence). Prints the CPU and load average. Results: docs/performance.md,
"Packed 4-bit checkpoints".
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path


def _bf16_head(weights):
    """A copy of ``weights`` (DecoderWeights) with its LM head rounded to bf16 (the decoder's kernels)."""
    import torch

    return dataclasses.replace(weights, head=dataclasses.replace(
        weights.head, fmt="bf16", w=weights.head.w.to(torch.bfloat16).contiguous(), matmul=None))


def _without(weights, perms: bool = True, head: bool = True):
    """A copy of ``weights`` (DecoderWeights) without its input permutations and/or its LM head."""
    w = dataclasses.replace(weights, head=weights.head if head else None)
    if not perms:
        w.layers = [dataclasses.replace(layer, **{n: dataclasses.replace(getattr(layer, n), perm=None)
                                                  for n in ("qkv", "o", "gate_up", "down")})
                    for layer in weights.layers]
    return w


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--format", default="gptq-act", choices=("awq", "gptq", "gptq-act", "ct"))
    parser.add_argument("--group", type=int, default=64)
    parser.add_argument("--matmuls", default="float32,amx")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--rows", default="1", help="the step's rows, a comma list (e.g. 1,48)")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    import torch
    from support import packed_writer
    from transformers import AutoModelForCausalLM

    from kvfleet.kernels import cpu_features
    from kvfleet.kernels.cpu_decoder import FusedDecoder, matmul_available
    from kvfleet.runtime.config import EngineConfig
    from kvfleet.runtime.engine.llm_engine import LLMEngine
    from kvfleet.runtime.worker import model_loader

    fmt, sym, act_order = {"awq": ("awq", False, False), "gptq": ("gptq", True, False),
                           "gptq-act": ("gptq", True, True), "ct": ("ct", True, False)}[args.format]
    source, _ = model_loader.resolve_model_path(None)
    print(f"CPU: {cpu_features.detect().summary()}; load average {os.getloadavg()}")
    with tempfile.TemporaryDirectory() as work:
        packed, plain = Path(work) / "packed", Path(work) / "float32"
        packed.mkdir()
        ref = AutoModelForCausalLM.from_pretrained(source, dtype="float32").eval()
        packed_writer.write(packed, ref, fmt, args.group, sym, act_order).save_pretrained(plain)
        for f in Path(source).iterdir():
            if f.name.startswith(("tokenizer", "special_tokens")):
                shutil.copy(f, packed / f.name)
                shutil.copy(f, plain / f.name)
        config = dict(num_blocks=16, max_num_batched_tokens=32)
        served = {args.format: LLMEngine(EngineConfig(**config), loaded=model_loader.load_model(str(packed))),
                  "float32 + --quantization int4": LLMEngine(
                      EngineConfig(**config, quantization="int4"),
                      loaded=model_loader.load_model(str(plain), quantization="int4"))}
    paths = {name: eng.runner.cpu_decode for name, eng in served.items()}
    for name, path in paths.items():
        w = path._fused.weights
        print(f"{name}: served with matmuls {path.matmul}, layers {w.layers[0].qkv.fmt}"
              f"{' + input permutations' if w.layers[0].qkv.perm is not None else ''}, LM head {w.head.fmt}")
    own = paths[args.format]._fused.weights
    rows = {args.format: (own, paths[args.format])}
    if act_order:
        rows[f"{args.format} without its permutations"] = (_without(own, perms=False), paths[args.format])
    rows[f"{args.format} without its LM head"] = (_without(own, head=False), paths[args.format])
    if own.head is not None and own.head.fmt == "fp32":
        rows[f"{args.format} with a bf16 LM head"] = (_bf16_head(own), paths[args.format])
    base = "float32 + --quantization int4"
    rows[base] = (paths[base]._fused.weights, paths[base])
    print("| rows | matmuls | step | ms per step | vs float32 + --quantization int4 |")
    print("| --- | --- | --- | --- | --- |")
    for m, kind in ((int(m), kind) for m in args.rows.split(",") for kind in args.matmuls.split(",")):
        if not matmul_available(kind):
            print(f"| {kind} | (not on this CPU) | | |")
            continue
        decoders = {name: (FusedDecoder(w, threads=torch.get_num_threads(), matmul=kind), path)
                    for name, (w, path) in rows.items()}
        best = dict.fromkeys(decoders, float("inf"))
        x = torch.randn(m, own.final_norm.shape[0])
        # each row position 10 of block 0 (its key/value not written: the rows' attention reads alike)
        slots, lens = torch.full((m,), -1), torch.full((m,), 11, dtype=torch.int32)
        tables = torch.zeros(m, 2, dtype=torch.int32)
        for _ in range(args.rounds):
            for name, (dec, path) in decoders.items():
                cos, sin = path._rope(x, torch.full((1, m), 10))
                t0 = time.perf_counter()
                for _ in range(5):
                    dec.step(x.clone(), cos, sin, slots, tables, lens)
                best[name] = min(best[name], (time.perf_counter() - t0) / 5)
        for name, t in best.items():
            print(f"| {m} | {kind} | {name} | {t * 1e3:.2f} | {best[base] / t:.2f}x |", flush=True)
    print(f"load average at the end {os.getloadavg()}")


if __name__ == "__main__":
    main()
