"""Structured outputs below the server: the hermes tool-call parser (streamed deltas add up to the
non-streamed calls), the xgrammar layer (library errors, the compiled-grammar cache, masks only on
constrained rows), the sampler's token controls, and the engine on the real model (schemas with
nested objects, arrays, enums, patterns and bounds; greedy equal with and without preemption;
n=3 seeded; truncation is finish_reason length)."""

from __future__ import annotations

import json
import math

import jsonschema
import pytest
import torch

from kvfleet.runtime.core.request import Request
from kvfleet.runtime.entrypoints.openai.tool_parsers import HermesStreamParser, HermesToolParser
from kvfleet.runtime.sampling_params import SamplingParams, StructuredOutputError, StructuredOutputsParams
from kvfleet.runtime.worker.sampler import Sampler

# ----------------------------------------------------------------------------- the hermes parser

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "when": {"days": [1, 2]}}}\n</tool_call>'
TEXTS = [
    CALL,
    "Let me check.\n" + CALL + "\n" + CALL.replace("Paris", "Rome"),
    '<tool_call>{"arguments": {"x": 1}, "name": "f"}</tool_call>',  # name second: re-encoded arguments
    "plain text with a < sign and <tool",
    "   \n" + CALL,  # blank content -> None
    CALL + "\n<tool_call>\n{\"name\": \"get_weather\", \"argu",  # cut short: the unfinished call is dropped
]


def _stream(text: str, step: int) -> tuple[str | None, list[tuple[str, str]]]:
    parser = HermesStreamParser()
    content, names, args = "", {}, {}

    def take(c, deltas):
        nonlocal content
        content += c
        for d in deltas:
            if "id" in d:
                assert d["type"] == "function" and d["function"]["arguments"] == ""
                names[d["index"]] = d["function"]["name"]
            args[d["index"]] = args.get(d["index"], "") + d["function"]["arguments"]

    for k in range(step, len(text) + step, step):
        take(*parser.feed(text[:k]))
    c, deltas, _ = parser.finish(text)
    take(c, deltas)
    return content or None, [(names[i], args[i]) for i in sorted(names)]


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_tool_call_deltas_add_up_to_the_parsed_calls(text):
    final = HermesToolParser.parse(text)
    for step in (1, 2, 5, 17):
        assert _stream(text, step) == (final.content, [(c.name, c.arguments) for c in final.calls])


def test_hermes_parse_results():
    one = HermesToolParser.parse(TEXTS[1])
    assert one.content == "Let me check.\n"
    assert [(c.name, json.loads(c.arguments)["city"]) for c in one.calls] == [("get_weather", "Paris"),
                                                                              ("get_weather", "Rome")]
    assert one.calls[0].arguments == '{"city": "Paris", "when": {"days": [1, 2]}}'  # as written
    assert HermesToolParser.parse(TEXTS[2]).calls[0].arguments == '{"x": 1}'
    assert HermesToolParser.parse(TEXTS[3]).content == TEXTS[3] and not HermesToolParser.parse(TEXTS[3]).calls
    assert HermesToolParser.parse(TEXTS[4]).content is None
    assert len(HermesToolParser.parse(TEXTS[5]).calls) == 1
    bad = '<tool_call>{"name": "f", "arguments": {"a": </tool_call>'
    assert HermesToolParser.parse(bad).content == bad and not HermesToolParser.parse(bad).calls


# ----------------------------------------------------------------------------- the grammar layer


@pytest.fixture(scope="module")
def manager(smollm2):
    from kvfleet.runtime.structured_output.manager import StructuredOutputManager

    m = StructuredOutputManager(smollm2.tokenizer, 49152, [smollm2.tokenizer.eos_token_id])
    yield m
    m.shutdown()


@pytest.mark.parametrize(("spec", "message"), [
    (StructuredOutputsParams(json={"type": "strin"}), 'invalid JSON schema: Unsupported type "strin"'),
    (StructuredOutputsParams(json="{not json"), "invalid JSON schema: "),
    (StructuredOutputsParams(json={"type": "integer", "minimum": 5, "maximum": 1}), "minimum greater than maximum"),
    (StructuredOutputsParams(regex="[a-"), "invalid regex: Regex parsing error at position 4"),
    (StructuredOutputsParams(grammar='root ::= foo'), 'invalid grammar: EBNF parser error at line 1, column 10'),
])
def test_library_errors_name_the_kind_with_the_library_message(manager, spec, message):
    with pytest.raises(StructuredOutputError) as info:
        manager.grammar_init(spec).result(timeout=60)
    assert message in str(info.value) and "/project/cpp" not in str(info.value)


def test_spec_validation():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputsParams(choice=[])
    a = StructuredOutputsParams(json={"b": 1, "a": 2})
    assert a.key() == StructuredOutputsParams(json={"a": 2, "b": 1}).key() != StructuredOutputsParams(
        json={"a": 2, "b": 1}, disable_any_whitespace=False).key()


