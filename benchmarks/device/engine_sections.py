"""The engine sections of benchmarks/gpu_check.py: ``engine`` (``LLM`` on CUDA vs CPU: identical
greedy tokens, prompt and sampled logprobs within ``ENGINE_LOGPROB_ATOL``), ``compiled``
(``enforce_eager=False`` with CUDA graphs vs the eager engine on the same device) and
``spec_decode`` (speculative decoding vs plain decoding on the same device). Each returns
True when it passed and fills ``rec`` with its rows; ``torch`` is passed in, as in gpu_check.py."""

from __future__ import annotations

import os
import time

from gpu_common import ENGINE_LOGPROB_ATOL, Budget, log, sync


def section_engine(torch, budget: Budget, max_tokens: int, rec: dict, model: str | None = None,
                   smoke: bool = False) -> bool:
    """Greedy tokens of ``kvfleet.runtime.LLM`` on CUDA vs on CPU (fp32) must be identical, and
    the log-probabilities of the prompt tokens and of the sampled tokens must agree within
    ``ENGINE_LOGPROB_ATOL`` (a wrong attention kernel can leave greedy tokens unchanged, most
    of all on a small or truncated model; it cannot leave every log-probability unchanged).
    ``smoke``: both runs on CPU, the first through the Triton kernels under the interpreter
    (``KVFLEET_ATTENTION_BACKEND=triton``), the second through the torch implementation."""
    from kvfleet.kernels import BACKEND_ENV
    from kvfleet.runtime import LLM, SamplingParams

    prompts = [
        "What is the capital of France?",
        "Write a haiku about the sea.",
        "List three prime numbers:",
        "The quick brown fox",
    ]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=0, prompt_logprobs=0)
    runs = [("cpu", "triton"), ("cpu", "torch")] if smoke else [("cuda", None), ("cpu", None)]
    torch.set_float32_matmul_precision("highest")  # no TF32 in the CUDA run's fp32 matmuls
    labels = [f"{d} ({b} backend)" if b else d for d, b in runs]
    rec.update(model=model or "default (SmolLM2-135M-Instruct)", dtype="float32", max_tokens=max_tokens,
               compared=labels, prompts=[])

    def run(device, backend, label):
        saved = os.environ.get(BACKEND_ENV)
        if backend:
            os.environ[BACKEND_ENV] = backend
        try:
            t0 = time.monotonic()
            llm = LLM(model, device=device, dtype="float32", kv_cache_memory=512 * 2**20)
            t1 = time.monotonic()
            outs = llm.generate(prompts, params, use_tqdm=False)
            t2 = time.monotonic()
        finally:
            if saved is None:
                os.environ.pop(BACKEND_ENV, None)
            else:
                os.environ[BACKEND_ENV] = saved
        ids = [list(o.outputs[0].token_ids) for o in outs]
        texts = [o.outputs[0].text for o in outs]
        # {(position kind, index, token id): logprob} per prompt
        lps = [{**{("prompt", i, t): lp.logprob for i, d in enumerate(o.prompt_logprobs or []) if d
                   for t, lp in d.items()},
                **{("output", i, t): lp.logprob for i, d in enumerate(o.outputs[0].logprobs or [])
                   for t, lp in d.items()}} for o in outs]
        ntok = sum(len(x) for x in ids)
        log(f"  {label}: load {t1 - t0:.1f} s, generate {t2 - t1:.2f} s ({ntok} tokens)")
        rec.setdefault("runs", []).append(dict(device=label, load_s=t1 - t0, generate_s=t2 - t1, tokens=ntok))
        del llm
        return ids, texts, lps

    first_ids, first_texts, first_lps = run(*runs[0], labels[0])
    if budget.left() < 20:
        log(f"  (time budget: {labels[1]} comparison run skipped)")
        rec["cut_short"] = True
        return False
    second_ids, _, second_lps = run(*runs[1], labels[1])
    ok = True
    for p, g, c, text, la, lb in zip(prompts, first_ids, second_ids, first_texts, first_lps, second_lps):
        shared = la.keys() & lb.keys()
        diff = max((abs(la[k] - lb[k]) for k in shared), default=float("nan"))
        entry = dict(prompt=p, text=text, same=g == c, logprobs_compared=len(shared), max_logprob_diff=diff)
        if not shared or not diff <= ENGINE_LOGPROB_ATOL:
            ok = False
            log(f"  LOGPROBS DIFFER: {p!r}: max |difference| {diff:.3e} over {len(shared)} positions "
                f"(tolerance {ENGINE_LOGPROB_ATOL})")
        if g == c:
            log(f"  same greedy tokens ({len(g)}), logprobs within {diff:.1e}: {p!r} -> {text[:60]!r}")
        else:
            first = next((i for i, (x, y) in enumerate(zip(g, c)) if x != y), min(len(g), len(c)))
            ok = False
            log(f"  DIFFERENT from token {first}: {p!r}\n    {runs[0][0]} {g}\n    {runs[1][0]}  {c}")
            entry.update(first_difference=first, ids={labels[0]: g, labels[1]: c})
        rec["prompts"].append(entry)
    return ok


