"""Where an engine step's time goes, and one-stream / 48-request throughput, A/B against a git revision.

::

    python benchmarks/step_profile.py phases [--concurrency 1 32] [--dtype float32 bfloat16] [--steps 40]
        [--kv-cache-dtype auto float32 bfloat16] [--model PATH]
    python benchmarks/step_profile.py bench [--baseline REV] [--rounds 2] [--dtype float32 bfloat16]
    python benchmarks/step_profile.py w48 [--dtype auto] [--no-batch-invariant] [--kv-cache-dtype float32 bfloat16]
    python benchmarks/step_profile.py prefill [--lengths 400] [--rounds 5] [--dtype float32]

``phases`` runs decode steps through ``LLMEngine`` at each concurrency (``C`` requests of
128-token prompts, decoding) with timers around each part of ``LLMEngine.step``: the
scheduler's ``schedule()``, the model runner's input preparation (``prepare_inputs``), the
model's forward, the rest of ``execute_model``, the sampler, the scheduler's
``update_from_output`` and the output side (detokenizer, ``RequestOutput``s, stats: the step's
remainder). It prints the median of each per step, ms, and its share, and, when the fused CPU
decoder runs the steps, the C step's own phases (``FusedDecoder.profile``: norm, qkv, attention,
o, mlp, down, head; mean ms per step). ``--cprofile N`` also prints the top ``N`` functions of
``cProfile`` over the same steps (tottime). ``--kv-cache-dtype`` (``phases``, ``w48``): one run
per cache dtype (``EngineConfig.kv_cache_dtype``).

``bench`` measures two workloads, each in a fresh process per build and dtype, greedy with EOS
ignored: one stream (a 128-token prompt, 256 new tokens; tok/s of the decode, first token
excluded, and of the whole request) and 48 requests at once (prompts 16-400 tokens, outputs
16-150, seed 0; output tok/s over the whole run). With ``--baseline REV`` it extracts the
revision's ``runtime/`` and ``kernels/`` (``git archive``) into a temporary folder, runs the
same measurement with that code (``PYTHONPATH`` puts it ahead of the editable install) and
alternates old/new runs ``--rounds`` times, so machine noise hits both alike; it prints the best
of the rounds for each and new/old.

``w48`` runs the 48-request workload in one engine and splits its wall time by step kind
(prefill or mixed, decode above / up to 32 rows), and, when the fused C decoder runs, each kind's
mean ms per C-step phase (``FusedDecoder.profile``). ``$KVFLEET_CPU_FUSED_PREFILL=1`` runs its
prefill and mixed steps through the fused C decoder (runtime/worker/cpu_decode.py).

``prefill`` times one step that prefills prompts of ``--lengths`` tokens (random ids, prefix cache
off), through torch's modules and through the fused C decoder alternately in one engine, and
prints the median and best of ``--rounds`` for each: an A/B that a shared machine's load hits
alike.

Both set ``OMP_WAIT_POLICY=PASSIVE`` as the engine does; torch uses its default threads
(``torch.get_num_threads()``, printed) unless ``--threads``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
import types

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PHASES = ("schedule", "prepare_inputs", "forward", "runner_other", "sampler", "update_from_output", "output")


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def make_engine(dtype: str, max_num_seqs: int = 128, kv_cache_dtype: str = "auto", model: str | None = None):
    from kvfleet.runtime.config import EngineConfig
    from kvfleet.runtime.engine.llm_engine import LLMEngine

    extra = {"kv_cache_dtype": kv_cache_dtype} if kv_cache_dtype != "auto" else {}  # a --baseline may lack it
    extra |= {"model": model} if model else {}
    return LLMEngine(EngineConfig(dtype=dtype, max_num_seqs=max_num_seqs, **extra))


def prompt(i: int, n: int, rng: random.Random | None = None) -> list[int]:
    rng = rng or random.Random(i)
    return [rng.randrange(100, 49152) for _ in range(n)]


# ---------------------------------------------------------------------- phases
class _Timer:
    def __init__(self) -> None:
        self.acc = dict.fromkeys(PHASES, 0.0)

    def wrap(self, name: str, fn, acc: dict | None = None):
        """``fn`` that adds its wall time to ``acc[name]`` (default: this timer's phases)."""
        acc = self.acc if acc is None else acc

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                acc[name] += time.perf_counter() - t0

        return timed


def profile_phases(dtype: str, concurrency: int, steps: int, cprofile: int, stub_forward: bool = False,
                   kv_cache_dtype: str = "auto", model: str | None = None) -> dict:
    import torch

    from kvfleet.runtime.sampling_params import SamplingParams

    eng = make_engine(dtype, kv_cache_dtype=kv_cache_dtype, model=model)
    timer = _Timer()
    runner = eng.runner
    runner_acc = {"execute_model": 0.0}
    sched = eng.scheduler
    sched.schedule = timer.wrap("schedule", sched.schedule)
    sched.update_from_output = timer.wrap("update_from_output", sched.update_from_output)
    if hasattr(runner, "prepare_inputs"):
        runner.prepare_inputs = timer.wrap("prepare_inputs", runner.prepare_inputs)
    model = runner.model
    if stub_forward:
        # No model math: logits of the right shape (fixed values), so the step's time is the
        # host work around the forward alone (less noisy on a shared machine).
        vocab = runner.vocab_size
        cache: dict[int, torch.Tensor] = {}

        def stub(*, logits_to_keep, **_):
            n = int(logits_to_keep.shape[0])
            if n not in cache:
                cache[n] = torch.randn((1, n, vocab), generator=torch.Generator().manual_seed(n))
            return types.SimpleNamespace(logits=cache[n].clone())

        model.forward = timer.wrap("forward", stub)
    else:
        model.forward = timer.wrap("forward", model.forward)
    runner.execute_model = timer.wrap("execute_model", runner.execute_model, runner_acc)
    runner.sample = timer.wrap("sampler", runner.sample)
    params = SamplingParams(temperature=0, max_tokens=steps + 64, ignore_eos=True)
    for i in range(concurrency):
        eng.add_request(f"r{i}", prompt(i, 128), params)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.running) or sched.num_waiting:
        eng.step()
    for _ in range(3):
        eng.step()
    fused = runner.cpu_decode._fused if getattr(runner, "cpu_decode", None) is not None else None
    if fused is not None:
        fused.profile()  # reset the C step's counters
    rows: dict[str, list[float]] = {p: [] for p in (*PHASES, "step")}
    prof = None
    if cprofile:
        import cProfile

        prof = cProfile.Profile()
    for _ in range(steps):
        for k in timer.acc:
            timer.acc[k] = 0.0
        runner_acc["execute_model"] = 0.0
        t0 = time.perf_counter()
        if prof is not None:
            prof.enable()
        eng.step()
        if prof is not None:
            prof.disable()
        total = time.perf_counter() - t0
        acc = timer.acc
        acc["runner_other"] = runner_acc["execute_model"] - acc["prepare_inputs"] - acc["forward"]
        acc["output"] = total - sum(acc[p] for p in PHASES if p != "output") - 0.0
        for p in PHASES:
            rows[p].append(acc[p] * 1e3)
        rows["step"].append(total * 1e3)
    med = {p: statistics.median(v) for p, v in rows.items()}
    stub = ", forward stubbed (host work only)" if stub_forward else ""
    cache = str(runner.kv_caches[0][0].dtype).removeprefix("torch.")
    print(f"\n{dtype}, KV cache {cache}, C={concurrency}, {steps} decode steps{stub}, torch threads "
          f"{torch.get_num_threads()}, context ~{128 + 3}..{128 + 3 + steps}")
    print("| phase | median ms | share of the median step |\n|---|---:|---:|")
    for p in PHASES:
        print(f"| {p} | {med[p]:.2f} | {100 * med[p] / med['step']:.1f}% |")
    outside = med["step"] - med["forward"]
    print(f"| **step** | **{med['step']:.2f}** | outside the forward: {outside:.2f} ms "
          f"({100 * outside / med['step']:.1f}%) |")
    c_step = fused.profile() if fused is not None else {}
    if c_step.get("steps"):
        print(f"fused C step, mean ms over {c_step['steps']} steps: "
              + ", ".join(f"{k} {v:.2f}" for k, v in c_step.items() if k != "steps"))
    if prof is not None:
        import pstats

        pstats.Stats(prof).sort_stats("tottime").print_stats(cprofile)
    return {"dtype": dtype, "concurrency": concurrency, "median_ms": med, "fused_ms": c_step}


