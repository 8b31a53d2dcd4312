"""One-stream decode speed of the default model on this CPU with float32, bf16 and int8 weights
(float32 activations; the fused C decoder where it applies), and the greedy agreement of bf16
weights with float32. Not a test::

    python benchmarks/cpu_weights.py [--formats fp32,bf16,int8] [--prompt-tokens 128]
        [--new-tokens 256] [--rounds 3] [--agree-prompts 4] [--agree-tokens 64]

Per format and round (the formats alternate, ``--rounds`` times, so that a shared machine's load
falls on all of them): one request, a ``--prompt-tokens`` prompt, ``--new-tokens`` greedy tokens
with EOS ignored; prints decode tok/s (tokens after the first over the time after the first), the
time to the first token and the fused C step's milliseconds (``FusedDecoder.profile``), then
each format's best round. bf16 weights come from
:func:`kvfleet.runtime.worker.woq_linear.to_bf16_weights`, int8 from ``--quantization int8``.
The first line records the CPU (:func:`kvfleet.kernels.cpu_features.detect`). Results:
docs/performance.md, "bf16 weights".
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from kvfleet.kernels import cpu_features
from kvfleet.runtime.config import EngineConfig
from kvfleet.runtime.engine.llm_engine import LLMEngine
from kvfleet.runtime.sampling_params import SamplingParams
from kvfleet.runtime.worker.model_loader import load_model
from kvfleet.runtime.worker.woq_linear import to_bf16_weights

PROMPTS = ["The history of the printing press", "Explain how a hash table works.",
           "Write a short poem about the sea.", "What is the capital of Australia, and why?",
           "List three uses of copper.", "Describe a sunrise over the mountains."]


def engine(fmt: str) -> LLMEngine:
    loaded = load_model(None, dtype="float32", device="cpu", quantization="int8" if fmt == "int8" else None)
    if fmt == "bf16":
        to_bf16_weights(loaded.model)
    cfg = EngineConfig(dtype="float32", device="cpu", quantization="int8" if fmt == "int8" else None)
    return LLMEngine(cfg, loaded=loaded)


def generate(eng: LLMEngine, prompt: list[int], n: int) -> tuple[list[int], float, float]:
    """(tokens, seconds to the first token, seconds after it)."""
    eng.add_request(f"r{time.monotonic_ns()}", prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    t0, first, tokens = time.perf_counter(), None, []
    while eng.has_unfinished_requests():
        for out in eng.step():
            tokens = list(out.outputs[0].token_ids)
            if first is None and tokens:
                first = time.perf_counter()
    return tokens, first - t0, time.perf_counter() - first


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--formats", default="fp32,bf16,int8")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--agree-prompts", type=int, default=4)
    ap.add_argument("--agree-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    print(f"cpu: {cpu_features.detect().summary()}; torch threads {torch.get_num_threads()}")
    formats = args.formats.split(",")
    engines = {fmt: engine(fmt) for fmt in formats}
    tok = engines[formats[0]].tokenizer
    prompt = tok.encode(" ".join(PROMPTS) * 20)[: args.prompt_tokens]
    best: dict[str, tuple[float, float, float]] = {}
    for r in range(args.rounds):  # formats alternate, so each round's figures share the machine's load
        for fmt, eng in engines.items():
            generate(eng, prompt[:16], 8)  # warm-up
            fused = eng.runner.cpu_decode._fused if eng.runner.cpu_decode is not None else None
            if fused is not None:
                fused.profile()  # reset the C step's counters
            tokens, ttft, rest = generate(eng, prompt, args.new_tokens)
            prof = fused.profile() if fused is not None else {}
            c_ms = sum(v for k, v in prof.items() if k != "steps")
            rate = (len(tokens) - 1) / rest
            print(f"round {r} {fmt:5s} decode {rate:7.1f} tok/s  first token {ttft * 1e3:6.0f} ms  "
                  f"C step {c_ms:6.2f} ms  fused={fused is not None}", flush=True)
            if fmt not in best or rate > best[fmt][0]:
                best[fmt] = (rate, ttft, c_ms)
    for fmt, (rate, ttft, c_ms) in best.items():
        print(f"best {fmt:5s} decode {rate:7.1f} tok/s  first token {ttft * 1e3:6.0f} ms  C step {c_ms:6.2f} ms")
    greedy = {fmt: [generate(eng, tok.encode(p), args.agree_tokens)[0] for p in PROMPTS[: args.agree_prompts]]
              for fmt, eng in engines.items()}
    if "fp32" in greedy:
        for fmt, outs in greedy.items():
            if fmt == "fp32":
                continue
            same = []
            for a, b in zip(greedy["fp32"], outs):
                same.append(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)))
            print(f"{fmt} vs fp32 greedy: identical prefix per prompt {same} of {args.agree_tokens}; "
                  f"{sum(s == args.agree_tokens for s in same)}/{len(same)} prompts identical")


if __name__ == "__main__":
    main()
