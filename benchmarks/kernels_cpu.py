"""Micro-benchmark of the CPU (torch) attention path: time per call of
``paged_attention`` and ``reshape_and_cache`` for the shapes the engine sees with
SmolLM2-135M (9 query heads, 3 kv heads, head_size 64, fp32, block_size 16).

Not a test. Run::

    python benchmarks/kernels_cpu.py            # default grid
    python benchmarks/kernels_cpu.py --threads 2 --repeat 20

Each line prints the shape, the time per call (min and median of ``--repeat`` runs, after
a warm-up; on a shared machine the min is the code, the median includes the neighbours)
and the min multiplied by the model's 30 layers, i.e. the attention cost of one engine
step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

# As the engine does (kvfleet.runtime.llm): idle OpenMP threads sleep instead of spinning,
# which matters on a CPU shared with other processes.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


import torch

from kvfleet.kernels import paged_attention_torch, reshape_and_cache_torch
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
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    print(f"torch {torch.__version__}, threads={torch.get_num_threads()}, dtype={args.dtype}, "
          f"block_size={args.block_size}, heads 9/3, head_size 64")
    print(f"{'case':45s} {'tokens':>6s} {'attn ms min/med':>17s} {'x30 ms (min)':>12s} {'cache ms':>9s}")
    for name, dec, pre in CASES:
        b = make_batch(dec, pre, block_size=args.block_size, dtype=dtype)
        t_attn = time_call(lambda: paged_attention_torch(*b.attn_args), args.repeat)
        t_cache = time_call(lambda: reshape_and_cache_torch(
            b.new_keys, b.new_values, b.key_cache, b.value_cache, b.slot_mapping), args.repeat)
        n = b.query.shape[0]
        print(f"{name:45s} {n:6d} {t_attn[0] * 1e3:8.2f}/{t_attn[1] * 1e3:8.2f} "
              f"{t_attn[0] * 1e3 * NUM_LAYERS:12.1f} {t_cache[0] * 1e3:9.3f}", flush=True)


if __name__ == "__main__":
    main()
