"""The router's SIGTERM drain: stop taking requests, let the ones in flight finish, exit 0.

- :class:`Drain`: whether the router drains (since when) and how many ``/v1`` requests it is
  answering (a stream counts until its last byte; a held request counts while it waits).
- :class:`DrainMiddleware` (ASGI): counts those requests; while draining a new one gets a
  retryable 503 (``shutting_down``, ``Retry-After: 1``, OpenAI's error shape), which the OpenAI
  and Anthropic SDKs retry, through the router Service, on another router.
- :class:`DrainingServer` (uvicorn): the first SIGTERM/SIGINT starts the drain (``/ready`` then
  says 503, held requests are answered 503 ``shutting_down`` at once since no replica has seen
  them); the server stops once nothing is in flight (the listener open at least
  :data:`LISTEN_GRACE` seconds, for clients whose endpoints are not updated yet) or once
  ``shutdown_timeout`` passes (then the remaining streams are cut). The process then exits 0;
  a second signal stops it at once. How clients see it: docs/routing.md, "Router restarts".
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from types import FrameType

import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send

from kvfleet.runtime.router.proxy import shutting_down_response

logger = logging.getLogger("kvfleet.router")

LISTEN_GRACE = 2.0
"""Seconds the listener stays open after SIGTERM even with nothing in flight (as the replicas'
drain): clients and kube-proxy still holding this pod's address get a retryable 503, not a
refused connection."""
CUT_GRACE = 1.0
"""Seconds uvicorn waits for the connections left once the drain ends, before cancelling them."""


class Drain:
    """The drain's state, shared by the middleware, ``/ready`` and the server."""

    def __init__(self, shutdown_timeout: float):
        self.shutdown_timeout = shutdown_timeout
        self.since: float | None = None
        self.in_flight = 0
        self._on_start: list[Callable[[], None]] = []

    @property
    def draining(self) -> bool:
        return self.since is not None

    def on_start(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` when the drain starts (e.g. release the held requests)."""
        self._on_start.append(callback)

    def start(self) -> None:
        if self.since is not None:
            return
        self.since = time.monotonic()
        logger.info("SIGTERM: draining %d requests (at most %g s)", self.in_flight, self.shutdown_timeout)
        for callback in self._on_start:
            callback()

    def done(self, now: float | None = None) -> bool:
        """Whether the drain is over: nothing in flight after the listen grace, or the timeout passed."""
        if self.since is None:
            return False
        elapsed = (time.monotonic() if now is None else now) - self.since
        if elapsed >= self.shutdown_timeout:
            if self.in_flight:
                logger.warning("shutdown_timeout (%g s) passed with %d requests in flight: cutting them",
                               self.shutdown_timeout, self.in_flight)
            return True
        if self.in_flight == 0 and elapsed >= min(LISTEN_GRACE, self.shutdown_timeout):
            logger.info("drained in %.1f s", elapsed)
            return True
        return False


class DrainMiddleware:
    """ASGI middleware: counts ``/v1`` requests in :attr:`Drain.in_flight`; refuses new ones while
    draining (calling ``on_refused`` for each, e.g. a metric)."""

    def __init__(self, app: ASGIApp, drain: Drain, on_refused: Callable[[], None] = lambda: None):
        self.app, self.drain, self.on_refused = app, drain, on_refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        if self.drain.draining:
            self.on_refused()
            await shutting_down_response()(scope, receive, send)
            return
        self.drain.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.in_flight -= 1


class DrainingServer(uvicorn.Server):
    """uvicorn whose first SIGTERM/SIGINT drains (module docstring); the exit status stays 0."""

    def __init__(self, config: uvicorn.Config, drain: Drain):
        config.timeout_graceful_shutdown = CUT_GRACE
        super().__init__(config)
        self.drain = drain

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.drain.draining or self.should_exit:
            super().handle_exit(sig, frame)  # a second signal: stop now
            return
        self.drain.start()  # not re-raised after shutdown: a finished drain exits 0

    async def on_tick(self, counter: int) -> bool:
        if await super().on_tick(counter):
            return True
        if self.drain.draining and counter % 10 == 0:
            logger.info("draining: %d requests in flight", self.drain.in_flight)
        return self.drain.done()
