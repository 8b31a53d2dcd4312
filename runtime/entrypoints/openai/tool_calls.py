"""Tool calling on ``/v1/chat/completions``: ``tools`` and ``tool_choice`` checked, the tools put
into the prompt, the grammar of ``required`` / named choices, and which parser reads the output.

* ``tools``: OpenAI's ``[{"type": "function", "function": {"name", "description", "parameters"}}]``.
* ``tool_choice``: ``none`` (tools in the prompt, output is text, never parsed), ``auto`` (the
  default with tools; the model chooses, its output is parsed by the server's parser: the one
  :func:`detect_tool_parser` picks at start-up, or ``--tool-call-parser``, which overrides it),
  ``required``
  (at least one call; ``parallel_tool_calls: false``: exactly one) or a named function (exactly
  one call of it). ``required`` and named choices are grammar-constrained (an xgrammar structural
  tag): the output is Hermes-format calls whose arguments are valid against each function's
  ``parameters``, read back by the ``hermes`` parser whatever ``--tool-call-parser`` says.
* The prompt: with a chat template that uses ``tools`` (it names the variable), the tools go to
  ``apply_chat_template(tools=...)`` and the messages keep their ``tool_calls`` / ``tool_call_id``
  (arguments as objects, transformers' convention). Otherwise (the default model's template)
  the fallback: :data:`FALLBACK_TOOL_PROMPT` (Hermes' system prompt) is added to the system
  message, assistant ``tool_calls`` become ``<tool_call>`` text and ``tool`` messages become user
  turns of ``<tool_response>`` text.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from kvfleet.runtime.entrypoints.openai import protocol as P
from kvfleet.runtime.entrypoints.openai.tool_parsers import TOOL_CALL_END, TOOL_CALL_START
from kvfleet.runtime.entrypoints.openai.tool_parsers_json import TOOL_PARSER_NAMES
from kvfleet.runtime.sampling_params import StructuredOutputsParams

FALLBACK_TOOL_PROMPT = (
    "You are a function calling AI model. You are provided with function signatures within <tools></tools> "
    "XML tags. You may call one or more functions to assist with the user query. Don't make assumptions about "
    "what values to plug into functions. Here are the available tools:\n<tools>\n{tools}\n</tools>\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}}\n</tool_call>"
)
"""The system prompt added when the chat template does not render tools (``{tools}``: one JSON
function definition per line)."""


@dataclass
class ToolSetup:
    """The resolved tool options of one chat request."""

    tools: list[dict[str, Any]]
    choice: str
    """``none``, ``auto``, ``required`` or ``named``."""
    name: str | None = None
    """The forced function (``named``)."""
    parallel: bool = True
    parser: str | None = None
    """The parser reading the output (None: the output is plain text)."""

    def grammar(self) -> StructuredOutputsParams | None:
        """The structural tag forcing the calls of ``required`` / ``named`` (None otherwise)."""
        if self.choice not in ("required", "named"):
            return None
        functions = [
            t["function"] for t in self.tools if self.choice == "required" or t["function"]["name"] == self.name
        ]

        def tag(fn: dict[str, Any]) -> dict[str, Any]:
            schema = fn.get("parameters") or {"type": "object", "properties": {}}
            return {
                "type": "tag",
                "begin": f'{TOOL_CALL_START}\n{{"name": {json.dumps(fn["name"])}, "arguments": ',
                "content": {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": 1},
                "end": f"}}\n{TOOL_CALL_END}",
            }

        if self.choice == "named":
            fmt: dict[str, Any] = tag(functions[0])
        else:
            fmt = {
                "type": "tags_with_separator",
                "tags": [tag(f) for f in functions],
                "separator": "\n",
                "at_least_one": True,
                "stop_after_first": not self.parallel,
            }
        return StructuredOutputsParams(structural_tag=json.dumps({"type": "structural_tag", "format": fmt}))


FUNCTION_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
"""A function name as OpenAI's API accepts it (and one the Hermes tags cannot be broken by)."""


def _check_tools(tools: list[dict[str, Any]]) -> None:
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
            raise P.UnsupportedFeature(f'tools[{i}] must be {{"type": "function", "function": {{...}}}}', "tools")
        if not isinstance(fn.get("name"), str) or not FUNCTION_NAME.fullmatch(fn["name"]):
            raise P.ProtocolError(f"tools[{i}].function.name must be 1-64 letters, digits, '_' or '-' (OpenAI's "
                                  f"rule), got {fn.get('name')!r}", "tools")
        if any(fn["name"] == u.get("function", {}).get("name") for u in tools[:i] if isinstance(u, dict)):
            raise P.ProtocolError(f"tools[{i}].function.name {fn['name']!r} is given twice", "tools")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise P.ProtocolError(f"tools[{i}].function.parameters must be a JSON schema object", "tools")


