"""``kvfleet bench serve``: load generator for any OpenAI-compatible streaming endpoint.

Methodology of vLLM's ``benchmark_serving.py`` (``vllm bench serve``): one warm-up request,
then ``num_prompts`` requests from one asyncio client (httpx), all at once or with gamma
inter-arrival times (shape ``burstiness``, mean ``1/request_rate`` s; 1 = Poisson);
``max_concurrency`` caps requests in flight (a request's clock starts when it is sent);
every request streams, each text chunk is timed, token counts come from the server's
``usage``; greedy, ``--ignore-eos`` for exact lengths. Report maths:
:mod:`kvfleet.runtime.bench.metrics`; options and results: docs/benchmarks.md.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import time
from dataclasses import dataclass
from datetime import UTC, datetime

import numpy as np

from kvfleet.runtime import env
from kvfleet.runtime.bench.datasets import SampleRequest
from kvfleet.runtime.bench.metrics import (
    RequestResult,
    compute_metrics,
    format_report,
    result_from_chunk_times,
    throughput_timeline,
)

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


def load_tokenizer(name_or_path: str | None):
    """A transformers tokenizer for building prompts and counting tokens.

    ``name_or_path``: a checkpoint folder, a ``.gguf`` file, a hub id (when the hub is
    reachable), or None for kvfleet's default model (resolved, and converted once, by
    :func:`kvfleet.runtime.worker.model_loader.resolve_model_path`). A name that is no path and
    no reachable hub id (a ``--served-model-name``, say) falls back to the default model's.
    """
    from transformers import AutoTokenizer

    from kvfleet.runtime.worker.model_loader import resolve_model_path

    if name_or_path:
        path, _ = resolve_model_path(name_or_path)
        try:
            return AutoTokenizer.from_pretrained(path)
        except Exception:
            if os.path.exists(path):
                raise
    path, _ = resolve_model_path(None)
    return AutoTokenizer.from_pretrained(path)


def source_revision() -> str | None:
    """The git commit of the kvfleet tree this runs from (``git rev-parse HEAD`` in the
    package folder, ``-dirty`` appended when tracked files changed), or None outside git."""
    import subprocess

    here = os.path.dirname(os.path.abspath(__file__))
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10)
        if rev.returncode != 0:
            return None
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", "--", "."],
            cwd=here,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        return rev.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


@dataclass
class RequestInput:
    """One HTTP request to send."""

    api_url: str
    model: str
    request: SampleRequest
    endpoint: str = "completions"
    ignore_eos: bool = False
    api_key: str | None = None


def _payload(inp: RequestInput) -> dict:
    body = {
        "model": inp.model,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if inp.endpoint == "chat":
        body["messages"] = inp.request.chat_messages()
        body["max_completion_tokens"] = inp.request.expected_output_len
    else:
        body["prompt"] = inp.request.completion_prompt()
        body["max_tokens"] = inp.request.expected_output_len
    if inp.ignore_eos:
        body["ignore_eos"] = True
    return body


def _chunk_text(chunk: dict, endpoint: str) -> str:
    text = ""
    for choice in chunk.get("choices") or []:
        if endpoint == "chat":
            text += (choice.get("delta") or {}).get("content") or ""
        else:
            text += choice.get("text") or ""
    return text


async def send_request(client, inp: RequestInput, t0: float, count_tokens=None) -> RequestResult:
    """Send one streaming request and time its chunks (seconds since ``t0``, a
    ``time.perf_counter()`` value). Never raises for HTTP or protocol errors: they end up
    in ``RequestResult.error``."""
    headers = {"Authorization": f"Bearer {inp.api_key}"} if inp.api_key else {}
    start = time.perf_counter()
    chunk_times: list[float] = []
    text_parts: list[str] = []
    usage = None
    try:
        async with client.stream("POST", inp.api_url, json=_payload(inp), headers=headers) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode("utf-8", "replace")
                return RequestResult(
                    success=False, start_time=start - t0, error=f"HTTP {resp.status_code}: {body[:500]}"
                )
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                now = time.perf_counter()
                if chunk.get("error"):
                    return RequestResult(success=False, start_time=start - t0, error=json.dumps(chunk["error"])[:500])
                if chunk.get("usage"):
                    usage = chunk["usage"]
                text = _chunk_text(chunk, inp.endpoint)
                if text:
                    chunk_times.append(now - t0)
                    text_parts.append(text)
    except Exception as exc:  # network errors, timeouts, bad JSON: a failed request, not a crash
        return RequestResult(success=False, start_time=start - t0, error=f"{type(exc).__name__}: {exc}")
    if not chunk_times:
        return RequestResult(success=False, start_time=start - t0, error="no output chunk received")
    text = "".join(text_parts)
    prompt_len = usage.get("prompt_tokens") if usage else None
    output_tokens = usage.get("completion_tokens") if usage else None
    if prompt_len is None:
        prompt_len = inp.request.prompt_len
    if output_tokens is None:
        output_tokens = count_tokens(text) if count_tokens else len(chunk_times)
    return result_from_chunk_times(start - t0, chunk_times, prompt_len, output_tokens, text)


def arrival_intervals(n: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> np.ndarray:
    """Gaps (seconds) before each of ``n`` requests after the first: zeros when
    ``request_rate`` is inf; otherwise gamma(shape=burstiness, scale=1/(rate*burstiness)),
    whose mean is ``1/request_rate`` (vLLM's ``get_request``)."""
    if burstiness <= 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if request_rate <= 0:
        raise ValueError(f"request_rate must be > 0 (or inf), got {request_rate}")
    if np.isinf(request_rate):
        return np.zeros(n)
    rng = np.random.default_rng(seed)
    return rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=n)


