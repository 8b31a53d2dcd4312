"""Systems under test of ``kvfleet bench compare``: one runner per way of serving a workload.

A runner takes a :class:`~kvfleet.runtime.bench.datasets.Workload`, a concurrency level C
and an optional progress bar, keeps at most C requests in flight (greedy, every request
producing exactly its output length) and returns a :class:`RunResult`; :func:`finish_run`
checks the lengths and computes the report. Systems (:data:`SYSTEMS`):

- ``kvfleet``: kvfleet's ``LLMEngine`` in-process (:func:`run_kvfleet`);
- ``hf-static``: transformers ``generate()`` on left-padded batches (:func:`run_hf_static`);
- ``hf-continuous``: transformers' continuous batching (:func:`run_hf_continuous`).

:func:`build_runners` binds them to a loaded model; a new peer adds a runner, an entry in
:data:`SYSTEMS` / :data:`SYSTEM_LABELS` and one in :func:`build_runners`. Latency and
concurrency rules: docs/benchmarks.md, `kvfleet bench compare`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvfleet.runtime.bench.datasets import Workload
from kvfleet.runtime.bench.metrics import RequestResult, compute_metrics

SYSTEMS = ("kvfleet", "hf-static", "hf-continuous")
SYSTEM_LABELS = {
    "kvfleet": "kvfleet (continuous, paged)",
    "hf-static": "transformers generate() static batches",
    "hf-continuous": "transformers continuous batching",
}

Runner = Callable[[Workload, int, object], "RunResult"]
"""``runner(workload, concurrency, progress)``: ``progress`` is a tqdm-like bar or None."""


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


def finish_run(system: str, c: int, results: list[RequestResult], duration: float, workload: Workload) -> RunResult:
    for r, o in zip(results, workload.output_lens):
        if r.success and r.output_tokens != o:
            r.success = False
            r.error = f"produced {r.output_tokens} tokens, expected {o}"
    run = RunResult(system, c, duration, results, compute_metrics(results, duration))
    bad = [r.error for r in results if not r.success]
    if bad:
        run.error = f"{len(bad)} requests failed; first: {bad[0]}"
    return run


def streamed_result(prompt_len: int, output_tokens: int, sent: float, t0: float, stamps: list[float]) -> RequestResult:
    """A successful request sent at ``sent`` whose tokens arrived at ``stamps``
    (``time.perf_counter()`` seconds, non-empty); times in the result are relative to the
    run's start ``t0`` (TTFT and latency relative to ``sent``)."""
    return RequestResult(
        success=True,
        prompt_len=prompt_len,
        output_tokens=output_tokens,
        start_time=sent - t0,
        ttft=stamps[0] - sent,
        latency=stamps[-1] - sent,
        itl=[b - a for a, b in zip(stamps, stamps[1:])],
        chunk_times=[t - t0 for t in stamps],
    )


def warmup_prompt(workload: Workload) -> list[int]:
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
            ids[row, width - len(x) :] = torch.tensor(x)
            mask[row, width - len(x) :] = 1
        new = max(workload.output_lens[i] for i in idx)
        clock = StepClock()
        b0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=pad_token_id,
                stopping_criteria=StoppingCriteriaList([clock]),
            )
        b1 = time.perf_counter()
        produced = out.shape[1] - width
        for i in idx:
            o = workload.output_lens[i]
            times = [t - t0 for t in clock.times[:o]]
            ok = produced >= o and len(times) == o
            results[i] = RequestResult(
                success=ok,
                prompt_len=len(workload.prompts[i]),
                output_tokens=o if ok else produced,
                start_time=b0 - t0,
                ttft=(clock.times[0] - b0) if clock.times else 0.0,
                latency=b1 - b0,
                itl=[b - a for a, b in zip(times, times[1:])],
                chunk_times=times,
                error="" if ok else f"generate() produced {produced} tokens, expected {o}",
            )
        if progress is not None:
            progress.update(len(idx))
    return finish_run("hf-static", concurrency, results, time.perf_counter() - t0, workload)


