"""Live tuning of an InferenceService's engine (``spec.tuning``): pure functions of plain data.

:func:`tune` chooses ``gpuMemoryUtilization`` (lowered at once after an out-of-memory restart,
raised after sustained preemption pressure) and ``blockSize`` (from the mean sequence length)
for the next rollout, and :func:`rollout_hold` says when a rollout must wait (one at a time;
never every pod at once). Like :mod:`kvfleet.operator.policy`: no API calls, no clock, no I/O;
the time comes in as ``now`` and the tuner's memory (:class:`TuningState`, persisted in
``status.engine``) goes in and comes back out as a value.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from kvfleet.operator import crd_schema, spec_view
from kvfleet.operator.pod_metrics import MetricsAggregate
from kvfleet.operator.times import parse_time, rfc3339


@dataclass(frozen=True)
class TuningConfig:
    """``spec.tuning`` with its defaults."""

    enabled: bool = False
    min_gpu_memory_utilization: float = 0.5
    max_gpu_memory_utilization: float = 0.95
    step: float = 0.05
    """One raise or lower of gpuMemoryUtilization (fraction of GPU memory)."""
    block_sizes: tuple[int, ...] = (16, 32)
    """Block sizes the tuner may choose from, tokens (the CRD's default)."""
    min_interval: float = 600.0
    """Minimum seconds between two changes (each one rolls the pods)."""
    oom_cooldown: float = 3600.0
    """Seconds after an out-of-memory restart during which utilisation is not raised."""
    preemption_rate_threshold: float = 0.05
    """Preemptions per second (fleet-wide) that count as "frequent"."""
    kv_usage_threshold: float = 0.95
    """Mean KV usage (0-1) that counts as "near 1"."""
    sustain: float = 120.0
    """Seconds the raise condition must hold without a break (hysteresis)."""
    min_requests: int = 100
    """Finished requests the length distribution needs before block size is chosen."""
    block_size_hysteresis: float = 0.25
    """Relative band around the observed length within which the current block size is kept."""
    tokens_per_block: float = 16.0
    """Block size is chosen as the largest allowed value <= mean sequence length / this."""

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any] | None) -> TuningConfig:
        """``spec.tuning`` given as a dict in the CRD's spelling (None or {}: disabled):
        :meth:`from_view` of its view."""
        return cls.from_view(spec_view.section(crd_schema.TUNING, spec))

    @classmethod
    def from_view(cls, t: spec_view.Tuning) -> TuningConfig:
        """The typed view's ``spec.tuning`` (the CRD's defaults already in it); the knobs the CRD
        does not expose keep the class defaults. Raises ValueError as :meth:`from_spec`."""
        g = t.gpu_memory_utilization
        lo, hi, step = float(g.min), float(g.max), float(g.step)
        if not (0 < lo <= hi <= 1) or step <= 0:
            raise ValueError(f"need 0 < min <= max <= 1 and step > 0 for gpuMemoryUtilization, got {lo}, {hi}, {step}")
        sizes = tuple(sorted({int(s) for s in (t.block_sizes or cls.block_sizes)}))
        if min(sizes) < 1:
            raise ValueError(f"blockSizes must be positive integers, got {sizes}")
        for name, value in (("minIntervalSeconds", t.min_interval_seconds),
                            ("oomCooldownSeconds", t.oom_cooldown_seconds)):
            if float(value) < 0:
                raise ValueError(f"tuning.{name} must be >= 0, got {value}")
        return cls(enabled=bool(t.enabled), min_gpu_memory_utilization=lo, max_gpu_memory_utilization=hi, step=step,
                   block_sizes=sizes, min_interval=float(t.min_interval_seconds),
                   oom_cooldown=float(t.oom_cooldown_seconds))


