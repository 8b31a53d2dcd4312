"""``/v1/responses`` request body (OpenAI's Responses API) and its translation to a chat request.

:class:`ResponsesRequest` accepts what kvfleet serves (``input`` as a string or message /
``function_call`` / ``function_call_output`` items, ``instructions``, ``max_output_tokens``,
``temperature``, ``top_p``, function ``tools``, ``tool_choice``, ``parallel_tool_calls``,
``text.format``, ``store``, ``previous_response_id``, ``stream``, ``metadata``) and refuses the
rest by name (``check_supported``: ``background``, built-in tools such as ``web_search``,
``reasoning``, ``include``, ``truncation: auto``, ``conversation``, ``prompt``): a
:class:`UnsupportedFeature` is a 400 naming the field. ``chat_messages`` and ``chat_fields``
turn the request into a ``/v1/chat/completions`` body, so generation reuses the chat path.
"""

from __future__ import annotations

from typing import Any

from kvfleet.runtime.entrypoints.openai.protocol.common import ProtocolError, StrictRequest, UnsupportedFeature

_INPUT_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text", "text")


class ResponsesRequest(StrictRequest):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = True
    text: dict[str, Any] | None = None
    store: bool | None = True
    previous_response_id: str | None = None
    stream: bool | None = False
    metadata: dict[str, str] | None = None
    user: str | None = None
    background: bool | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    truncation: str | None = None
    conversation: Any = None
    prompt: Any = None

    def check_supported(self) -> None:
        if self.background:
            raise UnsupportedFeature("background responses are not supported", "background")
        for name in ("reasoning", "include", "conversation", "prompt"):
            if getattr(self, name):
                raise UnsupportedFeature(f"{name} is not supported", name)
        if self.truncation not in (None, "disabled"):
            raise UnsupportedFeature("truncation must be 'disabled'", "truncation")
        for i, tool in enumerate(self.tools or []):
            if tool.get("type") != "function":
                raise UnsupportedFeature(
                    f"tools[{i}]: only function tools are supported, not {tool.get('type')!r}", "tools"
                )
            if not isinstance(tool.get("name"), str):
                raise ProtocolError(f"tools[{i}].name must be a string", "tools")

    def chat_tools(self) -> list[dict[str, Any]] | None:
        if not self.tools:
            return None
        keys = ("name", "description", "parameters")
        return [{"type": "function", "function": {k: t[k] for k in keys if t.get(k) is not None}} for t in self.tools]

    def chat_tool_choice(self) -> str | dict[str, Any] | None:
        c = self.tool_choice
        if isinstance(c, dict):
            if c.get("type") != "function" or not isinstance(c.get("name"), str):
                raise UnsupportedFeature("tool_choice must be auto, none, required or a function", "tool_choice")
            return {"type": "function", "function": {"name": c["name"]}}
        return c

    def response_format(self) -> dict[str, Any] | None:
        """``text.format`` as chat's ``response_format`` (json_schema, json_object; text: none)."""
        fmt = (self.text or {}).get("format")
        if fmt is None or fmt.get("type") == "text":
            return None
        if fmt.get("type") == "json_object":
            return {"type": "json_object"}
        if fmt.get("type") == "json_schema":
            schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
            return {"type": "json_schema", "json_schema": schema}
        raise UnsupportedFeature(f"text.format.type {fmt.get('type')!r} is not supported", "text.format")

    def chat_fields(self) -> dict[str, Any]:
        """Everything of the chat body except ``messages``."""
        out: dict[str, Any] = {"model": self.model, "stream": bool(self.stream)}
        for name, value in (
            ("max_completion_tokens", self.max_output_tokens),
            ("temperature", self.temperature),
            ("top_p", self.top_p),
            ("tools", self.chat_tools()),
            ("tool_choice", self.chat_tool_choice()),
            ("parallel_tool_calls", self.parallel_tool_calls),
            ("response_format", self.response_format()),
        ):
            if value is not None:
                out[name] = value
        if self.stream:
            out["stream_options"] = {"include_usage": True}
        return out


def input_messages(input_: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``input`` as chat messages (consecutive ``function_call`` items: one assistant message)."""
    if isinstance(input_, str):
        return [{"role": "user", "content": input_}]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(input_):
        kind = item.get("type", "message")
        if kind == "message":
            out.append({"role": _role(item, i), "content": _text(item.get("content"), i)})
        elif kind == "function_call":
            call = {
                "id": item.get("call_id"),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments", "")},
            }
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls"):
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(output, str):
                output = _text(output, i)
            out.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": output})
        else:
            raise UnsupportedFeature(f"input[{i}].type {kind!r} is not supported", "input")
    return out


def _role(item: dict[str, Any], i: int) -> str:
    role = item.get("role")
    if role not in _INPUT_ROLES:
        raise ProtocolError(f"input[{i}].role must be one of {', '.join(_INPUT_ROLES)}, got {role!r}", "input")
    return role


def _text(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ProtocolError(f"input[{i}].content must be a string or a list of text parts", "input")
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise UnsupportedFeature(f"input[{i}].content: only text parts are supported, not {kind!r}", "input")
        texts.append(part["text"])
    return "".join(texts)
