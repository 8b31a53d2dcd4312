"""The default model's fused C step at 48 rows, phase by phase, A/B against another revision's kernels.

::

    python benchmarks/cstep_ab.py [--baseline REV] [--rows 48] [--context mixed 512] [--rounds 10] [--steps 4]
        [--matmul amx] [--variant amx]

Loads the default model as the engine does (``LLMEngine``, no flags) and takes its fused decoder's
weights and plan (:class:`kvfleet.kernels.cpu_decoder.DecoderWeights`, the matmul kind of each
matrix); builds one decoder over them with a bf16 KV cache of random keys and values, each row its
own scattered blocks. ``--context mixed``: the rows' lengths drawn (seed 0) from the 48-request
workload's decode steps (prompt 16-512 plus up to 128 generated tokens); a number: every row at
that length. Nothing is written to the cache (slots -1), the LM head runs on every row.

With ``--baseline REV`` the same decoder also runs REV's ``kernels/`` (``git archive``, compiled
with this tree's flags for ``--variant`` into a temporary folder and loaded beside this tree's
library; the struct layouts must match): the two alternate, round after round, so that a shared
machine's load drifts over both alike, and the logits of both are compared bit for bit. Prints the
median and the least (the least-loaded round: preemption only adds) per round of each C-step phase
(``FusedDecoder.profile``, ms per step; ``--threads 1`` adds ``cpu``, the step's CPU time) and, for attention,
the bounds: the bytes of the cache it must read (each KV head once per GQA group) at the machine's
measured bandwidth, and its float32 FLOPs.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BANDWIDTH_GB_S = 23.75   # this machine's measured read bandwidth (kvfleet bench peers' limits)


def baseline_library(rev: str, variant: str) -> ctypes.CDLL:
    """REV's kernels compiled for ``variant`` with this tree's flags, loaded, ABI-checked, bound."""
    from kvfleet.kernels import cpu_lib

    root = tempfile.mkdtemp(prefix="kvfleet-cstep-")
    archive = subprocess.run(["git", "-C", REPO, "archive", rev, "kernels"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", root], input=archive, check=True)
    out = os.path.join(root, f"old-{variant}.so")
    sources = [os.path.join(root, "kernels", s.name) for s in cpu_lib.SOURCES]
    subprocess.run([cpu_lib.compiler(), *cpu_lib.COMMON_FLAGS, *cpu_lib.VARIANT_FLAGS[variant], *sources, "-o", out,
                    "-lm"], check=True)
    lib = ctypes.CDLL(out)
    cpu_lib.check_abi(lib)
    try:
        cpu_lib.bind(lib)
    except AttributeError:   # a build before kv_decode_profile_clock (bound last): wall-clock phases only
        pass
    return lib


def contexts(kind: str, rows: int) -> list[int]:
    if kind != "mixed":
        return [int(kind)] * rows
    rng = random.Random(0)
    return [rng.randint(16, 512) + rng.randint(1, 128) for _ in range(rows)]


def main() -> None:
    import torch

    from kvfleet.kernels.cpu_decoder import FusedDecoder
    from kvfleet.runtime.bench.machine import cpu_description
    from kvfleet.runtime.config import EngineConfig
    from kvfleet.runtime.engine.llm_engine import LLMEngine

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", default=None, metavar="REV")
    ap.add_argument("--rows", type=int, default=48)
    ap.add_argument("--context", nargs="+", default=["mixed"])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--variant", default="amx", help="the baseline's build variant (cpu_lib.VARIANT_FLAGS)")
    ap.add_argument("--threads", type=int, default=0,
                    help="the decoder's threads (default: torch's); 1 times the phases in the thread's CPU time "
                         "(cpu_lib.set_profile_clock) and adds 'cpu', the step's: on a shared machine the steadier A/B")
    ap.add_argument("--hot", action="store_true",
                    help="every row reads the same cache blocks (they stay in cache: attention's compute alone)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)   # before the engine: its decoder starts the C pool with them

    eng = LLMEngine(EngineConfig(num_blocks=8))
    base = eng.runner.cpu_decode._fused
    w, bs = base.weights, 16
    ctxs = {c: contexts(c, args.rows) for c in args.context}
    width = max((n + bs - 1) // bs for cs in ctxs.values() for n in cs)
    blocks = args.rows * width + 1
    gen = torch.Generator().manual_seed(0)
    layers = []
    for layer in w.layers:
        shape = (blocks, bs, *layer.k_cache.shape[2:])
        layers.append(dataclasses.replace(layer, k_cache=torch.randn(shape, generator=gen).to(torch.bfloat16),
                                          v_cache=torch.randn(shape, generator=gen).to(torch.bfloat16)))
    dec = FusedDecoder(dataclasses.replace(w, layers=layers), matmul=base.matmul)
    libs = {"new": dec._lib}
    if args.baseline:
        libs["old"] = baseline_library(args.baseline, args.variant)
        libs["old"].kv_pool_start(torch.get_num_threads(), 200)
    clock = "wall"
    if args.threads == 1:   # the thread's CPU clock only where every build has it (never mixed)
        if all(hasattr(lib, "kv_decode_profile_clock") for lib in libs.values()):
            for lib in libs.values():
                lib.kv_decode_profile_clock(1)
            clock = "thread CPU"
        else:
            clock = "wall (a build lacks kv_decode_profile_clock)"
    QH, KVH, D, H = w.num_heads, w.num_kv_heads, w.head_size, dec.hidden
    print(f"CPU: {cpu_description()}, torch threads {torch.get_num_threads()}, load average "
          f"{os.getloadavg()[0]:.1f}; matmul {dec.matmul}, KV cache bf16, {args.rows} rows, "
          f"{args.rounds} rounds x {args.steps} steps per build; phases in {clock} time")
    tables = torch.randperm(blocks - 1, generator=gen)[: args.rows * width].view(args.rows, width).to(torch.int32)
    if args.hot:
        tables = tables[:1].expand(args.rows, width).contiguous()
    for name, cs in ctxs.items():
        lens = torch.tensor(cs, dtype=torch.int32)
        slots = torch.full((args.rows,), -1, dtype=torch.int64)
        cos, sin = torch.ones(args.rows, dec.rotary_dim), torch.zeros(args.rows, dec.rotary_dim)
        x = torch.randn(args.rows, H, generator=gen)
        per: dict = {k: [] for k in libs}
        logits = {}
        for r in range(args.rounds):
            for k in (libs if r % 2 == 0 else list(libs)[::-1]):
                dec._lib = libs[k]
                dec.profile()
                t, c = time.perf_counter(), time.thread_time()
                for _ in range(args.steps):
                    _, logits[k] = dec.step(x.clone(), cos, sin, slots, tables, lens)
                prof = dec.profile()
                prof["wall"] = (time.perf_counter() - t) * 1e3 / args.steps
                if args.threads == 1:
                    prof["cpu"] = (time.thread_time() - c) * 1e3 / args.steps
                per[k].append(prof)
        dec._lib = libs["new"]
        positions = sum(cs) * len(w.layers)
        kv_bytes = positions * KVH * D * 2 * 2
        flops = positions * QH * D * 4
        print(f"\ncontext {name} (mean {statistics.mean(cs):.0f}, {min(cs)}..{max(cs)}): median of the rounds, ms "
              f"per step; attention's bounds: {kv_bytes / 1e6:.0f} MB of bf16 KV at {BANDWIDTH_GB_S} GB/s = "
              f"{kv_bytes / BANDWIDTH_GB_S / 1e6:.2f} ms, {flops / 1e9:.2f} GFLOP")
        phases = [p for p in per["new"][0] if p != "steps"]
        print("| build | " + " | ".join(phases) + " | C step |\n|---|" + "---:|" * (len(phases) + 1))
        for k in libs:
            med = {p: statistics.median(q[p] for q in per[k]) for p in phases}
            total = statistics.median(sum(v for p, v in q.items() if p not in ("steps", "wall", "cpu")) for q in per[k])
            print(f"| {k} | " + " | ".join(f"{med[p]:.2f}" for p in phases) + f" | {total:.2f} |")
            best = {p: min(q[p] for q in per[k]) for p in phases}   # preemption only adds: the least-loaded
            total = min(sum(v for p, v in q.items() if p not in ("steps", "wall", "cpu")) for q in per[k])
            print(f"| {k}, best round | " + " | ".join(f"{best[p]:.2f}" for p in phases) + f" | {total:.2f} |")
        if "old" in libs:
            same = torch.equal(logits["old"], logits["new"])
            print(f"logits old == new, bit for bit: {same}")
    print(f"load average at the end {os.getloadavg()[0]:.1f}")
    eng.shutdown()
    sys.stdout.flush()


if __name__ == "__main__":
    main()
