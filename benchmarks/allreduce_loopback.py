"""What a tensor-parallel step's all-reduces cost between processes on this machine (gloo over
127.0.0.1), the "network" of every multi-node test here, against docs/sizing.md's bytes.

::

    python benchmarks/allreduce_loopback.py [--ranks 2] [--hidden 576] [--layers 30] [--tokens 1 64 512]

Starts ``--ranks`` processes (torch.distributed, gloo, a TCP store on a free loopback port), and per
``--tokens`` count all-reduces a ``[tokens, hidden]`` float32 tensor ``2 x layers`` times (one
decoder step of tensor parallelism: after attention and after the MLP, every layer), after a
warm-up, for ``--repeats`` steps. Prints per token count the median step's all-reduce time (ms)
and the loopback rate it implies per rank, in bytes sent (``2 (t-1)/t x`` the tensor, a ring).
The default shape is SmolLM2-135M's, the tests' model. On a shared 2-core machine the numbers
move with the load: compare rows of one run only.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, args: argparse.Namespace, port: int, out) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.ranks)
    for tokens in args.tokens:
        x = torch.randn(tokens, args.hidden)
        times = []
        for step in range(args.repeats + 2):
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(2 * args.layers):
                dist.all_reduce(x)
            if step >= 2:  # two warm-up steps
                times.append(time.perf_counter() - t0)
        if rank == 0:
            out.put((tokens, statistics.median(times)))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 512])
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, args, port, out)) for r in range(args.ranks)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    t = args.ranks
    print(f"{t} ranks (gloo, 127.0.0.1), hidden {args.hidden}, {2 * args.layers} all-reduces per step, "
          f"float32, {os.cpu_count()} CPUs")
    print("| tokens in the step | all-reduce time per step (ms) | sent per rank per step | loopback rate |")
    print("|---|---|---|---|")
    while not out.empty():
        tokens, seconds = out.get()
        sent = 2 * (t - 1) / t * tokens * args.hidden * 4 * 2 * args.layers
        print(f"| {tokens} | {seconds * 1e3:.2f} | {sent / 2**20:.2f} MiB | {sent / seconds / 1e9:.2f} GB/s |")


if __name__ == "__main__":
    main()
