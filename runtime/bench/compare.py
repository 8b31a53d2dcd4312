"""``kvfleet bench compare``: one workload, three ways of serving it, on this machine.

For each concurrency level C (``--concurrency 8,32,64``) the same ``num_prompts``
requests (random token-id prompts, lengths uniform in ``--input-len-range``; exact
output lengths uniform in ``--output-len-range``; greedy, EOS ignored so every system
produces exactly the same number of tokens) go through:

- **kvfleet**: kvfleet's engine in-process (``LLMEngine``: continuous batching over a
  paged KV cache);
- **transformers static**: ``model.generate()`` on left-padded batches of C prompts, each
  batch running until its longest request is done (the traditional baseline);
- **transformers continuous**: transformers' own continuous batching
  (``ContinuousBatchingManager``, the machinery behind ``model.generate_batch``), with
  ``max_requests_per_batch=C``.

Concurrency follows ``vllm bench serve --max-concurrency``: at most C requests are in
flight; when one finishes the next is submitted, and a request's latency runs from its
submission (static: from the start of its batch) to its last token (static: the end of
its batch, when ``generate()`` returns). Output token throughput is the workload's output
tokens over the wall time of the whole run, tokens/s.

Beside it:

- the **compute roofline**: the workload's FLOPs (linear layers + attention + LM head,
  :func:`workload_flops`) at the best FLOP/s this machine reaches on the model's own
  matmuls (:func:`measure_matmul_flops`, ``--prefill-tokens`` rows), as output tokens/s,
  and kvfleet's share of it;
- the **KV-memory report** (:func:`kv_memory_report`): on a mixed-length workload, the
  share of allocated KV slots that hold real tokens with paged allocation (``block_size``)
  versus reserving ``max_model_len`` per request (or the padded batch's length, as static
  batching does), and how many sequences each fits in the same KV budget.
"""

from __future__ import annotations

import json
import math
import os
import platform
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone

# As kvfleet's engine does (docs/engine.md, "CPU threads"): idle OpenMP threads sleep
# instead of spinning, which on a shared CPU keeps decode steps from slowing 10-20x. Set
# before torch loads, so that all three systems run under the same policy.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402

from kvfleet.runtime.bench.metrics import RequestResult, compute_metrics

SYSTEMS = ("kvfleet", "hf-static", "hf-continuous")
SYSTEM_LABELS = {
    "kvfleet": "kvfleet (continuous, paged)",
    "hf-static": "transformers generate() static batches",
    "hf-continuous": "transformers continuous batching",
}


# --------------------------------------------------------------------------- workload


@dataclass
class Workload:
    """Prompts (token ids) and exact output lengths (tokens), one per request."""

    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def prompt_lens(self) -> list[int]:
        return [len(p) for p in self.prompts]

    def __len__(self) -> int:
        return len(self.prompts)

    def take(self, n: int) -> "Workload":
        return Workload(self.prompts[:n], self.output_lens[:n])


def parse_range(text: str) -> tuple[int, int]:
    """``"16:256"`` -> (16, 256), inclusive token bounds."""
    lo, sep, hi = str(text).partition(":")
    try:
        bounds = (int(lo), int(hi if sep else lo))
    except ValueError:
        raise ValueError(f"expected MIN:MAX tokens, got {text!r}") from None
    if bounds[0] < 1 or bounds[1] < bounds[0]:
        raise ValueError(f"expected 1 <= MIN <= MAX, got {text!r}")
    return bounds


