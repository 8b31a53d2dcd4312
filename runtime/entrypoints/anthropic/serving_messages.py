"""``POST /v1/messages``: Anthropic's Messages API answered by the chat serving path.

The request is checked (:class:`~.protocol.MessagesRequest`), translated into a chat request
and answered by :class:`~kvfleet.runtime.entrypoints.openai.serving_chat.OpenAIServingChat`;
its typed result (:meth:`~kvfleet.runtime.entrypoints.openai.serving_chat.OpenAIServingChat.chat`:
the response model, or the stream's chunk models) is translated back:

* a message: ``content`` (a ``text`` block when there is text, a ``tool_use`` block per call
  with ``input`` parsed from the arguments), ``stop_reason`` (``end_turn``, ``max_tokens``,
  ``stop_sequence`` with ``stop_sequence``, ``tool_use``), ``usage`` (input / output tokens);
* a stream: ``message_start`` (with the prompt's ``input_tokens``, known before the first
  chunk), per block
  ``content_block_start`` / ``content_block_delta`` (``text_delta``, ``input_json_delta``) /
  ``content_block_stop``, then ``message_delta`` (stop reason, ``usage``) and ``message_stop``;
  an engine failure mid-stream is an ``error`` event;
* errors: Anthropic's ``{"type": "error", "error": {"type", "message"}}`` with the status.

Authentication: ``x-api-key`` (Anthropic's header) or ``Authorization: Bearer``.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from kvfleet.runtime.entrypoints.anthropic.protocol import MessagesRequest, error_body, stop_reason, tool_use_id
from kvfleet.runtime.entrypoints.openai import protocol as P
from kvfleet.runtime.entrypoints.openai.errors import APIError, checked
from kvfleet.runtime.entrypoints.openai.request_body import parse_body
from kvfleet.runtime.entrypoints.openai.serving_chat import ChatStream, OpenAIServingChat
from kvfleet.runtime.entrypoints.openai.streaming import ChunkStream, sse_event, streaming_events
from kvfleet.runtime.http.auth import key_matches


def _check_key(request: Request, key: str | None) -> None:
    if not key:
        return
    if not key_matches(request.headers, key, x_api_key=True):
        raise APIError(401, "invalid x-api-key")


async def create_message(request: Request, chat: OpenAIServingChat) -> Response:
    """The route's body: any :class:`APIError` is answered in Anthropic's error shape."""
    try:
        settings = chat.state.settings
        _check_key(request, settings.api_key)
        body = await parse_body(request, MessagesRequest, settings.max_request_body_size)
        chat_body = checked(body.to_chat)
        result = await chat.chat(chat_body, request)
    except APIError as exc:
        return JSONResponse(error_body(exc.status, exc.body.error.message), status_code=exc.status,
                            headers=exc.headers)
    msg_id = "msg_" + uuid.uuid4().hex[:24]
    if isinstance(result, ChunkStream):
        return streaming_events(_events(result, msg_id, body.model))
    return JSONResponse(_message(result, msg_id, body.model))


def _message(chat: P.ChatCompletionResponse, msg_id: str, model: str) -> dict[str, Any]:
    choice = chat.choices[0]
    msg = choice.message
    content: list[dict[str, Any]] = []
    if msg.content:
        content.append({"type": "text", "text": msg.content})
    for call in msg.tool_calls:
        content.append({"type": "tool_use", "id": tool_use_id(call["id"]), "name": call["function"]["name"],
                        "input": _input(call["function"]["arguments"])})
    reason, sequence = stop_reason(choice.finish_reason, choice.stop_reason)
    return {"id": msg_id, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": reason, "stop_sequence": sequence, "usage": _usage(chat.usage)}


def _usage(usage: P.UsageInfo) -> dict[str, int]:
    return {"input_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens}


def _input(arguments: str) -> dict[str, Any]:
    """A tool call's ``input``: the JSON object the model wrote as the call's arguments ({} if it is none)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _sse(kind: str, data: dict[str, Any]) -> str:
    return sse_event(kind, {"type": kind, **data}, ensure_ascii=False)


class _Blocks:
    """The open content block of a stream, and the events that open, feed and close blocks."""

    def __init__(self) -> None:
        self.index = -1
        self.kind: str | None = None

    def close(self) -> list[str]:
        if self.kind is None:
            return []
        self.kind = None
        return [_sse("content_block_stop", {"index": self.index})]

    def open(self, block: dict[str, Any]) -> list[str]:
        out = self.close()
        self.index += 1
        self.kind = block["type"]
        return out + [_sse("content_block_start", {"index": self.index, "content_block": block})]

    def text(self, text: str) -> list[str]:
        out = [] if self.kind == "text" else self.open({"type": "text", "text": ""})
        return out + [_sse("content_block_delta", {"index": self.index, "delta": {"type": "text_delta", "text": text}})]

    def call(self, delta: dict[str, Any]) -> list[str]:
        out = []
        fn = delta.get("function") or {}
        if delta.get("id"):
            out = self.open({"type": "tool_use", "id": tool_use_id(delta["id"]), "name": fn.get("name"), "input": {}})
        if fn.get("arguments"):
            out.append(_sse("content_block_delta", {"index": self.index, "delta": {
                "type": "input_json_delta", "partial_json": fn["arguments"]}}))
        return out


async def _events(stream: ChatStream, msg_id: str, model: str) -> AsyncIterator[str]:
    """The chat stream's typed chunks as Anthropic's event sequence (see the module doc)."""
    usage = {"input_tokens": stream.prompt_tokens, "output_tokens": 0}
    yield _sse("message_start", {"message": {
        "id": msg_id, "type": "message", "role": "assistant", "model": model, "content": [],
        "stop_reason": None, "stop_sequence": None, "usage": dict(usage)}})
    blocks = _Blocks()
    reason: tuple[str | None, str | None] = (None, None)
    async with aclosing(stream.chunks) as chunks:  # type: ignore[type-var]
        try:
            async for chunk in chunks:
                if not isinstance(chunk, P.ChatCompletionStreamResponse):
                    continue
                for choice in chunk.choices:
                    delta = choice.delta
                    for event in blocks.text(delta.content) if delta.content else []:
                        yield event
                    for call in delta.tool_calls or []:
                        for event in blocks.call(call):
                            yield event
                    if choice.finish_reason is not None:
                        reason = stop_reason(choice.finish_reason, choice.stop_reason)
                if chunk.usage is not None:
                    usage = _usage(chunk.usage)
        except APIError as exc:
            yield _sse("error", {"error": error_body(500, exc.body.error.message)["error"]})  # api_error
            return
    for event in blocks.close():
        yield event
    yield _sse("message_delta", {"delta": {"stop_reason": reason[0], "stop_sequence": reason[1]}, "usage": usage})
    yield _sse("message_stop", {})
