"""``/v1/responses`` (OpenAI's Responses API) on top of the chat path: :class:`OpenAIServingResponses`.

A Responses request becomes a ``/v1/chat/completions`` body (:mod:`.protocol.responses`): the
stored conversation of ``previous_response_id``, then ``instructions`` as the system message, then
``input``. :class:`~.serving_chat.OpenAIServingChat` renders the chat template, samples, applies
structured outputs (``text.format``) and parses tool calls; its typed result
(:meth:`~.serving_chat.OpenAIServingChat.chat`: the response model, or the stream's chunk models)
is translated into a ``response`` object (``message`` and ``function_call`` output items,
``usage``). Streams turn the chat chunks into the typed Responses events, each with a
``sequence_number``; a failure once streaming is an ``error`` then a ``response.failed`` event. With ``store``
(default true) the response and the conversation that led to it are kept in a bounded LRU store
(:class:`ResponseStore`, ``--max-stored-responses``) on *this replica* for GET / DELETE and
``previous_response_id``. A 400 from the chat path names the Responses field, not the chat one
(``max_output_tokens``, ``text.format``: :func:`_as_responses_error`).
"""

from __future__ import annotations

import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from kvfleet.runtime.entrypoints.openai import protocol as P
from kvfleet.runtime.entrypoints.openai.errors import APIError, checked
from kvfleet.runtime.entrypoints.openai.protocol.responses import ResponsesRequest, input_messages
from kvfleet.runtime.entrypoints.openai.serving_chat import ChatStream, OpenAIServingChat
from kvfleet.runtime.entrypoints.openai.streaming import ChunkStream, sse_event, streaming_events


@dataclass
class Stored:
    """A stored response and the chat messages that continue it."""

    body: dict[str, Any]
    messages: list[dict[str, Any]]


class ResponseStore:
    """Bounded in-memory LRU of stored responses (``size`` 0: nothing is stored)."""

    def __init__(self, size: int):
        self.size = size
        self._items: OrderedDict[str, Stored] = OrderedDict()

    def put(self, rid: str, item: Stored) -> None:
        if self.size <= 0:
            return
        self._items[rid] = item
        self._items.move_to_end(rid)
        while len(self._items) > self.size:
            self._items.popitem(last=False)

    def find(self, rid: str) -> Stored | None:
        item = self._items.get(rid)
        if item is not None:
            self._items.move_to_end(rid)
        return item

    def get(self, rid: str) -> Stored:
        item = self.find(rid)
        if item is None:
            raise APIError(404, f"Response with id '{rid}' not found.", param="response_id", code="not_found")
        return item

    def delete(self, rid: str) -> None:
        self.get(rid)
        del self._items[rid]


@dataclass
class _Result:
    """What the chat path produced, in the shape both the JSON and the stream paths build from."""

    text: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str | None = None
    usage: P.UsageInfo = field(default_factory=P.UsageInfo)


