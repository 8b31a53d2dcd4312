"""The server's life around the engine: drain on SIGTERM, a stuck or dead engine, the termination log.

- :class:`DrainingServer` (uvicorn): the first SIGTERM/SIGINT starts a drain: ``/ready`` says 503,
  new generation requests get a retryable 503, the ones in flight finish (at most
  ``shutdown_timeout`` seconds, then the engine is shut down and their streams end with an error
  event). The streams a router asked token ids for are handed off instead, never cut: after
  ``drain_handoff_grace`` seconds (default :data:`~.serve_args.DEFAULT_DRAIN_HANDOFF_GRACE`; None:
  at ``shutdown_timeout``, whichever comes first) they end with a ``kvfleet_resume_elsewhere``
  error event, which the router migrates (docs/routing.md), also when the deadline stops the
  engine under them; after SIGTERM the listener stays open at least :data:`DRAIN_GRACE` seconds.
  Then uvicorn's own shutdown; a second signal skips the drain.
- :class:`InFlight` (ASGI middleware): counts generation requests in flight, refuses new ones while
  draining.
- :func:`engine_stalled`: the engine loop alive but its step heartbeat older than
  ``engine_iteration_timeout`` (``/health`` fails).
- :func:`report_fatal`: when the engine fails to load or (:func:`watch_engine`) its loop dies, the
  reason goes to the termination log (:func:`write_termination_log`), ``on_fatal`` ends the process.
The uvicorn server and the counting middleware are the router's too (:mod:`kvfleet.runtime.http.draining`);
this module holds the server's drain policy (:class:`ServerDrain`).
Why these bounds hold: docs/server.md, "Shutdown, probes and the termination log".
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from typing import TYPE_CHECKING

import uvicorn
from starlette.types import ASGIApp

from kvfleet.runtime.entrypoints.openai.errors import APIError
from kvfleet.runtime.http import draining
from kvfleet.runtime.model_errors import ModelLoadError, reason_for

if TYPE_CHECKING:
    from kvfleet.runtime.entrypoints.openai.serving_engine import ServerState

logger = logging.getLogger("kvfleet.server")

DRAIN_GRACE = 2.0
"""Seconds the listener stays open after SIGTERM even with nothing in flight (stale endpoints
still send a few requests; they get a retryable 503 rather than a refused connection)."""
DEFAULT_TERMINATION_LOG = "/dev/termination-log"
"""Kubernetes' ``terminationMessagePath`` default; written only where it exists (the kubelet mounts it)."""
TERMINATION_LOG_LIMIT = 4096
"""Kubernetes keeps at most 4096 bytes of a termination message."""
GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/embeddings"})
_OOM_MARKERS = ("out of memory", "can't allocate memory", "cannot allocate memory")


def shutting_down_error() -> APIError:
    return APIError(
        503, "the server is shutting down; retry on another replica", code="shutting_down", headers={"Retry-After": "1"}
    )


class InFlight(draining.InFlightMiddleware):
    """ASGI middleware: ``state.in_flight`` counts the generation requests being answered (a stream
    until its last byte); while ``state.draining`` a new one is answered 503 ``shutting_down``."""

    def __init__(self, app: ASGIApp, state: ServerState):
        super().__init__(app, ServerDrain(state), GENERATION_PATHS.__contains__,
                         lambda: shutting_down_error().response())


def engine_stalled(state: ServerState) -> str | None:
    """Why the engine counts as stuck (its loop alive, its heartbeat too old), or None."""
    engine = state.engine
    if engine is None or not engine.is_running:
        return None
    age, limit = engine.heartbeat_age, state.settings.engine_iteration_timeout
    if age <= limit:
        return None
    return f"the engine loop made no progress for {age:.1f} s (engine_iteration_timeout {limit:g} s)"


def not_ready(state: ServerState) -> str | None:
    """Why ``/ready`` says 503 (``dead``, ``loading``, ``draining``, ``stalled``), or None."""
    if state.engine_dead():
        return "dead"
    if state.loading:
        return "loading"
    if state.draining_since is not None:
        return "draining"
    return "stalled" if engine_stalled(state) else None


def is_out_of_memory(exc: BaseException) -> bool:
    """torch.OutOfMemoryError (CUDA), MemoryError, or a CPU allocator failure (a RuntimeError)."""
    if isinstance(exc, MemoryError) or any(c.__name__ == "OutOfMemoryError" for c in type(exc).__mro__):
        return True
    text = str(exc).lower()
    return any(m in text for m in _OOM_MARKERS)


