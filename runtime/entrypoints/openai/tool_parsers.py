"""Tool-call parsers: the model's text -> ``content`` and OpenAI ``tool_calls`` (vLLM's
``--tool-call-parser`` names).

``hermes`` (:class:`HermesToolParser`, the format of NousResearch's Hermes 2 Pro and Qwen2.5's
chat templates): each call is ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
(newlines around the JSON optional); ``content`` is the text before the first call (None when
it is blank), text after the calls is dropped (as vLLM's ``hermes`` parser). A call whose JSON
does not parse makes the whole text ``content`` (no calls), except an unfinished last call after
complete ones (output cut by ``max_tokens``), which is dropped. ``arguments`` is the JSON text of
``"arguments"`` exactly as the model wrote it when ``"name"`` comes first (always the case under
the tool grammar), else the parsed value re-encoded.

Streaming (:class:`HermesStreamParser`): each call to ``feed(text so far)`` returns the deltas
not sent yet: content (holding back a possible ``<tool_call>`` prefix and blank text), then per
call ``{"index", "id", "type": "function", "function": {"name", "arguments": ""}}`` once its name
is known, then argument fragments (holding back what could still be the call's closing
``}`` / ``</tool_call>``). ``finish(final text)`` sends the rest: the fragments add up to the
non-streamed ``arguments`` of :meth:`HermesToolParser.parse` on the same text.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


@dataclass
class ParsedCall:
    name: str
    arguments: str
    """JSON text of the arguments (the part known so far while streaming)."""
    complete: bool = True


@dataclass
class ParsedOutput:
    content: str | None
    calls: list[ParsedCall] = field(default_factory=list)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _complete_call(body: str) -> ParsedCall | None:
    """One call's JSON (between the tags) parsed; None when it is not a valid call."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or "arguments" not in obj:
        return None
    m = _HEAD.match(body)
    if m is not None:
        raw = body.rstrip()[:-1].rstrip()[m.end():]  # up to the object's closing brace
        try:
            if json.loads(raw) == obj["arguments"]:
                return ParsedCall(obj["name"], raw)
        except ValueError:
            pass
    args = obj["arguments"]
    return ParsedCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


def _safe_arguments(partial: str) -> str:
    """The part of an unfinished call's argument text that cannot be its closing ``}`` or tag."""
    text = partial[: len(partial) - _partial_suffix(partial, TOOL_CALL_END)].rstrip()
    if text.endswith("}"):
        text = text[:-1].rstrip()
    return text


class HermesToolParser:
    """Parses ``<tool_call>{json}</tool_call>`` calls (see the module doc)."""

    name = "hermes"

    @staticmethod
    def parse(text: str, final: bool = True) -> ParsedOutput:
        """``text`` as content and calls. ``final=False``: ``text`` may still grow (the last call
        may be unfinished, ``complete=False``, with only its safe argument prefix)."""
        first = text.find(TOOL_CALL_START)
        if first < 0:
            content = text if final else text[: len(text) - _partial_suffix(text, TOOL_CALL_START)]
            return ParsedOutput(content if final or content.strip() else "")
        content = text[:first]
        calls: list[ParsedCall] = []
        pos = first
        while pos >= 0:
            start = pos + len(TOOL_CALL_START)
            end = text.find(TOOL_CALL_END, start)
            if end < 0 and not final:
                m = _HEAD.match(text, start)
                if m is not None:
                    calls.append(ParsedCall(json.loads(f'"{m.group(1)}"'), _safe_arguments(text[m.end():]), False))
                break
            call = _complete_call(text[start:end] if end >= 0 else text[start:])
            if call is None:
                if final and (end >= 0 or not calls):
                    return ParsedOutput(text)  # not a valid call: everything is content (as vLLM)
                break  # an unfinished last call (the output was cut short) is dropped
            calls.append(call)
            pos = text.find(TOOL_CALL_START, end + len(TOOL_CALL_END)) if end >= 0 else -1
        return ParsedOutput(content if content.strip() else None, calls)


def tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def tool_calls_body(calls: list[ParsedCall]) -> list[dict[str, Any]]:
    """OpenAI's ``message.tool_calls``."""
    return [
        {"id": tool_call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for c in calls
    ]


class HermesStreamParser:
    """The deltas of one streamed choice (see the module doc); ``parser``: any parser class of
    :func:`~.tool_parsers_json.tool_parsers` (default ``hermes``)."""

    def __init__(self, parser: Any = HermesToolParser) -> None:
        self.parser = parser
        self.sent_content = ""
        self.sent_args: list[str] = []
        self.ids: list[str] = []

    def _deltas(self, parsed: ParsedOutput) -> tuple[str, list[dict[str, Any]]]:
        content = ""
        if parsed.content and parsed.content.startswith(self.sent_content) and len(parsed.content) > len(
                self.sent_content):
            content = parsed.content[len(self.sent_content):]
            self.sent_content = parsed.content
        calls: list[dict[str, Any]] = []
        for i, call in enumerate(parsed.calls):
            if i == len(self.ids):
                self.ids.append(tool_call_id())
                self.sent_args.append("")
                calls.append(
                    {
                        "index": i,
                        "id": self.ids[i],
                        "type": "function",
                        "function": {"name": call.name, "arguments": ""},
                    }
                )
            sent = self.sent_args[i]
            if len(call.arguments) > len(sent) and call.arguments.startswith(sent):
                calls.append({"index": i, "function": {"arguments": call.arguments[len(sent):]}})
                self.sent_args[i] = call.arguments
        return content, calls

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """``(content delta, tool_calls deltas)`` for the text so far (it may still grow)."""
        return self._deltas(self.parser.parse(text, final=False))

    def finish(self, text: str) -> tuple[str, list[dict[str, Any]], bool]:
        """The remaining deltas of the final text, and whether it made tool calls."""
        parsed = self.parser.parse(text, final=True)
        content, calls = self._deltas(parsed)
        return content, calls, bool(parsed.calls)
