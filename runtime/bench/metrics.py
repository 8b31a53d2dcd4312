"""Report maths of ``kvfleet bench``: pure functions of per-request timings.

Definitions follow vLLM's serving benchmark (``benchmark_serving.py``, ``vllm bench serve``):
TTFT (send to first text chunk, s), e2e latency (``e2el``, send to last chunk, s), TPOT
(``(e2e - ttft) / (output_tokens - 1)``, requests with > 1 output token), ITL (gaps between
a request's chunks, pooled), throughputs over the benchmark duration (requests/s, output
tokens/s, total tokens/s), goodput (DistServe, Zhong et al. 2024: completed requests/s
meeting every SLO ``ttft``/``tpot``/``e2el``, ms) and ``slo_attainment``. Percentiles:
``numpy.percentile``, linear interpolation; statistics of an empty set are 0 (as vLLM).
Nothing here touches a clock, the network or a model. Full definitions: docs/benchmarks.md,
"Definitions".
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

GOODPUT_METRICS = ("ttft", "tpot", "e2el")
"""Metrics that ``--goodput`` accepts SLOs for (values in milliseconds)."""

DEFAULT_PERCENTILES = (50.0, 90.0, 99.0)


@dataclass
class RequestResult:
    """What the client observed for one request. Times are seconds.

    ``start_time`` and ``chunk_times`` are relative to the start of the benchmark
    (``time.perf_counter()`` at the start subtracted), so several results share one
    time axis; ``ttft``, ``latency`` and ``itl`` are durations.
    """

    success: bool
    prompt_len: int = 0
    """Input tokens (the server's ``usage.prompt_tokens`` when it reports it)."""
    output_tokens: int = 0
    """Output tokens (the server's ``usage.completion_tokens`` when it reports it)."""
    start_time: float = 0.0
    ttft: float = 0.0
    latency: float = 0.0
    """e2e latency: request sent to last output chunk received, seconds."""
    itl: list[float] = field(default_factory=list)
    """Gaps between consecutive output chunks, seconds (len = chunks - 1)."""
    chunk_times: list[float] = field(default_factory=list)
    """Arrival time of each output chunk, seconds since the benchmark started."""
    generated_text: str = ""
    error: str = ""

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first, seconds; None when <= 1 output token."""
        if self.output_tokens <= 1:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)

    def to_dict(self) -> dict:
        return asdict(self)


def result_from_chunk_times(
    start_time: float,
    chunk_times: Sequence[float],
    prompt_len: int,
    output_tokens: int,
    generated_text: str = "",
) -> RequestResult:
    """Build a successful :class:`RequestResult` from the send time and the arrival times
    of the output chunks (all seconds on one clock).

    TTFT is ``chunk_times[0] - start_time``, ITL the successive differences of
    ``chunk_times`` and e2e latency ``chunk_times[-1] - start_time``.
    """
    if not chunk_times:
        raise ValueError("chunk_times must hold at least one output chunk")
    times = [float(t) for t in chunk_times]
    if any(b < a for a, b in zip(times, times[1:])) or times[0] < start_time:
        raise ValueError("chunk_times must be non-decreasing and not before start_time")
    return RequestResult(
        success=True,
        prompt_len=int(prompt_len),
        output_tokens=int(output_tokens),
        start_time=start_time,
        ttft=times[0] - start_time,
        latency=times[-1] - start_time,
        itl=[b - a for a, b in zip(times, times[1:])],
        chunk_times=times,
        generated_text=generated_text,
    )


def parse_goodput(specs: Iterable[str] | None) -> dict[str, float]:
    """Parse ``--goodput`` arguments such as ``["ttft:500", "tpot:50"]`` into
    ``{"ttft": 500.0, "tpot": 50.0}`` (milliseconds).

    Raises:
        ValueError: on an unknown metric, a missing ``:``, or a negative or non-numeric
            value.
    """
    slos: dict[str, float] = {}
    for spec in specs or ():
        name, sep, value = str(spec).partition(":")
        name = name.strip().lower()
        if not sep:
            raise ValueError(f"goodput: expected METRIC:MILLISECONDS, got {spec!r}")
        if name not in GOODPUT_METRICS:
            raise ValueError(f"goodput: unknown metric {name!r}; choose from {', '.join(GOODPUT_METRICS)}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"goodput: {name} needs a number of milliseconds, got {value!r}") from None
        if not math.isfinite(ms) or ms < 0:
            raise ValueError(f"goodput: {name} must be a finite number >= 0, got {value!r}")
        slos[name] = ms
    return slos


def summarize(values: Sequence[float], percentiles: Sequence[float] = DEFAULT_PERCENTILES) -> dict[str, float]:
    """Mean, median, std and the given percentiles of ``values``, in the values' unit.

    Keys: ``mean``, ``median``, ``std``, and ``p{q}`` per percentile (``p99``, ``p99.9``).
    An empty input gives 0 everywhere (vLLM's convention).
    """
    arr = np.asarray(values if len(values) else [0.0], dtype=np.float64)
    out = {"mean": float(arr.mean()), "median": float(np.median(arr)), "std": float(arr.std())}
    for q in percentiles:
        out[f"p{_fmt_q(q)}"] = float(np.percentile(arr, q))
    return out


def _fmt_q(q: float) -> str:
    return str(int(q)) if float(q).is_integer() else str(q)


def is_good(result: RequestResult, slos_ms: dict[str, float]) -> bool:
    """True when a successful request meets every SLO (milliseconds; ``<=`` passes).

    A request with a single output token has TPOT 0 for this purpose (vLLM).
    """
    if not result.success:
        return False
    observed_s = {"ttft": result.ttft, "tpot": result.tpot or 0.0, "e2el": result.latency}
    return all(observed_s[name] <= ms / 1000.0 for name, ms in slos_ms.items())


def compute_metrics(
    results: Sequence[RequestResult],
    duration: float,
    percentiles: Sequence[float] = DEFAULT_PERCENTILES,
    goodput_slos_ms: dict[str, float] | None = None,
) -> dict:
    """The benchmark report (vLLM's ``calculate_metrics``) as a flat JSON-able dict.

    Args:
        results: one per request, failed ones included.
        duration: benchmark wall time, seconds (> 0).
        percentiles: which percentiles to report, e.g. ``(50, 90, 99)``.
        goodput_slos_ms: SLOs in milliseconds (``ttft``, ``tpot``, ``e2el``); None or
            empty: no goodput.

    Returns:
        ``completed``, ``failed``, ``duration`` (s), ``total_input_tokens``,
        ``total_output_tokens``, ``request_throughput`` (req/s), ``output_throughput``
        (tok/s), ``total_token_throughput`` (tok/s), ``request_goodput`` (req/s, None
        without SLOs), ``slo_attainment`` (0-1, None without SLOs), and for each of
        ``ttft``, ``tpot``, ``itl``, ``e2el``: ``mean_X_ms``, ``median_X_ms``,
        ``std_X_ms`` and ``pQ_X_ms`` (milliseconds).
    """
    if not duration > 0:
        raise ValueError(f"duration must be > 0 seconds, got {duration!r}")
    done = [r for r in results if r.success]
    ttfts = [r.ttft for r in done]
    e2els = [r.latency for r in done]
    tpots = [t for t in (r.tpot for r in done) if t is not None]
    itls = [gap for r in done for gap in r.itl]
    total_in = sum(r.prompt_len for r in done)
    total_out = sum(r.output_tokens for r in done)
    report: dict = {
        "completed": len(done),
        "failed": len(results) - len(done),
        "duration": float(duration),
        "total_input_tokens": int(total_in),
        "total_output_tokens": int(total_out),
        "request_throughput": len(done) / duration,
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
        "request_goodput": None,
        "slo_attainment": None,
    }
    if goodput_slos_ms:
        good = sum(is_good(r, goodput_slos_ms) for r in done)
        report["request_goodput"] = good / duration
        report["slo_attainment"] = good / len(done) if done else 0.0
        report["goodput_slos_ms"] = dict(goodput_slos_ms)
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        for stat, value in summarize(values, percentiles).items():
            report[f"{stat}_{name}_ms"] = value * 1000.0
    return report


def throughput_timeline(results: Sequence[RequestResult], duration: float, bin_s: float = 1.0):
    """Output tokens per second over the run, in bins of ``bin_s`` seconds.

    Each chunk of a request counts ``output_tokens / len(chunk_times)`` tokens (one
    token per chunk when the server streams token by token, which kvfleet and vLLM do).

    Returns:
        ``(bin_starts, tokens_per_s)``: two numpy arrays, seconds and tokens/s.
    """
    if bin_s <= 0:
        raise ValueError("bin_s must be > 0")
    nbins = max(1, math.ceil(duration / bin_s))
    edges = np.arange(nbins + 1) * bin_s
    times, weights = [], []
    for r in results:
        if r.success and r.chunk_times:
            w = r.output_tokens / len(r.chunk_times)
            times.extend(r.chunk_times)
            weights.extend([w] * len(r.chunk_times))
    counts, _ = np.histogram(np.asarray(times, dtype=float), bins=edges, weights=np.asarray(weights, dtype=float))
    return edges[:-1], counts / bin_s


REPORT_LINES = (
    ("Successful requests:", "completed", "{:d}"),
    ("Failed requests:", "failed", "{:d}"),
    ("Benchmark duration (s):", "duration", "{:.2f}"),
    ("Total input tokens:", "total_input_tokens", "{:d}"),
    ("Total generated tokens:", "total_output_tokens", "{:d}"),
    ("Request throughput (req/s):", "request_throughput", "{:.2f}"),
    ("Request goodput (req/s):", "request_goodput", "{:.2f}"),
    ("SLO attainment (%):", "slo_attainment", "{:.1%}"),
    ("Output token throughput (tok/s):", "output_throughput", "{:.2f}"),
    ("Total token throughput (tok/s):", "total_token_throughput", "{:.2f}"),
)

_SECTIONS = (
    ("ttft", "Time to First Token"),
    ("tpot", "Time per Output Token (excl. 1st token)"),
    ("itl", "Inter-token Latency"),
    ("e2el", "End-to-end Latency"),
)


def format_report(
    report: dict, percentiles: Sequence[float] = DEFAULT_PERCENTILES, title: str = "Serving Benchmark Result"
) -> str:
    """The report as text, in the layout of vLLM's benchmark output."""
    lines = [f"{' ' + title + ' ':=^50}"]
    for label, key, fmt in REPORT_LINES:
        value = report.get(key)
        if value is None:
            continue
        if key == "slo_attainment":
            lines.append(f"{'SLO attainment:':<40} {value:.1%}")
            continue
        lines.append(f"{label:<40} {fmt.format(value):<10}")
    for name, heading in _SECTIONS:
        lines.append(f"{heading:-^50}")
        lines.append(f"{'Mean ' + name.upper() + ' (ms):':<40} {report[f'mean_{name}_ms']:<10.2f}")
        lines.append(f"{'Median ' + name.upper() + ' (ms):':<40} {report[f'median_{name}_ms']:<10.2f}")
        for q in percentiles:
            if float(q) == 50.0:
                continue
            key = f"p{_fmt_q(q)}_{name}_ms"
            lines.append(f"{'P' + _fmt_q(q) + ' ' + name.upper() + ' (ms):':<40} {report[key]:<10.2f}")
    lines.append("=" * 50)
    return "\n".join(lines)
