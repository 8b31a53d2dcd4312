"""Peer result files side by side, with their greedy-token agreement (stdlib only).

The files are the JSON objects an offline run of :mod:`.vllm_offline` or :mod:`.llama_server`
prints (with each request's output token ids)::

    python -m kvfleet.runtime.bench.peers.agreement /tmp/peers-vllm-bf16.json /tmp/peers-llama.json

Prints one row per file: system, mode, dtype, requests, wall seconds, output tok/s, and the
greedy-token agreement with the FIRST file (same workload): requests whose output ids match
exactly, and the mean share of each output that matches before the first difference.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def agreement(ref: list[list[int]], other: list[list[int]]) -> tuple[int, float]:
    """(exact matches, mean common-prefix share of the reference output)."""
    exact, shares = 0, []
    for a, b in zip(ref, other):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        exact += a == b
        shares.append(n / len(a) if a else 1.0)
    return exact, sum(shares) / len(shares) if shares else 0.0


def main(argv: list[str] | None = None) -> int:
    files = argv if argv is not None else sys.argv[1:]
    if not files:
        print(__doc__)
        return 2
    rows = [json.loads(Path(f).read_text().strip().splitlines()[-1]) for f in files]
    ref = rows[0].get("output_token_ids") or []
    head = f"{'system':<10} {'mode':<10} {'dtype':<9} {'reqs':>4} {'wall s':>8} {'out tok/s':>9}  agreement"
    print(head)
    for f, r in zip(files, rows):
        if "error" in r:
            print(f"{r.get('system', f):<10} {r.get('mode', ''):<10} FAILED: {r['error'][:80]}")
            continue
        exact, share = agreement(ref, r.get("output_token_ids") or [])
        print(
            f"{r['system']:<10} {r['mode']:<10} {r['dtype']:<9} {r['num_requests']:>4} "
            f"{r['wall_s']:>8.2f} {r['output_tok_s']:>9.1f}  "
            f"{exact}/{len(ref)} exact, {share:.0%} common prefix"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
