"""The fused C step alone: a mixture-of-experts decoder against the dense one of the same active
size, in this process. Not a test::

    python benchmarks/moe_step.py [--matmul amx|avx512_bf16|float32] [--rounds 5] [--threads 1]

Both: SmolLM2-135M's shape (hidden 576, 9 query / 3 KV heads of 64, vocabulary 49152), 12 layers, bf16
weights, a bf16 KV cache; dense MLP 1536 wide against 8 experts of 768, top-2 (the same active
weights). Steps of 1 and 48 rows, each row a sequence at position 200. Prints the best milliseconds
per step over ``--rounds`` rounds (30 steps of 1 row, 8 of 48; the two models alternate within a
round) and the C step's phases (``FusedDecoder.profile``: the MoE's routing + gate_up + SiLU count
as ``mlp``, its down and combine as ``down``) of that best round, then each phase's minimum over
the rounds and the dense / MoE ratio of the best steps. On a shared machine, ``--threads 1`` (the C
pool's and torch's threads) and more rounds: one thread is preempted less than two that wait on
each other, and the phase minima keep what a round lost to another process out of the comparison.
Results: docs/performance.md, "Mixture of experts on the fused path" and "bf16 weights as A tiles".
"""

from __future__ import annotations

import argparse
import time

import torch

from kvfleet.kernels.cpu_decoder import DecoderWeights, FusedDecoder, Layer, Linear, MoeLayer

H, QH, KVH, D, FF, LAYERS, V, BS = 576, 9, 3, 64, 1536, 12, 49152, 16
E, TOP_K, IE, POSITION = 8, 2, 768, 200


def _model(moe: bool, gen: torch.Generator) -> DecoderWeights:
    def lin(n, k):
        return Linear("bf16", (torch.randn(n, k, generator=gen) * 0.05).to(torch.bfloat16).contiguous())

    blocks = 48 * (POSITION // BS + 1)
    layers = []
    for _ in range(LAYERS):
        kc = torch.randn(blocks, BS, KVH, D, generator=gen).to(torch.bfloat16)
        if moe:
            experts = MoeLayer(Linear("fp32", torch.randn(E, H, generator=gen) * 0.05),
                               [lin(2 * IE, H) for _ in range(E)], [lin(H, IE) for _ in range(E)], TOP_K)
            layers.append(Layer(torch.ones(H), torch.ones(H), lin((QH + 2 * KVH) * D, H), lin(H, QH * D), None, None,
                                kc, kc.clone(), moe=experts))
        else:
            layers.append(Layer(torch.ones(H), torch.ones(H), lin((QH + 2 * KVH) * D, H), lin(H, QH * D),
                                lin(2 * FF, H), lin(H, FF), kc, kc.clone()))
    return DecoderWeights(QH, KVH, D, 1e-5, D ** -0.5, layers, torch.ones(H), lin(V, H))


def _rows(M: int, gen: torch.Generator):
    width = POSITION // BS + 1
    tables = torch.arange(M * width, dtype=torch.int32).view(M, width)
    slots = torch.tensor([int(tables[i, (POSITION - 1) // BS]) * BS + (POSITION - 1) % BS for i in range(M)])
    lens = torch.full((M,), POSITION, dtype=torch.int32)
    return torch.randn(M, H, generator=gen), torch.ones(M, D), torch.zeros(M, D), slots, tables, lens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--matmul", default="amx")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="the C pool's and torch's (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    decoders = {name: FusedDecoder(_model(name == "moe", gen), threads=args.threads, matmul=args.matmul)
                for name in ("dense", "moe")}
    best: dict = {}
    lowest: dict = {}
    for _ in range(args.rounds):
        for M, steps in ((1, 30), (48, 8)):
            x, *rest = _rows(M, gen)
            for name, dec in decoders.items():
                dec.profile()
                start = time.perf_counter()
                for _ in range(steps):
                    dec.step(x.clone(), *rest)
                ms = (time.perf_counter() - start) / steps * 1e3
                prof = dec.profile()
                if (name, M) not in best or ms < best[name, M][0]:
                    best[name, M] = (ms, prof)
                low = lowest.setdefault((name, M), {})
                for k, v in prof.items():
                    low[k] = min(v, low.get(k, v))
    for (name, M), (ms, prof) in sorted(best.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        print(f"{decoders[name].matmul} {name:5s} {M:2d} rows: {ms:7.2f} ms/step; "
              + " ".join(f"{k} {v:.2f}" for k, v in prof.items() if k != "steps"))
    for (name, M), low in sorted(lowest.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        print(f"{name:5s} {M:2d} rows, each phase's minimum: "
              + " ".join(f"{k} {v:.2f}" for k, v in low.items() if k != "steps"))
    for M in (1, 48):
        print(f"{M:2d} rows: dense / MoE {best['dense', M][0] / best['moe', M][0]:.2f}x (best steps)")


if __name__ == "__main__":
    main()