# ---------------------------------------------------------------------- throughput
def workload_48() -> list[tuple[list[int], int]]:
    rng = random.Random(0)
    out = []
    for i in range(48):
        n = rng.randint(16, 400)
        out.append((prompt(i, n, rng), rng.randint(16, 150)))
    return out


def warmed_engine(dtype: str, model: str | None = None):
    """:func:`make_engine` after one short request (first-call costs: allocator, oneDNN primitives)."""
    from kvfleet.runtime.sampling_params import SamplingParams

    eng = make_engine(dtype, model=model)
    eng.add_request("warm", prompt(999, 128), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    eng.run_until_done()
    return eng


def one_stream(eng) -> dict:
    """One stream on ``eng``: a 128-token prompt, 256 new tokens; decode and end-to-end tok/s, the median
    step after the first (ms) and the tokens."""
    from kvfleet.runtime.sampling_params import SamplingParams

    eng.add_request("one", prompt(1, 128), SamplingParams(temperature=0, max_tokens=256, ignore_eos=True))
    steps, first, final = [], None, None
    t0 = time.perf_counter()
    while eng.has_unfinished_requests():
        s0 = time.perf_counter()
        outs = eng.step()
        steps.append(time.perf_counter() - s0)
        for out in outs:
            if first is None and out.outputs[0].token_ids:
                first = time.perf_counter()
            if out.finished:
                final = out
    t1 = time.perf_counter()
    n_out = len(final.outputs[0].token_ids)
    return {"tokens": n_out, "decode_tok_s": (n_out - 1) / (t1 - first), "e2e_tok_s": n_out / (t1 - t0),
            "step_ms": 1e3 * statistics.median(steps[1:]), "token_ids": final.outputs[0].token_ids}


def run_bench(dtype: str) -> dict:
    """One measurement in this process (the code on ``sys.path``): one stream, then 48 at once."""
    import torch

    from kvfleet.runtime.sampling_params import SamplingParams

    eng = warmed_engine(dtype)
    one = one_stream(eng)
    # 48 requests at once.
    work = workload_48()
    for i, (p, m) in enumerate(work):
        eng.add_request(f"b{i}", p, SamplingParams(temperature=0, max_tokens=m, ignore_eos=True))
    t0 = time.perf_counter()
    finals = eng.run_until_done()
    dt = time.perf_counter() - t0
    total_out = sum(len(o.outputs[0].token_ids) for o in finals.values())
    many = {"prompt_tokens": sum(len(p) for p, _ in work), "output_tokens": total_out, "seconds": dt,
            "output_tok_s": total_out / dt,
            "token_ids": {k: finals[k].outputs[0].token_ids for k in sorted(finals)}}
    return {"dtype": dtype, "threads": torch.get_num_threads(), "one_stream": one, "batch48": many}


def extract_baseline(rev: str) -> str:
    """``runtime/`` and ``kernels/`` of git revision ``rev`` as an importable ``kvfleet`` in a
    temporary folder (put it first on ``PYTHONPATH``); returns the folder. A folder that
    already holds ``kvfleet/runtime`` is used as it is."""
    if os.path.isdir(os.path.join(rev, "kvfleet", "runtime")):
        return rev
    root = tempfile.mkdtemp(prefix="kvfleet-step-baseline-")
    pkg = os.path.join(root, "kvfleet")
    os.makedirs(pkg)
    archive = subprocess.run(["git", "-C", REPO, "archive", rev, "runtime", "kernels"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", pkg], input=archive, check=True)
    return root


def _env_with(path: str | None) -> dict:
    """The environment of a measuring subprocess: ``path`` (an extracted revision) first on
    ``PYTHONPATH``, no empty entry (the repository root would shadow the stdlib's operator)."""
    env = dict(os.environ, PYTHONSAFEPATH="1")
    if path:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (path, env.get("PYTHONPATH", "")) if p)
    return env


def bench(args) -> None:
    builds = [("new", extract_baseline(args.new) if args.new else None)]
    if args.baseline:
        builds.append(("old", extract_baseline(args.baseline)))
    results: dict[tuple[str, str], list[dict]] = {}
    for rnd in range(args.rounds):
        for dtype in args.dtype:
            order = builds if rnd % 2 == 0 else builds[::-1]
            for name, path in order:
                env = _env_with(path)
                cmd = [sys.executable, os.path.abspath(__file__), "_one", "--dtype", dtype]
                if args.threads:
                    cmd += ["--threads", str(args.threads)]
                t0 = time.time()
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
                if proc.returncode != 0:
                    sys.stderr.write(proc.stderr[-3000:])
                    raise SystemExit(f"{name} {dtype} failed")
                res = json.loads(proc.stdout.strip().splitlines()[-1])
                results.setdefault((name, dtype), []).append(res)
                o, b = res["one_stream"], res["batch48"]
                print(f"round {rnd} {name:3} {dtype:8}: one stream {o['decode_tok_s']:.1f} tok/s decode "
                      f"({o['e2e_tok_s']:.1f} e2e), 48 at once {b['output_tok_s']:.1f} tok/s "
                      f"({b['output_tokens']} tokens in {b['seconds']:.1f} s)  [{time.time() - t0:.0f} s, "
                      f"load {os.getloadavg()[0]:.1f}]", flush=True)
    print(f"\nCPU: {cpu_model()}, {os.cpu_count()} cores; best of {args.rounds} rounds")
    print("| dtype | build | one stream decode tok/s | one stream e2e tok/s | 48 at once output tok/s |")
    print("|---|---|---:|---:|---:|")
    for dtype in args.dtype:
        for name, _ in builds:
            rs = results[(name, dtype)]
            print(f"| {dtype} | {name} | {max(r['one_stream']['decode_tok_s'] for r in rs):.1f} | "
                  f"{max(r['one_stream']['e2e_tok_s'] for r in rs):.1f} | "
                  f"{max(r['batch48']['output_tok_s'] for r in rs):.1f} |")
        if args.baseline:
            new, old = results[("new", dtype)], results[("old", dtype)]
            same = all(n["one_stream"]["token_ids"] == old[0]["one_stream"]["token_ids"]
                       and n["batch48"]["token_ids"] == old[0]["batch48"]["token_ids"] for n in new)
            r1 = max(r["one_stream"]["decode_tok_s"] for r in new) / max(r["one_stream"]["decode_tok_s"] for r in old)
            r2 = max(r["batch48"]["output_tok_s"] for r in new) / max(r["batch48"]["output_tok_s"] for r in old)
            print(f"| {dtype} | new/old | {r1:.2f}x | | {r2:.2f}x | same tokens: {same} |")


def split_w48(dtype: str, batch_invariant: bool, speculative_config: str | None = None,
              kv_cache_dtype: str = "auto") -> None:
    """The 48-request workload through ``LLMEngine``: wall time of the steps with prompt tokens
    (prefill, chunked or mixed) and of decode-only steps above / up to 32 rows (tokens: drafts
    verified included)."""
    from kvfleet.runtime.config import EngineConfig
    from kvfleet.runtime.engine.llm_engine import LLMEngine
    from kvfleet.runtime.sampling_params import SamplingParams

    eng = LLMEngine(EngineConfig(dtype=dtype, max_num_seqs=128, batch_invariant=batch_invariant,
                                 speculative_config=speculative_config, kv_cache_dtype=kv_cache_dtype))
    seen: dict = {}
    schedule = eng.scheduler.schedule

    def timed_schedule(*a, **k):
        out = schedule(*a, **k)
        seen.update(prefill=out.num_prefill_tokens, tokens=out.total_num_scheduled_tokens)
        return out

    eng.scheduler.schedule = timed_schedule
    work = workload_48()
    for i, (p, n) in enumerate(work):
        eng.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    kinds: dict[str, list[float]] = {}
    fused = eng.runner.cpu_decode
    phases: dict[str, dict[str, float]] = {}   # kind -> the C step's phase -> ms summed over its steps
    if fused is not None:
        fused.profile()   # reset
    t0 = time.perf_counter()
    while eng.has_unfinished_requests():
        t = time.perf_counter()
        eng.step()
        kind = "prefill" if seen["prefill"] else ("decode > 32 rows" if seen["tokens"] > 32 else "decode <= 32 rows")
        acc = kinds.setdefault(kind, [0, 0.0, 0])
        acc[0], acc[1], acc[2] = acc[0] + 1, acc[1] + time.perf_counter() - t, acc[2] + seen["tokens"]
        if fused is not None:
            prof = fused.profile()
            for phase, ms in prof.items():
                if phase != "steps" and prof["steps"]:
                    phases.setdefault(kind, {}).setdefault(phase, 0.0)
                    phases[kind][phase] += ms * prof["steps"]
    total, out_tokens = time.perf_counter() - t0, sum(n for _, n in work)
    flags = "" if batch_invariant else " --no-batch-invariant"
    flags += f" {speculative_config}" if speculative_config else ""
    flags += f", KV cache {str(eng.runner.kv_caches[0][0].dtype).removeprefix('torch.')}"
    print(f"\n{dtype}{flags}: {total:.2f} s, "
          f"{out_tokens / total:.1f} output tok/s\n| steps | count | s | tokens | ms/step |\n|---|---:|---:|---:|---:|")
    for kind, (steps, secs, tokens) in kinds.items():
        print(f"| {kind} | {steps} | {secs:.2f} | {tokens} | {1e3 * secs / steps:.1f} |")
    if phases:
        names = list(next(iter(phases.values())))
        print("\nthe fused C step's phases, mean ms per step of each kind (steps it ran)\n| steps | "
              + " | ".join(names) + " |\n|---|" + "---:|" * len(names))
        for kind, ms in phases.items():
            print(f"| {kind} | " + " | ".join(f"{ms[n] / kinds[kind][0]:.1f}" for n in names) + " |")


def prefill_ab(dtype: str, lengths: list[int], rounds: int) -> None:
    """One prefill step of prompts of ``lengths`` tokens, torch's modules against the fused C
    decoder (``CpuDecodePath.prefill``), alternating in one engine."""
    from kvfleet.runtime.config import EngineConfig
    from kvfleet.runtime.engine.llm_engine import LLMEngine
    from kvfleet.runtime.sampling_params import SamplingParams

    eng = LLMEngine(EngineConfig(dtype=dtype, enable_prefix_caching=False,
                                 max_num_batched_tokens=max(2048, sum(lengths))))
    path = eng.runner.cpu_decode
    if path is None:
        print(f"{dtype}: the fused CPU decoder is off here (see the log)")
        return
    rng = random.Random(0)
    times: dict[bool, list[float]] = {False: [], True: []}
    for r in range(rounds):
        for fused in (False, True):
            path.prefill = fused
            for i, n in enumerate(lengths):
                eng.add_request(f"{r}-{fused}-{i}", [rng.randint(100, 20000) for _ in range(n)],
                                SamplingParams(temperature=0, max_tokens=1))
            t = time.perf_counter()
            eng.step()  # every prompt's whole prefill
            times[fused].append(time.perf_counter() - t)
            while eng.has_unfinished_requests():
                eng.step()
    print(f"\n{dtype}, one step prefilling {lengths} tokens, {rounds} rounds, load average {os.getloadavg()[0]:.1f}")
    print("| prefill | median ms | best ms |\n|---|---:|---:|")
    for fused in (False, True):
        print(f"| {'fused C decoder' if fused else 'torch modules'} | {1e3 * statistics.median(times[fused]):.0f} | "
              f"{1e3 * min(times[fused]):.0f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("phases")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    p.add_argument("--dtype", nargs="+", default=["float32"])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--cprofile", type=int, default=0, metavar="N")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--baseline", default=None, metavar="REV", help="profile REV's code first (own process)")
    p.add_argument("--stub-forward", action="store_true",
                   help="replace the model's forward by fixed logits: time the host work alone")
    p.add_argument("--kv-cache-dtype", nargs="+", default=["auto"])
    p.add_argument("--model", default=None, help="the model (default: the engine's default), e.g. a GGUF file")
    b = sub.add_parser("bench")
    b.add_argument("--baseline", default=None, metavar="REV")
    b.add_argument("--new", default=None, metavar="REV", help="measure REV's code as 'new' (default: the working tree)")
    b.add_argument("--rounds", type=int, default=2)
    b.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    b.add_argument("--threads", type=int, default=0)
    w = sub.add_parser("w48", help="the 48-request workload's time by step kind")
    w.add_argument("--dtype", nargs="+", default=["auto"])
    w.add_argument("--no-batch-invariant", action="store_true")
    w.add_argument("--speculative-config", default=None, help="e.g. '{\"method\": \"ngram\"}'")
    w.add_argument("--threads", type=int, default=0)
    w.add_argument("--kv-cache-dtype", nargs="+", default=["auto"])
    f = sub.add_parser("prefill", help="one prefill step, torch against the fused C decoder")
    f.add_argument("--dtype", default="float32")
    f.add_argument("--lengths", type=int, nargs="+", default=[400])
    f.add_argument("--rounds", type=int, default=5)
    f.add_argument("--threads", type=int, default=0)
    o = sub.add_parser("_one")
    o.add_argument("--dtype", default="float32")
    o.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if args.cmd == "phases":
        if args.baseline:
            # The same profile with the baseline's code first, in its own process.
            env = dict(os.environ)
            env = _env_with(extract_baseline(args.baseline))
            argv = list(sys.argv[1:])
            i = argv.index("--baseline")
            del argv[i:i + 2]
            print(f"===== baseline {args.baseline}", flush=True)
            subprocess.run([sys.executable, os.path.abspath(__file__), *argv], env=env, check=True)
            print("===== current tree", flush=True)
        print(f"CPU: {cpu_model()}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}")
        for dtype in args.dtype:
            for kv in args.kv_cache_dtype:
                for c in args.concurrency:
                    profile_phases(dtype, c, args.steps, args.cprofile, args.stub_forward, kv, args.model)
    elif args.cmd == "bench":
        bench(args)
    elif args.cmd == "w48":
        print(f"CPU: {cpu_model()}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}")
        for dtype in args.dtype:
            for kv in args.kv_cache_dtype:
                split_w48(dtype, not args.no_batch_invariant, args.speculative_config, kv)
    elif args.cmd == "prefill":
        print(f"CPU: {cpu_model()}, {os.cpu_count()} cores")
        prefill_ab(args.dtype, args.lengths, args.rounds)
    else:
        print(json.dumps(run_bench(args.dtype)))


if __name__ == "__main__":
    main()
