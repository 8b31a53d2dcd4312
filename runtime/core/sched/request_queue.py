"""The scheduler's waiting queues, one per scheduling policy, behind one protocol.

``fcfs``: arrival order, a preempted request back at the head. ``priority``: lowest
``priority`` first, then arrival (vLLM's semantics). ``fair``: round robin between tenants
with waiting work, FCFS within a tenant. ``create_request_queue(policy)`` is the factory.
Torch-free.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict, deque
from collections.abc import Iterator
from typing import Protocol

from kvfleet.runtime.core.request import Request


class RequestQueue(Protocol):
    """What the scheduler needs of a waiting queue."""

    def add(self, r: Request) -> None: ...
    def prepend(self, r: Request) -> None: ...
    def peek(self) -> Request: ...
    def pop(self) -> Request: ...
    def take(self, r: Request) -> None: ...
    def remove(self, r: Request) -> None: ...
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[Request]: ...


class FCFSQueue:
    """First come, first served; preempted requests go back to the head."""

    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def add(self, r: Request) -> None:
        self._q.append(r)

    def prepend(self, r: Request) -> None:
        self._q.appendleft(r)

    def peek(self) -> Request:
        return self._q[0]

    def pop(self) -> Request:
        return self._q.popleft()

    def take(self, r: Request) -> None:
        """Dequeue ``r`` for admission (``pop`` when it is the head)."""
        if self._q[0] is r:
            self._q.popleft()
        else:
            self._q.remove(r)

    def remove(self, r: Request) -> None:
        self._q.remove(r)

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self):
        return iter(self._q)


class PriorityQueue:
    """Lowest ``priority`` first, then earliest arrival (vLLM's semantics)."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._counter = itertools.count()

    def add(self, r: Request) -> None:
        heapq.heappush(self._heap, (r.priority, r.arrival_time, next(self._counter), r))

    prepend = add  # a preempted request's (priority, arrival) already puts it in front

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def take(self, r: Request) -> None:
        """Dequeue ``r`` for admission (``pop`` when it is the head)."""
        if self._heap[0][3] is r:
            heapq.heappop(self._heap)
        else:
            self.remove(r)

    def remove(self, r: Request) -> None:
        self._heap = [e for e in self._heap if e[3] is not r]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self):
        return (e[3] for e in sorted(self._heap))


class FairQueue:
    """Round-robin between tenants with waiting work; FCFS within a tenant.

    A tenant with many queued requests gets one admission per turn, so another tenant's
    single request waits for at most one admission per other active tenant.
    """

    def __init__(self) -> None:
        self._tenants: OrderedDict[str, deque[Request]] = OrderedDict()
        self._len = 0

    @staticmethod
    def _key(r: Request) -> str:
        return r.tenant or ""

    def add(self, r: Request) -> None:
        self._tenants.setdefault(self._key(r), deque()).append(r)
        self._len += 1

    def prepend(self, r: Request) -> None:
        key = self._key(r)
        if key not in self._tenants:
            self._tenants[key] = deque()
        self._tenants[key].appendleft(r)
        self._tenants.move_to_end(key, last=False)
        self._len += 1

    def peek(self) -> Request:
        return next(iter(self._tenants.values()))[0]

    def pop(self) -> Request:
        key, q = next(iter(self._tenants.items()))
        r = q.popleft()
        self._len -= 1
        if q:
            self._tenants.move_to_end(key)  # this tenant's turn is over
        else:
            del self._tenants[key]
        return r

    def take(self, r: Request) -> None:
        """Dequeue ``r`` for admission: its tenant's turn is over, as with ``pop``."""
        key = self._key(r)
        q = self._tenants[key]
        q.remove(r)
        self._len -= 1
        if q:
            self._tenants.move_to_end(key)
        else:
            del self._tenants[key]

    def remove(self, r: Request) -> None:
        key = self._key(r)
        q = self._tenants[key]
        q.remove(r)
        self._len -= 1
        if not q:
            del self._tenants[key]

    def __len__(self) -> int:
        return self._len

    def __iter__(self):
        for q in self._tenants.values():
            yield from q


POLICIES = {"fcfs": FCFSQueue, "priority": PriorityQueue, "fair": FairQueue}
"""Scheduling policy name (``EngineConfig.scheduling_policy``) -> waiting-queue class."""


def create_request_queue(policy: str) -> RequestQueue:
    """A new, empty waiting queue for ``policy`` (``fcfs``, ``priority`` or ``fair``).

    Raises:
        ValueError: ``policy`` is not one of :data:`POLICIES`.
    """
    try:
        return POLICIES[policy]()
    except KeyError:
        raise ValueError(f"unknown scheduling_policy {policy!r}; expected one of {sorted(POLICIES)}") from None