def run_hf_continuous(model, workload: Workload, concurrency: int, pad_token_id: int, progress=None) -> RunResult:
    """transformers' continuous batching (``ContinuousBatchingManager``, what
    ``generate_batch`` drives), ``max_requests_per_batch=concurrency``, per-request
    ``max_new_tokens`` and EOS disabled (``eos_token_id=-1``)."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    gen_cfg = GenerationConfig(
        do_sample=False, max_new_tokens=max(workload.output_lens), eos_token_id=-1, pad_token_id=pad_token_id
    )
    cb_cfg = ContinuousBatchingConfig(max_requests_per_batch=concurrency)
    hints = WorkloadHints(
        max_prompt_length=max(workload.prompt_lens),
        max_generated_length=max(workload.output_lens),
        num_requests=len(workload),
    )
    results: list[RequestResult] = [None] * len(workload)  # type: ignore[list-item]
    with model.continuous_batching_context_manager(
        generation_config=gen_cfg, continuous_batching_config=cb_cfg, block=True, timeout=60, workload_hints=hints
    ) as manager:
        # warm-up request, not timed
        manager.add_request(warmup_prompt(workload), request_id="warmup", max_new_tokens=2, eos_token_id=-1)
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
            manager.add_request(
                workload.prompts[i],
                request_id=rid,
                max_new_tokens=workload.output_lens[i],
                eos_token_id=-1,
                record_timestamps=True,
            )

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
                results[i] = streamed_result(len(workload.prompts[i]), n, sent, t0, stamps)
            else:
                results[i] = RequestResult(
                    success=False,
                    prompt_len=len(workload.prompts[i]),
                    output_tokens=n,
                    start_time=sent - t0,
                    error=str(r.error or "no timestamps"),
                )
            done += 1
            if progress is not None:
                progress.update(1)
            if nxt < len(workload):
                submit()
        duration = time.perf_counter() - t0
    return finish_run("hf-continuous", concurrency, results, duration, workload)


def run_kvfleet(engine_factory, workload: Workload, concurrency: int, progress=None) -> RunResult:
    """kvfleet's ``LLMEngine`` in-process: at most ``concurrency`` requests in flight,
    greedy, ``ignore_eos`` with ``max_tokens`` = the request's output length."""
    from kvfleet.runtime.sampling_params import SamplingParams

    engine = engine_factory(concurrency)
    # warm-up request, not timed
    engine.add_request(
        "warmup", warmup_prompt(workload), SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    )
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
        params = SamplingParams(
            max_tokens=workload.output_lens[i], min_tokens=workload.output_lens[i], temperature=0.0, ignore_eos=True
        )
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
                results[i] = streamed_result(len(workload.prompts[i]), n, sent, t0, stamps)
                done += 1
                if progress is not None:
                    progress.update(1)
                if nxt < len(workload):
                    submit()
    return finish_run("kvfleet", concurrency, results, time.perf_counter() - t0, workload)


def kvfleet_engine_factory(model_path: str, args):
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
        cfg = dict(
            model=model_path,
            dtype="float32",
            device="cpu",
            block_size=args.block_size,
            max_num_seqs=max(concurrency, 1),
        )
        if args.max_num_batched_tokens:
            cfg["max_num_batched_tokens"] = args.max_num_batched_tokens
        if args.kv_cache_memory:
            cfg["kv_cache_memory"] = args.kv_cache_memory
        state["engine"] = LLMEngine(EngineConfig(**cfg), loaded=state["loaded"])
        return state["engine"]

    return factory


def build_runners(systems, model, pad_token_id: int, model_path: str, args) -> dict[str, Runner]:
    """One :data:`Runner` per name in ``systems`` (names from :data:`SYSTEMS`).

    ``model`` is the loaded transformers model the transformers systems share; kvfleet's
    engines load their own copy of ``model_path`` (see :func:`kvfleet_engine_factory`,
    which reads ``args.block_size``, ``args.max_num_batched_tokens``, ``args.kv_cache_memory``).
    """
    runners: dict[str, Runner] = {}
    for s in systems:
        if s == "kvfleet":
            factory = kvfleet_engine_factory(model_path, args)
            runners[s] = lambda wl, c, bar, f=factory: run_kvfleet(f, wl, c, bar)
        elif s == "hf-static":
            runners[s] = lambda wl, c, bar: run_hf_static(model, wl, c, pad_token_id, bar)
        elif s == "hf-continuous":
            runners[s] = lambda wl, c, bar: run_hf_continuous(model, wl, c, pad_token_id, bar)
        else:
            raise ValueError(f"unknown system {s!r}; choose from {SYSTEMS}")
    return runners