@dataclass(frozen=True)
class TuningState:
    """What the tuner remembers; persisted in ``status.engine`` (see :meth:`to_status`)."""

    gpu_memory_utilization: float | None = None
    """Applied value; None: not tuned yet (the spec's value applies)."""
    block_size: int | None = None
    last_change: float | None = None
    """Seconds since the epoch of the last applied change."""
    last_oom: float | None = None
    """finishedAt of the newest out-of-memory termination already acted on."""
    pressure_since: float | None = None
    """Since when the preemption pressure has held without a break."""

    @classmethod
    def from_status(cls, engine: Mapping[str, Any] | None) -> TuningState:
        """Read ``status.engine`` back (missing or malformed fields become None)."""
        e = dict(engine or {})

        def t(key: str) -> float | None:
            try:
                return parse_time(e.get(key))
            except (TypeError, ValueError):
                return None

        gmu = e.get("gpuMemoryUtilization")
        bs = e.get("blockSize")
        return cls(
            gpu_memory_utilization=float(gmu) if isinstance(gmu, (int, float)) else None,
            block_size=int(bs) if isinstance(bs, int) else None,
            last_change=t("lastChangeTime"),
            last_oom=t("lastOOMTime"),
            pressure_since=t("preemptionPressureSince"),
        )

    def to_status(self) -> dict[str, Any]:
        """``status.engine``: ``gpuMemoryUtilization`` and ``blockSize`` are the applied
        values the ConfigMap is built with; the times are bookkeeping (None clears)."""
        return {
            "gpuMemoryUtilization": self.gpu_memory_utilization,
            "blockSize": self.block_size,
            "lastChangeTime": None if self.last_change is None else rfc3339(self.last_change),
            "lastOOMTime": None if self.last_oom is None else rfc3339(self.last_oom),
            "preemptionPressureSince": None if self.pressure_since is None else rfc3339(self.pressure_since),
        }

    def overrides(self) -> dict[str, Any]:
        """The engine fields (spec.engine spelling) to apply over the user's spec.engine."""
        out: dict[str, Any] = {}
        if self.gpu_memory_utilization is not None:
            out["gpuMemoryUtilization"] = self.gpu_memory_utilization
        if self.block_size is not None:
            out["blockSize"] = self.block_size
        return out


@dataclass(frozen=True)
class OOMRestart:
    """A container termination for lack of memory, read from a pod's containerStatuses."""

    pod: str
    container: str
    finished_at: float
    """Seconds since the epoch."""
    reason: str


_CUDA_OOM = re.compile(r"out of memory|OutOfMemoryError", re.IGNORECASE)


def oom_restarts(pods: Iterable[Mapping[str, Any]]) -> list[OOMRestart]:
    """Out-of-memory terminations in pods' ``status.containerStatuses[].lastState.terminated``
    (and ``state.terminated``): reason ``OOMKilled`` (the kernel's OOM killer, i.e. host
    memory) or a termination message mentioning CUDA out of memory (the runtime writes its
    fatal error to the termination log; ``torch.OutOfMemoryError``). Oldest first."""
    found = []
    for pod in pods:
        name = (pod.get("metadata") or {}).get("name", "?")
        for cs in (pod.get("status") or {}).get("containerStatuses") or ():
            for state in (cs.get("lastState") or {}, cs.get("state") or {}):
                term = state.get("terminated")
                if not term:
                    continue
                reason = term.get("reason") or ""
                if reason == "OOMKilled" or _CUDA_OOM.search(term.get("message") or ""):
                    try:
                        t = parse_time(term.get("finishedAt"))
                    except ValueError:
                        t = None
                    if t is not None:
                        found.append(OOMRestart(name, cs.get("name", "?"), t, reason or "Error"))
    return sorted(set(found), key=lambda o: (o.finished_at, o.pod))


def choose_block_size(mean_len: float, allowed: Sequence[int], tokens_per_block: float = 16.0) -> int:
    """Largest allowed block size <= ``mean_len / tokens_per_block`` (the smallest allowed
    when none fits): a sequence then wastes on average half a block, i.e. at most
    ``1 / (2 * tokens_per_block)`` of its KV cache, to internal fragmentation, while long
    sequences get big blocks (shorter block tables, fewer kernel iterations)."""
    allowed = sorted(allowed)
    fit = [b for b in allowed if b <= mean_len / tokens_per_block]
    return fit[-1] if fit else allowed[0]


@dataclass(frozen=True)
class TuningDecision:
    state: TuningState
    """New state (write it to status.engine even when nothing changed: bookkeeping)."""
    changes: tuple[tuple[str, str], ...] = ()
    """``(reason, message)`` per applied change, one Event each: ``GpuMemoryRaised``,
    ``GpuMemoryLowered``, ``BlockSizeChanged``."""
    notes: tuple[str, ...] = ()
    """Why nothing changed, for logs."""
    held: tuple[str, str] | None = None
    """``(reason, message)``: why changes are held back so a roll causes no outage (:func:`rollout_hold`), if so."""

    @property
    def changed(self) -> bool:
        return bool(self.changes)


