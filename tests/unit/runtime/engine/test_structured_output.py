"""Structured outputs in the engine on the real model: schemas with nested objects, arrays, enums,
patterns and bounds give valid outputs, greedy equal with and without preemption, n=3 seeded;
truncation is finish_reason length; a bad regex is refused."""

from __future__ import annotations

import json

import jsonschema
import pytest

from kvfleet.runtime.sampling_params import SamplingParams, StructuredOutputError, StructuredOutputsParams

ADDRESS = {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[A-Z][a-z]+$"},
                                            "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
           "required": ["city", "zip"], "additionalProperties": False}  # fmt: skip
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 2, "maxLength": 20},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "height_m": {"type": "number", "minimum": 1.0, "maximum": 2.5},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 1, "maxItems": 3},
        "address": ADDRESS,
    },
    "required": ["name", "age", "height_m", "role", "tags", "address"],
    "additionalProperties": False,
}


def _chat(tok, text: str) -> list[int]:
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                              add_generation_prompt=True), add_special_tokens=False)  # fmt: skip


@pytest.mark.slow
def test_engine_schema_outputs_are_valid_under_preemption_and_n3(smollm2):
    from support.schedules import record_schedules

    from kvfleet.runtime.config import EngineConfig
    from kvfleet.runtime.engine.llm_engine import LLMEngine
    from kvfleet.runtime.llm import LLM

    tok = smollm2.tokenizer
    spec = StructuredOutputsParams(json=ADDRESS)  # short outputs: the server test has the big schema
    greedy = SamplingParams(temperature=0, max_tokens=40, structured_outputs=spec)
    prompt = _chat(tok, "Give an address as JSON.")
    roomy = LLM.from_engine(LLMEngine(EngineConfig(kv_cache_memory=64 * 2**20), loaded=smollm2))
    alone = roomy.generate([prompt], greedy, use_tqdm=False)[0].outputs[0]
    jsonschema.validate(json.loads(alone.text), ADDRESS)
    assert alone.finish_reason == "stop"

    # 8 blocks of 16 tokens: the long unconstrained prompt beside it forces the constrained one
    # (the later arrival) out mid-output; recomputed, its matcher state is still right.
    small = LLMEngine(EngineConfig(num_blocks=8, enable_prefix_caching=False), loaded=smollm2)
    schedules = record_schedules(small)
    long_prompt = _chat(tok, "Tell me about the history of Rome. " * 4)
    outs = LLM.from_engine(small).generate(
        [long_prompt, prompt], [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), greedy], use_tqdm=False)
    victims = {rid for out in schedules for rid in out.preempted_request_ids}
    assert outs[1].request_id in victims, victims
    assert outs[1].outputs[0].text == alone.text

    # n=3, seeded: three valid objects, reproducible; a choice and a truncated object beside them.
    sampled = SamplingParams(temperature=1.0, seed=7, n=3, max_tokens=40, structured_outputs=spec)
    both = roomy.generate([prompt, prompt, _chat(tok, "Pick one."), prompt], [
        sampled, sampled, SamplingParams(temperature=1.0, structured_outputs=StructuredOutputsParams(
            choice=["left", "right"])), SamplingParams(temperature=0, max_tokens=4, structured_outputs=spec)],
        use_tqdm=False)  # fmt: skip
    texts = [c.text for c in both[0].outputs]
    assert texts == [c.text for c in both[1].outputs] and len(set(texts)) > 1
    for c in both[0].outputs:
        jsonschema.validate(json.loads(c.text), ADDRESS)
        assert c.finish_reason == "stop"
    assert both[2].outputs[0].text in ("left", "right") and both[2].outputs[0].finish_reason == "stop"
    cut = both[3].outputs[0]
    assert cut.finish_reason == "length" and alone.text.startswith(cut.text)
    with pytest.raises(StructuredOutputError, match="invalid regex"):
        roomy.generate([prompt], SamplingParams(structured_outputs=StructuredOutputsParams(regex="(")), use_tqdm=False)
