"""The fused C step alone: a mixture-of-experts decoder against the dense one of the same active
size, in this process, with each step's bandwidth bound. Not a test::

    python benchmarks/moe_step.py [--matmul amx|avx512_bf16|float32] [--weights bf16|int8] [--rounds 5]
        [--threads 1] [--inputs vary|same] [--bandwidth 22]

Both: SmolLM2-135M's shape (hidden 576, 9 query / 3 KV heads of 64, vocabulary 49152), 12 layers
(``--layers``, ``--vocab``: a smaller model, whose one-row step the last-level cache can keep), a
bf16 KV cache; dense MLP 1536 wide against 8 experts of 768, top-2 (the same active weights); every
matrix in ``--weights`` (bf16, or int8 per output channel as ``--quantization int8`` stores them).
Steps of 1 and 48 rows, each row a sequence at position 200. ``--inputs vary`` (the default) gives
each step new rows, so that each step routes to other experts, as an engine's tokens do; ``same``
repeats one input, so every step reads the same two experts at one row (what this script and
``families.py``'s step A/B measured before: the experts' weights the previous step left in the
last-level cache are hit again, which an engine's one stream does not get).

Prints the best milliseconds per step over ``--rounds`` rounds (30 steps of 1 row, 8 of 48; the two
models alternate within a round) and the C step's phases (``FusedDecoder.profile``: the MoE's
routing + gate_up + SiLU count as ``mlp``, its down and combine as ``down``) of that best round,
each phase's minimum over the rounds, the dense / MoE ratio of the best steps, and each step's
bytes -- the weights it reads (the MoE's experts as the expected number that have rows under
uniform routing: ``E (1 - (1 - k/E)^M)``, 2 at one row, all 8 at 48) and its KV cache -- with the
time they take at ``--bandwidth`` GB/s (this machine's measured ~21-23 on both cores): how close
each step is to its bound, and the ratio the bounds allow. ``--threads 1`` times one thread's CPU
(``cpu_lib.set_profile_clock``: the phases and the steps), which a shared machine's load moves
least; its bound is then one core's rate, not the machine's. Results: docs/performance.md,
"Mixture of experts on the fused path" and its later sections.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from kvfleet.kernels import cpu_lib
from kvfleet.kernels.cpu_decoder import DecoderWeights, FusedDecoder, Layer, Linear, MoeLayer

H, QH, KVH, D, FF, LAYERS, V, BS = 576, 9, 3, 64, 1536, 12, 49152, 16
E, TOP_K, IE, POSITION = 8, 2, 768, 200


def _linear(n: int, k: int, weights: str, gen: torch.Generator) -> Linear:
    w = (torch.randn(n, k, generator=gen) * 0.05).to(torch.bfloat16)
    if weights == "bf16":
        return Linear("bf16", w.contiguous())
    scale = (w.float().abs().amax(1) / 127).contiguous()   # symmetric int8 per output channel
    return Linear("int8", torch.round(w.float() / scale[:, None]).to(torch.int8).contiguous(), scale)


def _model(moe: bool, gen: torch.Generator, weights: str = "bf16", layers: int = LAYERS, vocab: int = V
           ) -> DecoderWeights:
    def lin(n, k):
        return _linear(n, k, weights, gen)

    blocks = 48 * (POSITION // BS + 1)
    decoder_layers = []
    for _ in range(layers):
        kc = torch.randn(blocks, BS, KVH, D, generator=gen).to(torch.bfloat16)
        norm, qkv, o = torch.ones(H), lin((QH + 2 * KVH) * D, H), lin(H, QH * D)
        if moe:
            experts = MoeLayer(Linear("fp32", torch.randn(E, H, generator=gen) * 0.05),
                               [lin(2 * IE, H) for _ in range(E)], [lin(H, IE) for _ in range(E)], TOP_K)
            decoder_layers.append(Layer(norm, norm.clone(), qkv, o, None, None, kc, kc.clone(), moe=experts))
        else:
            decoder_layers.append(Layer(norm, norm.clone(), qkv, o, lin(2 * FF, H), lin(H, FF), kc, kc.clone()))
    return DecoderWeights(QH, KVH, D, 1e-5, D ** -0.5, decoder_layers, torch.ones(H), lin(vocab, H))


def _rows(M: int, gen: torch.Generator):
    width = POSITION // BS + 1
    tables = torch.arange(M * width, dtype=torch.int32).view(M, width)
    slots = torch.tensor([int(tables[i, (POSITION - 1) // BS]) * BS + (POSITION - 1) % BS for i in range(M)])
    lens = torch.full((M,), POSITION, dtype=torch.int32)
    return torch.randn(M, H, generator=gen), torch.ones(M, D), torch.zeros(M, D), slots, tables, lens


def _bytes(m: Linear) -> int:
    return m.w.numel() * m.w.element_size() + sum(t.numel() * 4 for t in (m.scale, m.shift) if t is not None)


def step_bytes(w: DecoderWeights, M: int) -> tuple[float, float]:
    """(weight bytes, KV bytes) one step of ``M`` rows at ``POSITION`` reads (see the module docstring)."""
    total = _bytes(w.head)
    for layer in w.layers:
        total += _bytes(layer.qkv) + _bytes(layer.o)
        if layer.moe is None:
            total += _bytes(layer.gate_up) + _bytes(layer.down)
            continue
        m = layer.moe
        used = len(m.gate_up) * (1 - (1 - m.top_k / len(m.gate_up)) ** M)
        total += _bytes(m.router) + used * (_bytes(m.gate_up[0]) + _bytes(m.down[0]))
    kv = M * POSITION * len(w.layers) * 2 * KVH * D * 2   # bf16 keys and values, each row its own blocks
    return total, kv


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--matmul", default="amx")
    parser.add_argument("--weights", choices=("bf16", "int8"), default="bf16")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="the C pool's and torch's (default: torch's); "
                        "1: one thread's CPU time")
    parser.add_argument("--inputs", choices=("vary", "same"), default="vary")
    parser.add_argument("--layers", type=int, default=LAYERS)
    parser.add_argument("--vocab", type=int, default=V, help="the LM head's rows (a smaller model: what the "
                        "last-level cache keeps from one step to the next)")
    parser.add_argument("--bandwidth", type=float, default=22.0, help="GB/s for the bound (both cores' reads)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cpu_clock = args.threads == 1
    if cpu_clock:
        cpu_lib.set_profile_clock(True)
    clock = time.thread_time if cpu_clock else time.perf_counter
    gen = torch.Generator().manual_seed(0)
    decoders = {name: FusedDecoder(_model(name == "moe", gen, args.weights, args.layers, args.vocab),
                                   threads=args.threads, matmul=args.matmul) for name in ("dense", "moe")}
    cases = {M: (_rows(M, gen), [torch.randn(M, H, generator=gen) for _ in range(steps)])
             for M, steps in ((1, 30), (48, 8))}
    best: dict = {}
    lowest: dict = {}
    for _ in range(args.rounds):
        for M, ((x, *rest), inputs) in cases.items():
            for name, dec in decoders.items():
                dec.profile()
                start = clock()
                for xi in inputs:
                    dec.step((xi if args.inputs == "vary" else x).clone(), *rest)
                ms = (clock() - start) / len(inputs) * 1e3
                prof = dec.profile()
                if (name, M) not in best or ms < best[name, M][0]:
                    best[name, M] = (ms, prof)
                low = lowest.setdefault((name, M), {})
                for k, v in prof.items():
                    low[k] = min(v, low.get(k, v))
    print(f"{decoders['dense'].matmul}, {args.weights} weights, inputs {args.inputs}, threads {torch.get_num_threads()}"
          f" ({'one thread CPU time' if cpu_clock else 'wall time'}); load average {os.getloadavg()[0]:.1f}")
    for (name, M), (ms, prof) in sorted(best.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        print(f"{name:5s} {M:2d} rows: {ms:7.2f} ms/step; "
              + " ".join(f"{k} {v:.2f}" for k, v in prof.items() if k != "steps"))
    for (name, M), low in sorted(lowest.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        print(f"{name:5s} {M:2d} rows, each phase's minimum: "
              + " ".join(f"{k} {v:.2f}" for k, v in low.items() if k != "steps"))
    bounds = {}
    for (name, M) in sorted(best, key=lambda k: (k[1], k[0])):
        weights, kv = step_bytes(decoders[name].weights, M)
        bounds[name, M] = (weights + kv) / args.bandwidth / 1e6
        print(f"{name:5s} {M:2d} rows reads {weights / 1e6:.0f} MB of weights + {kv / 1e6:.0f} MB of KV: "
              f"{bounds[name, M]:.2f} ms at {args.bandwidth:g} GB/s, the step at "
              f"{bounds[name, M] / best[name, M][0]:.0%} of that bound")
    for M in (1, 48):
        print(f"{M:2d} rows: dense / MoE {best['dense', M][0] / best['moe', M][0]:.2f}x (best steps); "
              f"the dense step + the MoE's extra bytes at {args.bandwidth:g} GB/s would be "
              f"{best['dense', M][0] / (best['dense', M][0] + bounds['moe', M] - bounds['dense', M]):.2f}x")


if __name__ == "__main__":
    main()
