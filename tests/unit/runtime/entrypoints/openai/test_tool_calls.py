"""Tools in the prompt (kvfleet.runtime.entrypoints.openai.tool_calls): a chat template that renders
tools gets them natively, others through the fallback prompt; tool names follow OpenAI's rule."""

from __future__ import annotations

import json

import pytest

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

    assert resolve_tools(body("get_weather", "get-time2"), "hermes").choice == "required"
    for names, why in ((("g</tool_call>",), "1-64 letters"), (("a" * 65,), "1-64 letters"),
                       (("f", "f"), "given twice")):
        with pytest.raises(P.ProtocolError, match=why):
            resolve_tools(body(*names), "hermes")