def _int_or_percent(value: Any, total: int, round_up: bool) -> int:
    """A rollingUpdate ``maxSurge`` (rounded up) / ``maxUnavailable`` (rounded down) as pods."""
    if isinstance(value, str) and value.endswith("%"):
        pods = float(value[:-1]) * total / 100
        return int(-(-pods // 1)) if round_up else int(pods)
    return int(value or 0)


def rollout_hold(deployment: Mapping[str, Any] | None) -> tuple[str, str] | None:
    """``(reason, message)``: why a tuning change must not roll the pods now (None: it may).

    - the Deployment is still rolling out (the controller has not observed its generation, or
      not every wanted pod is updated and available): one roll at a time, the next one only
      after the last has landed (the cool-down ``min_interval`` then counts from the change);
    - a roll would take every pod down at once: with ``maxSurge`` 0 no new pod starts before
      an old one stops, so when ``replicas - maxUnavailable < 1`` (e.g. 1 replica with
      ``rollout.strategy: ResourceAware``) the service would go dark while the new pod loads
      (reason ``RollWouldTakeAllPods``; the other is ``RollingOut``).
    """
    if not deployment:
        return "RollingOut", "the Deployment does not exist yet"
    spec, st = deployment.get("spec") or {}, deployment.get("status") or {}
    want = int(spec.get("replicas", 1))
    gen, observed = (deployment.get("metadata") or {}).get("generation"), st.get("observedGeneration")
    if (gen is not None and (observed is None or observed < gen)) or want and (
            int(st.get("updatedReplicas") or 0) < want or int(st.get("availableReplicas") or 0) < want
            or int(st.get("replicas") or 0) > want):
        return "RollingOut", "the Deployment is still rolling out; the next tuning change waits for it"
    ru = (spec.get("strategy") or {}).get("rollingUpdate") or {}
    surge = _int_or_percent(ru.get("maxSurge", "25%"), want, round_up=True)
    unavailable = _int_or_percent(ru.get("maxUnavailable", "25%"), want, round_up=False)
    if want and surge == 0 and want - unavailable < 1:
        return "RollWouldTakeAllPods", (f"{want} replica(s) with maxSurge 0 and maxUnavailable {unavailable}: "
                                        "rolling the pods would take every one down at once (use "
                                        "rollout.strategy Availability, or more replicas)")
    return None


def tune(
    config: TuningConfig,
    state: TuningState,
    *,
    now: float,
    spec_engine: spec_view.Engine,
    metrics: MetricsAggregate | None,
    pods: Iterable[Mapping[str, Any]] = (),
    hold: tuple[str, str] | None = None,
) -> TuningDecision:
    """Choose ``gpuMemoryUtilization`` and ``blockSize`` for the next rollout.

    Rules, in order:

    1. An out-of-memory restart newer than ``state.last_oom`` (``OOMKilled``, or CUDA out
       of memory in the termination message) lowers utilisation one ``step`` (not below
       ``min``) at once, minimum interval or not, and starts the ``oom_cooldown``.
    2. Otherwise, at most one change per ``min_interval`` seconds.
    3. Raise utilisation one step (not above ``max``) when preemptions are frequent
       (fleet rate >= ``preemption_rate_threshold`` per second) with mean KV usage
       >= ``kv_usage_threshold``, continuously for ``sustain`` seconds, and no OOM restart in
       the last ``oom_cooldown`` seconds.
    4. Block size from the mean prompt + output length of finished requests (at least
       ``min_requests`` of them): :func:`choose_block_size`, kept while the current size is
       what the length +- ``block_size_hysteresis`` would also choose.

    ``spec_engine`` (the view's ``spec.engine``, the CRD's defaults in it) gives the starting
    values until the tuner has applied its own. ``now`` is seconds
    since the epoch; ``pods`` are the pod dicts (their containerStatuses). ``hold``
    (:func:`rollout_hold`) holds every change but rule 1 (the pods crash anyway) and is
    returned as the decision's ``held``.
    """
    if not config.enabled:
        return TuningDecision(state, notes=("tuning disabled",))
    lo, hi = config.min_gpu_memory_utilization, config.max_gpu_memory_utilization
    gmu = state.gpu_memory_utilization
    if gmu is None:
        gmu = float(spec_engine.gpu_memory_utilization)
    gmu_clamped = round(min(max(gmu, lo), hi), 4)
    bs = state.block_size if state.block_size is not None else int(spec_engine.block_size)
    changes: list[tuple[str, str]] = []
    notes: list[str] = []

    ooms = [o for o in oom_restarts(pods) if state.last_oom is None or o.finished_at > state.last_oom]
    if ooms:
        newest = ooms[-1]
        new = round(max(gmu_clamped - config.step, lo), 4)
        state = replace(state, last_oom=newest.finished_at, pressure_since=None)
        if new != gmu:
            changes.append(("GpuMemoryLowered",
                            f"gpuMemoryUtilization {gmu:g} -> {new:g}: {newest.reason} restart of "
                            f"{newest.pod}/{newest.container} at {rfc3339(newest.finished_at)}; "
                            f"no raise for {config.oom_cooldown:g} s"))
            state = replace(state, gpu_memory_utilization=new, last_change=now)
        else:
            notes.append(f"{newest.reason} restart of {newest.pod}, but utilisation is already at min {lo:g}")
        return TuningDecision(state, tuple(changes), tuple(notes))

    if hold is not None:
        return TuningDecision(state, notes=(f"held: {hold[1]}",), held=hold)

    if gmu != gmu_clamped:  # bounds changed under us: apply them now.
        changes.append(("GpuMemoryBounded",
                        f"gpuMemoryUtilization {gmu:g} -> {gmu_clamped:g} (bounds [{lo:g}, {hi:g}])"))
        return TuningDecision(replace(state, gpu_memory_utilization=gmu_clamped, last_change=now), tuple(changes))

    # Hysteresis for the raise: track how long the pressure has held.
    pressure = (
        metrics is not None and metrics.preemption_rate is not None and metrics.pods
        and metrics.preemption_rate >= config.preemption_rate_threshold
        and (metrics.kv_cache_usage or 0.0) >= config.kv_usage_threshold
    )
    state = replace(state, pressure_since=(state.pressure_since or now) if pressure else None)

    if state.last_change is not None and now - state.last_change < config.min_interval:
        notes.append(f"last change {now - state.last_change:.0f} s ago < min interval {config.min_interval:g} s")
        return TuningDecision(state, notes=tuple(notes))

    new_gmu = gmu
    if pressure and now - state.pressure_since >= config.sustain:
        if state.last_oom is not None and now - state.last_oom < config.oom_cooldown:
            notes.append(f"preemption pressure, but an OOM restart {now - state.last_oom:.0f} s ago (cool-down)")
        elif gmu >= hi:
            notes.append(f"preemption pressure, but utilisation is at max {hi:g}")
        else:
            new_gmu = round(min(gmu + config.step, hi), 4)
            changes.append(("GpuMemoryRaised",
                            f"gpuMemoryUtilization {gmu:g} -> {new_gmu:g}: {metrics.preemption_rate:.3f} "
                            f"preemptions/s with mean KV usage {metrics.kv_cache_usage:.2f} for "
                            f"{now - state.pressure_since:.0f} s"))

    new_bs = bs
    if metrics is not None and metrics.finished_requests >= config.min_requests:
        mean_len = (metrics.mean_prompt_tokens or 0.0) + (metrics.mean_generation_tokens or 0.0)
        h = config.block_size_hysteresis
        keep_lo = choose_block_size(mean_len * (1 - h), config.block_sizes, config.tokens_per_block)
        keep_hi = choose_block_size(mean_len * (1 + h), config.block_sizes, config.tokens_per_block)
        if not (keep_lo <= bs <= keep_hi and bs in config.block_sizes):
            new_bs = choose_block_size(mean_len, config.block_sizes, config.tokens_per_block)
            changes.append(("BlockSizeChanged",
                            f"blockSize {bs} -> {new_bs}: mean sequence length {mean_len:.0f} tokens "
                            f"over {metrics.finished_requests:g} requests"))
    elif metrics is not None:
        notes.append(f"{metrics.finished_requests:g} finished requests < {config.min_requests} for block size")

    if changes:
        state = replace(state, gpu_memory_utilization=new_gmu, block_size=new_bs, last_change=now,
                        pressure_since=None)
    return TuningDecision(state, tuple(changes), tuple(notes))