def test_cache_masks_and_matcher(manager, smollm2):
    tok = smollm2.tokenizer
    spec = StructuredOutputsParams(choice=['say "yes"', "no\n"])
    before = manager.num_compiles
    f1, f2 = manager.grammar_init(spec), manager.grammar_init(StructuredOutputsParams(choice=['say "yes"', "no\n"]))
    assert f1 is f2 and manager.num_compiles - before <= 1
    grammar = manager.new_grammar(f1.result(timeout=60))
    # Row 0 unconstrained, row 1 constrained: row 0 is untouched, row 1 keeps only allowed tokens.
    reqs = [Request("u", [1], SamplingParams()), Request("c", [1], SamplingParams())]
    reqs[1].structured_output = grammar
    logits = torch.randn(2, 49152)
    before_row0 = logits[0].clone()
    assert manager.apply_bitmask(logits, reqs) == 1
    assert torch.equal(logits[0], before_row0)
    allowed = torch.isfinite(logits[1]).nonzero().flatten().tolist()
    assert allowed and all(tok.decode([t]) and ('say "yes"'.startswith(tok.decode([t])) or
                                                "no\n".startswith(tok.decode([t]))) for t in allowed)
    assert manager.apply_bitmask(logits, [reqs[0]]) == 0  # nothing constrained: nothing masked
    for t in tok.encode("no\n", add_special_tokens=False):
        assert grammar.accept_token(t) is False
    assert grammar.accept_token(tok.eos_token_id) is True  # complete + stop token: the sequence stops

    # A number with bounds: the matcher accepts 1.5 and refuses 3 and -1 (what the mask forbids).
    import xgrammar as xgr

    bounded = manager.grammar_init(StructuredOutputsParams(json={"type": "number", "minimum": 1, "maximum": 2}))
    accepts = [xgr.GrammarMatcher(bounded.result(timeout=60)).accept_string(t) for t in ("1.5", "3", "-1")]
    assert accepts == [True, False, False]


# ----------------------------------------------------------------------------- token controls


def test_logit_bias_allowed_token_ids_and_bad_words_in_the_sampler():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2, 0.0 + 1e-9, 1e-9, 1e-9, 1e-9, 1e-9]])).repeat(4, 1)
    params = [
        SamplingParams(temperature=0, logit_bias={0: -100}),
        SamplingParams(temperature=0, logit_bias={5: 100}),
        SamplingParams(temperature=0, allowed_token_ids=[2, 6]),
        SamplingParams(temperature=0, bad_words_token_ids=[[0], [9, 1]]),
    ]
    reqs = [Request(str(i), [1], p) for i, p in enumerate(params)]
    reqs[3].output_token_ids = [9]  # the output ends with the first token of [9, 1]: token 1 banned too
    out = Sampler(torch.device("cpu"))(logits.clone(), reqs)
    assert out.token_ids == [1, 5, 2, 2]
    for bad in ({0: 101}, {-1: 1}, {0: math.inf}):
        with pytest.raises(ValueError, match="logit_bias"):
            SamplingParams(logit_bias=bad)
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[])


# ----------------------------------------------------------------------------- the engine, real model

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


# ----------------------------------------------------------------------------- tools in the prompt

TOOLS_TEMPLATE = (
    "{% for t in tools %}TOOL {{ t.function.name }}\n{% endfor %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }} city={{ c.function.arguments.city }}{% endfor %}"
    "{% if m.tool_call_id %} ({{ m.tool_call_id }}){% endif %}\n{% endfor %}"
)
"""A chat template that renders tools (as Qwen2.5's does, reading ``arguments`` as a mapping)."""


def test_tools_reach_a_tools_template_natively_and_others_through_the_fallback_prompt(smollm2):
    from kvfleet.runtime.entrypoints.openai.tool_calls import (
        FALLBACK_TOOL_PROMPT,
        prepare_messages,
        template_renders_tools,
    )

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "call-1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "content": '{"temp_c": 21}', "tool_call_id": "call-1"}]  # fmt: skip
    assert template_renders_tools(TOOLS_TEMPLATE) and not template_renders_tools(smollm2.tokenizer.chat_template)
    native = smollm2.tokenizer.apply_chat_template(prepare_messages(messages, tools, True), tools=tools,
                                                   chat_template=TOOLS_TEMPLATE, tokenize=False)  # fmt: skip
    # (transformers renders with trim_blocks: the newline after a block tag goes)
    assert native == 'TOOL get_weather\n<user>Weather?<assistant>CALL get_weather city=Paris<tool>{"temp_c": 21} (call-1)'
    fallback = prepare_messages(messages, tools, False)
    assert fallback[0]["role"] == "system" and fallback[0]["content"].startswith(FALLBACK_TOOL_PROMPT[:40])
    assert json.dumps(tools[0]) in fallback[0]["content"]
    assert fallback[2] == {"role": "assistant", "content": '<tool_call>\n{"name": "get_weather", "arguments": '
                                                          '{"city": "Paris"}}\n</tool_call>'}
    assert fallback[3] == {"role": "user", "content": '<tool_response>\n{"temp_c": 21}\n</tool_response>'}
    smollm2.tokenizer.apply_chat_template(fallback, tokenize=False)  # the default template renders it


def test_tool_names_follow_openais_rule_and_are_unique():
    """A name the Hermes tags could be broken by (``g</tool_call>``), or a name given twice, is a
    400 on ``tools`` before anything is generated."""
    from kvfleet.runtime.entrypoints.openai import protocol as P
    from kvfleet.runtime.entrypoints.openai.tool_calls import resolve_tools

    def body(*names: str) -> P.ChatCompletionRequest:
        return P.ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tool_choice="required",
                                       tools=[{"type": "function", "function": {"name": n}} for n in names])

    assert resolve_tools(body("get_weather", "get-time2"), "hermes", False).choice == "required"
    for names, why in ((("g</tool_call>",), "1-64 letters"), (("a" * 65,), "1-64 letters"),
                       (("f", "f"), "given twice")):
        with pytest.raises(P.ProtocolError, match=why):
            resolve_tools(body(*names), "hermes", False)
