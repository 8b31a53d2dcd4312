"""The replicas the router knows: their URLs, readiness, load and ejection back-off.

:class:`EndpointPool` is plain state, changed from one event loop (the probe loop, the request
path, the endpoint source); nothing here does I/O. An endpoint is *available* when its last probe
said ready and it is not ejected. A request-path failure (connect error, 503 before the first
byte) ejects it for ``eject_base * 2**(failures - 1)`` seconds, at most ``eject_max`` (as Envoy's
outlier detection does); a success resets the count. Listeners registered with
:meth:`EndpointPool.on_available` are called whenever some endpoint may have become available
(the hold queue wakes its waiters then).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kvfleet.runtime.router.picker import Candidate


@dataclass
class Endpoint:
    """One replica. ``url`` is its base URL (``http://10.0.0.7:8000``, no trailing slash)."""

    url: str
    ready: bool = False
    """The last probe's answer (``GET /ready`` == 200)."""
    in_flight: int = 0
    """Requests this router sent to it that have not finished."""
    waiting: float = 0.0
    """``num_requests_waiting`` at the last ``/metrics`` scrape."""
    running: float = 0.0
    """``num_requests_running`` at the last scrape."""
    kv_cache_usage: float = 0.0
    """``kv_cache_usage_perc`` (0..1) at the last scrape."""
    foreign: float = 0.0
    """``running + waiting`` at the last scrape minus this router's in-flight requests then."""
    failures: int = 0
    """Consecutive request-path failures."""
    ejected_until: float = 0.0
    """Clock time (``time.monotonic``) until which it gets no requests."""

    def candidate(self) -> Candidate:
        return Candidate(self.url, self.in_flight, self.foreign, self.kv_cache_usage)


class EndpointPool:
    """The set of endpoints and their state.

    Args:
        eject_base: seconds of the first ejection (> 0).
        eject_max: longest ejection, seconds.
        clock: monotonic seconds (tests pass their own).
    """

    def __init__(self, *, eject_base: float = 1.0, eject_max: float = 30.0,
                 clock: Callable[[], float] = time.monotonic):
        self.eject_base = eject_base
        self.eject_max = eject_max
        self.clock = clock
        self._by_url: dict[str, Endpoint] = {}
        self._listeners: list[Callable[[], None]] = []
        self._changed: list[Callable[[], None]] = []

    # ---------------------------------------------------------------- membership

    def set_urls(self, urls: Iterable[str]) -> None:
        """Make the pool hold exactly ``urls``; state of kept endpoints is kept, new ones start
        not ready until probed."""
        wanted = [u.rstrip("/") for u in urls]
        for url in list(self._by_url):
            if url not in wanted:
                del self._by_url[url]
        added = False
        for url in wanted:
            if url not in self._by_url:
                self._by_url[url] = Endpoint(url)
                added = True
        if added:
            for cb in self._changed:
                cb()

    def urls(self) -> list[str]:
        return list(self._by_url)

    def get(self, url: str) -> Endpoint | None:
        return self._by_url.get(url)

    def __iter__(self):
        return iter(list(self._by_url.values()))

    def __len__(self) -> int:
        return len(self._by_url)

    # ---------------------------------------------------------------- availability

    def available(self, exclude: Iterable[str] = ()) -> list[Endpoint]:
        """Endpoints that may take a request now, minus ``exclude`` (URLs already tried)."""
        now = self.clock()
        skip = set(exclude)
        return [e for e in self._by_url.values() if e.ready and e.ejected_until <= now and e.url not in skip]

    def is_ejected(self, ep: Endpoint) -> bool:
        return ep.ejected_until > self.clock()

    def on_available(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` whenever an endpoint may have become available."""
        self._listeners.append(callback)

    def on_added(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` when new endpoints join (the prober probes them at once)."""
        self._changed.append(callback)

    def _notify(self) -> None:
        for cb in self._listeners:
            cb()

    def set_probe(self, url: str, ready: bool, *, waiting: float | None = None, running: float | None = None,
                  kv_cache_usage: float | None = None) -> None:
        """Record a probe of ``url``: readiness and, when scraped, its load gauges."""
        ep = self._by_url.get(url)
        if ep is None:
            return
        was_available = ep.ready and not self.is_ejected(ep)
        ep.ready = ready
        if waiting is not None:
            ep.waiting = waiting
        if running is not None:
            ep.running = running
        if kv_cache_usage is not None:
            ep.kv_cache_usage = kv_cache_usage
        if waiting is not None or running is not None:
            ep.foreign = max(0.0, ep.running + ep.waiting - ep.in_flight)
        if ready and not was_available and not self.is_ejected(ep):
            self._notify()

    def eject(self, ep: Endpoint) -> float:
        """Eject ``ep`` after a failure; returns the back-off in seconds."""
        ep.failures += 1
        backoff = min(self.eject_max, self.eject_base * 2 ** (ep.failures - 1))
        ep.ejected_until = self.clock() + backoff
        return backoff

    def succeeded(self, ep: Endpoint) -> None:
        ep.failures = 0

    def end_ejections(self) -> None:
        """Notify listeners of endpoints whose ejection has run out (called by the probe loop)."""
        now = self.clock()
        if any(e.ready and 0 < e.ejected_until <= now for e in self._by_url.values()):
            for e in self._by_url.values():
                if e.ejected_until <= now:
                    e.ejected_until = 0.0
            self._notify()
