"""Automatic prefix caching: the same greedy tokens with the cache on and off, fewer prefill
tokens for a shared prefix, and correct sharing under memory pressure (issue 5).

On the real default model's first two decoder layers (conftest's ``smollm2_two_layers``: cached
blocks are shared the same way in every layer; over all 30 layers this module took 69 s on
CI). Such a cut's greedy tokens barely depend on the context (dropping a prompt's first block
left them unchanged), so every comparison of outputs here also compares each sampled token's
log-probability, within 1e-4 (:class:`Seq`): a wrong cached block moves them far more."""

from __future__ import annotations

import pytest
from support.engine_workload import QUESTIONS
from support.schedules import record_schedules

from kvfleet.runtime.config import EngineConfig
from kvfleet.runtime.engine.llm_engine import LLMEngine
from kvfleet.runtime.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)

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


def engine(smollm2_two_layers, caching: bool, **kw):
    recorder = Recorder()
    kw.setdefault("kv_cache_memory", 64 * 2**20)
    kw.setdefault("max_num_batched_tokens", 1024)
    config = EngineConfig(enable_prefix_caching=caching, **kw)
    return LLMEngine(config, [recorder], loaded=smollm2_two_layers), recorder


class Seq(list):
    """A sequence's token ids; ``==`` also needs its tokens' log-probabilities (``.logprobs``,
    from ``logprobs=0``) within 1e-4 of the other's."""

    def __init__(self, completion) -> None:
        super().__init__(completion.token_ids)
        self.logprobs = [e[t].logprob for t, e in zip(completion.token_ids, completion.logprobs or [], strict=True)]
        assert len(self.logprobs) == len(self), "ask for logprobs=0"

    def __eq__(self, other) -> bool:
        return (list.__eq__(self, other) is True and isinstance(other, Seq)
                and all(abs(a - b) <= 1e-4 for a, b in zip(self.logprobs, other.logprobs, strict=True)))

    def __ne__(self, other) -> bool:
        return not self == other

    __hash__ = None


def run(eng: LLMEngine, prompts: list[list[int]], params=GREEDY) -> list[Seq]:
    ids = [f"q{i}-{id(prompts)}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        eng.add_request(rid, prompt, params)
    final = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                final[out.request_id] = Seq(out.outputs[0])
    return [final[rid] for rid in ids]


def test_shared_system_prompt_same_tokens_with_and_without_cache(smollm2_two_layers):
    tok = smollm2_two_layers.tokenizer
    system = system_prompt(tok)
    prompts = [system + tok(q, add_special_tokens=False)["input_ids"] for q in QUESTIONS]

    off, _ = engine(smollm2_two_layers, caching=False)
    expected = run(off, prompts)

    on, recorder = engine(smollm2_two_layers, caching=True)
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


def test_entirely_cached_prompt_gives_the_same_tokens(smollm2_two_layers):
    tok = smollm2_two_layers.tokenizer
    prompt = system_prompt(tok, 320)  # 20 full blocks of 16
    on, recorder = engine(smollm2_two_layers, caching=True)
    first = run(on, [prompt])
    schedules = record_schedules(on)
    second = run(on, [prompt])
    assert first == second
    sr = schedules[0].scheduled[0]
    assert sr.start_pos == 320 - 16 and sr.sample  # the last block is recomputed for logits
    assert recorder.total("prefix_cache_hits") == 320 - 16


def test_identical_long_prompts_under_memory_pressure(smollm2_two_layers):
    tok = smollm2_two_layers.tokenizer
    prompt = system_prompt(tok, 300)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=0)
    off, _ = engine(smollm2_two_layers, caching=False)
    expected = run(off, [prompt], params)[0]

    # 23 blocks of 16: both copies start together (18 shared full blocks + a tail block
    # each = 20), but two sequences of 340 tokens need 18 + 2 * 4 = 26: one is preempted.
    on, recorder = engine(smollm2_two_layers, caching=True, num_blocks=23)
    schedules = record_schedules(on)
    outs = run(on, [prompt, prompt], params)
    assert outs == [expected, expected]
    assert any(out.preempted_request_ids for out in schedules), "no preemption happened"
    assert recorder.total("prefix_cache_hits") > 0
    assert on.scheduler.kv_cache_manager.block_pool.num_free_blocks == on.num_blocks


# -- n > 1: the prompt is computed once, the other sequences take it from the cache --------
N_PARAMS = SamplingParams(n=4, temperature=1.5, seed=11, max_tokens=8, ignore_eos=True, logprobs=0)


def open_prompt(tokenizer) -> list[int]:
    """~300 tokens ending in an open question (the samples differ); not a multiple of 16."""
    ids = system_prompt(tokenizer, 280) + tokenizer(
        " Now tell me, in your own words, what you would name a new small red fruit and why",
        add_special_tokens=False)["input_ids"]
    assert len(ids) % 16 not in (0, 1)
    return ids


def run_n(eng: LLMEngine, rid: str, prompt: list[int], params: SamplingParams, **kw):
    """Run one request to the end; returns (final RequestOutput, scheduled prompt tokens)."""
    schedules = record_schedules(eng)
    eng.add_request(rid, prompt, params, **kw)
    final = None
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished and out.request_id == rid:
                final = out
    prefill = sum(sr.num_new_tokens for out in schedules for sr in out.scheduled
                  if sr.start_pos < sr.request.num_prompt_tokens and sr.request_id.startswith(rid))
    return final, prefill, schedules


