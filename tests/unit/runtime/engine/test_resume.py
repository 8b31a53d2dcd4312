"""Resuming a request from delivered output token ids (docs/routing.md, "Resume"), on the real
default model: the resumed run reports exactly the tokens and text an uninterrupted run gives
after the cut -- greedy, seeded sampling (the generator of output step ``i`` is seeded from
``(seed, i)``), ``n = 2`` and a ``json_schema`` grammar advanced over the delivered tokens."""

from __future__ import annotations

import pytest

from kvfleet.runtime.config import EngineConfig
from kvfleet.runtime.engine.llm_engine import LLMEngine
from kvfleet.runtime.sampling_params import SamplingParams, StructuredOutputsParams

pytestmark = pytest.mark.slow

PROMPT = "Tell me a story about a dragon."
CUT = 9
MAX = 24


@pytest.fixture(scope="module")
def engine(smollm2):
    return LLMEngine(EngineConfig(kv_cache_memory=64 * 2**20), loaded=smollm2)


def run(engine, rid, params, resume=None):
    prepared = engine.prepare_request(rid, PROMPT, params, resume_output_ids=resume)
    engine.add_prepared(prepared)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return {c.index: c for c in done[rid].outputs}


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, max_tokens=MAX, ignore_eos=True),
    SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=MAX, ignore_eos=True),
    SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=MAX, ignore_eos=True),
    SamplingParams(temperature=0.0, max_tokens=MAX, structured_outputs=StructuredOutputsParams(
        json={"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]})),
], ids=["greedy", "seeded", "n2", "json_schema"])
def test_resumed_run_continues_the_uninterrupted_one(engine, params):
    full = run(engine, "full", params)
    resume = [list(full[i].token_ids[:CUT]) for i in range(params.n)]
    rest = run(engine, "resumed", params, resume)
    tok = engine.tokenizer
    for i in range(params.n):
        assert list(rest[i].token_ids) == list(full[i].token_ids[CUT:])
        assert rest[i].finish_reason == full[i].finish_reason
        head = tok.decode(full[i].token_ids[:CUT], skip_special_tokens=True)
        assert head + rest[i].text == full[i].text


def test_bad_resume_is_refused_naming_the_field(engine):
    params = SamplingParams(temperature=0.0, max_tokens=4)
    for bad in ([[1], [2]], [[10**9]], [[1, 2, 3, 4]], [["a"]]):
        with pytest.raises(ValueError, match="resume_output_ids"):
            engine.prepare_request("bad", PROMPT, params, resume_output_ids=bad)
