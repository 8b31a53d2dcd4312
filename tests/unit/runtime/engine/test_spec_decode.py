"""Speculative decoding in the engine (issue 30), on the real default model: greedy and seeded
output with speculation equals output without it, token for token, in a mixed batch with chunked
prefill, prefix-cache hits, penalties and a grammar; under preemption; with suffix decoding; and
every KV block comes back when the requests are done (rejected drafts leave nothing behind)."""

from __future__ import annotations

import pytest

from kvfleet.runtime.config import EngineConfig
from kvfleet.runtime.engine.llm_engine import LLMEngine
from kvfleet.runtime.sampling_params import SamplingParams, StructuredOutputsParams

pytestmark = pytest.mark.slow

TEXT = ("The lighthouse keeper climbed the spiral stairs at dusk, lit the great lamp, and wrote in "
        "his log: wind from the west, sea calm, two fishing boats returned to the harbour before dark. "
        "Each night he wrote the same three lines, and each morning he read them again.")
GROUNDED = f"Copy the text below exactly.\n\nText: {TEXT}\n\nCopy: {TEXT[:40]}"
FREE = "Once upon a time"
NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2}'
SUFFIX = '{"method": "suffix", "num_speculative_tokens": 4}'
MAX = 40


class Recorder:
    def __init__(self) -> None:
        self.drafts = self.draft_tokens = self.accepted = self.preemptions = 0

    def record(self, scheduler_stats, iteration_stats) -> None:
        self.preemptions += scheduler_stats.num_preemptions
        spec = scheduler_stats.spec_decoding
        if spec is not None:
            self.drafts += spec.num_drafts
            self.draft_tokens += spec.num_draft_tokens
            self.accepted += spec.num_accepted_tokens


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX, ignore_eos=True, **kw)


BATCH = [
    (GROUNDED, greedy()),
    (FREE, greedy()),
    (GROUNDED + " Each", greedy(repetition_penalty=1.1, frequency_penalty=0.2)),
    (GROUNDED + " He", SamplingParams(temperature=0.8, top_p=0.95, seed=11, max_tokens=MAX, ignore_eos=True)),
    ("Give the keeper's name and age as JSON.", SamplingParams(
        temperature=0.0, max_tokens=MAX, structured_outputs=StructuredOutputsParams(json={
            "type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
            "required": ["name", "age"]}))),
]


def run(engine: LLMEngine, batches) -> list[list[int]]:
    """Each batch's requests added together, run to completion; then the next batch."""
    out = []
    for b, batch in enumerate(batches):
        for i, (prompt, params) in enumerate(batch):
            engine.add_request(f"b{b}-{i}", prompt, params)
        done = {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    done[o.request_id] = list(o.outputs[0].token_ids)
        out.extend(done[f"b{b}-{i}"] for i in range(len(batch)))
    return out


def engine_with(smollm2, spec, recorder=None, **kw) -> LLMEngine:
    config = EngineConfig(speculative_config=spec, max_num_batched_tokens=48, **kw)
    return LLMEngine(config, [recorder] if recorder else None, loaded=smollm2)


@pytest.fixture(scope="module")
def reference(smollm2):
    engine = engine_with(smollm2, None, kv_cache_memory=64 * 2**20)
    # The second batch repeats the grounded prompt: its prompt blocks are prefix-cache hits.
    return run(engine, [BATCH, [BATCH[0]]])


@pytest.mark.parametrize("spec", [NGRAM, SUFFIX], ids=["ngram", "suffix"])
def test_greedy_speculation_gives_the_tokens_of_plain_decoding(smollm2, reference, spec):
    recorder = Recorder()
    engine = engine_with(smollm2, spec, recorder, kv_cache_memory=64 * 2**20)
    assert run(engine, [BATCH, [BATCH[0]]]) == reference
    assert recorder.drafts > 10 and recorder.accepted > recorder.draft_tokens / 4
    kv = engine.scheduler.kv_cache_manager
    assert kv.usage == 0.0 and kv.num_free_blocks == kv.num_usable_blocks  # no block left behind


def test_under_preemption_too(smollm2):
    batch = [(GROUNDED + "x" * i, greedy()) for i in range(4)]
    plain = run(engine_with(smollm2, None, num_blocks=24, enable_prefix_caching=False), [batch])
    recorder = Recorder()
    engine = engine_with(smollm2, NGRAM, recorder, num_blocks=24, enable_prefix_caching=False)
    assert run(engine, [batch]) == plain
    assert recorder.preemptions > 0 and recorder.accepted > 0
    kv = engine.scheduler.kv_cache_manager
    assert kv.usage == 0.0 and kv.num_free_blocks == kv.num_usable_blocks
