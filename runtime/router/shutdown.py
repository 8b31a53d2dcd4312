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

The uvicorn server and the counting middleware are the server's too (:mod:`kvfleet.runtime.http.draining`);
this module holds the router's drain policy.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import uvicorn
from starlette.types import ASGIApp

from kvfleet.runtime.http import draining
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

    def start(self, sig: int | None = None) -> None:
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

    async def poll(self) -> bool:
        return self.done()


class DrainMiddleware(draining.InFlightMiddleware):
    """ASGI middleware: counts ``/v1`` requests in :attr:`Drain.in_flight`; refuses new ones while
    draining (calling ``on_refused`` for each, e.g. a metric)."""

    def __init__(self, app: ASGIApp, drain: Drain, on_refused: Callable[[], None] = lambda: None):
        super().__init__(app, drain, lambda path: path.startswith("/v1/"), shutting_down_response, on_refused)


class DrainingServer(draining.DrainingServer):
    """uvicorn whose first SIGTERM/SIGINT drains (module docstring); the exit status stays 0 (the
    signal is not re-raised after a finished drain)."""

    def __init__(self, config: uvicorn.Config, drain: Drain):
        config.timeout_graceful_shutdown = CUT_GRACE
        super().__init__(config, drain, exit_by_signal=False, log=logger)
