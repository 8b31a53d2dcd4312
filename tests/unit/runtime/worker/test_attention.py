"""The CPU attention plan on the real default model: the engine plans the torch paged
attention once per step (not once per layer), and the tokens and logprobs it generates
are bit-identical to planning in every layer's call (the path before the plan existed)."""

from __future__ import annotations

import pytest

from kvfleet.kernels.testing import record_calls
from kvfleet.runtime.config import EngineConfig
from kvfleet.runtime.engine.llm_engine import LLMEngine
from kvfleet.runtime.llm import LLM
from kvfleet.runtime.sampling_params import SamplingParams
from kvfleet.runtime.worker import attention

pytestmark = pytest.mark.slow

PROMPTS = [
    "Hello, my name is",
    "The history of the Roman Empire spans many centuries. " * 12,
    "def fibonacci(n):\n    ",
    "Write a short poem about the sea. " * 5,
]
PARAMS = SamplingParams(temperature=0.0, max_tokens=20, logprobs=3, prompt_logprobs=2, ignore_eos=True)


def generate(smollm2, **config):
    # Chunked prefill (64-token steps) gives steps that mix decode and prefill sequences.
    engine = LLMEngine(EngineConfig(kv_cache_memory=64 * 2**20, max_num_batched_tokens=64, **config),
                       loaded=smollm2)
    outs = LLM.from_engine(engine).generate(PROMPTS, PARAMS, use_tqdm=False)
    return engine, [(o.prompt_logprobs, o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def test_one_plan_per_step_and_same_outputs_as_per_layer_planning(smollm2, monkeypatch):
    monkeypatch.delenv("KVFLEET_ATTENTION_BACKEND", raising=False)
    # The transformers path on every step: the fused CPU decode path would run the decode
    # steps without the model's forward (kvfleet.runtime.worker.cpu_decode).
    monkeypatch.setenv("KVFLEET_CPU_DECODER", "0")
    plans = record_calls(monkeypatch, attention, "plan_paged_attention_torch")
    forwards = []
    hook = smollm2.model.register_forward_pre_hook(lambda _m, _a: forwards.append(1))
    try:
        engine, planned = generate(smollm2)
    finally:
        hook.remove()
    # SmolLM2 has no sliding window: one plan per forward pass (the engine's steps and its
    # two load-time probes), each shared by the 30 layers.
    assert engine.num_steps > 20
    assert plans and {p.get("sliding_window") for p in plans} == {None}
    assert len(plans) == len(forwards) >= engine.num_steps

    # The path before the plan: every layer's call plans for itself.
    monkeypatch.setattr(attention.AttentionMetadata, "torch_plan", lambda self, key_cache, window: None)
    plans.clear()
    _, per_layer = generate(smollm2)
    assert plans == []
    assert per_layer == planned


def test_plan_is_not_a_metadata_field():
    # runtime/worker/executor.py copies the metadata with dataclasses.replace over its fields:
    # a copy must not carry the step's plans (they belong to the driver's caches).
    import dataclasses

    import torch

    cache = torch.zeros(4, 8, 2, 16)
    meta = attention.AttentionMetadata(
        slot_mapping=torch.arange(3), block_tables=torch.zeros((1, 1), dtype=torch.int32),
        seq_lens=torch.tensor([3], dtype=torch.int32), query_start_loc=torch.tensor([0, 3], dtype=torch.int32),
        max_query_len=3, max_seq_len=3, kv_caches=[(cache, cache)],
    )
    plan = meta.torch_plan(cache, None)
    assert meta.torch_plan(cache, None) is plan
    assert meta.torch_plan(cache, 2) is not plan
    assert "_torch_plans" not in {f.name for f in dataclasses.fields(meta)}
    assert "_torch_plans" not in dataclasses.replace(meta).__dict__