def termination_message(exc: BaseException) -> str:
    """One line for the kubelet: ``out of memory: ...`` first when it is one (the operator's tuner
    looks for it), at most :data:`TERMINATION_LOG_LIMIT` bytes."""
    if isinstance(exc, ModelLoadError):  # the operator shows its reason as a condition
        return exc.line().encode("utf-8")[:TERMINATION_LOG_LIMIT].decode("utf-8", "ignore")
    reason = reason_for(exc)  # a bad GGUF file, a packed checkpoint kvfleet cannot read: the same
    if reason is not None:
        text = f"{reason}: {exc}".replace("\n", " ")
        return text.encode("utf-8")[:TERMINATION_LOG_LIMIT].decode("utf-8", "ignore")
    head = "out of memory" if is_out_of_memory(exc) else "the engine died"
    cls = type(exc)
    text = f"{head}: {cls.__module__}.{cls.__qualname__}: {exc}".replace("\n", " ")
    return text.encode("utf-8")[:TERMINATION_LOG_LIMIT].decode("utf-8", "ignore")


def write_termination_log(path: str | None, exc: BaseException) -> bool:
    """Write :func:`termination_message` to ``path`` (None: :data:`DEFAULT_TERMINATION_LOG`, only
    if it exists). Returns whether it was written; never raises."""
    if path is None:
        path = DEFAULT_TERMINATION_LOG
        if not os.path.exists(path):
            return False
    try:
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(termination_message(exc))
        return True
    except OSError:
        logger.warning("cannot write the termination log %s", path, exc_info=True)
        return False


def report_fatal(state: ServerState, error: BaseException) -> None:
    """The engine failed to load or died: the reason to the termination log, then ``state.on_fatal``
    (``main`` makes the process exit 1)."""
    if write_termination_log(state.settings.termination_log, error):
        logger.info("wrote the termination log: %s", termination_message(error)[:200])
    if state.on_fatal is not None:
        state.on_fatal()


async def watch_engine(state: ServerState, interval: float = 0.25) -> None:
    """Until the app stops: once the engine loop died, :func:`report_fatal` (a failed load is
    reported where it fails)."""
    while state.engine is None or state.engine.dead_error is None:
        await asyncio.sleep(interval)
    report_fatal(state, state.engine.dead_error)


class ServerDrain:
    """The server's drain policy (module docstring) over ``state``'s ``draining_since``,
    ``in_flight`` and ``handing_off``: the :class:`~kvfleet.runtime.http.draining.Drain` that
    :class:`DrainingServer` and :class:`InFlight` run."""

    def __init__(self, state: ServerState):
        self.state = state
        self._sigint = False

    @property
    def draining(self) -> bool:
        return self.state.draining_since is not None

    @property
    def in_flight(self) -> int:
        return self.state.in_flight

    @in_flight.setter
    def in_flight(self, value: int) -> None:
        self.state.in_flight = value

    def start(self, sig: int) -> None:
        self._sigint = sig == signal.SIGINT
        self.state.draining_since = time.monotonic()

    async def poll(self) -> bool:
        since = self.state.draining_since
        assert since is not None
        elapsed = time.monotonic() - since
        handoff = self.state.settings.drain_handoff_grace
        if handoff is not None and elapsed >= handoff and not self.state.handing_off:
            logger.info("drain hand-off: %d requests in flight resume elsewhere (router streams)", self.state.in_flight)
            self.state.handing_off = True
        grace = 0.0 if self._sigint else min(DRAIN_GRACE, self.state.settings.shutdown_timeout)
        if self.state.in_flight == 0 and elapsed >= grace:
            logger.info("drained in %.1f s", elapsed)
            return True
        if elapsed >= self.state.settings.shutdown_timeout:
            self.state.handing_off = True  # router streams cut by the engine's stop are handed off
            logger.warning(
                "shutdown_timeout (%g s) passed with %d requests in flight: stopping the engine (router streams "
                "resume elsewhere)",
                self.state.settings.shutdown_timeout,
                self.state.in_flight,
            )
            if self.state.engine is not None:
                await self.state.engine.shutdown()  # their streams end with an error event
            return True
        return False


class DrainingServer(draining.DrainingServer):
    """uvicorn, whose first SIGTERM/SIGINT drains (see the module docstring) before it shuts down;
    the signal is re-raised after shutdown (the process ends by it)."""

    def __init__(self, config: uvicorn.Config, state: ServerState):
        super().__init__(config, ServerDrain(state), exit_by_signal=True, log=logger)
        self.state = state
