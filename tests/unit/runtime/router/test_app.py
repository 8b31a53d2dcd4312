"""The router's app (kvfleet.runtime.router.app) in process: a path or method it does not serve is
answered in OpenAI's error shape, as ``kvfleet serve`` answers it, not as Starlette's plain text."""

from __future__ import annotations

from starlette.testclient import TestClient

from kvfleet.runtime.router.app import create_app
from kvfleet.runtime.router.settings import parse_args


def test_unknown_path_and_method_are_openai_errors():
    app = create_app(parse_args(["--endpoints", "http://127.0.0.1:9", "--probe-interval", "60"], environ={}))
    with TestClient(app) as client:
        missing = client.post("/v2/completions", json={})
        assert missing.status_code == 404
        assert missing.json()["error"] == {"message": "Not Found", "type": "invalid_request_error",
                                           "param": None, "code": "not_found"}
        wrong = client.post("/health")
        assert wrong.status_code == 405 and wrong.json()["error"]["code"] == "method_not_allowed"
        assert "GET" in wrong.headers["allow"]
        assert client.get("/health").status_code == 200
