"""OpenAI's error body, ``{"error": {"message", "type", "param", "code"}}``, as both front ends send it:
as a JSON response (:func:`error_response`) or as one SSE event of a stream (:func:`error_event`).

:func:`error_type` is the ``type`` of a status when the caller names none (OpenAI's names: 4xx
``invalid_request_error``, 429 ``rate_limit_error``, 500 ``internal_server_error``, 503
``service_unavailable``, other 5xx ``server_error``).
"""

from __future__ import annotations

import json
from typing import Any

from starlette.responses import JSONResponse

_TYPES = {429: "rate_limit_error", 500: "internal_server_error", 503: "service_unavailable"}


def error_type(status: int) -> str:
    return _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")


def error_body(message: str, type_: str, *, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(status: int, message: str, type_: str | None = None, code: str | None = None, *,
                   param: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    """The error as a JSON response with ``status`` (``type_`` default: :func:`error_type`)."""
    body = error_body(message, type_ or error_type(status), param=param, code=code)
    return JSONResponse(body, status_code=status, headers=headers)


def error_event(message: str, type_: str, *, code: str | None = None) -> bytes:
    """The error as one SSE event (``data: {...}\\n\\n``): how a stream already under way fails."""
    return f"data: {json.dumps(error_body(message, type_, code=code))}\n\n".encode()
