"""Automatic prefix caching on the real default model: the same greedy tokens with the
cache on and off, fewer prefill tokens for a shared prefix, and correct sharing under
memory pressure (issue 5)."""

from __future__ import annotations

import pytest

from kvfleet.runtime.config import EngineConfig
from kvfleet.runtime.engine import LLMEngine
from kvfleet.runtime.sampling_params import SamplingParams
from support import record_schedules

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

QUESTIONS = [
    "What is the capital of France?",
    "Name a prime number larger than ten.",
    "Why is the sky blue?",
    "Give me a synonym for happy.",
    "What is 7 times 8?",
    "Who wrote Hamlet?",
    "What colour is grass?",
    "Translate 'thank you' into Spanish.",
]


class Recorder:
    def __init__(self) -> None:
        self.stats = []

    def record(self, scheduler_stats, iteration_stats) -> None:
        self.stats.append(scheduler_stats)

    def total(self, name: str) -> int:
        return sum(getattr(s, name) for s in self.stats)


def system_prompt(tokenizer, num_tokens: int = 300) -> list[int]:
    text = "You are a careful assistant. Answer in one short sentence. Be concise and exact. " * 40
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) >= num_tokens
    return ids[:num_tokens]


def engine(smollm2, caching: bool, **kw):
    recorder = Recorder()
    kw.setdefault("kv_cache_memory", 64 * 2**20)
    config = EngineConfig(enable_prefix_caching=caching, max_num_batched_tokens=1024, **kw)
    return LLMEngine(config, [recorder], loaded=smollm2), recorder


def run(eng: LLMEngine, prompts: list[list[int]], params=GREEDY) -> list[list[int]]:
    ids = [f"q{i}-{id(prompts)}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        eng.add_request(rid, prompt, params)
    final = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                final[out.request_id] = out.outputs[0].token_ids
    return [final[rid] for rid in ids]


def test_shared_system_prompt_same_tokens_with_and_without_cache(smollm2):
    tok = smollm2.tokenizer
    system = system_prompt(tok)
    prompts = [system + tok(q, add_special_tokens=False)["input_ids"] for q in QUESTIONS]

    off, _ = engine(smollm2, caching=False)
    expected = run(off, prompts)

    on, recorder = engine(smollm2, caching=True)
    # Warm the cache with the first question, then send the rest together.
    first = run(on, prompts[:1])
    schedules = record_schedules(on)
    rest = run(on, prompts[1:])
    assert first + rest == expected

    prefill = {sr.request_id: (sr.start_pos, sr.num_new_tokens) for out in schedules for sr in out.scheduled
               if sr.start_pos < sr.request.num_prompt_tokens}
    block = on.config.block_size
    cached_prefix = len(system) // block * block
    assert all(start >= cached_prefix for start, _ in prefill.values()), prefill
    assert recorder.total("prefix_cache_hits") >= cached_prefix * (len(QUESTIONS) - 1)
    assert recorder.total("prefix_cache_queries") == sum(len(p) for p in prompts)


def test_entirely_cached_prompt_gives_the_same_tokens(smollm2):
    tok = smollm2.tokenizer
    prompt = system_prompt(tok, 320)  # 20 full blocks of 16
    on, recorder = engine(smollm2, caching=True)
    first = run(on, [prompt])
    schedules = record_schedules(on)
    second = run(on, [prompt])
    assert first == second
    sr = schedules[0].scheduled[0]
    assert sr.start_pos == 320 - 16 and sr.sample  # the last block is recomputed for logits
    assert recorder.total("prefix_cache_hits") == 320 - 16


def test_identical_long_prompts_under_memory_pressure(smollm2):
    tok = smollm2.tokenizer
    prompt = system_prompt(tok, 300)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    off, _ = engine(smollm2, caching=False)
    expected = run(off, [prompt], params)[0]

    # 23 blocks of 16: both copies start together (18 shared full blocks + a tail block
    # each = 20), but two sequences of 340 tokens need 18 + 2 * 4 = 26: one is preempted.
    on, recorder = engine(smollm2, caching=True, num_blocks=23)
    schedules = record_schedules(on)
    outs = run(on, [prompt, prompt], params)
    assert outs == [expected, expected]
    assert any(out.preempted_request_ids for out in schedules), "no preemption happened"
    assert recorder.total("prefix_cache_hits") > 0
    assert on.scheduler.kv_cache_manager.block_pool.num_free_blocks == on.num_blocks
