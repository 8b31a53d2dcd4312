"""The engine with the Triton kernels (interpreted on CPU) generates the same greedy tokens, with
the same log-probabilities (within 1e-4), as with the torch kernels, on the first two decoder
layers of the real default model (conftest's ``smollm2_two_layers``: its embedding, final norm
and LM head; every layer runs the same kernels at the same shapes, and the interpreter runs
them once per layer and step: over all 30 layers this test took 49 s). The log-probabilities
are compared because a two-layer cut's greedy tokens barely depend on the context: they alone
would miss a kernel that reads the wrong blocks.

On a fresh engine the Triton run goes through chunked prefill (16-token step budget, 8-token
blocks) and mixed prefill/decode steps; run again on the same engine, through prefix-cache hits
(its prompts' full blocks are then cached)."""

from __future__ import annotations

import pytest
import torch
from support.schedules import record_schedules

from kvfleet.kernels import BACKEND_ENV
from kvfleet.kernels.testing import record_calls, triton_kernels

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is a city called",
    "The quick brown fox jumps over the lazy dog because it",
]


def test_engine_greedy_tokens_same_with_triton_kernels(smollm2_two_layers, monkeypatch):
    from kvfleet.runtime.config import EngineConfig
    from kvfleet.runtime.engine.llm_engine import LLMEngine
    from kvfleet.runtime.llm import LLM
    from kvfleet.runtime.sampling_params import SamplingParams

    def engine():
        return LLMEngine(EngineConfig(max_num_batched_tokens=16, block_size=8, kv_cache_memory=64 * 2**20),
                         loaded=smollm2_two_layers)

    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)

    def run(llm):
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        return ([o.outputs[0].token_ids for o in outs], [o.num_cached_tokens or 0 for o in outs],
                [[e[t].logprob for t, e in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)] for o in outs])

    def close(a, b):
        return all(abs(x - y) <= 1e-4 for xs, ys in zip(a, b, strict=True) for x, y in zip(xs, ys, strict=True))

    monkeypatch.setenv(BACKEND_ENV, "torch")
    expected, _, expected_lp = run(LLM.from_engine(engine()))
    assert all(len(ids) == 6 for ids in expected)
    with triton_kernels(interpret=not torch.cuda.is_available()) as (_, attn_mod):
        calls = record_calls(monkeypatch, attn_mod, "paged_attention_triton")
        monkeypatch.setenv(BACKEND_ENV, "triton")
        eng = engine()
        schedules = record_schedules(eng)
        llm = LLM.from_engine(eng)
        fresh, fresh_cached, fresh_lp = run(llm)
        again, again_cached, again_lp = run(llm)
    assert calls, "the Triton kernel was not used"
    assert fresh == expected and again == expected
    assert close(fresh_lp, expected_lp) and close(again_lp, expected_lp), (expected_lp, fresh_lp, again_lp)
    steps = [out.scheduled for out in schedules]
    assert any(not sr.sample for step in steps for sr in step), "no prefill was chunked"
    assert any({sr.num_new_tokens == 1 for sr in step} == {True, False} for step in steps), "no mixed step"
    # the second prompt's first block (of 11 tokens) came from the cache; the first prompt is one
    # full block of 8, whose last block is always recomputed for its logits
    assert fresh_cached == [0, 0] and again_cached[1] >= 8, (fresh_cached, again_cached)
