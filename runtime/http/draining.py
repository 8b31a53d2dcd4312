"""The draining uvicorn server and in-flight counter both HTTP front ends run on.

- :class:`Drain` (protocol): what the front end drains -- ``draining``, ``in_flight``, ``start(sig)``
  (the first SIGTERM/SIGINT) and ``poll()`` (awaited every server tick while draining: True stops
  serving). The server's drain (engine hand-off, engine stop at the deadline) and the router's
  (held requests released, exit 0) implement it in their own modules.
- :class:`DrainingServer` (uvicorn): the first SIGTERM/SIGINT calls ``drain.start`` instead of
  stopping; the server stops once ``drain.poll()`` says so; a second signal stops it at once. With
  ``exit_by_signal`` the signal is re-raised after shutdown (the process ends by it, as uvicorn's
  own), else the process exits 0 after a finished drain.
- :class:`InFlightMiddleware` (ASGI): counts the requests ``counts(path)`` selects in
  ``drain.in_flight`` (a stream until its last byte) and answers new ones with ``refuse()`` while
  draining.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from types import FrameType
from typing import Protocol

import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send

logger = logging.getLogger("kvfleet.http")


class Drain(Protocol):
    in_flight: int

    @property
    def draining(self) -> bool: ...

    def start(self, sig: int) -> None: ...

    async def poll(self) -> bool: ...


class DrainingServer(uvicorn.Server):
    """uvicorn whose first SIGTERM/SIGINT drains (module docstring)."""

    def __init__(self, config: uvicorn.Config, drain: Drain, *, exit_by_signal: bool,
                 log: logging.Logger = logger):
        super().__init__(config)
        self.drain, self.exit_by_signal, self.log = drain, exit_by_signal, log

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.drain.draining or self.should_exit:
            super().handle_exit(sig, frame)  # a second signal: stop now
            return
        captured = getattr(self, "_captured_signals", None)
        if self.exit_by_signal and captured is not None:  # uvicorn re-raises it once shut down
            captured.append(sig)
        self.drain.start(sig)

    async def on_tick(self, counter: int) -> bool:
        if await super().on_tick(counter):
            return True
        if not self.drain.draining:
            return False
        if counter % 10 == 0:
            self.log.info("draining: %d requests in flight", self.drain.in_flight)
        return await self.drain.poll()


class InFlightMiddleware:
    """ASGI middleware: counts the requests ``counts(path)`` selects in ``drain.in_flight``; while
    draining answers a new one with ``refuse()`` (after ``on_refused()``, e.g. a metric)."""

    def __init__(self, app: ASGIApp, drain: Drain, counts: Callable[[str], bool],
                 refuse: Callable[[], ASGIApp], on_refused: Callable[[], None] = lambda: None):
        self.app, self.drain, self.counts, self.refuse, self.on_refused = app, drain, counts, refuse, on_refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.counts(scope["path"]):
            await self.app(scope, receive, send)
            return
        if self.drain.draining:
            self.on_refused()
            await self.refuse()(scope, receive, send)
            return
        self.drain.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.in_flight -= 1
