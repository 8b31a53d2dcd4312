"""Micro-benchmark of the CPU (torch) attention path: time per call of
``paged_attention`` and ``reshape_and_cache`` for the shapes the engine sees with
SmolLM2-135M (9 query heads, 3 kv heads, head_size 64, fp32, block_size 16). Not a test::

    python benchmarks/kernels_cpu.py [--threads 2] [--repeat 20] [--baseline HEAD~1]

Each line prints the shape, min and median time per call over ``--repeat`` runs (after a
warm-up) and the min times the model's 30 layers (one engine step's attention). ``step:``
cases time one step as the engine runs it (30 layers, one plan per step and window).
``--baseline REV`` also loads ``kernels/reference.py`` of git revision ``REV`` and alternates
calls with the current code, printing both minima and baseline / current (> 1: current is
faster). Results: docs/performance.md, "CPU path (torch)".
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time

# As the engine does (kvfleet.runtime.llm): idle OpenMP threads sleep instead of spinning,
# which matters on a CPU shared with other processes.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


import torch

from kvfleet.kernels import reference as current_ref
from kvfleet.kernels import reshape_and_cache_torch
from kvfleet.kernels.testing import make_paged_batch

NUM_LAYERS = 30


def make_batch(decode_lens, prefill, *, block_size=16, dtype=torch.float32, seed=0):
    """SmolLM2-135M-shaped batch: decode sequences of the given context lengths (one query
    token each) and prefill chunks given as ``(cached_prefix_len, chunk_len)``; shuffled
    physical blocks, as in a long-running engine."""
    seqs = [(L, 1) for L in decode_lens] + [(p + c, c) for p, c in prefill]
    return make_paged_batch(seqs, num_heads=9, num_kv_heads=3, head_size=64, block_size=block_size,
                            dtype=dtype, seed=seed, garbage=1.0)


def time_call(fn, repeat):
    """(min, median) seconds per call after one warm-up call."""
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times), statistics.median(times)


def time_pair(fn_a, fn_b, repeat):
    """((min, median) of fn_a, (min, median) of fn_b) seconds per call, calls alternating
    a, b, a, b, ... after one warm-up call each."""
    fn_a()
    fn_b()
    ta, tb = [], []
    for _ in range(repeat):
        for fn, times in ((fn_a, ta), (fn_b, tb)):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return (min(ta), statistics.median(ta)), (min(tb), statistics.median(tb))


def load_baseline(rev):
    """``kernels/reference.py`` at git revision ``rev`` as a module (ValueError if git fails)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        src = subprocess.run(["git", "show", f"{rev}:kernels/reference.py"], cwd=root, check=True,
                             capture_output=True, text=True).stdout
    except subprocess.CalledProcessError as e:
        raise ValueError(f"--baseline {rev}: {e.stderr.strip()}") from e
    path = os.path.join(tempfile.mkdtemp(prefix="kvfleet-baseline-"), "reference_baseline.py")
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location("kvfleet_reference_baseline", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def attn_call(ref, b):
    """One ``paged_attention`` call of module ``ref`` on batch ``b`` (planned in the call)."""
    return lambda: ref.paged_attention_torch(*b.attn_args)


def step_call(ref, b, caches):
    """One engine step's attention with module ``ref``: per layer, ``reshape_and_cache``
    of the step's new K/V into that layer's caches then ``paged_attention``; with the
    step's plan made once when ``ref`` has ``plan_paged_attention_torch``."""
    q, _, _, bt, sl, qsl, scale = b.attn_args

    def run():
        plan = None
        if hasattr(ref, "plan_paged_attention_torch"):
            plan = ref.plan_paged_attention_torch(bt, sl, qsl, caches[0][0])
        for kc, vc in caches:
            ref.reshape_and_cache_torch(b.new_keys, b.new_values, kc, vc, b.slot_mapping)
            if plan is None:
                ref.paged_attention_torch(q, kc, vc, bt, sl, qsl, scale)
            else:
                ref.paged_attention_torch(q, kc, vc, bt, sl, qsl, scale, plan=plan)
    return run


def engine_ab(args, base):
    """Decode steps of the real engine (SmolLM2-135M, fp32, CPU): ``--engine-seqs``
    requests with prompts of ``--engine-ctx`` lo..hi random tokens are prefilled, then
    rounds of ``--engine-steps`` pure decode steps alternate between the current attention
    (``kvfleet.runtime.worker.attention.paged_attention_forward``) and, with ``--baseline``, the
    same layer function over the baseline module's ``reshape_and_cache_torch`` /
    ``paged_attention_torch`` (one call per layer, no shared plan: what the engine did
    before); by default they alternate every step. Prints ms per step (min / median) of
    each and their ratios."""
    import random

    from transformers import AttentionInterface

    from kvfleet.runtime.config import EngineConfig
    from kvfleet.runtime.engine.llm_engine import LLMEngine
    from kvfleet.runtime.sampling_params import SamplingParams
    from kvfleet.runtime.worker import attention as attn

    def baseline_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        meta = kwargs[attn.METADATA_KWARG]
        meta.calls += 1
        window, softcap = attn._layer_options(module, module.layer_idx, meta, attention_mask, dropout, kwargs)
        kc, vc = meta.kv_caches[module.layer_idx]
        q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
        base.reshape_and_cache_torch(k, v, kc, vc, meta.slot_mapping)
        out = base.paged_attention_torch(q, kc, vc, meta.block_tables, meta.seq_lens, meta.query_start_loc, scaling,
                                         sliding_window=window, softcap=softcap)
        return out.unsqueeze(0), None

    n, (lo, hi) = args.engine_seqs, args.engine_ctx
    rounds, per_round = args.engine_rounds, args.engine_steps
    eng = LLMEngine(EngineConfig(model=None, dtype="float32", device="cpu", max_num_seqs=n,
                                 max_num_batched_tokens=4096))
    rng = random.Random(0)
    total_steps = 16 + rounds * per_round * 2
    for i in range(n):
        eng.add_request(f"r{i}", [rng.randrange(100, 40000) for _ in range(rng.randint(lo, hi))],
                        SamplingParams(temperature=0.0, max_tokens=total_steps + 8, ignore_eos=True))
    last = {}
    execute = eng.runner.execute_model

    def recorded(so):
        last["prefill"] = so.num_prefill_tokens
        return execute(so)

    eng.runner.execute_model = recorded
    t0 = time.perf_counter()
    while eng.num_waiting or last.get("prefill", 1):
        eng.step()
    print(f"engine: {n} sequences prefilled ({lo}..{hi} tokens) in {time.perf_counter() - t0:.0f} s", flush=True)
    impls = {"current": attn.paged_attention_forward}
    if base is not None:
        impls["baseline"] = baseline_forward
    times = {k: [] for k in impls}
    try:
        for _ in range(rounds):
            for name, fn in impls.items():
                AttentionInterface.register(attn.ATTN_IMPLEMENTATION, fn)
                for _ in range(per_round):
                    t = time.perf_counter()
                    eng.step()
                    times[name].append(time.perf_counter() - t)
                    assert not last["prefill"]
    finally:
        AttentionInterface.register(attn.ATTN_IMPLEMENTATION, attn.paged_attention_forward)
    line = f"engine decode step, {n} seqs, ctx {lo}..{hi}+:"
    for name, ts in times.items():
        line += f" {name} {min(ts) * 1e3:.1f} / {statistics.median(ts) * 1e3:.1f} ms (min / median of {len(ts)})"
    if base is not None:
        line += (f"; baseline/current: min {min(times['baseline']) / min(times['current']):.3f}, "
                 f"median {statistics.median(times['baseline']) / statistics.median(times['current']):.3f}")
    print(line, flush=True)


STEP_CASES = [
    # name, decode context lengths, prefill list: one engine step, NUM_LAYERS layers
    ("step: decode B=48 ctx 400..588", [400 + 4 * i for i in range(48)], []),
    ("step: decode B=64 ctx 200..956", [200 + 12 * i for i in range(64)], []),
    ("step: decode B=32 ctx 1000", [1000] * 32, []),
    ("step: 32 decode ctx~500 + prefill 256", [500] * 32, [(0, 256)]),
]


CASES = [
    # name, decode context lengths, prefill (prefix, chunk) list
    ("decode B=1 ctx=512", [512], []),
    ("decode B=32 ctx=256", [256] * 32, []),
    ("decode B=64 ctx=512", [512] * 64, []),
    ("decode B=128 ctx=512", [512] * 128, []),
    ("decode B=64 ragged 64..1024", list(range(64, 1025, 15))[:64], []),
    ("decode B=128 ctx=1024", [1024] * 128, []),
    ("prefill 1x512", [], [(0, 512)]),
    ("prefill chunk 256 after 768 cached", [], [(768, 256)]),
    ("mixed: 64 decode ctx~300 + prefill 256", [300] * 64, [(0, 256)]),
    ("mixed: 128 decode ctx~600 + 2 prefill 128", [600] * 128, [(0, 128), (512, 128)]),
]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--baseline", default=None, metavar="REV",
                    help="also time kernels/reference.py of this git revision, alternating calls")
    ap.add_argument("--only", default=None, choices=["calls", "steps", "engine"], help="run only one group of cases")
    ap.add_argument("--engine", action="store_true",
                    help="also time decode steps of the real engine (SmolLM2-135M; a minute or more)")
    ap.add_argument("--engine-seqs", type=int, default=48)
    ap.add_argument("--engine-ctx", type=int, nargs=2, default=[200, 600], metavar=("LO", "HI"))
    ap.add_argument("--engine-rounds", type=int, default=30)
    ap.add_argument("--engine-steps", type=int, default=1, help="timed steps per implementation per round")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    base = load_baseline(args.baseline) if args.baseline else None
    print(f"torch {torch.__version__}, threads={torch.get_num_threads()}, dtype={args.dtype}, "
          f"block_size={args.block_size}, heads 9/3, head_size 64"
          + (f", baseline {args.baseline}" if base else ""))
    extra = f" {'base ms min':>11s} {'base/cur':>8s}" if base else ""
    if args.only not in ("steps", "engine"):
        print(f"{'case':45s} {'tokens':>6s} {'attn ms min/med':>17s} {'x30 ms (min)':>12s} {'cache ms':>9s}" + extra)
        for name, dec, pre in CASES:
            b = make_batch(dec, pre, block_size=args.block_size, dtype=dtype)
            if base:
                t_attn, t_base = time_pair(attn_call(current_ref, b), attn_call(base, b), args.repeat)
            else:
                t_attn = time_call(attn_call(current_ref, b), args.repeat)
            t_cache = time_call(lambda b=b: reshape_and_cache_torch(
                b.new_keys, b.new_values, b.key_cache, b.value_cache, b.slot_mapping), args.repeat)
            n = b.query.shape[0]
            line = (f"{name:45s} {n:6d} {t_attn[0] * 1e3:8.2f}/{t_attn[1] * 1e3:8.2f} "
                    f"{t_attn[0] * 1e3 * NUM_LAYERS:12.1f} {t_cache[0] * 1e3:9.3f}")
            if base:
                line += f" {t_base[0] * 1e3:11.2f} {t_base[0] / t_attn[0]:8.2f}"
            print(line, flush=True)
    if args.only not in ("calls", "engine"):
        print(f"\n{'case (' + str(NUM_LAYERS) + ' layers)':45s} {'tokens':>6s} {'step ms min/med':>17s}" + extra)
        for name, dec, pre in STEP_CASES:
            b = make_batch(dec, pre, block_size=args.block_size, dtype=dtype)
            caches = [(b.key_cache.clone(), b.value_cache.clone()) for _ in range(NUM_LAYERS)]
            if base:
                t_step, t_base = time_pair(step_call(current_ref, b, caches), step_call(base, b, caches),
                                           max(3, args.repeat // 2))
            else:
                t_step = time_call(step_call(current_ref, b, caches), max(3, args.repeat // 2))
            line = f"{name:45s} {b.query.shape[0]:6d} {t_step[0] * 1e3:8.1f}/{t_step[1] * 1e3:8.1f}"
            if base:
                line += f" {t_base[0] * 1e3:11.1f} {t_base[0] / t_step[0]:8.2f}"
            print(line, flush=True)
            del caches
    if args.engine or args.only == "engine":
        engine_ab(args, base)


if __name__ == "__main__":
    main()
