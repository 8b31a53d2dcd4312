"""The router's SIGTERM drain (kvfleet.runtime.router.shutdown) in the real app, in process: once
the drain starts ``/ready`` fails, a held request and a new one get the retryable 503
``shutting_down``, and the drain is over when nothing is in flight after the listen grace or
when ``shutdown_timeout`` passes. The real process and a real stream: tests/e2e/test_router_shutdown.py."""

from __future__ import annotations

import concurrent.futures
import time

from starlette.testclient import TestClient

from kvfleet.runtime.router.app import create_app
from kvfleet.runtime.router.settings import parse_args
from kvfleet.runtime.router.shutdown import LISTEN_GRACE, Drain

BODY = {"model": "m", "prompt": "hi", "max_tokens": 1}


def test_drain_refuses_new_and_held_requests_and_fails_readiness():
    # a replica that never answers its probe: requests are held
    app = create_app(parse_args(["--endpoints", "http://127.0.0.1:9", "--probe-interval", "0.05"], environ={}))
    state = app.state.router
    with TestClient(app) as client, concurrent.futures.ThreadPoolExecutor(1) as pool:
        assert client.get("/ready").json()["draining"] is False
        held = pool.submit(client.post, "/v1/completions", json=BODY)
        deadline = time.monotonic() + 10
        while len(state.pending) == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(state.pending) == 1 and state.drain.in_flight == 1
        assert not state.drain.done()
        client.portal.call(state.drain.start)  # what SIGTERM does, in the app's loop
        answer = held.result(timeout=10)
        assert answer.status_code == 503 and answer.headers["retry-after"] == "1"
        assert answer.json()["error"]["code"] == "shutting_down"
        ready = client.get("/ready")
        assert ready.status_code == 503 and ready.json()["draining"] is True
        new = client.post("/v1/chat/completions", json={"model": "m", "messages": []})
        assert new.status_code == 503 and new.json()["error"]["code"] == "shutting_down"
        assert client.get("/health").status_code == 200
        metrics = client.get("/metrics").text
        assert 'kvfleet:router_requests_total{endpoint="",outcome="shutting_down"} 2.0' in metrics
        assert state.drain.in_flight == 0 and len(state.pending) == 0
        since = state.drain.since
        assert not state.drain.done(now=since + LISTEN_GRACE / 2)  # the listener stays open a moment
        assert state.drain.done(now=since + LISTEN_GRACE)


def test_drain_ends_at_shutdown_timeout_with_requests_still_in_flight():
    drain = Drain(shutdown_timeout=10)
    assert not drain.done()
    drain.in_flight = 2
    drain.start()
    assert drain.draining
    assert not drain.done(now=drain.since + 9.9)
    assert drain.done(now=drain.since + 10)
    short = Drain(shutdown_timeout=0.5)  # a timeout under the listen grace bounds it too
    short.start()
    assert not short.done(now=short.since + 0.4) and short.done(now=short.since + 0.5)
