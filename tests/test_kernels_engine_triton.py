"""The engine on the real default model with the Triton kernels (interpreted on CPU)
generates the same greedy tokens as with the torch kernels, through chunked prefill
(16-token step budget, 8-token blocks) and prefix-cache hits (the Triton run follows a
torch run of the same prompts, whose full blocks are then cached)."""

from __future__ import annotations

import pytest
import torch

from kvfleet.kernels import BACKEND_ENV
from kvfleet.kernels.testing import record_calls, triton_kernels

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is a city called",
    "The quick brown fox jumps over the lazy dog because it",
]


def test_engine_greedy_tokens_same_with_triton_kernels(smollm2, monkeypatch):
    from kvfleet.runtime.config import EngineConfig
    from kvfleet.runtime.engine.llm_engine import LLMEngine
    from kvfleet.runtime.llm import LLM
    from kvfleet.runtime.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(max_num_batched_tokens=16, block_size=8, kv_cache_memory=64 * 2**20),
                       loaded=smollm2)
    llm = LLM.from_engine(engine)
    params = SamplingParams(temperature=0.0, max_tokens=3)

    def run():
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]

    monkeypatch.setenv(BACKEND_ENV, "torch")
    expected = run()
    assert all(len(ids) == 3 for ids in expected)
    with triton_kernels(interpret=not torch.cuda.is_available()) as (_, attn_mod):
        calls = record_calls(monkeypatch, attn_mod, "paged_attention_triton")
        monkeypatch.setenv(BACKEND_ENV, "triton")
        got = run()
    assert calls, "the Triton kernel was not used"
    assert got == expected
