"""runtime/http/errors.py: OpenAI's error body as a response and as an SSE event."""

import json

import pytest

from kvfleet.runtime.http.errors import error_body, error_event, error_response, error_type


@pytest.mark.parametrize(("status", "kind"), [(400, "invalid_request_error"), (401, "invalid_request_error"),
                                              (429, "rate_limit_error"), (500, "internal_server_error"),
                                              (502, "server_error"), (503, "service_unavailable")])
def test_error_type(status, kind):
    assert error_type(status) == kind


def test_error_response_is_openais_shape():
    r = error_response(503, "busy", None, "shutting_down", headers={"Retry-After": "1"})
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert json.loads(r.body) == {"error": {"message": "busy", "type": "service_unavailable", "param": None,
                                            "code": "shutting_down"}}
    assert error_body("m", "t", param="p")["error"] == {"message": "m", "type": "t", "param": "p", "code": None}


def test_error_event_is_one_sse_event():
    raw = error_event("gone", "server_error", code="migration_failed")
    assert raw.startswith(b"data: ") and raw.endswith(b"\n\n") and raw.count(b"\n\n") == 1
    assert json.loads(raw[6:])["error"]["code"] == "migration_failed"
