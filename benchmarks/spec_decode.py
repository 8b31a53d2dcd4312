"""Speculative decoding, served over HTTP: kvfleet with and without ``--speculative-config``, and
llama.cpp's ``llama-server`` with and without its n-gram lookup, in one invocation on one machine
(issue 30's benchmark).

Two workloads, each at one stream (C1: requests one after another), at eight (C8: at once) and
as a wave of 48 at once (W48, issue 42: where the step is compute-bound and drafts cost most):

- ``grounded``: edit a given ~500-token text (copy it with one word changed): the answer repeats
  its context, where model-free drafts are right;
- ``free``: open-ended stories (``ignore_eos``, fixed length): drafts are mostly wrong, and
  speculation must not cost.

Greedy chat completions. Reported per system and workload: output tokens/s (completion tokens /
wall time), the ratio to the same system without speculation, and the draft acceptance rate
(kvfleet: ``/metrics``' ``spec_decode_*`` counters; llama.cpp: its responses' ``timings``).

    python benchmarks/spec_decode.py                      # every system
    python benchmarks/spec_decode.py --systems kvfleet,kvfleet-ngram --requests 2
    python benchmarks/spec_decode.py --systems kvfleet,kvfleet-ngram,kvfleet-suffix --cases C1,C8,W48 \
        --free-tokens 64 --grounded-tokens 128   # issue 42's default decision, kept short

The peers come from ``benchmarks/peers/setup.sh`` (``--peers-dir``, default ``.peers``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from kvfleet.runtime.bench.machine import machine
from kvfleet.runtime.bench.peers import systems as ps

SPEC = {"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
SYSTEMS = {
    "kvfleet": ("kvfleet", []),
    "kvfleet-ngram": ("kvfleet", ["--speculative-config", json.dumps({"method": "ngram", **SPEC})]),
    "kvfleet-suffix": ("kvfleet", ["--speculative-config", json.dumps({"method": "suffix",
                                                                       "num_speculative_tokens": 4})]),
    "llama.cpp": ("llama.cpp", []),
    "llama.cpp-ngram": ("llama.cpp", ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3",
                                      "--spec-ngram-simple-size-m", "8"]),
    "llama.cpp-ngram-mod": ("llama.cpp", ["--spec-type", "ngram-mod"]),
}
BASELINE = {"kvfleet-ngram": "kvfleet", "kvfleet-suffix": "kvfleet", "llama.cpp-ngram": "llama.cpp",
            "llama.cpp-ngram-mod": "llama.cpp"}

TEXT = (
    "The old harbour town wakes before the sun. Fishermen carry nets down the stone steps to the water, "
    "and the baker on Quay Street opens his shutters to let the smell of bread drift over the boats. "
    "By six the market square is full: farmers from the hills sell cheese, apples and honey, and a woman "
    "with a green cart sells hot tea to anyone who has a coin. The church bell rings the hour, and the "
    "gulls answer it from the roofs. Children run to school along the sea wall, counting the boats that "
    "have already left. In the afternoon the wind turns, the boats come back heavy with fish, and the "
    "whole town walks down to the quay to see what the sea has given. Prices are shouted, baskets change "
    "hands, and the harbour master writes every catch in a thick blue book that his grandfather started. "
    "When the lamps are lit, the taverns fill with songs about storms the singers never saw, and the "
    "baker, tired and floury, sits on his step to watch the lighthouse turn. Nobody remembers who built "
    "the lighthouse, but everyone knows that its light has never once failed, not in the great storm of "
    "the winter when the sea came over the wall, and not in the fog that lasted nine days. The town is "
    "small, and the winters are long, but the people say they would not live anywhere else, because "
    "here the day begins with bread and ends with the light going round and round over the dark water."
)
EDITS = [("baker", "potter"), ("lighthouse", "tower"), ("harbour", "port"), ("gulls", "crows"),
         ("apples", "pears"), ("tea", "soup"), ("blue", "red"), ("nine", "seven")]
STORIES = ["a dragon who learns to cook", "a robot lost in a forest", "two friends who build a boat",
           "a girl who can talk to birds", "a city under the sea", "a clock that runs backwards",
           "a painter who paints the wind", "a cat who becomes mayor"]


MAX_TOKENS = {"grounded": 400, "free": 256}
"""Output tokens per request (``--grounded-tokens``, ``--free-tokens``)."""
CASES = {"C1": (1, 3), "C8": (8, None), "W48": (48, 48)}
"""case -> (concurrency, requests; None: ``--requests``)."""


def messages(workload: str, i: int) -> tuple[list[dict], dict]:
    """Chat messages of request ``i`` and its extra body fields."""
    if workload == "grounded":
        old, new = EDITS[i % len(EDITS)]
        content = (f"Copy the text below exactly, word for word, but write \"{new}\" instead of \"{old}\". "
                   f"Output only the text.\n\n{TEXT}")
        return [{"role": "user", "content": content}], {"max_tokens": MAX_TOKENS["grounded"]}
    return ([{"role": "user", "content": f"Write a long story about {STORIES[i % len(STORIES)]}."}],
            {"max_tokens": MAX_TOKENS["free"], "ignore_eos": True})


def chat(client: httpx.Client, base: str, workload: str, i: int) -> dict:
    msgs, extra = messages(workload, i)
    r = client.post(f"{base}/v1/chat/completions", json={"model": "peer", "messages": msgs, "temperature": 0,
                                                          **extra}, timeout=1200)
    r.raise_for_status()
    return r.json()


def spec_counters(base: str) -> tuple[float, float]:
    """kvfleet's (draft tokens, accepted tokens) so far; (0, 0) for a server without them."""
    try:
        text = httpx.get(f"{base}/metrics", timeout=10).text
    except httpx.HTTPError:
        return 0.0, 0.0

    def total(name: str) -> float:
        return sum(float(m) for m in re.findall(rf"^kvfleet:{name}_total\{{[^}}]*\}} ([0-9.e+]+)$", text, re.M))

    return total("spec_decode_num_draft_tokens"), total("spec_decode_num_accepted_tokens")


