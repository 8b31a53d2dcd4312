"""A mixture of experts against the dense model of the same shape, on this CPU, in one process, no
flags (``load_model``'s and ``EngineConfig``'s defaults: the CPU plan's dtype, weights and matmuls).
Not a test::

    python benchmarks/moe.py [--rounds 3] [--layers 12] [--out-dir /tmp/kvfleet-moe] [--tokenizer DIR]

Both models are random (fixed seed), SmolLM2-135M's shape cut to ``--layers`` layers (hidden 576, 9
query / 3 KV heads, vocabulary 49152, tied embeddings): a Llama with a 1536-wide MLP, and a Mixtral
with 8 experts of width 768, top-2 -- the same active parameters per token (2 x 768 = 1536), four
times the MLP parameters in all. Each is saved once under ``--out-dir`` (with the tokenizer of
``--tokenizer``, default the default model's converted checkpoint) and served by kvfleet's engine
in-process; per round and model: one stream (1 request), then 48 requests at once, each 128 random
prompt tokens and 128 generated (``ignore_eos``), after an 8-token warm-up. Prints output tokens/s
(prefill included), the fused C step's milliseconds per phase (``FusedDecoder.profile``), and the
best-of-rounds ratio Mixtral / Llama. Results: docs/performance.md, "Mixture of experts".
"""

from __future__ import annotations

import argparse
import gc
import os
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from kvfleet.kernels import cpu_features

SHAPE = dict(vocab_size=49152, hidden_size=576, num_attention_heads=9, num_key_value_heads=3,
             max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True,
             initializer_range=0.02, bos_token_id=1, eos_token_id=2)


def _configs(layers: int) -> dict:
    from transformers import AutoConfig

    shape = dict(SHAPE, num_hidden_layers=layers)
    return {"llama": AutoConfig.for_model("llama", intermediate_size=1536, **shape),
            "mixtral": AutoConfig.for_model("mixtral", intermediate_size=768, num_local_experts=8,
                                            num_experts_per_tok=2, **shape)}


def _default_tokenizer() -> str:
    from kvfleet.runtime.worker.model_loader import resolve_model_path

    return resolve_model_path(None)[0]


def checkpoint(name: str, config, out_dir: str, tokenizer: str) -> str:
    """The random model ``name`` saved (once) under ``out_dir``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = os.path.join(out_dir, f"{name}-{config.num_hidden_layers}")
    if not os.path.exists(os.path.join(path, "config.json")):
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(path)
        AutoTokenizer.from_pretrained(tokenizer).save_pretrained(path)
    return path


def measure(path: str, requests: int, prompt_len: int = 128, out_len: int = 128) -> tuple[float, dict]:
    """Output tokens/s of ``requests`` at once, and the C step's ms per phase."""
    from kvfleet.runtime.config import EngineConfig
    from kvfleet.runtime.engine.llm_engine import LLMEngine
    from kvfleet.runtime.llm import LLM
    from kvfleet.runtime.sampling_params import SamplingParams
    from kvfleet.runtime.worker.model_loader import load_model

    engine = LLMEngine(EngineConfig(model=path), loaded=load_model(path))
    if engine.runner.cpu_decode is None:
        raise SystemExit(f"{path}: the fused CPU decoder is off (see the log)")
    llm = LLM.from_engine(engine)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(100, 40000, (prompt_len,), generator=gen).tolist() for _ in range(requests)]
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    engine.runner.cpu_decode.profile()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True), use_tqdm=False)
    seconds = time.perf_counter() - t0
    profile = engine.runner.cpu_decode.profile()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    del engine, llm
    gc.collect()
    return tokens / seconds, profile


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--out-dir", default="/tmp/kvfleet-moe")
    parser.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the default model's)")
    args = parser.parse_args()
    tokenizer = args.tokenizer or _default_tokenizer()
    paths = {name: checkpoint(name, cfg, args.out_dir, tokenizer) for name, cfg in _configs(args.layers).items()}
    print(f"CPU: {cpu_features.detect().summary()}; {torch.get_num_threads()} threads")
    best: dict[tuple[str, int], float] = {}
    for rnd in range(args.rounds):
        for requests in (1, 48):
            for name, path in paths.items():
                tps, prof = measure(path, requests)
                best[name, requests] = max(best.get((name, requests), 0.0), tps)
                print(f"round {rnd} {name:8s} {requests:3d} requests: {tps:7.1f} tok/s; C step ms/step "
                      + " ".join(f"{k} {v:.2f}" for k, v in prof.items() if k != "steps"), flush=True)
    for requests in (1, 48):
        dense, moe = best["llama", requests], best["mixtral", requests]
        print(f"{requests:3d} requests: llama {dense:.1f} tok/s, mixtral {moe:.1f} tok/s: {moe / dense:.2f}x "
              f"(best of {args.rounds})")


if __name__ == "__main__":
    main()