async def run_benchmark(
    base_url: str,
    model: str,
    requests: list[SampleRequest],
    endpoint: str = "completions",
    api_key: str | None = None,
    request_rate: float = float("inf"),
    burstiness: float = 1.0,
    max_concurrency: int | None = None,
    ignore_eos: bool = False,
    seed: int = 0,
    disable_tqdm: bool = False,
    warmup: bool = True,
    timeout_s: float = 3600.0,
    count_tokens=None,
) -> tuple[list[RequestResult], float]:
    """Run the load; returns (results in request order, duration in seconds)."""
    import httpx
    from tqdm.asyncio import tqdm

    if endpoint not in ENDPOINTS:
        raise ValueError(f"endpoint must be one of {sorted(ENDPOINTS)}, got {endpoint!r}")
    api_url = base_url.rstrip("/") + ENDPOINTS[endpoint]
    if base_url.rstrip("/").endswith("/v1"):
        api_url = base_url.rstrip("/") + ENDPOINTS[endpoint][3:]
    limits = httpx.Limits(max_connections=max_concurrency or max(len(requests), 1) + 1, max_keepalive_connections=None)
    inputs = [RequestInput(api_url, model, r, endpoint, ignore_eos, api_key) for r in requests]
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=30.0), limits=limits) as client:
        if warmup and inputs:
            test = RequestInput(
                api_url,
                model,
                SampleRequest(
                    requests[0].prompt,
                    requests[0].prompt_len,
                    min(4, requests[0].expected_output_len),
                    requests[0].system,
                ),
                endpoint,
                ignore_eos,
                api_key,
            )
            res = await send_request(client, test, time.perf_counter(), count_tokens)
            if not res.success:
                raise RuntimeError(f"warm-up request to {api_url} failed: {res.error}")
        semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        pbar = tqdm(total=len(inputs), disable=disable_tqdm, desc="requests", unit="req")
        gaps = arrival_intervals(len(inputs), request_rate, burstiness, seed)

        async def one(inp: RequestInput) -> RequestResult:
            if semaphore is None:
                res = await send_request(client, inp, t0, count_tokens)
            else:
                async with semaphore:
                    res = await send_request(client, inp, t0, count_tokens)
            pbar.update(1)
            return res

        t0 = time.perf_counter()
        tasks = []
        for i, inp in enumerate(inputs):
            if i and gaps[i] > 0:
                await asyncio.sleep(float(gaps[i]))
            tasks.append(asyncio.create_task(one(inp)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        pbar.close()
    return list(results), duration


def plot_serve(results: list[RequestResult], duration: float, path: str, title: str = "kvfleet bench serve") -> None:
    """Latency CDFs (TTFT, TPOT, ITL, e2e; milliseconds) and output tokens/s over time, to ``path``."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in results if r.success]
    series = {
        "TTFT": [r.ttft * 1e3 for r in done],
        "TPOT": [r.tpot * 1e3 for r in done if r.tpot is not None],
        "ITL": [g * 1e3 for r in done for g in r.itl],
        "e2e latency": [r.latency * 1e3 for r in done],
    }
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, values in series.items():
        if values:
            xs = np.sort(values)
            axes[0].plot(xs, np.arange(1, len(xs) + 1) / len(xs), label=name)
    axes[0].set_xscale("log")
    axes[0].xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    axes[0].set_xlabel("latency (ms, log scale)")
    axes[0].set_ylabel("fraction of requests / chunks")
    axes[0].set_title("latency CDFs")
    axes[0].grid(True, which="both", alpha=0.3)
    axes[0].legend()
    bin_s = max(duration / 60.0, 0.25)
    starts, tps = throughput_timeline(results, duration, bin_s)
    axes[1].step(starts, tps, where="post")
    axes[1].set_xlabel("time since start (s)")
    axes[1].set_ylabel("output tokens/s")
    axes[1].set_title(f"output throughput ({bin_s:.2f} s bins)")
    axes[1].grid(True, alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_arguments(p) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (or .../v1); default %(default)s")
    p.add_argument(
        "--model", default=None, help="model name sent in requests (default: the server's first /v1/models entry)"
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer path for building prompts and counting "
        "(default: --model if it is a path, else the default model's)",
    )
    p.add_argument("--api-key", default=env.SERVE_OPTION.read("api_key") or os.environ.get("OPENAI_API_KEY"))
    p.add_argument("--endpoint", choices=sorted(ENDPOINTS), default="completions")
    p.add_argument("--dataset-name", choices=["random", "sharegpt", "shared-prefix"], default="random")
    p.add_argument(
        "--dataset-path", default=None, help="ShareGPT JSON file (sharegpt); without it the built-in synthetic set"
    )
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument(
        "--input-len", type=int, default=128, help="random/shared-prefix: prompt tokens (per request, after the prefix)"
    )
    p.add_argument(
        "--output-len",
        type=int,
        default=None,
        help="output tokens (random default 64; sharegpt: override the dataset's)",
    )
    p.add_argument("--range-ratio", type=float, default=0.0, help="random: lengths uniform in [len*(1-r), len*(1+r)]")
    p.add_argument(
        "--prefix-len", type=int, default=256, help="shared-prefix: system prompt tokens shared by all requests"
    )
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s; inf = all at once (default)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of inter-arrival times; 1 = Poisson")
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--ignore-eos", action="store_true", help="ask for exactly max_tokens output tokens (vLLM's ignore_eos)"
    )
    p.add_argument("--goodput", nargs="+", default=None, metavar="METRIC:MS", help="SLOs, e.g. ttft:500 tpot:50 (ms)")
    p.add_argument("--percentiles", default="50,90,99", help="comma-separated percentiles to report")
    p.add_argument("--output-json", default=None, help="write the report and per-request timings here")
    p.add_argument("--plot", default=None, help="write latency CDFs and throughput over time to this PNG")
    p.add_argument("--disable-tqdm", action="store_true")
    p.add_argument("--no-warmup", action="store_true", help="skip the uncounted warm-up request")
    p.add_argument("--timeout", type=float, default=3600.0, help="per-request timeout, seconds")


def build_requests(args, tokenizer) -> list[SampleRequest]:
    from kvfleet.runtime.bench import datasets as ds

    if args.num_prompts < 1:
        raise ValueError("num-prompts must be >= 1")
    if args.dataset_name == "random":
        return ds.random_dataset(
            tokenizer, args.num_prompts, args.input_len, args.output_len or 64, args.range_ratio, args.seed
        )
    if args.dataset_name == "sharegpt":
        return ds.sharegpt_dataset(tokenizer, args.num_prompts, args.dataset_path, args.output_len, args.seed)
    return ds.shared_prefix_dataset(
        tokenizer, args.num_prompts, args.prefix_len, args.input_len, args.output_len or 64, args.seed
    )


def _first_model(base_url: str, api_key: str | None) -> str:
    import httpx

    root = base_url.rstrip("/")
    url = root + ("/models" if root.endswith("/v1") else "/v1/models")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        resp = httpx.get(url, headers=headers, timeout=30)
        resp.raise_for_status()
        return resp.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        raise RuntimeError(f"could not list the server's models at {url} (give --model): {exc}") from exc


def main(args) -> int:
    """Run ``kvfleet bench serve`` with parsed arguments; returns the exit status."""
    from kvfleet.runtime.bench.metrics import parse_goodput

    percentiles = [float(q) for q in str(args.percentiles).split(",") if q.strip()]
    slos = parse_goodput(args.goodput)
    model = args.model or _first_model(args.base_url, args.api_key)
    tokenizer = load_tokenizer(args.tokenizer or (args.model if args.model and os.path.exists(args.model) else None))
    requests = build_requests(args, tokenizer)

    def count_tokens(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    rate = args.request_rate
    print(
        f"Traffic request rate: {rate} req/s; burstiness {args.burstiness} "
        f"({'Poisson process' if args.burstiness == 1.0 else 'gamma distribution'}); "
        f"max concurrency: {args.max_concurrency}"
    )
    results, duration = asyncio.run(
        run_benchmark(
            args.base_url,
            model,
            requests,
            args.endpoint,
            args.api_key,
            rate,
            args.burstiness,
            args.max_concurrency,
            args.ignore_eos,
            args.seed,
            args.disable_tqdm,
            not args.no_warmup,
            args.timeout,
            count_tokens,
        )
    )
    report = compute_metrics(results, duration, percentiles, slos)
    print(format_report(report, percentiles))
    failed = [r for r in results if not r.success]
    if failed:
        print(f"first error: {failed[0].error}")
    if args.output_json:
        doc = {
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "host": platform.node(),
            "kvfleet_revision": source_revision(),
            "base_url": args.base_url,
            "model": model,
            "endpoint": args.endpoint,
            "dataset_name": args.dataset_name,
            "num_prompts": args.num_prompts,
            "request_rate": "inf" if np.isinf(rate) else rate,
            "burstiness": args.burstiness,
            "max_concurrency": args.max_concurrency,
            "ignore_eos": args.ignore_eos,
            "seed": args.seed,
            "percentiles": percentiles,
            **report,
            "requests": [{**r.to_dict(), "tpot": r.tpot} for r in results],
        }
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1)
        print(f"wrote {args.output_json}")
    if args.plot:
        plot_serve(
            results,
            duration,
            args.plot,
            f"kvfleet bench serve: {model}, {args.dataset_name}, {args.num_prompts} prompts",
        )
        print(f"wrote {args.plot}")
    return 0 if report["completed"] else 1