def run_case(base: str, workload: str, concurrency: int, requests: int) -> dict:
    with httpx.Client() as client:
        chat(client, base, workload, 99)  # warm-up, untimed
        d0, a0 = spec_counters(base)
        start = time.monotonic()
        with ThreadPoolExecutor(concurrency) as pool:
            outs = list(pool.map(lambda i: chat(client, base, workload, i), range(requests)))
        wall = time.monotonic() - start
    d1, a1 = spec_counters(base)
    tokens = sum(o["usage"]["completion_tokens"] for o in outs)
    drafted = d1 - d0 or sum((o.get("timings") or {}).get("draft_n", 0) for o in outs)
    accepted = a1 - a0 or sum((o.get("timings") or {}).get("draft_n_accepted", 0) for o in outs)
    return {"tok_s": tokens / wall, "tokens": tokens, "wall_s": wall, "draft_tokens": drafted,
            "acceptance": accepted / drafted if drafted else None,
            "texts": [o["choices"][0]["message"]["content"] for o in outs]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, of {', '.join(SYSTEMS)}")
    parser.add_argument("--requests", type=int, default=8, help="requests per case (C1 runs 3 of them)")
    parser.add_argument("--cases", default="C1,C8", help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument("--grounded-tokens", type=int, default=MAX_TOKENS["grounded"])
    parser.add_argument("--free-tokens", type=int, default=MAX_TOKENS["free"])
    parser.add_argument("--peers-dir", default=".peers")
    parser.add_argument("--output", type=Path, help="JSON results here")
    args = parser.parse_args(argv)
    MAX_TOKENS.update(grounded=args.grounded_tokens, free=args.free_tokens)
    cases = args.cases.split(",")
    max_num_seqs = max(8, *(CASES[c][0] for c in cases))
    mach = machine()
    print(f"[spec] {mach['cpu']}; flags {' '.join(mach['flags'])}", flush=True)
    log_dir = Path(tempfile.mkdtemp(prefix="kvfleet-spec-"))
    ctx = ps.Context(peers_dir=Path(args.peers_dir).resolve(), kvfleet_dtype="auto", vllm_dtype="bfloat16",
                     model_dir="", threads=os.cpu_count() or 1, log_dir=log_dir)
    results: dict = {"machine": mach, "systems": {}}
    for name in args.systems.split(","):
        family, extra = SYSTEMS[name]
        try:
            with ps.serve(family, ctx, max_num_seqs=max_num_seqs, max_model_len=2048, startup_timeout=600,
                          extra_args=extra, log_name=name) as base:
                res = {}
                for workload in ("grounded", "free"):
                    for case in cases:
                        conc, requests = CASES[case]
                        res[f"{workload}-{case}"] = r = run_case(base, workload, conc, requests or args.requests)
                        acc = f"{r['acceptance']:.2f}" if r["acceptance"] is not None else "-"
                        print(f"[spec] {name:20s} {workload:8s} {case}: {r['tok_s']:7.1f} tok/s, acceptance {acc}",
                              flush=True)
        except (ps.PeerUnavailable, RuntimeError) as exc:
            print(f"[spec] {name}: unavailable ({exc})", flush=True)
            continue
        results["systems"][name] = res
    columns = [f"{w}-{c}" for w in ("grounded", "free") for c in cases]
    print("\n| system | " + " | ".join(columns) + " | acceptance (grounded C1) |")
    print("|---|" + "---:|" * (len(columns) + 1))
    for name, res in results["systems"].items():
        base = results["systems"].get(BASELINE.get(name, name), res)
        cells = []
        for case in columns:
            ratio = res[case]["tok_s"] / base[case]["tok_s"] if base is not res else None
            cells.append(f"{res[case]['tok_s']:.1f}" + (f" ({ratio:.2f}x)" if ratio else ""))
        acc = res.get("grounded-C1", {}).get("acceptance")
        print(f"| {name} | {' | '.join(cells)} | {f'{acc:.2f}' if acc is not None else '-'} |")
    if args.output:
        args.output.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
