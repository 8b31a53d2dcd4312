"""Anthropic Messages request models, and their translation into an OpenAI chat request.

A :class:`MessagesRequest` (unknown fields are a 400, as Anthropic's API) becomes a
:class:`~kvfleet.runtime.entrypoints.openai.protocol.ChatCompletionRequest`
(:meth:`MessagesRequest.to_chat`), so the chat template, sampling, structured outputs and tool
parsing are the chat path's own:

* ``system`` (a string or text blocks) -> a ``system`` message; ``messages``' ``text`` blocks ->
  content, ``tool_use`` blocks -> the assistant's ``tool_calls`` (``input`` as JSON arguments),
  ``tool_result`` blocks -> ``tool`` messages (``is_error`` prefixes ``Error: ``); images,
  documents and thinking blocks are refused.
* ``tools`` (``name``, ``description``, ``input_schema``) -> function tools; ``tool_choice``
  ``auto`` / ``any`` / ``tool`` / ``none`` -> ``auto`` / ``required`` / a named function / ``none``;
  ``disable_parallel_tool_use`` -> ``parallel_tool_calls: false``.
* ``max_tokens`` (required, >= 1), ``stop_sequences`` -> ``stop``, ``temperature`` (0..1),
  ``top_p``, ``top_k``, ``stream`` (with usage), ``metadata`` (accepted, unused).
* Refused (400): ``thinking``, ``mcp_servers``, ``container``, server tools (a ``type`` other
  than ``custom``).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvfleet.runtime.entrypoints.openai import protocol as P


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


class _Block(BaseModel):
    # Clients echo the blocks of earlier responses back (with fields this server never sends,
    # e.g. the SDK's ``caller``): unknown block fields are ignored, unknown request fields refused.
    model_config = ConfigDict(extra="ignore")


class TextBlock(_Block):
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None
    citations: list[dict[str, Any]] | None = None


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None
    cache_control: dict[str, Any] | None = None

    def text(self) -> str:
        body = self.content if isinstance(self.content, str) else "\n".join(b.text for b in self.content or [])
        return f"Error: {body}" if self.is_error else body


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")]


class Message(_Strict):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class Tool(_Strict):
    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class MessagesRequest(_Strict):
    model: str
    messages: list[Message] = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: int | None = Field(None, ge=0)
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None

    def to_chat(self) -> P.ChatCompletionRequest:
        """The equivalent chat request (see the module doc).

        Raises:
            ProtocolError: a ``tool`` choice without ``name``.
        """
        body: dict[str, Any] = {
            "model": self.model,
            "messages": self._chat_messages(),
            "max_tokens": self.max_tokens,
            "stream": self.stream,
        }
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        for key, value in (("stop", self.stop_sequences), ("temperature", self.temperature),
                           ("top_p", self.top_p), ("top_k", self.top_k)):
            if value is not None:
                body[key] = value
        if self.tools:
            body["tools"] = [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                                               "parameters": t.input_schema}} for t in self.tools]
        if self.tool_choice is not None:
            body["tool_choice"] = self._chat_tool_choice()
            if self.tool_choice.disable_parallel_tool_use:
                body["parallel_tool_calls"] = False
        return P.ChatCompletionRequest.model_validate(body)

    def _chat_tool_choice(self) -> str | dict[str, Any]:
        choice = self.tool_choice
        assert choice is not None
        if choice.type == "tool":
            if not choice.name:
                raise P.ProtocolError('tool_choice of type "tool" needs a name', "tool_choice")
            return {"type": "function", "function": {"name": choice.name}}
        return {"auto": "auto", "any": "required", "none": "none"}[choice.type]

    def _chat_messages(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if self.system:
            text = self.system if isinstance(self.system, str) else "\n".join(b.text for b in self.system)
            out.append({"role": "system", "content": text})
        for m in self.messages:
            blocks = [TextBlock(type="text", text=m.content)] if isinstance(m.content, str) else m.content
            texts = [b.text for b in blocks if isinstance(b, TextBlock)]
            if m.role == "assistant":
                calls = [{"id": b.id, "type": "function",
                          "function": {"name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}}
                         for b in blocks if isinstance(b, ToolUseBlock)]
                out.append({"role": "assistant", "content": "".join(texts), **({"tool_calls": calls} if calls else {})})
                continue
            if any(isinstance(b, ToolUseBlock) for b in blocks):
                raise P.ProtocolError("tool_use blocks belong in assistant messages", "messages")
            out += [{"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()}
                    for b in blocks if isinstance(b, ToolResultBlock)]
            if texts or not any(isinstance(b, ToolResultBlock) for b in blocks):
                out.append({"role": "user", "content": "\n".join(texts)})
        return out


class CountTokensRequest(_Strict):
    """``POST /v1/messages/count_tokens``: the prompt part of a Messages request (no sampling)."""

    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None

    def to_chat(self) -> P.ChatCompletionRequest:
        """The chat request whose prompt the count is of (as ``/v1/messages`` renders it)."""
        return MessagesRequest(**self.model_dump(exclude_none=True), max_tokens=1).to_chat()


def stop_reason(finish_reason: str | None, chat_stop_reason: Any) -> tuple[str | None, str | None]:
    """Anthropic's ``(stop_reason, stop_sequence)`` from a chat choice's ``finish_reason`` and
    ``stop_reason`` (the matched stop string, or an end-of-sequence token id)."""
    if finish_reason == "tool_calls":
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if isinstance(chat_stop_reason, str):
        return "stop_sequence", chat_stop_reason
    return ("end_turn", None) if finish_reason is not None else (None, None)


def tool_use_id(chat_id: str) -> str:
    """A chat tool-call id (``chatcmpl-tool-<hex>``) in Anthropic's ``toolu_`` form."""
    return "toolu_" + chat_id.rsplit("-", 1)[-1]


_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def error_body(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error shape for an HTTP status."""
    kind = _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def _inline(node: Any, defs: dict[str, Any]) -> Any:
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/$defs/"):
            return _inline(defs[ref.removeprefix("#/$defs/")], defs)
        return {k: _inline(v, defs) for k, v in node.items() if k != "$defs"}
    if isinstance(node, list):
        return [_inline(v, defs) for v in node]
    return node


def openapi_request_body() -> dict[str, Any]:
    """The route's OpenAPI ``requestBody``: :class:`MessagesRequest`'s JSON schema, self-contained."""
    schema = MessagesRequest.model_json_schema()
    return {"required": True, "content": {"application/json": {"schema": _inline(schema, schema.get("$defs", {}))}}}
