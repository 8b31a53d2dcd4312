"""Output kinds (``SamplingParams.output_kind``): deltas cost O(n) over a stream, and join into
exactly the cumulative output.

The cost test streams a 2,000-token completion through the real server (HTTP app, async
engine, engine step, output processor) on the default model cut to two layers, and counts what
each engine step copies into its outputs: token ids, logprob entries and text. Cumulative
outputs (what the engine produced for the server before) copy a request's whole token list
every step, 2,001,000 token ids over 2,000 steps; deltas copy each token once.
"""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from kvfleet.runtime.config import EngineConfig
from kvfleet.runtime.engine.async_llm import AsyncLLMEngine
from kvfleet.runtime.engine.llm_engine import LLMEngine
from kvfleet.runtime.entrypoints.openai.api_server import create_app
from kvfleet.runtime.entrypoints.openai.serve_args import ServerSettings
from kvfleet.runtime.sampling_params import RequestOutputKind, SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see tests/conftest.py

N = 2000


def _copied(outputs) -> tuple[int, int]:
    """(token ids + logprob entries, text characters) that a step's outputs hold."""
    tokens = chars = 0
    for out in outputs:
        tokens += len(out.prompt_logprobs or ())
        for c in out.outputs:
            tokens += len(c.token_ids) + len(c.logprobs or ())
            chars += len(c.text)
    return tokens, chars


@pytest.mark.slow  # 2,000 steps: about 30 s of CPU (minutes on a shared one)
def test_a_streamed_2000_token_request_copies_each_token_once(smollm2_two_layers):
    per_step: list[tuple[int, int]] = []
    engine_text: list[str] = []

    def factory(cfg: EngineConfig, stat_loggers: list) -> AsyncLLMEngine:
        engine = AsyncLLMEngine(cfg, stat_loggers, loaded=smollm2_two_layers)
        step = engine.engine.step

        def counted_step():
            outputs = step()
            per_step.append(_copied(outputs))
            engine_text.extend(c.text for out in outputs for c in out.outputs)
            return outputs

        engine.engine.step = counted_step
        return engine

    config = EngineConfig(kv_cache_memory=16 * 2**20, max_model_len=N + 64)
    app = create_app(config, ServerSettings(), engine_factory=factory)
    with TestClient(app) as client:
        while client.get("/ready").status_code != 200:
            pass
        body = {
            "prompt": "Once upon a time", "max_tokens": N, "ignore_eos": True, "temperature": 0, "logprobs": 1,
            "stream": True, "stream_options": {"include_usage": True},
        }
        resp = client.post("/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    events = [json.loads(b[len("data: "):]) for b in resp.text.split("\n\n")[:-1] if b != "data: [DONE]"]
    assert events[-1]["usage"]["completion_tokens"] == N
    streamed = [ch for e in events for ch in e["choices"]]
    assert "".join(ch["text"] for ch in streamed) == "".join(engine_text)
    assert sum(len(ch["logprobs"]["tokens"]) for ch in streamed if ch.get("logprobs")) == N

    steps = [s for s in per_step if s != (0, 0)]
    assert len(steps) >= N  # one decode step per token (the prompt fits in the first)
    tokens = sum(t for t, _ in per_step)
    chars = sum(c for _, c in per_step)
    assert tokens == 2 * N  # each token id and each logprob entry once: O(n)
    assert max(t for t, _ in per_step) <= 2  # no step copies more than its own token
    assert chars == len("".join(engine_text))  # each character of text once


def _joined(outputs, aggregate: bool):
    """The outputs joined with ``RequestOutput.add`` (the first one is changed in place)."""
    first = outputs[0]
    for out in outputs[1:]:
        first = first.add(out, aggregate)
    return first


def _run(engine: LLMEngine, rid: str, params: SamplingParams) -> list:
    engine.add_request(rid, "The capital of France is", params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.request_id == rid]
    return outputs


def test_deltas_join_into_the_cumulative_output_and_final_only_is_one(smollm2_two_layers):
    engine = LLMEngine(EngineConfig(kv_cache_memory=8 * 2**20), loaded=smollm2_two_layers)
    common = dict(n=2, seed=7, max_tokens=24, stop=[" the"], logprobs=2, prompt_logprobs=1)
    cumulative = _run(engine, "c", SamplingParams(**common))
    deltas = _run(engine, "d", SamplingParams(**common, output_kind=RequestOutputKind.DELTA))
    final = _run(engine, "f", SamplingParams(**common, output_kind=RequestOutputKind.FINAL_ONLY))
    want = cumulative[-1]
    assert len(final) == 1 and final[0].finished
    assert len(deltas) > 2 and sum(len(c.token_ids) for o in deltas for c in o.outputs) == sum(
        len(c.token_ids) for c in want.outputs)
    # a delta carries each sequence's finish once, and only sequences with something new
    finishes = [c.index for o in deltas for c in o.outputs if c.finish_reason is not None]
    assert sorted(finishes) == [0, 1]
    assert all(c.token_ids or c.text or c.finish_reason for o in deltas for c in o.outputs)
    for got in (_joined(deltas, aggregate=True), final[0], _joined(cumulative, aggregate=False)):
        assert got.finished
        assert got.prompt_logprobs == want.prompt_logprobs and len(got.prompt_logprobs) == len(got.prompt_token_ids)
        by_index = {c.index: c for c in got.outputs}
        for c in want.outputs:
            g = by_index[c.index]
            assert (g.text, g.token_ids, g.logprobs, g.finish_reason, g.stop_reason) == (
                c.text, c.token_ids, c.logprobs, c.finish_reason, c.stop_reason)
            assert g.cumulative_logprob == pytest.approx(c.cumulative_logprob)