def section_compiled(torch, budget: Budget, max_tokens: int, rec: dict, model: str | None = None,
                     smoke: bool = False) -> bool:
    """The compiled engine (``enforce_eager=False``) vs the eager one on the same device (CUDA;
    CPU under ``smoke``), fp32, greedy: identical token ids; records the warm-up, the CUDA graph
    replays (the decode steps that ran a captured graph) and each engine's decode tok/s."""
    from kvfleet.runtime.config import EngineConfig
    from kvfleet.runtime.engine.llm_engine import LLMEngine
    from kvfleet.runtime.llm import LLM
    from kvfleet.runtime.sampling_params import SamplingParams
    from kvfleet.runtime.worker.compilation import BACKEND_ENV, compile_counts

    device = "cpu" if smoke else "cuda"
    prompts = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers:",
               "The quick brown fox", "Explain why the sky is blue.", "def fibonacci(n):"]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    torch.set_float32_matmul_precision("highest")
    rec.update(device=device, dtype="float32", max_tokens=max_tokens, runs=[])
    saved = os.environ.get(BACKEND_ENV)
    if smoke:
        os.environ[BACKEND_ENV] = "eager"
    results = {}
    try:
        for mode in ("compiled", "eager"):
            t0 = time.monotonic()
            engine = LLMEngine(EngineConfig(model=model, device=device, dtype="float32", kv_cache_memory=512 * 2**20,
                                            max_num_seqs=16, enforce_eager=mode == "eager"))
            t1 = time.monotonic()
            counts = compile_counts()
            outs = LLM.from_engine(engine).generate(prompts, params, use_tqdm=False)
            sync(torch, torch.device(device))
            t2 = time.monotonic()
            cf = engine.runner.compiled
            graphs = cf.cudagraphs if cf is not None else None
            run = dict(mode=mode, start_s=round(t1 - t0, 2), warmup_s=round(cf.warmup_seconds, 2) if cf else 0.0,
                       generate_s=round(t2 - t1, 3), tok_s=round(len(prompts) * max_tokens / (t2 - t1), 1),
                       captured_sizes=sorted(graphs.graphs) if graphs else [],
                       graph_replays=graphs.replays if graphs else 0,
                       recompiles_during_generate=compile_counts()["recompiles"] - counts["recompiles"])
            log(f"  {mode}: start {run['start_s']} s (warm-up {run['warmup_s']} s), {run['tok_s']} tok/s, "
                f"{run['graph_replays']} CUDA graph replays, {run['recompiles_during_generate']} recompiles")
            rec["runs"].append(run)
            results[mode] = [list(o.outputs[0].token_ids) for o in outs]
            del engine
            if budget.left() < 20 and mode == "compiled":
                rec["cut_short"] = True
                log("  (time budget: eager comparison run skipped)")
                return False
    finally:
        if saved is None:
            os.environ.pop(BACKEND_ENV, None)
        else:
            os.environ[BACKEND_ENV] = saved
    same = results["compiled"] == results["eager"]
    rec["same_tokens"] = same
    for p, a, b in zip(prompts, results["compiled"], results["eager"]):
        if a != b:
            first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            log(f"  DIFFERENT from token {first}: {p!r}\n    compiled {a}\n    eager    {b}")
    compiled_run = rec["runs"][0]
    ok = same and compiled_run["recompiles_during_generate"] == 0
    if not smoke:
        ok = ok and compiled_run["graph_replays"] > 0
    log(f"  greedy tokens {'identical' if same else 'DIFFER'} over {len(prompts)} prompts x {max_tokens}")
    return ok


