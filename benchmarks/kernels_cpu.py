"""Micro-benchmark of the CPU (torch) attention path: time per call of
``paged_attention`` and ``reshape_and_cache`` for the shapes the engine sees with
SmolLM2-135M (9 query heads, 3 kv heads, head_size 64, fp32, block_size 16).

Not a test. Run::

    python benchmarks/kernels_cpu.py            # default grid
    python benchmarks/kernels_cpu.py --threads 2 --repeat 20

Each line prints the shape, the time per call (median of ``--repeat`` runs, after a
warm-up) and that time multiplied by the model's 30 layers, i.e. the attention cost of
one engine step.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvfleet.kernels import paged_attention_torch, reshape_and_cache_torch

NUM_LAYERS = 30


def make_batch(decode_lens, prefill, *, heads=9, kv_heads=3, head_size=64, block_size=16,
               dtype=torch.float32, seed=0):
    """Build a random paged cache and a packed batch.

    ``decode_lens``: context length of each decode sequence (1 query token each).
    ``prefill``: list of ``(cached_prefix_len, chunk_len)`` prefill sequences.
    Physical blocks are shuffled, as in a long-running engine.
    """
    g = torch.Generator().manual_seed(seed)
    seqs = [(L, 1) for L in decode_lens] + [(p + c, c) for p, c in prefill]
    blocks_per_seq = [(L + block_size - 1) // block_size for L, _ in seqs]
    num_blocks = sum(blocks_per_seq) + 1
    max_blocks = max(blocks_per_seq)
    key_cache = torch.randn(num_blocks, block_size, kv_heads, head_size, generator=g).to(dtype)
    value_cache = torch.randn(num_blocks, block_size, kv_heads, head_size, generator=g).to(dtype)
    perm = torch.randperm(num_blocks, generator=g)
    block_tables = torch.zeros(len(seqs), max_blocks, dtype=torch.int32)
    used = 0
    for s, nb in enumerate(blocks_per_seq):
        block_tables[s, :nb] = perm[used:used + nb]
        used += nb
    q_lens = torch.tensor([q for _, q in seqs])
    query_start_loc = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.cumsum(q_lens, 0)
    num_tokens = int(query_start_loc[-1])
    query = torch.randn(num_tokens, heads, head_size, generator=g).to(dtype)
    seq_lens = torch.tensor([L for L, _ in seqs], dtype=torch.int32)
    # slot mapping of the new tokens (the last q_len positions of each sequence)
    slots = []
    for s, (L, ql) in enumerate(seqs):
        for pos in range(L - ql, L):
            slots.append(int(block_tables[s, pos // block_size]) * block_size + pos % block_size)
    slot_mapping = torch.tensor(slots, dtype=torch.long)
    key = torch.randn(num_tokens, kv_heads, head_size, generator=g).to(dtype)
    return dict(query=query, key=key, value=key.clone(), key_cache=key_cache, value_cache=value_cache,
                block_tables=block_tables, seq_lens=seq_lens, query_start_loc=query_start_loc,
                slot_mapping=slot_mapping)


def time_call(fn, repeat):
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


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
    print(f"{'case':45s} {'tokens':>6s} {'attn ms':>9s} {'x30 ms':>8s} {'cache ms':>9s}")
    for name, dec, pre in CASES:
        b = make_batch(dec, pre, block_size=args.block_size, dtype=dtype)
        scale = 0.125
        t_attn = time_call(lambda: paged_attention_torch(
            b["query"], b["key_cache"], b["value_cache"], b["block_tables"], b["seq_lens"],
            b["query_start_loc"], scale), args.repeat)
        t_cache = time_call(lambda: reshape_and_cache_torch(
            b["key"], b["value"], b["key_cache"], b["value_cache"], b["slot_mapping"]), args.repeat)
        n = b["query"].shape[0]
        print(f"{name:45s} {n:6d} {t_attn * 1e3:9.3f} {t_attn * 1e3 * NUM_LAYERS:8.1f} {t_cache * 1e3:9.3f}")


if __name__ == "__main__":
    main()
