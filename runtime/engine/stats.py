"""Statistics the engine hands to stat loggers (the Prometheus exporter) after each step.

Counters are *deltas* since the previous step, so a logger only has to ``inc()`` them;
gauges are the state after the step. Times are seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvfleet.runtime.core.sched.output import SchedulerStats


@dataclass
class FinishedRequestStats:
    finish_reason: str
    """``stop``, ``length`` or ``abort``."""
    e2e_latency: float
    """Arrival to finish, seconds."""
    queue_time: float
    """Arrival to first scheduled, seconds (0 if never scheduled)."""
    num_prompt_tokens: int
    num_generation_tokens: int
    prefill_time: float = 0.0
    """First scheduled to first token, seconds (0 without a token)."""
    decode_time: float = 0.0
    """First token to last token, seconds."""
    inference_time: float = 0.0
    """First scheduled to last token, seconds (prefill + decode)."""
    max_tokens: int | None = None
    """The request's ``max_tokens``."""
    n: int | None = None
    """The user request's ``n``, on the stats of the sequence that finished it (None on the others)."""
    lora_name: str | None = None
    """The LoRA adapter it ran with (None: the base model)."""


@dataclass
class IterationStats:
    num_prompt_tokens: int = 0
    """Delta: prompt tokens computed this step (prefill, excluding prefix-cache hits)."""
    num_generation_tokens: int = 0
    """Delta: output tokens produced this step."""
    time_to_first_tokens: list[float] = field(default_factory=list)
    """TTFT of each request whose first token came this step (arrival to first token), seconds."""
    inter_token_latencies: list[float] = field(default_factory=list)
    """ITL of each request that got a further token this step, seconds."""
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)
    num_pulled_tokens: int = 0
    """Delta: prompt tokens whose KV was pulled from a peer replica (``--kv-transfer-config``)."""
    num_disk_loaded_tokens: int = 0
    """Delta: prompt tokens whose KV was loaded from the disk tier (``kv_transfer_config.disk_path``)."""
    kv_disk_bytes: int | None = None
    """A state, not a delta: the disk tier's bytes after its latest writes (None: not reported here)."""
    kv_pull_failures: list[str] = field(default_factory=list)
    """The reason of each refused or failed pull (:class:`kvfleet.runtime.kv_transfer.wire.TransferError`)."""


class StatLoggerBase:
    """Interface of a stat logger: the engine calls ``record`` once per step."""

    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None:
        raise NotImplementedError