def resolve_tools(body: P.ChatCompletionRequest, parser: str | None) -> ToolSetup | None:
    """The request's tool setup (None: no tools); ``parser``: the server's ``auto`` parser.

    Raises:
        ProtocolError: malformed ``tools`` / ``tool_choice``, a named function that is not among
            the tools, ``auto`` when the server has no parser (none detected, no ``--tool-call-parser``).
    """
    tools = body.tools or []
    choice = body.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise P.ProtocolError("tool_choice requires tools", "tool_choice")
        return None
    _check_tools(tools)
    choice = "auto" if choice is None else choice
    name = None
    if isinstance(choice, dict):
        fn = choice.get("function")
        if choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise P.ProtocolError(
                'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
                "tool_choice",
            )
        name = fn["name"]
        if name not in [t["function"]["name"] for t in tools]:
            raise P.ProtocolError(f"tool_choice names function {name!r}, which is not in tools", "tool_choice")
        choice = "named"
    elif choice not in ("none", "auto", "required"):
        raise P.ProtocolError(
            f'tool_choice must be "none", "auto", "required" or a named function, got {choice!r}', "tool_choice"
        )
    if choice == "auto" and parser not in TOOL_PARSER_NAMES:
        raise P.ProtocolError('"auto" tool choice needs a tool-call parser: none matches this model\'s chat '
                              'template; start the server with --enable-auto-tool-choice --tool-call-parser NAME '
                              '(or send tool_choice "none", "required" or a named function)', "tool_choice")
    reader = {"none": None, "auto": parser}.get(choice, "hermes")
    return ToolSetup(tools, choice, name, body.parallel_tool_calls is not False, reader)


_TEMPLATE_MARKERS = (("<tool_call>", "hermes"), ("[TOOL_CALLS]", "mistral"), ("<|python_tag|>", "llama3_json"))
_FAMILY_NAMES = (("hermes", "hermes"), ("qwen", "hermes"), ("mistral", "mistral"), ("mixtral", "mistral"),
                 ("llama-3", "llama3_json"), ("llama3", "llama3_json"))


def detect_tool_parser(chat_template: str | None, model_name: str) -> tuple[str | None, str]:
    """The ``auto`` tool-call parser for a model, and why (logged at start-up).

    A template that renders tools is searched for a parser's call marker (``<tool_call>``,
    ``[TOOL_CALLS]``, ``<|python_tag|>``), then the model's name for its family (Hermes / Qwen,
    Mistral / Mixtral, Llama 3); a template that renders tools in no known format gets no parser
    (``auto`` is refused rather than misread). A template that does not render tools (the
    embedded default model's) gets ``hermes``: the server then puts the tools into the prompt
    itself with Hermes' system prompt (:data:`FALLBACK_TOOL_PROMPT`), so the model is asked for
    exactly the format the ``hermes`` parser reads.
    """
    if not template_renders_tools(chat_template):
        return "hermes", "the chat template does not render tools: the server prompts for Hermes-format calls"
    for marker, name in _TEMPLATE_MARKERS:
        if marker in (chat_template or ""):
            return name, f"the chat template renders tools with {marker}"
    lowered = model_name.lower()
    for part, name in _FAMILY_NAMES:
        if part in lowered:
            return name, f"the model name {model_name!r} is of the {part} family"
    return None, "the chat template renders tools in a format no parser knows"


def template_renders_tools(chat_template: str | None) -> bool:
    """True when the chat template uses the ``tools`` variable."""
    return bool(chat_template) and "tools" in chat_template


def _call_text(call: dict[str, Any]) -> str:
    fn = call.get("function") or {}
    args = fn.get("arguments", "{}")
    try:
        args = json.loads(args) if isinstance(args, str) else args
    except ValueError:
        pass
    return f"{TOOL_CALL_START}\n{json.dumps({'name': fn.get('name'), 'arguments': args})}\n{TOOL_CALL_END}"


def prepare_messages(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, native: bool
) -> list[dict[str, Any]]:
    """The messages as the chat template gets them (see the module doc): ``native`` keeps tool
    calls (arguments parsed into objects) for a template that renders them; otherwise the
    fallback text forms, and the tool prompt in the system message when ``tools`` are given."""
    out = []
    for m in messages:
        m = dict(m)
        calls = m.get("tool_calls")
        if native:
            if calls:
                m["tool_calls"] = [_with_parsed_arguments(c) for c in calls]
        else:
            if calls:
                m["content"] = "\n".join(filter(None, [m.get("content") or "", *(_call_text(c) for c in calls)]))
                del m["tool_calls"]
            if m["role"] == "tool":
                m = {"role": "user", "content": f"<tool_response>\n{m.get('content', '')}\n</tool_response>"}
        out.append(m)
    if tools and not native:
        prompt = FALLBACK_TOOL_PROMPT.format(tools="\n".join(json.dumps(t) for t in tools))
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _with_parsed_arguments(call: dict[str, Any]) -> dict[str, Any]:
    """A call with its JSON-text ``arguments`` parsed (templates read ``arguments`` as a mapping)."""
    fn = dict(call.get("function") or {})
    if isinstance(fn.get("arguments"), str):
        try:
            fn["arguments"] = json.loads(fn["arguments"])
        except ValueError:
            pass
    return {**call, "function": fn}
