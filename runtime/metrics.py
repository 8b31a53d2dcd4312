"""Prometheus metrics of the runtime (``GET /metrics``), shaped like vLLM v1's.

Names, meanings, histogram buckets and suffixes follow vLLM's ``PrometheusStatLogger``
(vllm/v1/metrics/loggers.py) so that dashboards, HPA/KEDA triggers and Gateway API
Inference Extension setups written for vLLM read them unchanged; the prefix is
``kvfleet:`` (and, with ``metrics_compat="vllm"``, additionally ``vllm:``). Every series is
labelled ``model_name``. Counters end in ``_total``, histograms in ``_bucket``/``_sum``/``_count``
(prometheus-client). Series: gauges ``num_requests_running``, ``num_requests_waiting``,
``kv_cache_usage_perc`` (0-1; under ``vllm:`` also as v0's ``gpu_cache_usage_perc``),
``cache_config_info``; counters ``num_preemptions``, ``prompt_tokens``, ``generation_tokens``,
``request_success{finished_reason}``, ``prefix_cache_queries``, ``prefix_cache_hits``;
histograms (seconds) ``time_to_first_token_seconds``, ``inter_token_latency_seconds``,
``e2e_request_latency_seconds``, ``request_{queue,prefill,decode,inference}_time_seconds``,
and (counts) ``request_prompt_tokens``, ``request_generation_tokens``, ``request_params_n``,
``request_params_max_tokens``, ``iteration_tokens_total``. With LoRA (:meth:`PrometheusStatLogger.log_lora_config`):
vLLM's ``lora_requests_info`` gauge (labels ``running_lora_adapters``, ``waiting_lora_adapters``:
comma-separated adapter names, ``max_lora``; value: the wall-clock time of the last step; only the
current label set is kept) and ``kvfleet:lora_requests_total{lora_name}`` (finished requests per
adapter, ``kvfleet:`` only), the gauge ``kvfleet:num_waiting_prompt_tokens`` (prompt tokens of the
waiting requests: a prefill pool's scaling signal, docs/autoscaling.md; ``kvfleet:`` only). Peer KV
pull (``--kv-transfer-config``, ``kvfleet:`` only):
``kv_pull_tokens_total`` (prompt tokens whose KV came from a peer; they count as prefix-cache hits
too), ``kv_disk_load_tokens_total`` (the same from the disk tier), the gauge
``kv_disk_usage_bytes`` (the disk tier's size) and
``kv_pull_failures_total{reason}`` (refused or failed pulls and disk reads; ``not_replica``: an
answer without the fleet's seal), ``kv_peer_hints_refused_total{reason}`` (hints ignored:
``unsigned``, ``signature``, ``expired``, ``malformed``, ``no_secret``). Meanings: docs/server.md,
"Metrics"; docs/lora.md; docs/routing.md.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvfleet.runtime.core.sched.output import SchedulerStats
from kvfleet.runtime.engine.stats import IterationStats, StatLoggerBase

# Buckets copied from vLLM v1 (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
"""Seconds; ``time_to_first_token_seconds``."""
ITL_BUCKETS: tuple[float, ...] = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
"""Seconds; ``inter_token_latency_seconds``."""
REQUEST_LATENCY_BUCKETS: tuple[float, ...] = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
    50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
"""Seconds; ``e2e_request_latency_seconds`` and ``request_{queue,prefill,decode,inference}_time_seconds``."""
ITERATION_TOKENS_BUCKETS: tuple[int, ...] = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
"""Tokens per engine step; ``iteration_tokens_total`` (a histogram despite its name, as vLLM's)."""
N_BUCKETS: tuple[int, ...] = (1, 2, 5, 10, 20)
"""``request_params_n``."""

FINISH_REASONS = ("stop", "length", "abort")
KVFLEET_PREFIX = "kvfleet:"
VLLM_PREFIX = "vllm:"
CONTENT_TYPE = CONTENT_TYPE_LATEST
"""Content type of :func:`exposition` (``text/plain; version=0.0.4``)."""


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` inclusive (vLLM's token-count buckets).

    >>> build_1_2_5_buckets(100)
    [1, 2, 5, 10, 20, 50, 100]
    """
    buckets: list[int] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return buckets
            buckets.append(value)
        exponent += 1


class _Fanout:
    """The same update applied to one labelled child per prefix."""

    def __init__(self, children: Sequence):
        self.children = list(children)

    def set(self, value: float) -> None:
        for c in self.children:
            c.set(value)

    def inc(self, amount: float = 1) -> None:
        if amount:
            for c in self.children:
                c.inc(amount)

    def observe(self, value: float) -> None:
        for c in self.children:
            c.observe(value)


class PrometheusStatLogger(StatLoggerBase):
    """Stat logger that exports the engine's per-step statistics to Prometheus.

    Args:
        model_name: value of the ``model_name`` label (the served model name).
        registry: where the metrics live (one per app; default: a new ``CollectorRegistry``).
        prefixes: metric name prefixes; every series is exported once per prefix
            (``("kvfleet:", "vllm:")`` for vLLM-compatible names).
        max_model_len: top of the token-count histogram buckets; when None, those two
            histograms are created by :meth:`log_engine_initialized`.

    The engine calls :meth:`record` once per step (counters are deltas, gauges states; see
    :mod:`kvfleet.runtime.engine.stats`). Thread-safe (prometheus-client metrics are).
    """

    def __init__(
        self,
        model_name: str,
        *,
        registry: CollectorRegistry | None = None,
        prefixes: Iterable[str] = (KVFLEET_PREFIX,),
        max_model_len: int | None = None,
    ) -> None:
        self.model_name = model_name
        self.registry = registry if registry is not None else CollectorRegistry()
        self.prefixes = tuple(prefixes)
        if not self.prefixes:
            raise ValueError("prefixes must not be empty")
        self._make_step_series()
        self._make_request_series()
        self.histogram_prompt_tokens: _Fanout | None = None
        self.histogram_generation_tokens: _Fanout | None = None
        self.histogram_max_tokens: _Fanout | None = None
        self.max_model_len: int | None = None
        self.cache_config_info: dict | None = None
        if max_model_len is not None:
            self._make_token_histograms(max_model_len)
        self.max_lora: str | None = None
        self._lora_info: list[Gauge] = []
        self._lora_requests: Counter | None = None
        self._make_kv_tier_series()

    def _make_kv_tier_series(self) -> None:
        """Peer KV pull and the disk tier (``--kv-transfer-config``): ``kvfleet:`` only (vLLM has no
        such series), none when that prefix is not exported."""
        own = [p for p in self.prefixes if p == KVFLEET_PREFIX]

        def one(cls, name: str, doc: str) -> _Fanout:
            return _Fanout([cls(p + name, doc, labelnames=["model_name"], registry=self.registry)
                            .labels(self.model_name) for p in own])

        self.counter_kv_pull_tokens = one(Counter, "kv_pull_tokens", "Prompt tokens whose KV was pulled from a peer.")
        self.counter_kv_disk_load_tokens = one(Counter, "kv_disk_load_tokens",
                                               "Prompt tokens whose KV was loaded from the disk tier.")
        self.gauge_kv_disk_bytes = one(Gauge, "kv_disk_usage_bytes", "Bytes of KV blocks held by the disk tier.")
        self._kv_pull_failures = [Counter(p + "kv_pull_failures", "Refused or failed KV pulls and disk reads, by "
                                          "reason.", labelnames=["model_name", "reason"], registry=self.registry)
                                  for p in own]
        self._kv_peer_hints_refused = [Counter(p + "kv_peer_hints_refused", "x-kvfleet-kv-peer hints ignored (not "
                                               "the router's, or naming no fleet address), by reason.",
                                               labelnames=["model_name", "reason"], registry=self.registry)
                                       for p in own]

    def count_refused_hint(self, reason: str) -> None:
        """One ``x-kvfleet-kv-peer`` hint ignored (``kvfleet:kv_peer_hints_refused_total{reason}``)."""
        for counter in self._kv_peer_hints_refused:
            counter.labels(self.model_name, reason).inc()

    def _fan(self, cls, name: str, doc: str, **kw) -> _Fanout:
        """One series ``name`` per prefix, labelled with the model name, updated together."""
        return _Fanout(
            [
                cls(p + name, doc, labelnames=["model_name"], registry=self.registry, **kw).labels(self.model_name)
                for p in self.prefixes
            ]
        )

    def _make_step_series(self) -> None:
        """The per-step gauges and counters (scheduler state, tokens, prefix cache, KV usage)."""
        fan = self._fan
        self.gauge_running = fan(Gauge, "num_requests_running", "Number of requests in model execution batches.")
        self.gauge_waiting = fan(Gauge, "num_requests_waiting", "Number of requests waiting to be processed.")
        self.gauge_waiting_prompt_tokens = _Fanout([  # kvfleet: only (vLLM has none; a prefill pool scales on it)
            Gauge(p + "num_waiting_prompt_tokens", "Prompt tokens of the requests waiting to be processed.",
                  labelnames=["model_name"], registry=self.registry).labels(self.model_name)
            for p in self.prefixes if p == KVFLEET_PREFIX])
        self.gauge_kv_cache_usage = fan(Gauge, "kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.counter_preemptions = fan(Counter, "num_preemptions", "Cumulative number of preemption from the engine.")
        self.counter_prompt_tokens = fan(Counter, "prompt_tokens", "Number of prefill tokens processed.")
        self.counter_generation_tokens = fan(Counter, "generation_tokens", "Number of generation tokens processed.")
        self.counter_prefix_cache_queries = fan(
            Counter, "prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."
        )
        self.counter_prefix_cache_hits = fan(
            Counter, "prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        )
        self.counter_spec_drafts = fan(Counter, "spec_decode_num_drafts", "Number of spec decoding drafts.")
        self.counter_spec_draft_tokens = fan(Counter, "spec_decode_num_draft_tokens", "Number of draft tokens.")
        self.counter_spec_accepted_tokens = fan(Counter, "spec_decode_num_accepted_tokens",
                                                "Number of accepted tokens.")
        self._spec_accepted_per_pos = [
            Counter(p + "spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position.",
                    labelnames=["model_name", "position"], registry=self.registry)
            for p in self.prefixes
        ]
        vllm_only = [p for p in self.prefixes if p == VLLM_PREFIX]
        # Gateway API Inference Extension's endpoint picker reads v0's name by default.
        self.gauge_gpu_cache_usage = _Fanout(
            [
                Gauge(
                    p + "gpu_cache_usage_perc",
                    "GPU KV-cache usage. 1 means 100 percent usage.",
                    labelnames=["model_name"],
                    registry=self.registry,
                ).labels(self.model_name)
                for p in vllm_only
            ]
        )
        self.histogram_iteration_tokens = fan(
            Histogram,
            "iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            buckets=ITERATION_TOKENS_BUCKETS,
        )

    def _make_request_series(self) -> None:
        """The per-request series: finished requests by reason, latencies, phase times, ``n``."""
        fan = self._fan
        self._request_success = [
            Counter(
                p + "request_success",
                "Count of successfully processed requests.",
                labelnames=["model_name", "finished_reason"],
                registry=self.registry,
            )
            for p in self.prefixes
        ]
        self.counter_request_success = {reason: self._success_child(reason) for reason in FINISH_REASONS}
        self.histogram_ttft = fan(
            Histogram,
            "time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            buckets=TTFT_BUCKETS,
        )
        self.histogram_itl = fan(
            Histogram,
            "inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            buckets=ITL_BUCKETS,
        )
        self.histogram_e2e = fan(
            Histogram,
            "e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            buckets=REQUEST_LATENCY_BUCKETS,
        )
        self.histogram_queue_time = fan(
            Histogram,
            "request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            buckets=REQUEST_LATENCY_BUCKETS,
        )
        self.histogram_phase_times = {
            phase: fan(
                Histogram,
                f"request_{phase}_time_seconds",
                f"Histogram of time spent in {phase.upper()} phase for request.",
                buckets=REQUEST_LATENCY_BUCKETS,
            )
            for phase in ("prefill", "decode", "inference")
        }
        self.histogram_n = fan(
            Histogram, "request_params_n", "Histogram of the n request parameter.", buckets=N_BUCKETS
        )

    def log_lora_config(self, lora_info: dict[str, str]) -> None:
        """Create the LoRA series (``lora_info``: ``{"max_lora": "4"}``; empty: LoRA off, nothing made)."""
        if not lora_info or self.max_lora is not None:
            return
        self.max_lora = str(lora_info["max_lora"])
        self._lora_info = [
            Gauge(
                p + "lora_requests_info",
                "Running stats on lora requests.",
                labelnames=["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
                registry=self.registry,
            )
            for p in self.prefixes
        ]
        self._lora_requests = Counter(KVFLEET_PREFIX + "lora_requests", "Finished requests per LoRA adapter.",
                                      labelnames=["model_name", "lora_name"], registry=self.registry)
        self._set_lora_info({}, {})

    def _set_lora_info(self, running: dict[str, int], waiting: dict[str, int]) -> None:
        for gauge in self._lora_info:
            gauge.clear()
            gauge.labels(
                max_lora=self.max_lora, waiting_lora_adapters=",".join(waiting), running_lora_adapters=",".join(running)
            ).set_to_current_time()

    def _success_child(self, reason: str) -> _Fanout:
        return _Fanout([c.labels(self.model_name, reason) for c in self._request_success])

    def _make_token_histograms(self, max_model_len: int) -> None:
        if self.histogram_prompt_tokens is not None:
            return
        self.max_model_len = int(max_model_len)
        buckets = build_1_2_5_buckets(self.max_model_len)
        self.histogram_prompt_tokens = self._fan(
            Histogram, "request_prompt_tokens", "Number of prefill tokens processed.", buckets=buckets
        )
        self.histogram_generation_tokens = self._fan(
            Histogram, "request_generation_tokens", "Number of generation tokens processed.", buckets=buckets
        )
        self.histogram_max_tokens = self._fan(
            Histogram, "request_params_max_tokens", "Histogram of the max_tokens request parameter.", buckets=buckets
        )

    def log_engine_initialized(self, max_model_len: int, cache_config_info: dict | None = None) -> None:
        """Create what depends on the loaded engine: the token-count histograms (buckets up
        to ``max_model_len``) and the ``cache_config_info`` gauge (value 1, one label per key
        of ``cache_config_info``, e.g. block_size, num_blocks, gpu_memory_utilization; under
        the ``vllm:`` prefix ``num_blocks`` is also given as vLLM's ``num_gpu_blocks``).
        Call once, before the engine's first step."""
        self._make_token_histograms(max_model_len)
        if cache_config_info is None or self.cache_config_info is not None:
            return
        self.cache_config_info = dict(cache_config_info)
        for p in self.prefixes:
            info = {k: str(v) for k, v in self.cache_config_info.items()}
            if p == VLLM_PREFIX and "num_blocks" in info:
                info.setdefault("num_gpu_blocks", info["num_blocks"])
            info = {"model_name": self.model_name, **info}
            gauge = Gauge(
                p + "cache_config_info",
                "Information of the LLMEngine CacheConfig",
                labelnames=list(info),
                registry=self.registry,
            )
            gauge.labels(**info).set(1)

    def set_scheduler_state(self, num_running: int, num_waiting: int, kv_cache_usage: float | None = None) -> None:
        """Set the state gauges directly (the server refreshes them at scrape time)."""
        self.gauge_running.set(num_running)
        self.gauge_waiting.set(num_waiting)
        if kv_cache_usage is not None:
            self.gauge_kv_cache_usage.set(kv_cache_usage)
            self.gauge_gpu_cache_usage.set(kv_cache_usage)

    def record(self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None) -> None:
        """Apply one engine step's statistics (either argument may be None)."""
        if scheduler_stats is not None:
            self.set_scheduler_state(
                scheduler_stats.num_running_reqs, scheduler_stats.num_waiting_reqs, scheduler_stats.kv_cache_usage
            )
            self.gauge_waiting_prompt_tokens.set(scheduler_stats.num_waiting_prompt_tokens)
            self.counter_preemptions.inc(scheduler_stats.num_preemptions)
            self.counter_prefix_cache_queries.inc(scheduler_stats.prefix_cache_queries)
            self.counter_prefix_cache_hits.inc(scheduler_stats.prefix_cache_hits)
            if self._lora_info:
                self._set_lora_info(scheduler_stats.running_lora_adapters, scheduler_stats.waiting_lora_adapters)
            spec = scheduler_stats.spec_decoding
            if spec is not None:
                self.counter_spec_drafts.inc(spec.num_drafts)
                self.counter_spec_draft_tokens.inc(spec.num_draft_tokens)
                self.counter_spec_accepted_tokens.inc(spec.num_accepted_tokens)
                for pos, n in enumerate(spec.num_accepted_tokens_per_pos):
                    for c in self._spec_accepted_per_pos:
                        c.labels(self.model_name, str(pos)).inc(n)
        if iteration_stats is None:
            return
        self.counter_prompt_tokens.inc(iteration_stats.num_prompt_tokens)
        if iteration_stats.num_pulled_tokens:
            self.counter_kv_pull_tokens.inc(iteration_stats.num_pulled_tokens)
        if iteration_stats.kv_disk_bytes is not None:
            self.gauge_kv_disk_bytes.set(iteration_stats.kv_disk_bytes)
        if iteration_stats.num_disk_loaded_tokens:
            self.counter_kv_disk_load_tokens.inc(iteration_stats.num_disk_loaded_tokens)
        for reason in iteration_stats.kv_pull_failures:
            for counter in self._kv_pull_failures:
                counter.labels(self.model_name, reason).inc()
        self.counter_generation_tokens.inc(iteration_stats.num_generation_tokens)
        step_tokens = iteration_stats.num_prompt_tokens + iteration_stats.num_generation_tokens
        if step_tokens:  # an abort's stats carry no step
            self.histogram_iteration_tokens.observe(step_tokens)
        for ttft in iteration_stats.time_to_first_tokens:
            self.histogram_ttft.observe(ttft)
        for itl in iteration_stats.inter_token_latencies:
            self.histogram_itl.observe(itl)
        for fin in iteration_stats.finished_requests:
            child = self.counter_request_success.get(fin.finish_reason)
            if child is None:
                child = self.counter_request_success[fin.finish_reason] = self._success_child(fin.finish_reason)
            child.inc()
            self.histogram_e2e.observe(fin.e2e_latency)
            self.histogram_queue_time.observe(fin.queue_time)
            for phase, seconds in (
                ("prefill", fin.prefill_time),
                ("decode", fin.decode_time),
                ("inference", fin.inference_time),
            ):
                self.histogram_phase_times[phase].observe(seconds)
            if fin.n is not None:
                self.histogram_n.observe(fin.n)
            if fin.lora_name and self._lora_requests is not None:
                self._lora_requests.labels(self.model_name, fin.lora_name).inc()
            if self.histogram_prompt_tokens is not None and self.histogram_generation_tokens is not None:
                self.histogram_prompt_tokens.observe(fin.num_prompt_tokens)
                self.histogram_generation_tokens.observe(fin.num_generation_tokens)
            if self.histogram_max_tokens is not None and fin.max_tokens is not None:
                self.histogram_max_tokens.observe(fin.max_tokens)


class _WithoutCreated:
    """A collector view of a registry without the ``*_created`` samples (vLLM disables them)."""

    def __init__(self, registry: CollectorRegistry):
        self.registry = registry

    def collect(self):
        for family in self.registry.collect():
            samples = [s for s in family.samples if not s.name.endswith("_created")]
            if samples or not family.samples:
                family.samples = samples
                yield family


def exposition(registry: CollectorRegistry) -> bytes:
    """Prometheus text format (0.0.4) of ``registry``, without ``_created`` series.

    Returns: UTF-8 bytes, content type :data:`CONTENT_TYPE`.
    """
    return generate_latest(_WithoutCreated(registry))  # type: ignore[arg-type]
