"""Reading and parsing a request body: the size limit (``max_request_body_size``; 413 before
anything is read when ``Content-Length`` says so, else as soon as the chunks pass it), UTF-8,
JSON into the route's protocol model, and the clear 400s (not JSON at all, a lone surrogate
escape in a string, naming the field).
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from kvfleet.runtime.entrypoints.openai.errors import APIError, validation_error

BodyT = TypeVar("BodyT", bound=BaseModel)


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, at most ``limit`` bytes: a larger ``Content-Length`` is refused before
    anything is read, a body without one (chunked) as soon as its chunks pass the limit (413)."""

    def too_large(size: str) -> APIError:
        return APIError(
            413,
            f"request body is {size} bytes, over the limit of {limit} bytes (max_request_body_size)",
            code="request_too_large",
        )

    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large(declared)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(f"more than {limit}")
        chunks.append(chunk)
    return b"".join(chunks)


async def parse_body(request: Request, model: type[BodyT], limit: int) -> BodyT:
    """The body as ``model``: UTF-8 JSON whatever the ``Content-Type``, at most ``limit`` bytes;
    anything else is a 400 (413 when too large)."""
    raw = await read_body(request, limit)
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise APIError(400, f"request body is not valid UTF-8: {exc}", code="invalid_encoding") from None
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        if any(err.get("type") == "json_invalid" for err in exc.errors()):
            _explain_invalid_json(raw)  # raises the clearer error when there is one
        raise validation_error(exc) from None


def _explain_invalid_json(raw: bytes) -> None:
    """Why pydantic's JSON parser refused ``raw``: not JSON at all (Python's parser says where),
    or JSON whose strings hold a lone surrogate escape (``"\\ud800"``), which is no Unicode
    text (it cannot be encoded as UTF-8) -- the error names the top-level field holding it."""
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # RecursionError: nesting deeper than the stack
        raise APIError(400, f"request body is not valid JSON: {exc}", code="invalid_json") from None
    for key, value in data.items() if isinstance(data, dict) else ():
        bad = _lone_surrogate(key)
        if bad is not None:  # never echoed back: it cannot be encoded in the answer either
            raise APIError(
                400,
                f"request body is not valid UTF-8 text: a field name contains a lone surrogate (\\u{ord(bad):04x})",
                code="invalid_encoding",
            )
        bad = _lone_surrogate(value)
        if bad is not None:
            raise APIError(
                400,
                f"{key} is not valid UTF-8 text: it contains a lone surrogate (\\u{ord(bad):04x}) that is not part "
                "of a surrogate pair",
                param=str(key),
                code="invalid_encoding",
            )


def _lone_surrogate(value: Any) -> str | None:
    """The first lone surrogate in a parsed JSON value's strings (keys included), or None."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError as exc:
                return v[exc.start]
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return None
