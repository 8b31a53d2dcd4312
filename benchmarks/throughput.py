"""Offline throughput: kvfleet's continuous batching vs transformers' static batches.

Workload (issue 2): 64 requests of random token ids, prompts uniform in [16, 512] tokens,
outputs uniform in [16, 256] tokens (fixed seed, ``ignore_eos``), all submitted at once, on
the default model (fp32 on CPU unless --device/--dtype say otherwise). kvfleet:
``LLM.generate`` over all 64; baseline: transformers ``generate()`` on left-padded static
batches of 8 in arrival order, each running to its longest output. Both count only the
requested output tokens and run in this process, on separate copies of the model::

    python benchmarks/throughput.py                 # the issue's workload (minutes on 2 cores)
    python benchmarks/throughput.py --num-requests 16 --max-output 64   # a quick look

Results: docs/engine.md, "Throughput benchmark".
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch


def make_workload(n: int, min_prompt: int, max_prompt: int, min_output: int, max_output: int, vocab: int, seed: int):
    rng = random.Random(seed)
    requests = []
    for _ in range(n):
        plen = rng.randint(min_prompt, max_prompt)
        olen = rng.randint(min_output, max_output)
        # Avoid the first ids (special tokens of most tokenizers).
        requests.append(([rng.randrange(100, vocab) for _ in range(plen)], olen))
    return requests


def run_kvfleet(args, requests) -> tuple[float, int, dict]:
    from kvfleet.runtime.config import EngineConfig
    from kvfleet.runtime.engine.llm_engine import LLMEngine
    from kvfleet.runtime.llm import LLM
    from kvfleet.runtime.sampling_params import SamplingParams

    config = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    engine = LLMEngine(config)
    llm = LLM.from_engine(engine)
    prompts = [p for p, _ in requests]
    params = [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True) for _, o in requests]
    # Warm-up (first-call overheads), not timed.
    llm.generate([prompts[0][:32]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    steps_before = engine.num_steps
    # Split the wall time between steps that carry prefill tokens and pure decode steps.
    split = {"prefill_steps": 0, "prefill_s": 0.0, "decode_steps": 0, "decode_s": 0.0, "decode_tokens": 0}
    execute = engine.runner.execute_model

    def timed_execute(scheduler_output):
        t = time.perf_counter()
        result = execute(scheduler_output)
        dt = time.perf_counter() - t
        kind = "prefill" if scheduler_output.num_prefill_tokens else "decode"
        split[f"{kind}_steps"] += 1
        split[f"{kind}_s"] += dt
        if kind == "decode":
            split["decode_tokens"] += scheduler_output.num_decode_tokens
        return result

    engine.runner.execute_model = timed_execute
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=not args.quiet)
    elapsed = time.perf_counter() - t0
    engine.runner.execute_model = execute
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert all(len(o.outputs[0].token_ids) == n for o, (_, n) in zip(outs, requests)), "wrong output lengths"
    info = {"steps": engine.num_steps - steps_before, "num_blocks": engine.num_blocks, **split}
    del llm, engine
    return elapsed, tokens, info


def run_transformers(args, requests) -> tuple[float, int]:
    from kvfleet.runtime.worker.model_loader import load_model

    loaded = load_model(args.model, dtype=args.dtype, device=args.device)
    model, tok = loaded.model, loaded.tokenizer
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    dev = loaded.device
    tokens = 0
    with torch.inference_mode():
        # Warm-up, not timed.
        model.generate(torch.tensor([requests[0][0][:32]], device=dev), max_new_tokens=4, do_sample=False)
        t0 = time.perf_counter()
        for b in range(0, len(requests), args.baseline_batch_size):
            batch = requests[b : b + args.baseline_batch_size]
            width = max(len(p) for p, _ in batch)
            ids = torch.full((len(batch), width), pad, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for i, (p, _) in enumerate(batch):
                ids[i, width - len(p) :] = torch.tensor(p)
                mask[i, width - len(p) :] = 1
            new = max(o for _, o in batch)
            out = model.generate(
                ids.to(dev),
                attention_mask=mask.to(dev),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=pad,
            )
            assert out.shape[1] == width + new
            tokens += sum(o for _, o in batch)
            if not args.quiet:
                print(f"  baseline batch {b // args.baseline_batch_size + 1}: {new} steps, "
                      f"{time.perf_counter() - t0:.1f} s so far", file=sys.stderr)
        elapsed = time.perf_counter() - t0
    return elapsed, tokens


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--min-prompt", type=int, default=16)
    ap.add_argument("--max-prompt", type=int, default=512)
    ap.add_argument("--min-output", type=int, default=16)
    ap.add_argument("--max-output", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--baseline-batch-size", type=int, default=8)
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--skip-baseline", action="store_true")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}")
    vocab = 49152
    requests = make_workload(
        args.num_requests, args.min_prompt, args.max_prompt, args.min_output, args.max_output, vocab, args.seed
    )
    n_prompt = sum(len(p) for p, _ in requests)
    n_out = sum(o for _, o in requests)
    print(f"workload: {len(requests)} requests, {n_prompt} prompt tokens, {n_out} output tokens (seed {args.seed})")

    k_time, k_tokens, info = run_kvfleet(args, requests)
    k_tps = k_tokens / k_time
    print(f"kvfleet:      {k_tokens} output tokens in {k_time:7.1f} s = {k_tps:7.1f} output tok/s "
          f"({info['steps']} steps, {info['num_blocks']} KV blocks)")
    print(f"  forward passes: {info['prefill_steps']} with prefill tokens {info['prefill_s']:.1f} s, "
          f"{info['decode_steps']} decode-only {info['decode_s']:.1f} s "
          f"(mean batch {info['decode_tokens'] / max(info['decode_steps'], 1):.1f}); "
          f"outside the forward pass {k_time - info['prefill_s'] - info['decode_s']:.1f} s")
    if args.skip_baseline:
        return 0
    b_time, b_tokens = run_transformers(args, requests)
    b_tps = b_tokens / b_time
    print(f"transformers: {b_tokens} output tokens in {b_time:7.1f} s = {b_tps:7.1f} output tok/s "
          f"(static batches of {args.baseline_batch_size})")
    print(f"ratio kvfleet / transformers: {k_tps / b_tps:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
