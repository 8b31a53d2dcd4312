"""Each model family against a same-shape Llama, with no flags (issue 40).

::

    python benchmarks/families.py                       # every dense family, SmolLM2's shape, 12 layers
    python benchmarks/families.py --families llama qwen3 --requests 16 --tokens 32   # a quick look
    python benchmarks/families.py --families llama mixtral qwen3_moe --quantization int8   # int8 weights

For each family a random-initialised model of one shape (SmolLM2-135M's: hidden 576, 9 query and 3
KV heads of 64, MLP 1536, its 49152-token tokenizer; ``--layers`` layers, default 12; the family's
own features on: Gemma 3's 5 local (window 512) : 1 global layers, GLM-4's half rotary, Granite's
multipliers, ...) is saved as a float32 checkpoint and served in this process as ``kvfleet serve``
would with no flags (``EngineConfig(model=dir)``: dtype auto, the CPU plan's weights and matmuls;
``--quantization int8`` or ``int4`` adds that option on every side).
Measured: one stream (one request, ``--prompt`` tokens, ``--tokens`` greedy outputs) and
``--requests`` requests at once (the same lengths), output tokens per second of wall time (with
``--threads 1``: of the one thread's CPU time) after a warm-up request; each family's ratio to
Llama's. First, and steadier on a shared machine, the fused C step alone, A/B across the
families (:func:`step_ms`): its milliseconds for 1 and 48 rows, each step on new rows (a mixture of
experts then routes each step to other experts, as an engine's tokens do; ``--same-inputs`` repeats
one input, the A/B before 2026-12-06 15:00, whose one-row MoE step re-read the two experts the
previous step had left in the last-level cache).
``--rounds`` rounds go over every family in turn
(a fresh engine each time) and each family keeps its best round, so that a machine whose load
drifts (or the first engine's one-time costs) does not favour the families measured later. Prints
the CPU model and flags and the table (docs/performance.md, "Model families on the fused path").
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

def dense_families() -> list[str]:
    """The families runtime/worker/recipes.py puts on the fused path, Llama first."""
    from kvfleet.runtime.worker.recipes import RECIPES

    return sorted((f for f, r in RECIPES.items() if r.unsupported is None), key=lambda f: f != "llama")
SHAPE = dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
             vocab_size=49152, max_position_embeddings=8192, initializer_range=0.05, tie_word_embeddings=True,
             bos_token_id=1, eos_token_id=2, pad_token_id=2)
FEATURES = {
    "gemma3_text": dict(sliding_window=512, query_pre_attn_scalar=64),
    "glm4": dict(partial_rotary_factor=0.5),
    "granite": dict(attention_multiplier=0.125, residual_multiplier=0.22, embedding_multiplier=12.0,
                    logits_scaling=2.0),
    # mixtures of experts: 8 experts of 768, top-2 -- the active parameters of the 1536-wide MLP
    "mixtral": dict(intermediate_size=768, num_local_experts=8, num_experts_per_tok=2),
    "qwen3_moe": dict(moe_intermediate_size=768, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True),
}


def build(family: str, layers: int, folder: str, tokenizer) -> str:
    """A random model of ``family`` in the shared shape, saved with ``tokenizer`` under ``folder``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(family, num_hidden_layers=layers, **{**SHAPE, **FEATURES.get(family, {})})
    path = os.path.join(folder, family)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def measure(path: str, args) -> dict:
    """tok/s of one stream and of ``args.requests`` at once, and what ran (the fused path's line).
    ``--threads 1``: per second of this thread's CPU time (``LLM.generate`` runs the engine's steps in
    it, the C pool and torch on one thread), which a shared machine's load moves least."""
    from kvfleet.runtime.config import EngineConfig
    from kvfleet.runtime.engine.llm_engine import LLMEngine
    from kvfleet.runtime.llm import LLM
    from kvfleet.runtime.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model=path, quantization=args.quantization))
    llm = LLM.from_engine(engine)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, SHAPE["vocab_size"]) for _ in range(args.prompt)] for _ in range(args.requests)]
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    llm.generate([prompts[0][:16]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm-up
    out = {}
    clock = time.thread_time if args.threads == 1 else time.perf_counter   # (generate steps in this thread)
    for name, batch in (("one stream", prompts[:1]), (f"{args.requests} requests", prompts)):
        start = clock()
        results = llm.generate(batch, params, use_tqdm=False)
        seconds = clock() - start
        out[name] = sum(len(r.outputs[0].token_ids) for r in results) / seconds
    path_ = engine.runner.cpu_decode
    out["path"] = f"fused ({path_.matmul})" if path_ is not None else "transformers"
    return out


def step_ms(paths: dict[str, str], args) -> dict[str, dict[int, float]]:
    """The fused C step alone, A/B: per family an engine as with no flags (its KV cache cut to what
    the rows need), then ``--step-rounds`` rounds that each run ``--steps`` decode steps of every
    ``--step-rows`` count for every family in turn (rows at ``--context`` positions, each its own
    blocks; nothing written; each step new random rows unless ``--same-inputs``), so that the
    machine's drifting load falls on all families alike. Each case's timed steps follow one untimed
    step of it, so that they start where an engine's steps run: the last-level cache holding what
    the model's previous step left (the family before it evicted it), not another family's weights.
    Returns family -> rows -> the median over rounds of the mean step, milliseconds (``--threads 1``:
    of the thread's CPU time, which other processes' load moves least)."""
    import statistics

    import torch

    from kvfleet.runtime.config import EngineConfig
    from kvfleet.runtime.engine.llm_engine import LLMEngine

    per_row = -(-args.context // 16)
    blocks = max(args.step_rows) * per_row + 1
    cases = {}
    for family, path in paths.items():
        runner = LLMEngine(EngineConfig(model=path, num_blocks=blocks, quantization=args.quantization)).runner
        fused, cpu_path = runner.cpu_decode._fused, runner.cpu_decode
        for rows in args.step_rows:
            xs = [torch.randn(rows, fused.hidden) for _ in range(1 if args.same_inputs else args.steps)]
            positions = torch.full((1, rows), args.context - 1, dtype=torch.long)
            cos, sin = cpu_path._rope(xs[0], positions)
            tables = torch.arange(rows * per_row, dtype=torch.int32).view(rows, per_row)
            lens = torch.full((rows,), args.context, dtype=torch.int32)
            cases[family, rows] = (fused, xs, cos, sin, torch.full((rows,), -1, dtype=torch.int64), tables, lens)
    clock = time.thread_time if args.threads == 1 else time.perf_counter   # one thread: its CPU time
    times: dict[tuple[str, int], list[float]] = {key: [] for key in cases}
    for _ in range(args.step_rounds):
        for key, (fused, xs, cos, sin, slots, tables, lens) in cases.items():
            fused.step(xs[-1].clone(), cos, sin, slots, tables, lens)   # untimed: the caches hold this model's weights
            start = clock()
            for i in range(args.steps):
                fused.step(xs[i % len(xs)].clone(), cos, sin, slots, tables, lens)
            times[key].append((clock() - start) / args.steps * 1e3)
    out: dict[str, dict[int, float]] = {}
    for (family, rows), values in times.items():
        out.setdefault(family, {})[rows] = statistics.median(values)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", nargs="+", default=None, help="default: every dense family of the recipes")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--step-rows", type=int, nargs="+", default=[1, 48])
    parser.add_argument("--context", type=int, default=128, help="positions each row of the step A/B attends")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--step-rounds", type=int, default=7)
    parser.add_argument("--same-inputs", action="store_true", help="the step A/B repeats one input (see step_ms)")
    parser.add_argument("--quantization", choices=("int8", "int4"), default=None,
                        help="every family's engine with this --quantization (default: none, no flags)")
    parser.add_argument("--skip-engine", action="store_true", help="only the C step A/B")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch's and the C pool's threads (default: torch's); 1 on a loaded machine, where a "
                             "descheduled helper thread stalls every phase of a step")
    args = parser.parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    from kvfleet.kernels.cpu_features import detect
    from kvfleet.runtime.worker.model_loader import load_model

    families = ["llama"] + [f for f in (args.families or dense_families()) if f != "llama"]
    tokenizer = load_model(None, device="cpu").tokenizer
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as folder:
        paths = {family: build(family, args.layers, folder, tokenizer) for family in families}
        steps = step_ms(paths, args)
        for round_ in range(0 if args.skip_engine else args.rounds):
            for family in families:
                got = measure(paths[family], args)
                print(f"round {round_ + 1} {family}: " + ", ".join(
                    f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in got.items()), flush=True)
                best = results.setdefault(family, got)
                for key, value in got.items():
                    if isinstance(value, float):
                        best[key] = max(best[key], value)
    features = detect()
    print(f"\nCPU: {features.summary()}; threads {args.threads or 'torch default'}")
    print(f"shape: SmolLM2-135M's (576 hidden, 9/3 heads of 64, MLP 1536, 49152 vocab), {args.layers} layers; "
          f"prompt {args.prompt}, {args.tokens} outputs; "
          f"{'--quantization ' + args.quantization if args.quantization else 'no flags'}; step inputs "
          f"{'the same' if args.same_inputs else 'new each step'}; the best of {args.rounds} rounds; load average "
          f"{os.getloadavg()[0]:.1f}\n")
    print("| | " + " | ".join(families) + " |")
    print("|---|" + "---:|" * len(families))
    for rows in args.step_rows:
        print(f"| C step, {rows} rows at {args.context}, ms | " + " | ".join(
            f"{steps[f][rows]:.2f}" for f in families) + " |")
        print(f"| C step, {rows} rows: llama's time / its | " + " | ".join(
            f"{steps['llama'][rows] / steps[f][rows]:.2f}x" for f in families) + " |")
    if results:
        base = results["llama"]
        print("| path | " + " | ".join(results[f]["path"] for f in families) + " |")
        for key in ("one stream", f"{args.requests} requests"):
            print(f"| {key}, tok/s | " + " | ".join(f"{results[f][key]:.1f}" for f in families) + " |")
            print(f"| {key} vs llama | " + " | ".join(f"{results[f][key] / base[key]:.2f}x" for f in families) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
