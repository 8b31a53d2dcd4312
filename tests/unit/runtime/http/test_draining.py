"""runtime/http/draining.py: the draining uvicorn server and the in-flight middleware, over a
recording drain (each front end's own policy is tested beside it: router/test_shutdown.py,
entrypoints/openai/test_lifecycle.py)."""

import asyncio
import signal

import pytest
import uvicorn
from starlette.responses import PlainTextResponse

from kvfleet.runtime.http.draining import DrainingServer, InFlightMiddleware


class RecordingDrain:
    def __init__(self, stop_after: int = 2):
        self.in_flight, self.signals, self.polls, self.stop_after = 0, [], 0, stop_after

    @property
    def draining(self) -> bool:
        return bool(self.signals)

    def start(self, sig: int) -> None:
        self.signals.append(sig)

    async def poll(self) -> bool:
        self.polls += 1
        return self.polls >= self.stop_after


async def _app(scope, receive, send):
    await PlainTextResponse("ok")(scope, receive, send)


@pytest.mark.parametrize("exit_by_signal", [True, False])
def test_the_first_signal_drains_the_second_stops(exit_by_signal):
    drain = RecordingDrain()
    server = DrainingServer(uvicorn.Config(_app), drain, exit_by_signal=exit_by_signal)
    server.handle_exit(signal.SIGTERM, None)
    assert drain.signals == [signal.SIGTERM] and not server.should_exit
    assert server._captured_signals == ([signal.SIGTERM] if exit_by_signal else [])
    assert asyncio.run(server.on_tick(1)) is False and asyncio.run(server.on_tick(2)) is True
    server.handle_exit(signal.SIGTERM, None)  # a second signal: uvicorn's own exit
    assert server.should_exit and drain.signals == [signal.SIGTERM]


def test_no_poll_before_a_signal():
    drain = RecordingDrain(stop_after=1)
    server = DrainingServer(uvicorn.Config(_app), drain, exit_by_signal=False)
    assert asyncio.run(server.on_tick(1)) is False and drain.polls == 0


def test_the_middleware_counts_selected_paths_and_refuses_while_draining():
    drain, refused, seen = RecordingDrain(), [], []

    async def app(scope, receive, send):
        seen.append(drain.in_flight)
        await _app(scope, receive, send)

    mw = InFlightMiddleware(app, drain, lambda p: p.startswith("/v1/"),
                            lambda: PlainTextResponse("no", status_code=503), lambda: refused.append(1))
    sent = []

    async def send(message):
        sent.append(message)

    async def receive():
        return {"type": "http.request", "body": b""}

    def call(path):
        sent.clear()
        asyncio.run(mw({"type": "http", "path": path, "method": "GET", "headers": []}, receive, send))
        return sent[0]["status"]

    assert call("/v1/x") == 200 and seen == [1] and drain.in_flight == 0
    assert call("/ready") == 200 and seen == [1, 0]  # not counted
    drain.start(signal.SIGTERM)
    assert call("/v1/x") == 503 and refused == [1] and seen == [1, 0]
    assert call("/health") == 200  # probes still answer while draining