class OpenAIServingResponses:
    """``POST /v1/responses``, ``GET`` / ``DELETE /v1/responses/{id}``."""

    def __init__(self, chat: OpenAIServingChat, store_size: int):
        self.chat = chat
        self.store = ResponseStore(store_size)

    async def create(self, body: ResponsesRequest, http_request: Request) -> Response:
        checked(body.check_supported)
        history: list[dict[str, Any]] = []
        if body.previous_response_id is not None:
            stored = self.store.find(body.previous_response_id)
            if stored is None:
                raise APIError(
                    404,
                    f"Previous response with id '{body.previous_response_id}' not found.",
                    param="previous_response_id",
                    code="not_found",
                )
            history = list(stored.messages)
        new = checked(lambda: input_messages(body.input))
        system = [{"role": "system", "content": body.instructions}] if body.instructions else []
        messages = system + history + new
        try:
            chat_body = P.ChatCompletionRequest.model_validate({**checked(body.chat_fields), "messages": messages})
        except ValidationError as exc:
            raise APIError(400, f"invalid request: {exc.errors()[0]['msg']}", param="input") from None
        rid = f"resp_{uuid.uuid4().hex}"
        try:
            chat = await self.chat.chat(chat_body, http_request)
        except APIError as exc:
            raise _as_responses_error(exc) from None
        shell = _shell(body, rid, self.chat.state.response_model(body.model))
        keep = history + new
        if isinstance(chat, ChunkStream):
            return streaming_events(self._events(body, rid, shell, keep, chat), _id_header(body, rid))
        choice = chat.choices[0]
        result = _Result(choice.message.content or "", choice.message.tool_calls, choice.finish_reason, chat.usage)
        final = _final(shell, result)
        self._keep(body, rid, final, keep, result)
        return JSONResponse(final, headers=_id_header(body, rid))

    def _keep(self, body: ResponsesRequest, rid: str, final: dict, keep: list, result: _Result) -> None:
        if body.store:
            reply = {"role": "assistant", "content": result.text}
            if result.tool_calls:
                reply["tool_calls"] = result.tool_calls
            self.store.put(rid, Stored(final, keep + [reply]))

    async def _events(
        self, body: ResponsesRequest, rid: str, shell: dict, keep: list, stream: ChatStream
    ) -> AsyncIterator[str]:
        """The typed events of one streamed response, from the chat path's typed chunks."""
        s = _ResponseStream(shell)
        yield s.event("response.created", response={**shell, "status": "in_progress"})
        yield s.event("response.in_progress", response={**shell, "status": "in_progress"})
        async with aclosing(stream.chunks) as chunks:  # type: ignore[type-var]
            try:
                async for chunk in chunks:
                    if isinstance(chunk, P.ChatCompletionStreamResponse):
                        for event in s.on_chunk(chunk):
                            yield event
            except APIError as exc:
                err = exc.body.error
                yield s.event("error", message=err.message, code=err.code, param=err.param)
                yield s.event("response.failed", response={**shell, "status": "failed", "error": err.model_dump()})
                return
        final = s.final()
        for event in s.closing(final):
            yield event
        self._keep(body, rid, final, keep, s.result)
        yield s.event("response.completed" if final["status"] == "completed" else "response.incomplete", response=final)

    def retrieve(self, rid: str) -> dict[str, Any]:
        return self.store.get(rid).body

    def delete(self, rid: str) -> dict[str, Any]:
        self.store.delete(rid)
        return {"id": rid, "object": "response", "deleted": True}


class _ResponseStream:
    """The state of one streamed response: the sequence numbers, the text and calls so far."""

    def __init__(self, shell: dict[str, Any]):
        self.shell = shell
        self.seq = 0
        self.result = _Result()
        self.msg_id = P.random_id("msg")
        self.started = False
        self.calls: dict[int, dict[str, Any]] = {}

    def event(self, kind: str, **data: Any) -> str:
        self.seq += 1
        return sse_event(kind, {"type": kind, "sequence_number": self.seq - 1, **data})

    def _open_message(self, index: int) -> list[str]:
        self.started = True
        return [
            self.event("response.output_item.added", output_index=index, item=_message(self.msg_id, "", "in_progress")),
            self.event(
                "response.content_part.added",
                item_id=self.msg_id,
                output_index=index,
                content_index=0,
                part=_text_part(""),
            ),
        ]

    def on_chunk(self, chunk: P.ChatCompletionStreamResponse) -> list[str]:
        out: list[str] = []
        if chunk.usage is not None:
            self.result.usage = chunk.usage
        for choice in chunk.choices:
            delta = choice.delta
            if choice.finish_reason:
                self.result.finish_reason = choice.finish_reason
            for tc in delta.tool_calls or []:
                _merge_call(self.calls, tc)
            if delta.content:
                if not self.started:
                    out += self._open_message(0)
                self.result.text += delta.content
                out.append(
                    self.event(
                        "response.output_text.delta",
                        item_id=self.msg_id,
                        output_index=0,
                        content_index=0,
                        delta=delta.content,
                        logprobs=[],
                    )
                )
        return out

    def final(self) -> dict[str, Any]:
        self.result.tool_calls = [self.calls[i] for i in sorted(self.calls)]
        return _final(self.shell, self.result, self.msg_id)

    def closing(self, final: dict[str, Any]) -> list[str]:
        """The ``.done`` events of every output item (and the ``.added`` ones not sent yet)."""
        out: list[str] = []
        text = self.result.text
        for index, item in enumerate(final["output"]):
            if item["type"] == "message":
                if not self.started:
                    out += self._open_message(index)
                ids = {"item_id": self.msg_id, "output_index": index, "content_index": 0}
                out.append(self.event("response.output_text.done", **ids, text=text, logprobs=[]))
                out.append(self.event("response.content_part.done", **ids, part=_text_part(text)))
            else:
                ids = {"item_id": item["id"], "output_index": index}
                out.append(
                    self.event(
                        "response.output_item.added",
                        output_index=index,
                        item={**item, "arguments": "", "status": "in_progress"},
                    )
                )
                out.append(self.event("response.function_call_arguments.delta", **ids, delta=item["arguments"]))
                out.append(self.event("response.function_call_arguments.done", **ids, arguments=item["arguments"]))
            out.append(self.event("response.output_item.done", output_index=index, item=item))
        return out


