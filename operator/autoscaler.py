"""The operator's autoscaler: one operator-wide loop that scales and tunes InferenceServices
from the pods' live metrics. Thin: read the cluster, call the pure :mod:`kvfleet.operator.policy`
and :mod:`kvfleet.operator.tuning`, write the result.

- :func:`autoscaled_index` (a kopf index, no finalizer) holds the InferenceServices in mode
  ``operator`` or with ``spec.tuning.enabled`` (and, once more, those to retire:
  :func:`kvfleet.operator.autoscale_step.tracked`);
- :class:`AutoscalerLoop` (started and stopped by kopf startup/cleanup handlers) runs one
  iteration (:func:`kvfleet.operator.autoscale_step.step`: read, decide, write) for each every
  ``intervalSeconds`` (``$KVFLEET_AUTOSCALER_INTERVAL`` overrides); one object's failure is
  logged and retried, the others go on;
- while kopf peering pauses this operator (:func:`kvfleet.operator.peering.pause_reason`) the
  loop acts on nothing.

Mode ``hpa`` is not in the loop (the HPA is a child: :func:`builders.build_hpa`). See docs/autoscaling.md.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Mapping
from typing import Any

import httpx
import kopf

from kvfleet.operator import autoscale_step, crd, peering
from kvfleet.operator.autoscale_step import ServiceState, interval_seconds, tracked
from kvfleet.operator.kube import ApiError, Kube, make_kube

log = logging.getLogger(__name__)


INDEX = "autoscaled"
"""The kopf index of the InferenceServices the loop works on: ``{(namespace, name): uid}``
(kopf passes it to handlers as the keyword argument of that name)."""
TICK = 1.0
"""Longest sleep of the loop (seconds): how soon a newly indexed InferenceService is visited."""
PEERING_TTL = TICK
"""Seconds a "not paused" answer of :func:`peering.pause_reason` is reused: the peering object is
read at most once per this time, however many objects fall due in it (their due times
spread out, so without it every object's iteration would cost one more API read). With
one object, or intervals longer than this, every iteration still checks first."""
MAX_CONCURRENT = 8
"""Iterations run at the same time (each waits on API calls and metrics scrapes)."""


@kopf.index(crd.GROUP, crd.VERSION, crd.PLURAL, id=INDEX, when=tracked)
def autoscaled_index(namespace: str, name: str, uid: str, **_: Any) -> dict[tuple[str, str], str]:
    """Index the InferenceServices the loop works on (filter :func:`tracked`). kopf keeps
    the index from its watch, drops an object when it is deleted or stops matching, and
    needs no finalizer for indices."""
    return {(namespace, name): uid}


class AutoscalerLoop:
    """One loop for the whole operator: every InferenceService in ``index`` gets
    :func:`autoscale_step.step` every ``interval`` seconds, with its own :class:`ServiceState`.

    - Objects are visited concurrently (at most :data:`MAX_CONCURRENT` at once), each as
      its own task: a slow or failing one (API error, bad metrics, a bug) is logged and
      retried after the interval; the others go on.
    - Per iteration of one object: a GET of it, a LIST of its pods, a scrape of each ready
      pod (or one Prometheus query), and for mode ``operator`` a LIST of the namespace's
      HPAs; writes only on a change. Per pass: at most one read of the peering object per
      :data:`PEERING_TTL` (one per namespace for a namespaced operator).
    - State is dropped for objects that leave the index (deleted, no longer autoscaled or
      tuned; :func:`autoscale_step.step` has set ``ScalingActive=False`` before that).
    - Before starting iterations it asks :func:`peering.pause_reason`; while the operator is
      paused by peering it starts none, cancels those in flight and forgets all state (as a
      restart would: the history is seeded afresh on resume).

    Args:
        kube: the API client.
        index: kopf's index :data:`INDEX` (a live, read-only mapping ``(namespace, name) -> uids``).
        settings: kopf's settings (peering name, priority, mode).
        identity: this operator's kopf peering identity (None: unknown, see :func:`peers_ahead`).
        logger: where to log.
    """

    def __init__(self, kube: Kube, index: Mapping[tuple[str, str], Any], settings: kopf.OperatorSettings,
                 identity: str | None, logger: logging.Logger):
        self.kube, self.index, self.settings, self.identity, self.logger = kube, index, settings, identity, logger
        self.states: dict[tuple[str, str], ServiceState] = {}
        self.running: dict[tuple[str, str], asyncio.Task[None]] = {}
        self.paused: str | None = None
        self.recheck_at = 0.0
        """``time.monotonic()`` before which :func:`peering.pause_reason` is not asked again (paused:
        the shortest interval; not paused: :data:`PEERING_TTL`)."""
        self.http = httpx.AsyncClient()
        self._limit = asyncio.Semaphore(MAX_CONCURRENT)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self.run(), name="kvfleet autoscaler loop")

    async def stop(self) -> None:
        """Stop the loop and the iterations in flight; close the HTTP client."""
        tasks = [t for t in [self._task, *self.running.values()] if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.running.clear()
        await self.http.aclose()

    async def run(self) -> None:
        while True:
            try:
                await self.tick()
            except Exception:
                self.logger.exception("autoscaler loop")
            await asyncio.sleep(self._sleep())

    def _sleep(self) -> float:
        now = time.monotonic()
        waits = [st.due - now for key, st in self.states.items() if key not in self.running]
        if self.paused:
            waits.append(self.recheck_at - now)
        return max(0.05, min([TICK, *waits]))

    def _forget(self, key: tuple[str, str]) -> None:
        self.states.pop(key, None)
        task = self.running.pop(key, None)
        if task is not None:
            task.cancel()

    async def tick(self) -> None:
        """One pass: drop what left the index, check peering, start the due iterations."""
        keys = set(self.index)
        for key in [k for k in self.states if k not in keys]:
            self._forget(key)
        now = time.monotonic()
        due = [k for k in sorted(keys) if k not in self.running
               and (k not in self.states or self.states[k].due <= now)]
        if not due:
            return
        if now >= self.recheck_at:
            try:
                reason = await asyncio.to_thread(peering.pause_reason, self.kube, self.settings, self.identity,
                                                 {ns for ns, _ in keys})
            except ApiError as e:
                reason = f"the peering object could not be read: {e}"
            if reason:
                if reason != self.paused:
                    self.logger.info("autoscaler paused: %s", reason)
                recheck = min([st.interval for st in self.states.values()] or [_default_interval()])
                for key in list(self.states):
                    self._forget(key)
                self.paused, self.recheck_at = reason, now + recheck
                return
            if self.paused:
                self.logger.info("autoscaler resumed")
                self.paused = None
            self.recheck_at = now + PEERING_TTL
        elif self.paused:
            return
        for key in due:
            state = self.states.setdefault(key, ServiceState(http=self.http, interval=_default_interval()))
            self.running[key] = asyncio.create_task(self._iterate(key, state), name=f"autoscaler {key[0]}/{key[1]}")

    async def _iterate(self, key: tuple[str, str], state: ServiceState) -> None:
        namespace, name = key
        try:
            async with self._limit:
                try:
                    delay = await autoscale_step.step(self.kube, namespace, name, state, self.logger)
                except (ApiError, httpx.HTTPError, OSError) as e:
                    self.logger.warning("autoscaler of %s/%s: %s", namespace, name, e)
                    delay = state.interval
                except Exception:
                    self.logger.exception("autoscaler of %s/%s", namespace, name)
                    delay = state.interval
            state.interval = delay
            state.due = time.monotonic() + delay
        finally:
            if self.running.get(key) is asyncio.current_task():
                del self.running[key]


def _default_interval() -> float:
    """The interval before an object's spec is known: ``$KVFLEET_AUTOSCALER_INTERVAL``, else 15 s."""
    return interval_seconds(None)


@kopf.on.startup(id="autoscaler-start")
async def start_autoscaler(memo: Any, settings: kopf.OperatorSettings, logger: logging.Logger,
                           **kwargs: Any) -> None:
    """Start the loop (after :func:`kvfleet.operator.handlers.configure`, which made ``memo.kube``).

    The peering identity comes from ``memo.peering_identity`` (``kvfleet operator`` passes
    the same value to ``kopf.run(identity=...)``), else ``$POD_ID`` (what kopf itself uses)."""
    kube = getattr(memo, "kube", None)
    if kube is None:
        kube = memo.kube = make_kube()
    identity = getattr(memo, "peering_identity", None) or os.environ.get("POD_ID")
    loop = memo.autoscaler = AutoscalerLoop(kube, kwargs[INDEX], settings, identity, log)
    loop.start()
    logger.info("autoscaler loop started (peering identity %s)", identity or "unknown")


@kopf.on.cleanup(id="autoscaler-stop")
async def stop_autoscaler(memo: Any, **_: Any) -> None:
    """Stop the loop when the operator stops."""
    loop = getattr(memo, "autoscaler", None)
    if loop is not None:
        await loop.stop()