def sample_lengths(n: int, input_range: tuple[int, int], output_range: tuple[int, int], seed: int = 0,
                   dist: str = "uniform", sigma: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """Prompt and output lengths (tokens) within their inclusive ranges.

    ``dist="uniform"``: uniform over each range. ``dist="lognormal"``: heavy-tailed like
    chat logs (ShareGPT): lognormal with median the range's geometric midpoint
    ``sqrt(min * max)`` and shape ``sigma``, rounded and clipped to the range.
    """
    rng = np.random.default_rng(seed)
    if dist == "uniform":
        return rng.integers(input_range[0], input_range[1] + 1, size=n), rng.integers(output_range[0], output_range[1] + 1, size=n)
    if dist != "lognormal":
        raise ValueError(f"length distribution must be uniform or lognormal, got {dist!r}")
    if not sigma > 0:
        raise ValueError(f"sigma must be > 0, got {sigma}")

    def draw(lo: int, hi: int) -> np.ndarray:
        return np.clip(np.round(rng.lognormal(np.log(np.sqrt(lo * hi)), sigma, size=n)), lo, hi).astype(np.int64)

    return draw(*input_range), draw(*output_range)


def make_workload(n: int, input_range: tuple[int, int], output_range: tuple[int, int], vocab_size: int, special_ids=(), seed: int = 0,
                  dist: str = "uniform", sigma: float = 1.0) -> Workload:
    """``n`` requests of random (non-special) token ids with lengths from :func:`sample_lengths`."""
    p_lens, o_lens = sample_lengths(n, input_range, output_range, seed, dist, sigma)
    rng = np.random.default_rng(seed + 1)
    allowed = np.setdiff1d(np.arange(vocab_size), np.asarray(list(special_ids), dtype=np.int64))
    prompts = [rng.choice(allowed, size=int(p)).tolist() for p in p_lens]
    return Workload(prompts, [int(o) for o in o_lens])


# --------------------------------------------------------------------------- roofline


@dataclass
class ModelShape:
    """The dimensions of a Llama-style decoder that set its FLOPs and KV bytes."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int

    @classmethod
    def from_config(cls, config) -> "ModelShape":
        heads = config.num_attention_heads
        return cls(
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            vocab_size=config.vocab_size,
        )

    def layer_matmul_shapes(self) -> list[tuple[int, int]]:
        """(in_features, out_features) of one layer's linear maps: q, k, v, o, gate, up, down."""
        h, q, kv, i = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.intermediate_size
        return [(h, q), (h, kv), (h, kv), (q, h), (h, i), (h, i), (i, h)]

    @property
    def linear_flops_per_token(self) -> int:
        """2 x multiply-adds of all layers' linear maps for one token (no LM head), FLOPs."""
        return 2 * self.num_layers * sum(a * b for a, b in self.layer_matmul_shapes())

    @property
    def lm_head_flops(self) -> int:
        """FLOPs of the LM head for one sampled token."""
        return 2 * self.hidden_size * self.vocab_size

    @property
    def attention_flops_per_key(self) -> int:
        """FLOPs of QK^T plus PV for one query token against one key, all layers."""
        return 4 * self.num_layers * self.num_heads * self.head_dim

    def kv_bytes_per_token(self, dtype_bytes: int = 4) -> int:
        """Bytes of K and V for one token, all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


def workload_flops(prompt_lens, output_lens, shape: ModelShape) -> tuple[float, float]:
    """(prefill FLOPs, decode FLOPs) that any engine must spend on a workload.

    Prefill: every prompt token through the linear maps, causal attention over the
    prompt (token t attends to t+1 keys) and one LM head (the first output token).
    Decode: output tokens 2..o each feed the previous token (o-1 forward tokens per
    request, at positions p..p+o-2, attending to p+1..p+o-1 keys) plus an LM head.
    """
    pre = dec = 0.0
    for p, o in zip(prompt_lens, output_lens):
        p, o = int(p), int(o)
        pre += p * shape.linear_flops_per_token + shape.attention_flops_per_key * p * (p + 1) / 2 + shape.lm_head_flops
        n_dec = max(o - 1, 0)
        keys = (p + 1 + p + o - 1) * n_dec / 2  # sum of k for k = p+1 .. p+o-1
        dec += n_dec * (shape.linear_flops_per_token + shape.lm_head_flops) + shape.attention_flops_per_key * keys
    return pre, dec


def model_linear_weights(model, include_lm_head: bool = True) -> list:
    """The weight matrices of every ``nn.Linear`` of ``model`` (all layers' q/k/v/o and
    MLP projections, and the LM head when asked), in forward order."""
    import torch

    lm_head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not lm_head]
    if include_lm_head and lm_head is not None:
        weights.append(lm_head.weight)
    return weights


def static_batch_flops(prompt_lens, output_lens, batch: int, shape: ModelShape) -> float:
    """FLOPs that static padded batching spends: every request of a batch of ``batch``
    consecutive requests is computed at the batch's longest prompt and longest output."""
    total = 0.0
    p, o = list(prompt_lens), list(output_lens)
    for s in range(0, len(p), batch):
        n = len(p[s : s + batch])
        pre, dec = workload_flops([max(p[s : s + batch])] * n, [max(o[s : s + batch])] * n, shape)
        total += pre + dec
    return total


def measure_matmul_flops(weights, tokens: int, min_seconds: float = 0.5, repeats: int = 3) -> float:
    """FLOP/s this machine reaches on ``torch.nn.functional.linear`` of a ``[tokens, in]``
    activation with each of ``weights`` (``[out, in]``) in turn: the model's own matmuls,
    one forward pass's worth, so that decode-sized batches are as memory-bound as in the
    real model. Best of ``repeats`` timings of at least ``min_seconds`` each."""
    import torch

    gen = torch.Generator().manual_seed(0)
    xs = {w.shape[1]: torch.randn(tokens, w.shape[1], generator=gen, dtype=w.dtype) for w in weights}
    flops = sum(2 * tokens * w.shape[0] * w.shape[1] for w in weights)
    F = torch.nn.functional.linear
    best = 0.0
    with torch.inference_mode():
        for w in weights:
            F(xs[w.shape[1]], w)
        for _ in range(repeats):
            n, t0 = 0, time.perf_counter()
            while True:
                for w in weights:
                    F(xs[w.shape[1]], w)
                n += 1
                dt = time.perf_counter() - t0
                if dt >= min_seconds:
                    break
            best = max(best, n * flops / dt)
    return best


@dataclass
class Roofline:
    """Compute roofline of a workload on this machine: the time its FLOPs take at the best
    matmul FLOP/s measured here, and the output token throughput that allows. No engine
    can beat it; decode at small batches is memory-bound and stays well below it."""

    prefill_gflop: float
    decode_gflop: float
    peak_gflops_per_s: float
    """Best measured matmul GFLOP/s (the model's own weights, ``--prefill-tokens`` rows)."""
    seconds: float
    """(prefill + decode FLOPs) / peak FLOP/s."""
    output_tokens: int
    output_tokens_per_s: float
    """Output tokens / ``seconds``: the best output token throughput compute allows, tokens/s."""
    decode_shape_gflops_per_s: float | None = None
    """Measured matmul GFLOP/s with as many rows as the concurrency level (a decode step's
    shape), for reference."""

    @property
    def gflop(self) -> float:
        return self.prefill_gflop + self.decode_gflop


def roofline(workload: Workload, shape: ModelShape, peak_flops_per_s: float, decode_shape_flops_per_s: float | None = None) -> Roofline:
    """The :class:`Roofline` of ``workload`` (FLOPs from :func:`workload_flops`) at
    ``peak_flops_per_s`` FLOP/s."""
    pre, dec = workload_flops(workload.prompt_lens, workload.output_lens, shape)
    seconds = (pre + dec) / peak_flops_per_s
    out = sum(workload.output_lens)
    return Roofline(pre / 1e9, dec / 1e9, peak_flops_per_s / 1e9, seconds, out, out / seconds,
                    None if decode_shape_flops_per_s is None else decode_shape_flops_per_s / 1e9)


# --------------------------------------------------------------------------- KV memory


def kv_memory_report(prompt_lens, output_lens, block_size: int, max_model_len: int, kv_bytes_per_token: int, kv_budget_bytes: int, static_batch: int) -> list[dict]:
    """How well three KV allocation schemes use memory on a mixed-length workload.

    Each request holds ``prompt + output`` real tokens at its peak. Schemes:

    - ``paged``: ``ceil(tokens / block_size)`` blocks of ``block_size`` slots (PagedAttention);
    - ``reserve max_model_len``: ``max_model_len`` slots per request, reserved up front;
    - ``static padded batch``: each batch of ``static_batch`` consecutive requests reserves
      (longest prompt + longest output of the batch) slots per request, as padded
      ``generate()`` does.

    Returns one dict per scheme: ``scheme``, ``allocated_slots``, ``real_tokens``,
    ``utilization`` (real / allocated, 0-1), ``slots_per_seq`` (mean), and
    ``max_concurrent_seqs``: how many sequences of this workload's mean footprint fit in
    ``kv_budget_bytes`` (``floor(budget_slots / slots_per_seq)``; paged: whole blocks).
    """
    p = np.asarray(prompt_lens, dtype=np.int64)
    o = np.asarray(output_lens, dtype=np.int64)
    real = p + o
    if len(real) == 0:
        raise ValueError("empty workload")
    if real.max() > max_model_len:
        raise ValueError(f"a request of {int(real.max())} tokens exceeds max_model_len {max_model_len}")
    budget_slots = kv_budget_bytes // kv_bytes_per_token
    paged = np.ceil(real / block_size).astype(np.int64) * block_size
    reserve = np.full_like(real, max_model_len)
    static = np.empty_like(real)
    for s in range(0, len(real), static_batch):
        static[s : s + static_batch] = p[s : s + static_batch].max() + o[s : s + static_batch].max()
    rows = []
    for name, alloc in (("paged (block_size %d)" % block_size, paged), ("reserve max_model_len (%d)" % max_model_len, reserve),
                        ("static padded batch of %d" % static_batch, static)):
        per_seq = float(alloc.mean())
        if name.startswith("paged"):
            fits = int((budget_slots // block_size) // (per_seq / block_size))
        else:
            fits = int(budget_slots // per_seq)
        rows.append({
            "scheme": name,
            "allocated_slots": int(alloc.sum()),
            "real_tokens": int(real.sum()),
            "utilization": float(real.sum() / alloc.sum()),
            "slots_per_seq": per_seq,
            "max_concurrent_seqs": fits,
        })
    return rows


# --------------------------------------------------------------------------- runners


@dataclass
class RunResult:
    """One system at one concurrency level."""

    system: str
    concurrency: int
    duration: float
    """Wall time from the first submission to the last completion, seconds."""
    results: list[RequestResult] = field(repr=False, default_factory=list)
    report: dict = field(default_factory=dict)
    error: str | None = None

    @property
    def output_throughput(self) -> float:
        return self.report.get("output_throughput", 0.0)

    @property
    def p99_e2e_s(self) -> float:
        return self.report.get("p99_e2el_ms", float("nan")) / 1000.0


def _finish(system: str, c: int, results: list[RequestResult], duration: float, workload: Workload) -> RunResult:
    for r, o in zip(results, workload.output_lens):
        if r.success and r.output_tokens != o:
            r.success = False
            r.error = f"produced {r.output_tokens} tokens, expected {o}"
    run = RunResult(system, c, duration, results, compute_metrics(results, duration))
    bad = [r.error for r in results if not r.success]
    if bad:
        run.error = f"{len(bad)} requests failed; first: {bad[0]}"
    return run


def _warmup_prompt(workload: Workload) -> list[int]:
    """16 tokens that prefix no request of the workload (so no prefix cache is primed)."""
    return list(reversed(workload.prompts[-1]))[:16]


def run_hf_static(model, workload: Workload, concurrency: int, pad_token_id: int, progress=None) -> RunResult:
    """transformers ``generate()`` on left-padded batches of ``concurrency`` prompts."""
    import torch
    from transformers import StoppingCriteria, StoppingCriteriaList

    class StepClock(StoppingCriteria):
        def __init__(self):
            self.times: list[float] = []

        def __call__(self, input_ids, scores, **kwargs):
            self.times.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    results: list[RequestResult] = [None] * len(workload)  # type: ignore[list-item]
    t0 = time.perf_counter()
    for s in range(0, len(workload), concurrency):
        idx = list(range(s, min(s + concurrency, len(workload))))
        prompts = [workload.prompts[i] for i in idx]
        width = max(len(x) for x in prompts)
        ids = torch.full((len(idx), width), pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(idx), width), dtype=torch.long)
        for row, x in enumerate(prompts):
            ids[row, width - len(x):] = torch.tensor(x)
            mask[row, width - len(x):] = 1
        new = max(workload.output_lens[i] for i in idx)
        clock = StepClock()
        b0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                 pad_token_id=pad_token_id, stopping_criteria=StoppingCriteriaList([clock]))
        b1 = time.perf_counter()
        produced = out.shape[1] - width
        for row, i in enumerate(idx):
            o = workload.output_lens[i]
            times = [t - t0 for t in clock.times[:o]]
            ok = produced >= o and len(times) == o
            results[i] = RequestResult(
                success=ok, prompt_len=len(workload.prompts[i]), output_tokens=o if ok else produced,
                start_time=b0 - t0, ttft=(clock.times[0] - b0) if clock.times else 0.0, latency=b1 - b0,
                itl=[b - a for a, b in zip(times, times[1:])], chunk_times=times,
                error="" if ok else f"generate() produced {produced} tokens, expected {o}",
            )
        if progress is not None:
            progress.update(len(idx))
    return _finish("hf-static", concurrency, results, time.perf_counter() - t0, workload)


def run_hf_continuous(model, workload: Workload, concurrency: int, pad_token_id: int, progress=None) -> RunResult:
    """transformers' continuous batching (``ContinuousBatchingManager``, what
    ``generate_batch`` drives), ``max_requests_per_batch=concurrency``, per-request
    ``max_new_tokens`` and EOS disabled (``eos_token_id=-1``)."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    gen_cfg = GenerationConfig(do_sample=False, max_new_tokens=max(workload.output_lens), eos_token_id=-1, pad_token_id=pad_token_id)
    cb_cfg = ContinuousBatchingConfig(max_requests_per_batch=concurrency)
    hints = WorkloadHints(max_prompt_length=max(workload.prompt_lens), max_generated_length=max(workload.output_lens), num_requests=len(workload))
    results: list[RequestResult] = [None] * len(workload)  # type: ignore[list-item]
    with model.continuous_batching_context_manager(generation_config=gen_cfg, continuous_batching_config=cb_cfg, block=True,
                                                   timeout=60, workload_hints=hints) as manager:
        # warm-up request, not timed
        manager.add_request(_warmup_prompt(workload), request_id="warmup", max_new_tokens=2, eos_token_id=-1)
        while True:
            r = manager.get_result(timeout=60)
            if r is None:
                raise RuntimeError("transformers continuous batching: warm-up request got no result")
            if r.is_finished():
                break
        t0 = time.perf_counter()
        submitted: dict[str, tuple[int, float]] = {}
        nxt = done = 0

        def submit():
            nonlocal nxt
            i = nxt
            nxt += 1
            rid = f"r{i}"
            submitted[rid] = (i, time.perf_counter())
            manager.add_request(workload.prompts[i], request_id=rid, max_new_tokens=workload.output_lens[i], eos_token_id=-1, record_timestamps=True)

        while nxt < min(concurrency, len(workload)):
            submit()
        while done < len(workload):
            r = manager.get_result(timeout=1)
            if r is None:
                if not manager.is_running():
                    raise RuntimeError("transformers continuous batching: generation thread stopped")
                continue
            if not r.is_finished() or r.request_id not in submitted:
                continue
            i, sent = submitted.pop(r.request_id)
            stamps = list(r.timestamps or [])
            n = len(r.generated_tokens)
            if r.error is None and stamps:
                results[i] = RequestResult(
                    success=True, prompt_len=len(workload.prompts[i]), output_tokens=n, start_time=sent - t0,
                    ttft=stamps[0] - sent, latency=stamps[-1] - sent, itl=[b - a for a, b in zip(stamps, stamps[1:])],
                    chunk_times=[t - t0 for t in stamps])
            else:
                results[i] = RequestResult(success=False, prompt_len=len(workload.prompts[i]), output_tokens=n, start_time=sent - t0,
                                           error=str(r.error or "no timestamps"))
            done += 1
            if progress is not None:
                progress.update(1)
            if nxt < len(workload):
                submit()
        duration = time.perf_counter() - t0
    return _finish("hf-continuous", concurrency, results, duration, workload)


def run_kvfleet(engine_factory, workload: Workload, concurrency: int, progress=None) -> RunResult:
    """kvfleet's ``LLMEngine`` in-process: at most ``concurrency`` requests in flight,
    greedy, ``ignore_eos`` with ``max_tokens`` = the request's output length."""
    from kvfleet.runtime.sampling_params import SamplingParams

    engine = engine_factory(concurrency)
    # warm-up request, not timed
    engine.add_request("warmup", _warmup_prompt(workload), SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    results: list[RequestResult] = [None] * len(workload)  # type: ignore[list-item]
    t0 = time.perf_counter()
    sent_at: dict[str, tuple[int, float]] = {}
    times: dict[str, list[float]] = {}
    nxt = done = 0

    def submit():
        nonlocal nxt
        i = nxt
        nxt += 1
        rid = f"r{i}"
        sent_at[rid] = (i, time.perf_counter())
        times[rid] = []
        params = SamplingParams(max_tokens=workload.output_lens[i], min_tokens=workload.output_lens[i], temperature=0.0, ignore_eos=True)
        engine.add_request(rid, workload.prompts[i], params)

    while nxt < min(concurrency, len(workload)):
        submit()
    while done < len(workload):
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            rid = out.request_id
            if rid not in sent_at:
                continue
            n = len(out.outputs[0].token_ids)
            stamps = times[rid]
            stamps.extend([now] * (n - len(stamps)))
            if out.finished:
                i, sent = sent_at.pop(rid)
                results[i] = RequestResult(
                    success=True, prompt_len=len(workload.prompts[i]), output_tokens=n, start_time=sent - t0,
                    ttft=stamps[0] - sent, latency=stamps[-1] - sent, itl=[b - a for a, b in zip(stamps, stamps[1:])],
                    chunk_times=[t - t0 for t in stamps])
                done += 1
                if progress is not None:
                    progress.update(1)
                if nxt < len(workload):
                    submit()
    return _finish("kvfleet", concurrency, results, time.perf_counter() - t0, workload)


# --------------------------------------------------------------------------- report


def cpu_description() -> str:
    """CPU model name (``/proc/cpuinfo``) and logical core count."""
    name = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{name}, {os.cpu_count()} logical cores"


def format_level_table(runs: list[RunResult], roof: Roofline | None = None) -> str:
    """Markdown table of one concurrency level with ratios to kvfleet."""
    ref = next((r for r in runs if r.system == "kvfleet" and not r.error), None)
    lines = ["| system | output tok/s | p99 e2e (s) | mean TTFT (s) | wall (s) | kvfleet speed-up | kvfleet p99 / system p99 |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in runs:
        if r.error and not r.report.get("completed"):
            lines.append(f"| {SYSTEM_LABELS.get(r.system, r.system)} | failed: {r.error} | | | | | |")
            continue
        tps, p99 = r.output_throughput, r.p99_e2e_s
        speed = f"{ref.output_throughput / tps:.2f}x" if ref and tps else "-"
        lat = f"{ref.p99_e2e_s / p99:.2f}" if ref and p99 else "-"
        note = f" ({r.error})" if r.error else ""
        lines.append(f"| {SYSTEM_LABELS.get(r.system, r.system)}{note} | {tps:.1f} | {p99:.2f} | {r.report['mean_ttft_ms'] / 1e3:.2f} | {r.duration:.1f} | {speed} | {lat} |")
    if roof is not None:
        share = f"kvfleet at {ref.output_throughput / roof.output_tokens_per_s:.0%} of it" if ref else ""
        lines.append(f"| compute roofline: {roof.gflop:.0f} GFLOP at {roof.peak_gflops_per_s:.0f} GFLOP/s | {roof.output_tokens_per_s:.1f} | | | {roof.seconds:.1f} | {share} | |")
    return "\n".join(lines)


def format_kv_table(rows: list[dict]) -> str:
    lines = ["| KV allocation | slots allocated | real tokens | share of slots holding real tokens | slots per sequence | max concurrent sequences in the budget |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['scheme']} | {r['allocated_slots']} | {r['real_tokens']} | {r['utilization']:.1%} | {r['slots_per_seq']:.0f} | {r['max_concurrent_seqs']} |")
    return "\n".join(lines)


def plot_compare(levels: dict[int, list[RunResult]], roofs: dict[int, Roofline], path: str, title: str) -> None:
    """Output tokens/s and p99 e2e latency per concurrency level and system, to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cs = sorted(levels)
    systems = [s for s in SYSTEMS if any(r.system == s for c in cs for r in levels[c])]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / max(len(systems), 1)
    x = np.arange(len(cs))
    for k, s in enumerate(systems):
        tps = [next((r.output_throughput for r in levels[c] if r.system == s), 0.0) for c in cs]
        p99 = [next((r.p99_e2e_s for r in levels[c] if r.system == s), 0.0) for c in cs]
        axes[0].bar(x + k * width, tps, width, label=SYSTEM_LABELS[s])
        axes[1].bar(x + k * width, p99, width, label=SYSTEM_LABELS[s])
    if roofs:
        axes[0].plot(x + width * (len(systems) - 1) / 2, [roofs[c].output_tokens_per_s if c in roofs else np.nan for c in cs], "k_", markersize=40,
                     label="compute roofline")
    for ax, ylabel in ((axes[0], "output tokens/s (higher is better)"), (axes[1], "p99 e2e latency, s (lower is better)")):
        ax.set_xticks(x + width * (len(systems) - 1) / 2, [f"C={c}" for c in cs])
        ax.set_ylabel(ylabel)
        ax.grid(True, axis="y", alpha=0.3)
    axes[0].legend(fontsize=8, loc="upper left")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------- CLI


def add_arguments(p) -> None:
    p.add_argument("--model", default=None, help="checkpoint dir, .gguf or hub id (default: SmolLM2-135M-Instruct)")
    p.add_argument("--concurrency", default="8,32,64", help="comma-separated concurrency levels (default %(default)s)")
    p.add_argument("--num-prompts", type=int, default=None, help="requests per level (default: the level's concurrency)")
    p.add_argument("--input-len-range", default="16:256", help="prompt tokens MIN:MAX, uniform (default %(default)s)")
    p.add_argument("--output-len-range", default="16:128", help="output tokens MIN:MAX, uniform (default %(default)s)")
    p.add_argument("--length-dist", choices=["uniform", "lognormal"], default="uniform",
                   help="uniform over the ranges, or lognormal (heavy-tailed like ShareGPT) with median sqrt(MIN*MAX), clipped")
    p.add_argument("--sigma", type=float, default=1.0, help="shape of --length-dist lognormal")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"subset of {','.join(SYSTEMS)}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="kvfleet token budget per step (default: the engine's)")
    p.add_argument("--kv-cache-memory", type=int, default=None, help="KV budget, bytes (default: the engine's CPU default)")
    p.add_argument("--max-model-len", type=int, default=None, help="for the KV report (default: the model's context length)")
    p.add_argument("--kv-report-requests", type=int, default=1000, help="requests in the KV-memory report's mixed workload")
    p.add_argument("--prefill-tokens", type=int, default=512, help="rows of the prefill-shaped matmul timing")
    p.add_argument("--output-json", default=None)
    p.add_argument("--plot", default=None, help="PNG: tokens/s and p99 latency per level")
    p.add_argument("--disable-tqdm", action="store_true")


def _kvfleet_engine_factory(model_path: str, args):
    """Build kvfleet's engine for one concurrency level (``max_num_seqs`` >= the level).

    The model is loaded once, on first use, and shared by the engines of all levels
    (each engine allocates its own KV cache; the previous one is dropped first)."""
    from kvfleet.runtime.config import EngineConfig
    from kvfleet.runtime.engine.llm_engine import LLMEngine
    from kvfleet.runtime.worker.model_loader import load_model

    state: dict = {}

    def factory(concurrency: int):
        state.pop("engine", None)
        if "loaded" not in state:
            state["loaded"] = load_model(model_path, dtype="float32", device="cpu")
        cfg = dict(model=model_path, dtype="float32", device="cpu", block_size=args.block_size, max_num_seqs=max(concurrency, 1))
        if args.max_num_batched_tokens:
            cfg["max_num_batched_tokens"] = args.max_num_batched_tokens
        if args.kv_cache_memory:
            cfg["kv_cache_memory"] = args.kv_cache_memory
        state["engine"] = LLMEngine(EngineConfig(**cfg), loaded=state["loaded"])
        return state["engine"]

    return factory


def main(args) -> int:
    """Run ``kvfleet bench compare`` with parsed arguments; returns the exit status."""
    import torch
    from tqdm import tqdm

    from kvfleet.runtime.bench.serve import source_revision
    from kvfleet.runtime.config import DEFAULT_KV_CACHE_MEMORY
    from kvfleet.runtime.worker.model_loader import load_model, resolve_model_path

    levels = sorted({int(c) for c in str(args.concurrency).split(",") if c.strip()})
    if not levels or levels[0] < 1:
        raise ValueError("concurrency levels must be integers >= 1")
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        raise ValueError(f"unknown systems {sorted(unknown)}; choose from {SYSTEMS}")
    in_range, out_range = parse_range(args.input_len_range), parse_range(args.output_len_range)
    if args.threads:
        torch.set_num_threads(args.threads)
    started = datetime.now(timezone.utc)
    print(f"kvfleet bench compare on {cpu_description()}, torch {torch.__version__} with {torch.get_num_threads()} threads, "
          f"{started:%Y-%m-%d %H:%M} UTC, kvfleet {source_revision() or 'outside git'}")

    model_path, model_name = resolve_model_path(args.model)
    loaded = load_model(model_path, dtype="float32", device="cpu")
    hf_model, tok = loaded.model, loaded.tokenizer
    shape = ModelShape.from_config(hf_model.config)
    pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    special = getattr(tok, "all_special_ids", []) or []
    n_max = max(args.num_prompts or c for c in levels)
    full = make_workload(n_max, in_range, out_range, shape.vocab_size, special, args.seed, args.length_dist, args.sigma)

    print("measuring matmul FLOP/s on the model's shapes ...")
    peak_fps = measure_matmul_flops(model_linear_weights(hf_model, include_lm_head=False), args.prefill_tokens, min_seconds=0.3, repeats=5)
    decode_fps = {c: measure_matmul_flops(model_linear_weights(hf_model), c, min_seconds=0.3, repeats=3) for c in levels}
    print(f"matmul: {peak_fps / 1e9:.1f} GFLOP/s at {args.prefill_tokens} rows; "
          + ", ".join(f"{v / 1e9:.1f} at {c}" for c, v in decode_fps.items()))

    factory = _kvfleet_engine_factory(model_path, args) if "kvfleet" in systems else None
    by_level: dict[int, list[RunResult]] = {}
    roofs: dict[int, Roofline] = {}
    for c in levels:
        wl = full.take(args.num_prompts or c)
        roofs[c] = roofline(wl, shape, peak_fps, decode_fps[c])
        runs = []
        for s in systems:
            bar = tqdm(total=len(wl), desc=f"C={c} {s}", unit="req", disable=args.disable_tqdm)
            try:
                if s == "kvfleet":
                    run = run_kvfleet(factory, wl, c, bar)
                elif s == "hf-static":
                    run = run_hf_static(hf_model, wl, c, pad, bar)
                else:
                    run = run_hf_continuous(hf_model, wl, c, pad, bar)
            except Exception as exc:  # one failing system must not lose the others' figures
                run = RunResult(s, c, 0.0, error=f"{type(exc).__name__}: {exc}")
            bar.close()
            runs.append(run)
        by_level[c] = runs
        print(f"\n### {len(wl)} requests, concurrency {c}, {args.length_dist} lengths: prompts {in_range[0]}-{in_range[1]} tokens "
              f"(total {sum(wl.prompt_lens)}), outputs {out_range[0]}-{out_range[1]} tokens (total {sum(wl.output_lens)})\n")
        print(format_level_table(runs, roofs[c]))
        waste = static_batch_flops(wl.prompt_lens, wl.output_lens, c, shape) / 1e9
        print(f"\nstatic batches of {c} compute {waste:.0f} GFLOP, {waste / roofs[c].gflop:.2f}x the workload's {roofs[c].gflop:.0f} GFLOP (padding and past-the-end tokens)")

    max_len = args.max_model_len or int(getattr(hf_model.config, "max_position_embeddings", 0) or 2048)
    budget = args.kv_cache_memory or DEFAULT_KV_CACHE_MEMORY
    kv_p, kv_o = sample_lengths(args.kv_report_requests, in_range, out_range, args.seed + 7, args.length_dist, args.sigma)
    kv_rows = kv_memory_report(kv_p, kv_o, args.block_size, max_len, shape.kv_bytes_per_token(4), budget, max(levels))
    print(f"\n### KV memory: {args.kv_report_requests} requests, {args.length_dist} lengths, prompts {in_range[0]}-{in_range[1]}, outputs {out_range[0]}-{out_range[1]} tokens; "
          f"{shape.kv_bytes_per_token(4)} KV bytes per token (fp32), budget {budget / 2**30:.2f} GiB = {budget // shape.kv_bytes_per_token(4)} token slots\n")
    print(format_kv_table(kv_rows))

    if args.output_json:
        doc = {
            "date": started.isoformat(timespec="seconds"),
            "cpu": cpu_description(),
            "kvfleet_revision": source_revision(),
            "torch_threads": torch.get_num_threads(),
            "model": model_name,
            "args": {k: v for k, v in vars(args).items()},
            "matmul_gflops_per_s": {f"rows_{args.prefill_tokens}": peak_fps / 1e9, **{f"rows_{c}": v / 1e9 for c, v in decode_fps.items()}},
            "levels": {
                str(c): {
                    "roofline": asdict(roofs[c]),
                    "runs": [{"system": r.system, "duration": r.duration, "error": r.error, **r.report} for r in by_level[c]],
                }
                for c in levels
            },
            "kv_memory": kv_rows,
        }
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1, default=str)
        print(f"wrote {args.output_json}")
    if args.plot:
        plot_compare(by_level, roofs, args.plot, f"{model_name}, fp32, {cpu_description()}")
        print(f"wrote {args.plot}")
    failed = [r for rs in by_level.values() for r in rs if r.error]
    return 1 if failed else 0