def seq_tokens(out) -> list[Seq]:
    return [Seq(c) for c in sorted(out.outputs, key=lambda c: c.index)]


def plp_table(out):
    return [None if d is None else sorted((t, round(lp.logprob, 4), lp.rank) for t, lp in d.items())
            for d in out.prompt_logprobs]


@pytest.mark.parametrize("chunk", [1024, 128])
def test_n4_computes_the_prompt_once_with_the_same_samples(smollm2_two_layers, chunk):
    tok = smollm2_two_layers.tokenizer
    prompt = open_prompt(tok)
    block = 16
    tail = len(prompt) - (len(prompt) - 1) // block * block  # recomputed by each sibling

    off, _ = engine(smollm2_two_layers, caching=False, max_num_batched_tokens=chunk)
    expected, off_prefill, _ = run_n(off, "g", prompt, N_PARAMS)
    assert off_prefill == 4 * len(prompt)  # caching off: each sequence computes the prompt (as before)

    on, recorder = engine(smollm2_two_layers, caching=True, max_num_batched_tokens=chunk)
    got, on_prefill, schedules = run_n(on, "g", prompt, N_PARAMS)
    assert seq_tokens(got) == seq_tokens(expected)  # same per-sequence seeds, same samples
    assert len({tuple(t) for t in seq_tokens(got)}) > 1  # really sampled, not 4 copies
    assert on_prefill == len(prompt) + 3 * tail
    assert recorder.total("prefix_cache_hits") == 3 * (len(prompt) - tail)
    # The siblings start in the step of the leader's last prompt chunk, from the cache.
    first = {}
    for step, out in enumerate(schedules):
        for sr in out.scheduled:
            first.setdefault(sr.request_id, (step, sr.start_pos))
            if sr.request_id == "g-0" and sr.seq_len == len(prompt):
                leader_done = step
    assert leader_done == (0 if chunk > len(prompt) else len(prompt) // chunk)
    assert all(first[f"g-{i}"] == (leader_done, len(prompt) - tail) for i in (1, 2, 3)), first


def test_n4_with_prompt_logprobs_computes_the_prompt_once(smollm2_two_layers):
    tok = smollm2_two_layers.tokenizer
    prompt = open_prompt(tok)
    tail = len(prompt) % 16
    params = N_PARAMS.clone(prompt_logprobs=2)
    off, _ = engine(smollm2_two_layers, caching=False)
    expected, off_prefill, _ = run_n(off, "g", prompt, params)
    assert off_prefill == 4 * len(prompt)

    on, _ = engine(smollm2_two_layers, caching=True)
    got, on_prefill, _ = run_n(on, "g", prompt, params)
    assert seq_tokens(got) == seq_tokens(expected)
    assert len(got.prompt_logprobs) == len(prompt) and got.prompt_logprobs[0] is None
    assert plp_table(got) == plp_table(expected)
    assert on_prefill == len(prompt) + 3 * tail  # the leader computes every position, the others the tail
    # The leader asked for prompt logprobs, so it looked nothing up, even with its prompt cached.
    again, again_prefill, _ = run_n(on, "h", prompt, params.clone(n=1))
    assert again_prefill == len(prompt) and plp_table(again) == plp_table(expected)


def test_n4_leader_preempted_mid_prompt_still_finishes_all(smollm2_two_layers):
    tok = smollm2_two_layers.tokenizer
    prompt = open_prompt(tok)
    off, _ = engine(smollm2_two_layers, caching=False, max_num_batched_tokens=128)
    expected, _, _ = run_n(off, "g", prompt, N_PARAMS)

    # One seat: an urgent (priority 0) request arriving while the leader (priority 1) is in
    # its chunked prompt preempts it; the siblings wait for the resumed leader.
    on, _ = engine(smollm2_two_layers, caching=True, max_num_batched_tokens=128, scheduling_policy="priority", max_num_seqs=1)
    schedules = record_schedules(on)
    on.add_request("g", prompt, N_PARAMS, priority=1)
    on.step()  # 128 of the leader's 300 prompt tokens
    on.add_request("urgent", prompt[:40], SamplingParams(temperature=0, max_tokens=3), priority=0)
    final = {}
    while on.has_unfinished_requests():
        for out in on.step():
            if out.finished:
                final[out.request_id] = out
    # The budget left beside the leader's chunks lets the urgent request in (preempting
    # the leader) in step 3, after 256 of its 300-odd prompt tokens.
    hit = [i for i, out in enumerate(schedules) if "g-0" in out.preempted_request_ids]
    assert hit, "the leader was not preempted"
    done = sum(sr.num_new_tokens for out in schedules[:hit[0]] for sr in out.scheduled if sr.request_id == "g-0")
    assert done < len(prompt)
    assert "g-1" not in {sr.request_id for out in schedules[:hit[0] + 1] for sr in out.scheduled}
    assert seq_tokens(final["g"]) == seq_tokens(expected)
    assert on.scheduler.kv_cache_manager.block_pool.num_free_blocks == on.num_blocks