# The chat fields a Responses request sets (chat_fields) -> the Responses field the user sent.
_CHAT_TO_RESPONSES = {"max_completion_tokens": "max_output_tokens", "response_format": "text.format"}


def _as_responses_error(exc: APIError) -> APIError:
    """``exc`` with the Responses field names in its ``param`` and message (others unchanged)."""
    err = exc.body.error
    if err.param not in _CHAT_TO_RESPONSES:
        return exc
    param = _CHAT_TO_RESPONSES[err.param]
    message = err.message.replace(err.param, param)
    return APIError(exc.status, message, param=param, code=err.code, type=err.type, headers=exc.headers)


def _id_header(body: ResponsesRequest, rid: str) -> dict[str, str]:
    """Names a stored response's id for the router's affinity (:mod:`kvfleet.runtime.router.response_affinity`)."""
    return {"x-kvfleet-response-id": rid} if body.store else {}


def _merge_call(calls: dict[int, dict[str, Any]], tc: dict[str, Any]) -> None:
    """Fold one streamed ``tool_calls`` delta into the full call it belongs to."""
    call = calls.setdefault(
        tc.get("index", 0), {"id": None, "type": "function", "function": {"name": None, "arguments": ""}}
    )
    if tc.get("id"):
        call["id"] = tc["id"]
    fn = tc.get("function") or {}
    if fn.get("name"):
        call["function"]["name"] = fn["name"]
    call["function"]["arguments"] += fn.get("arguments") or ""


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message(msg_id: str, text: str, status: str) -> dict[str, Any]:
    content = [_text_part(text)] if status == "completed" else []
    return {"type": "message", "id": msg_id, "status": status, "role": "assistant", "content": content}


def _shell(body: ResponsesRequest, rid: str, model: str) -> dict[str, Any]:
    """The response object before its output (what ``response.created`` carries)."""
    return {
        "id": rid,
        "object": "response",
        "created_at": P.now(),
        "status": "in_progress",
        "model": model,
        "output": [],
        "error": None,
        "incomplete_details": None,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "tools": body.tools or [],
        "tool_choice": body.tool_choice or "auto",
        "parallel_tool_calls": bool(body.parallel_tool_calls),
        "text": body.text or {"format": {"type": "text"}},
        "previous_response_id": body.previous_response_id,
        "store": bool(body.store),
        "metadata": body.metadata or {},
        "usage": None,
        "background": False,
        "truncation": "disabled",
    }


def _final(shell: dict[str, Any], r: _Result, msg_id: str | None = None) -> dict[str, Any]:
    output: list[dict[str, Any]] = []
    if r.text or not r.tool_calls:
        output.append(_message(msg_id or P.random_id("msg"), r.text, "completed"))
    for call in r.tool_calls:
        fn = call["function"]
        output.append(
            {
                "type": "function_call",
                "id": P.random_id("fc"),
                "call_id": call["id"],
                "name": fn["name"],
                "arguments": fn["arguments"],
                "status": "completed",
            }
        )
    incomplete = r.finish_reason == "length"
    u = r.usage
    usage = {
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u.total_tokens,
    }
    return {
        **shell,
        "status": "incomplete" if incomplete else "completed",
        "output": output,
        "usage": usage,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
    }


def responses_router(auth: Sequence[Any], parse_body: Callable[[Request, type], Awaitable[Any]]) -> APIRouter:
    """The three routes, with the app's API-key dependency ``auth`` and body parser ``parse_body``."""
    router = APIRouter()

    def serving(request: Request) -> OpenAIServingResponses:
        return request.app.state.serving_responses

    schema = {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": ResponsesRequest.model_json_schema()}},
        }
    }

    @router.post("/v1/responses", dependencies=list(auth), openapi_extra=schema, summary="Create a response")
    async def create_response(request: Request):
        body = await parse_body(request, ResponsesRequest)
        return await serving(request).create(body, request)

    @router.get("/v1/responses/{response_id}", dependencies=list(auth), summary="Retrieve a stored response")
    async def retrieve_response(request: Request, response_id: str):
        return serving(request).retrieve(response_id)

    @router.delete("/v1/responses/{response_id}", dependencies=list(auth), summary="Delete a stored response")
    async def delete_response(request: Request, response_id: str):
        return serving(request).delete(response_id)

    return router
