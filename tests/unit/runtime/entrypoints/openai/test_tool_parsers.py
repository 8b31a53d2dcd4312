"""The hermes tool-call parser (kvfleet.runtime.entrypoints.openai.tool_parsers): streamed deltas add
up to the non-streamed calls; what it parses and what it leaves as text."""

from __future__ import annotations

import json

import pytest

from kvfleet.runtime.entrypoints.openai.tool_parsers import HermesStreamParser, HermesToolParser

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
