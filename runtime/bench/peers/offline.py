"""One offline run of kvfleet or transformers over a peers workload, in its own process.

``kvfleet bench peers`` (:mod:`kvfleet.runtime.bench.peers.runner`) starts this module once per
system and mode, as it starts :mod:`~kvfleet.runtime.bench.peers.vllm_offline` in vLLM's
virtualenv and :mod:`~kvfleet.runtime.bench.peers.llama_server` for llama.cpp, so every system
gets a fresh process::

    python -m kvfleet.runtime.bench.peers.offline --system kvfleet --workload W.json \\
        --mode throughput --dtype float32 [--quantization int4] [--compiled] -o OUT.json

The workload is a JSON list of ``{prompt_token_ids, max_tokens}``
(:mod:`~kvfleet.runtime.bench.peers.workload` writes it). Every request is greedy with EOS
ignored, so each system produces exactly ``max_tokens``. ``throughput``: every request at once
(kvfleet: all in flight; transformers: ``generate()`` on left-padded static batches of
``--hf-batch``); ``stream``: one request at a time. Prints one JSON object in the shape of
``vllm_offline.py``'s (``system``, ``mode``, ``versions``, ``dtype``, ``load_s``, ``wall_s``,
``output_tokens``, ``output_tok_s``, ``e2e_s``, ...) and exits 1 with ``{"error": ...}`` when the run fails.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def _versions() -> dict:
    import torch
    import transformers

    from kvfleet.runtime.bench.serve import source_revision

    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "kvfleet_revision": source_revision()}


def run(args: argparse.Namespace) -> dict:
    """The run's result document (see the module docstring)."""
    import torch

    from kvfleet.runtime.bench.datasets import Workload
    from kvfleet.runtime.bench.machine import cpu_description
    from kvfleet.runtime.bench.systems import run_hf_static, run_kvfleet
    from kvfleet.runtime.config import EngineConfig
    from kvfleet.runtime.engine.llm_engine import LLMEngine
    from kvfleet.runtime.worker.model_loader import load_model

    items = json.loads(Path(args.workload).read_text())
    workload = Workload([w["prompt_token_ids"] for w in items], [int(w["max_tokens"]) for w in items])
    t0 = time.perf_counter()
    doc: dict = {"system": args.system, "mode": args.mode, "versions": _versions(), "cpu": cpu_description(),
                 "num_requests": len(workload), "threads": torch.get_num_threads()}
    concurrency = len(workload) if args.mode == "throughput" else 1
    if args.system == "kvfleet":
        longest = max(len(p) + o for p, o in zip(workload.prompts, workload.output_lens))
        config = EngineConfig(dtype=args.dtype, device="cpu", quantization=args.quantization,
                              enforce_eager=not args.compiled, max_num_seqs=max(concurrency, 1),
                              max_model_len=max(longest, 64))
        loaded = load_model(args.model, dtype=config.dtype, device="cpu", quantization=args.quantization)
        engine = LLMEngine(config, loaded=loaded)
        doc["load_s"] = round(time.perf_counter() - t0, 2)
        doc["dtype"] = str(engine.runner.dtype).removeprefix("torch.") + (f"+{args.quantization}" if args.quantization
                                                                          else "")
        fused = getattr(engine.runner, "cpu_decode", None)
        doc["matmul"] = fused.matmul if fused is not None else None  # the fused CPU path's kernels (bf16 on AMX)
        doc["compiled"] = engine.runner.compiled is not None
        if engine.runner.compiled is not None:
            doc["warmup_s"] = round(engine.runner.compiled.warmup_seconds, 2)
            doc["compile_sizes"] = engine.runner.compiled.compile_sizes
        doc["weight_bytes"] = loaded.weight_bytes
        doc["decode_weight_bytes"] = loaded.decode_weight_bytes
        result = run_kvfleet(lambda c: engine, workload, concurrency)
    else:
        loaded = load_model(args.model, dtype=args.dtype, device="cpu")
        model = loaded.model
        doc["load_s"] = round(time.perf_counter() - t0, 2)
        doc["dtype"] = str(next(model.parameters()).dtype).removeprefix("torch.")
        pad = loaded.tokenizer.pad_token_id
        pad = loaded.tokenizer.eos_token_id if pad is None else pad
        result = run_hf_static(model, workload, args.hf_batch if args.mode == "throughput" else 1, pad)
    if result.error:
        raise RuntimeError(result.error)
    out = sum(r.output_tokens for r in result.results)
    doc.update(wall_s=round(result.duration, 3), prompt_tokens=sum(workload.prompt_lens), output_tokens=out,
               output_tok_s=round(out / result.duration, 3), e2e_s=[round(r.latency, 4) for r in result.results],
               ttft_s=[round(r.ttft, 4) for r in result.results])
    return doc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--system", choices=("kvfleet", "transformers"), required=True)
    parser.add_argument("--workload", required=True, help="JSON list of {prompt_token_ids, max_tokens}")
    parser.add_argument("--mode", choices=("throughput", "stream"), default="throughput")
    parser.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16")
    parser.add_argument("--model", default=None, help="a model (a .gguf file, a folder); default: kvfleet's default")
    parser.add_argument("--quantization", choices=("int8", "int4"), help="kvfleet only")
    parser.add_argument("--compiled", action="store_true", help="kvfleet only: --no-enforce-eager")
    parser.add_argument("--hf-batch", type=int, default=8, help="transformers: static batch size (throughput)")
    parser.add_argument("-o", "--output", type=Path, help="also write the JSON here")
    args = parser.parse_args(argv)
    try:
        doc, status = run(args), 0
    except Exception as exc:  # reported to the orchestrator, never a silent skip
        doc, status = {"system": args.system, "mode": args.mode, "error": f"{type(exc).__name__}: {exc}"}, 1
    text = json.dumps(doc)
    if args.output:
        args.output.write_text(text + "\n")
    print(text, flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