def section_spec_decode(torch, budget: Budget, max_tokens: int, rec: dict, model: str | None = None,
                        smoke: bool = False) -> bool:
    """Speculative decoding (``--speculative-config`` ngram) vs plain decoding on the same device
    (CUDA; CPU under ``smoke``), fp32, greedy, on prompts that repeat their context: records the
    prompts whose tokens are identical (the verification rows run as a short prefill on CUDA, whose
    rounding may differ from decode's: a divergence late in a text is reported, not failed), the
    acceptance rate and each engine's tok/s. Fails when fewer than half the texts are identical or
    no draft was accepted."""
    from kvfleet.runtime.config import EngineConfig
    from kvfleet.runtime.engine.llm_engine import LLMEngine
    from kvfleet.runtime.llm import LLM
    from kvfleet.runtime.sampling_params import SamplingParams

    device = "cpu" if smoke else "cuda"
    text = "The lighthouse keeper climbed the stairs, lit the lamp and wrote in his log: wind west, sea calm."
    prompts = [f"Copy this text exactly: {text}\nCopy: {text[:i]}" for i in (10, 30, 50, 70)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    torch.set_float32_matmul_precision("highest")
    rec.update(device=device, dtype="float32", max_tokens=max_tokens, runs={})
    accepted, tokens = [], {}

    class Counter:
        def record(self, scheduler_stats, iteration_stats) -> None:
            if scheduler_stats.spec_decoding is not None:
                accepted.append((scheduler_stats.spec_decoding.num_draft_tokens,
                                 scheduler_stats.spec_decoding.num_accepted_tokens))

    for mode in ("plain", "ngram"):
        if budget.left() < 20:
            return False
        spec = '{"method": "ngram", "num_speculative_tokens": 4}' if mode == "ngram" else None
        engine = LLMEngine(EngineConfig(model=model, device=device, dtype="float32", kv_cache_memory=512 * 2**20,
                                        speculative_config=spec), [Counter()])
        t0 = time.monotonic()
        outs = LLM.from_engine(engine).generate(prompts, params, use_tqdm=False)
        sync(torch, torch.device(device))
        wall = time.monotonic() - t0
        tokens[mode] = [list(o.outputs[0].token_ids) for o in outs]
        rec["runs"][mode] = {"tok_s": sum(map(len, tokens[mode])) / wall}
    drafted = sum(d for d, _ in accepted)
    rec["acceptance"] = sum(a for _, a in accepted) / drafted if drafted else 0.0
    rec["identical"] = sum(a == b for a, b in zip(tokens["plain"], tokens["ngram"]))
    rec["first_divergence"] = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
                               for a, b in zip(tokens["plain"], tokens["ngram"])]
    runs = rec["runs"]
    log(f"  spec decode on {device}: {rec['identical']}/{len(prompts)} texts identical, acceptance "
        f"{rec['acceptance']:.2f}, tok/s plain {runs['plain']['tok_s']:.1f} ngram {runs['ngram']['tok_s']:.1f}")
    return rec["identical"] * 2 >= len(prompts) and rec["acceptance"] > 0
