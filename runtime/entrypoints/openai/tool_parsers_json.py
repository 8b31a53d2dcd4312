"""The ``llama3_json`` and ``mistral`` tool-call parsers (vLLM's ``--tool-call-parser`` names),
with the same interface as :class:`~.tool_parsers.HermesToolParser`: ``parse(text, final)`` ->
:class:`~.tool_parsers.ParsedOutput`.

``llama3_json`` (Llama 3.1/3.2/3.3's JSON tool calling): the whole output is one or more
``{"name": ..., "parameters": {...}}`` objects (``"arguments"`` accepted too), optionally after
``<|python_tag|>``, separated by ``;``. Output that does not start that way is content.

``mistral`` (Mistral's ``[TOOL_CALLS]`` token): ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``
(tokenizer v3), or ``[TOOL_CALLS]name[ARGS]{...}`` repeated (v11+); ``content`` is the text before
``[TOOL_CALLS]``.

Both formats only make sense once complete: while streaming (``final=False``) the text after a
possible start of a call is held back and the calls come whole when the output ends. Invalid
calls make the whole text ``content`` (as the ``hermes`` parser).

:func:`tool_parsers` is the registry of every ``--tool-call-parser`` name.
"""

from __future__ import annotations

import json
from typing import Any

from kvfleet.runtime.entrypoints.openai.tool_parsers import HermesToolParser, ParsedCall, ParsedOutput, _partial_suffix

PYTHON_TAG = "<|python_tag|>"
MISTRAL_TOOL_CALLS = "[TOOL_CALLS]"
MISTRAL_ARGS = "[ARGS]"


def _call_of(obj: Any, args_keys: tuple[str, ...]) -> ParsedCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    for key in args_keys:
        if key in obj:
            args = obj[key]
            return ParsedCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))
    return None


def _json_values(text: str) -> list[Any] | None:
    """The JSON values in ``text`` separated by ``;`` / whitespace; None when something else is there."""
    decoder = json.JSONDecoder()
    values, pos = [], 0
    while True:
        while pos < len(text) and (text[pos].isspace() or text[pos] == ";"):
            pos += 1
        if pos == len(text):
            return values
        try:
            value, pos = decoder.raw_decode(text, pos)
        except ValueError:
            return None
        values.append(value)


class Llama3JsonToolParser:
    """Llama 3's JSON tool calls (see the module doc)."""

    name = "llama3_json"

    @staticmethod
    def parse(text: str, final: bool = True) -> ParsedOutput:
        body = text.lstrip()
        tagged = body.startswith(PYTHON_TAG)
        if tagged:
            body = body[len(PYTHON_TAG):]
        if not final:
            if tagged or body.startswith("{") or (body and PYTHON_TAG.startswith(body)):
                return ParsedOutput("")  # maybe a call: held back until the end
            return ParsedOutput(text if text.strip() else "")
        values = _json_values(body) if (tagged or body.startswith("{")) else None
        calls = [_call_of(v, ("parameters", "arguments")) for v in values or []]
        if not calls or any(c is None for c in calls):
            return ParsedOutput(text)
        return ParsedOutput(None, calls)  # type: ignore[arg-type]


class MistralToolParser:
    """Mistral's ``[TOOL_CALLS]`` calls (see the module doc)."""

    name = "mistral"

    @staticmethod
    def parse(text: str, final: bool = True) -> ParsedOutput:
        first = text.find(MISTRAL_TOOL_CALLS)
        if first < 0:
            content = text if final else text[: len(text) - _partial_suffix(text, MISTRAL_TOOL_CALLS)]
            return ParsedOutput(content if final or content.strip() else "")
        content = text[:first]
        if not final:
            return ParsedOutput(content if content.strip() else "")
        calls = _mistral_calls(text[first + len(MISTRAL_TOOL_CALLS):])
        if not calls:
            return ParsedOutput(text)
        return ParsedOutput(content if content.strip() else None, calls)


def _mistral_calls(rest: str) -> list[ParsedCall] | None:
    calls: list[ParsedCall] = []
    for part in rest.split(MISTRAL_TOOL_CALLS):
        part = part.strip()
        if MISTRAL_ARGS in part:  # v11: name[ARGS]{json}
            name, _, args = part.partition(MISTRAL_ARGS)
            values = _json_values(args)
            if not name.strip() or not values or len(values) != 1:
                return None
            calls.append(ParsedCall(name.strip(), json.dumps(values[0], ensure_ascii=False)))
            continue
        values = _json_values(part)  # v3: a JSON list of calls (or one call)
        if not values or len(values) != 1:
            return None
        items = values[0] if isinstance(values[0], list) else [values[0]]
        for item in items:
            call = _call_of(item, ("arguments", "parameters"))
            if call is None:
                return None
            calls.append(call)
    return calls or None


TOOL_PARSER_NAMES = ("hermes", "llama3_json", "mistral")
"""``--tool-call-parser`` values."""


def tool_parsers() -> dict[str, Any]:
    """``--tool-call-parser`` values -> parser classes (``parse(text, final) -> ParsedOutput``)."""
    return {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser, "mistral": MistralToolParser}
