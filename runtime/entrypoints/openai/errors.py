"""Errors in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, never FastAPI's 422.

:class:`APIError` carries an HTTP status and the body; :func:`add_exception_handlers` makes every
error of an app answer that way (validation errors 400, unknown routes 404, wrong methods 405,
anything unexpected 500). :func:`engine_error` maps what the engine raised to the right status.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvfleet.runtime.engine.outputs import RequestOutput
from kvfleet.runtime.entrypoints.openai import protocol as P
from kvfleet.runtime.http.errors import error_response, error_type
from kvfleet.runtime.lora_request import LoRANotFoundError

logger = logging.getLogger("kvfleet.server")

T = TypeVar("T")


class APIError(Exception):
    """An error answered in OpenAI's shape with HTTP ``status``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.body = P.ErrorResponse(
            error=P.ErrorInfo(
                message=message,
                type=type or error_type(status),
                param=param,
                code=code,
            )
        )
        self.headers = headers

    def response(self) -> JSONResponse:
        e = self.body.error
        return error_response(self.status, e.message, e.type, e.code, param=e.param, headers=self.headers)


def bad_request(exc: P.ProtocolError) -> APIError:
    return APIError(400, str(exc), param=exc.param, code=exc.code or "invalid_value")


def checked(fn: Callable[[], T]) -> T:
    """``fn()``, a :class:`~kvfleet.runtime.entrypoints.openai.protocol.ProtocolError` it raises answered as a 400."""
    try:
        return fn()
    except P.ProtocolError as exc:
        raise bad_request(exc) from None


def validation_error(exc: ValidationError | RequestValidationError) -> APIError:
    """A pydantic/FastAPI validation error as a 400 naming the first offending field."""
    errors = exc.errors()
    parts, params = [], []
    for err in errors:
        loc = [str(x) for x in err.get("loc", ()) if x not in ("body",)]
        # union members show up as extra loc items like "str" or "list[int]"; keep field names.
        loc = [x for x in loc if not any(c in x for c in "[]") and x not in ("str", "int", "float", "bool")]
        name = ".".join(loc)
        if name not in params:
            params.append(name)
            parts.append(f"{name}: {err.get('msg')}" if name else str(err.get("msg")))
    message = "; ".join(parts) or "invalid request"
    return APIError(400, message, param=params[0] if params else None, code="invalid_type")


class GenerationError(RuntimeError):
    """The engine finished a request with an internal error (``RequestOutput.extra["error"]``)."""


def raise_for_error(out: RequestOutput) -> None:
    error = (out.extra or {}).get("error")
    if error:
        raise GenerationError(f"request {out.request_id} failed in the engine: {error}")


_REQUEST_FIELDS = frozenset(P.CompletionRequest.model_fields) | frozenset(P.ChatCompletionRequest.model_fields)


def engine_error(exc: BaseException, *, engine_dead: bool) -> APIError:
    """What generation raised, as an answer: the engine's input errors (ValueError) 400, a dead
    engine 503, anything else 500."""
    if isinstance(exc, LoRANotFoundError):  # an adapter unloaded while the request was on its way
        return APIError(404, str(exc), param="model", code="model_not_found")
    if isinstance(exc, ValueError):  # the engine's messages start with the field they refuse
        first = str(exc).split(" ", 1)[0]
        first = {"resume_output_ids": "kvfleet_resume"}.get(first, first)  # the engine's name of the router's field
        return APIError(400, str(exc), param=first if first in _REQUEST_FIELDS else None, code="invalid_value")
    logger.error("generation failed: %r", exc, exc_info=exc)
    if engine_dead:
        return APIError(503, f"the engine died: {exc}", code="engine_dead")
    return APIError(500, f"generation failed: {type(exc).__name__}: {exc}", code="internal_error")


async def _api_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return exc.response()


async def _request_validation(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return validation_error(exc).response()


async def _http_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    return APIError(exc.status_code, str(exc.detail), code=code, headers=getattr(exc, "headers", None)).response()


async def _internal(_: Request, exc: Exception) -> JSONResponse:
    logger.exception("internal error")
    return APIError(500, f"internal server error: {type(exc).__name__}", code="internal_error").response()


def add_exception_handlers(app: FastAPI) -> None:
    """Every error of ``app`` in OpenAI's shape."""
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _request_validation)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _internal)
