"""The hold queue: requests that arrive while no replica is available wait here, in arrival
order, until one is (scale from zero, every replica restarting), or until their deadline.

Bounded (``max_pending``: one more is refused with :class:`QueueFull`, HTTP 429) and timed
(``pending_timeout`` seconds: :class:`PendingTimeout`, HTTP 503); :meth:`PendingQueue.close`
(the router's SIGTERM drain) answers every held request :class:`QueueClosed` (HTTP 503, retryable).
:meth:`PendingQueue.notify` wakes every waiter in FIFO order; a waiter that finds nothing
available after all (another took the endpoint's place, or it was ejected again) goes back to
the *head* of the queue, so arrival order holds. ``len(queue)`` is the
``kvfleet:router_pending_requests`` gauge the operator's autoscaler reads to scale from zero.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable


class QueueFull(Exception):
    """``max_pending`` requests are already held."""


class PendingTimeout(Exception):
    """No replica became available within ``pending_timeout`` seconds."""


class QueueClosed(Exception):
    """The router is shutting down (:meth:`PendingQueue.close`): nothing more is held."""


class PendingQueue:
    """FIFO of held requests (see the module docstring).

    Args:
        max_pending: most requests held at once (>= 0; 0 holds none: 429 at once).
        pending_timeout: seconds one request may be held in total.
    """

    def __init__(self, max_pending: int = 1024, pending_timeout: float = 300.0):
        self.max_pending = max_pending
        self.pending_timeout = pending_timeout
        self._waiters: deque[asyncio.Future] = deque()
        self.closed = False

    def __len__(self) -> int:
        return len(self._waiters)

    async def hold(self, available: Callable[[], bool], deadline: float | None = None) -> float:
        """Wait until ``available()`` is true. Returns the deadline (loop time) so that a caller
        holding again for the same request keeps its original one.

        Raises: QueueFull, PendingTimeout, QueueClosed.
        """
        loop = asyncio.get_running_loop()
        if self.closed:
            raise QueueClosed()
        if available():  # e.g. an ejection ran out between the caller's look and this call
            return deadline if deadline is not None else loop.time() + self.pending_timeout
        if deadline is None:
            if len(self._waiters) >= self.max_pending:
                raise QueueFull()
            deadline = loop.time() + self.pending_timeout
        fut = loop.create_future()
        self._waiters.append(fut)
        try:
            while True:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise PendingTimeout()
                await asyncio.wait([fut], timeout=remaining)
                if not fut.done():
                    raise PendingTimeout()
                if self.closed:
                    raise QueueClosed()
                if available():
                    return deadline
                fut = loop.create_future()
                self._waiters.appendleft(fut)
        finally:
            if fut in self._waiters:
                self._waiters.remove(fut)

    def close(self) -> None:
        """Hold nothing more: every held request and every later :meth:`hold` raises QueueClosed."""
        self.closed = True
        self.notify()

    def notify(self) -> None:
        """Wake every held request, oldest first."""
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
