"""The llama3_json and mistral parsers on the formats those models write, and parser detection."""

import json

import pytest

from kvfleet.runtime.entrypoints.openai.tool_calls import detect_tool_parser
from kvfleet.runtime.entrypoints.openai.tool_parsers import HermesStreamParser
from kvfleet.runtime.entrypoints.openai.tool_parsers_json import Llama3JsonToolParser, MistralToolParser, tool_parsers


def test_llama3_json_single_and_multiple_calls():
    out = Llama3JsonToolParser.parse('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}')
    assert out.content is None
    assert [(c.name, json.loads(c.arguments)) for c in out.calls] == [("get_weather", {"city": "Paris"})]
    out = Llama3JsonToolParser.parse(
        '{"name": "a", "parameters": {"x": 1}}; {"name": "b", "arguments": {"y": "z"}}')
    assert [(c.name, json.loads(c.arguments)) for c in out.calls] == [("a", {"x": 1}), ("b", {"y": "z"})]


@pytest.mark.parametrize("text", ["The weather is sunny.", '{"answer": 42}', '{"name": "a", "parameters": {"x": 1}} trailing'])
def test_llama3_json_text_stays_content(text):
    out = Llama3JsonToolParser.parse(text)
    assert out.content == text and out.calls == []


def test_mistral_v3_and_v11_formats():
    out = MistralToolParser.parse('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                                  '{"name": "get_time", "arguments": {}}]')
    assert out.content is None
    assert [(c.name, json.loads(c.arguments)) for c in out.calls] == [("get_weather", {"city": "Paris"}),
                                                                     ("get_time", {})]
    out = MistralToolParser.parse('Let me check.[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]t[ARGS]{}')
    assert out.content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in out.calls] == [("get_weather", {"city": "Oslo"}), ("t", {})]


def test_mistral_invalid_calls_are_content():
    text = "[TOOL_CALLS][{broken"
    assert MistralToolParser.parse(text).content == text
    assert MistralToolParser.parse("no calls").calls == []


@pytest.mark.parametrize("name,text", [
    ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {"a": [1, 2]}}'),
    ("mistral", 'Sure[TOOL_CALLS][{"name": "f", "arguments": {"a": [1, 2]}}]'),
    ("hermes", 'Sure<tool_call>\n{"name": "f", "arguments": {"a": [1, 2]}}\n</tool_call>'),
])
def test_streamed_deltas_add_up_to_the_parse(name, text):
    parser = tool_parsers()[name]
    stream = HermesStreamParser(parser)
    content, args, names = "", {}, {}
    for i in range(1, len(text) + 1):
        c, calls = stream.feed(text[:i])
        content += c
        for d in calls:
            names.setdefault(d["index"], d.get("function", {}).get("name"))
            args[d["index"]] = args.get(d["index"], "") + d["function"].get("arguments", "")
    c, calls, made = stream.finish(text)
    content += c
    for d in calls:
        names.setdefault(d["index"], d.get("function", {}).get("name"))
        args[d["index"]] = args.get(d["index"], "") + d["function"].get("arguments", "")
    parsed = parser.parse(text)
    assert made and (content or None) == parsed.content
    assert [(names[i], json.loads(args[i])) for i in sorted(args)] == [("f", {"a": [1, 2]})]


def test_detection():
    assert detect_tool_parser(None, "x")[0] == "hermes"
    assert detect_tool_parser("{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}", "x")[0] == "hermes"
    assert detect_tool_parser("{% if tools %}<tool_call>{% endif %}", "x")[0] == "hermes"
    assert detect_tool_parser("{% if tools %}[TOOL_CALLS]{% endif %}", "x")[0] == "mistral"
    assert detect_tool_parser("{% if tools %}<|python_tag|>{% endif %}", "x")[0] == "llama3_json"
    assert detect_tool_parser("{% if tools %}{{ tools }}{% endif %}", "meta-llama/Llama-3.2-1B")[0] == "llama3_json"
    assert detect_tool_parser("{% if tools %}{{ tools }}{% endif %}", "unknown-model")[0] is None
