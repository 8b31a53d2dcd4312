"""Write a benchmark workload for the peers: a JSON list of ``{prompt_token_ids, max_tokens}``.

Stdlib only, deterministic for a seed, so every system gets the very same token ids::

    python benchmarks/peers/workload.py --requests 16 --prompt-len 128 --max-tokens 64 \\
        -o /tmp/peers-w16.json
    python benchmarks/peers/workload.py --requests 1 --prompt-len 128 --max-tokens 128 \\
        -o /tmp/peers-w1.json

Prompt lengths may be a range (``--prompt-len 16-512``, also ``--max-tokens 16-256``), drawn
uniformly per request. Token ids are drawn from ``[--min-token, --vocab-size)``: the default
range skips the low ids where SmolLM2's special tokens live.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path


def _span(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition("-")
    low, high = int(lo), int(hi or lo)
    if not 1 <= low <= high:
        raise argparse.ArgumentTypeError(f"expected N or LOW-HIGH with 1 <= LOW <= HIGH: {text!r}")
    return low, high


def make_workload(
    requests: int,
    prompt_len: tuple[int, int],
    max_tokens: tuple[int, int],
    seed: int = 0,
    vocab_size: int = 49152,
    min_token: int = 100,
) -> list[dict]:
    """``requests`` entries of random prompt token ids, reproducible for ``seed``."""
    rng = random.Random(seed)
    out = []
    for _ in range(requests):
        n = rng.randint(*prompt_len)
        out.append(
            {
                "prompt_token_ids": [rng.randrange(min_token, vocab_size) for _ in range(n)],
                "max_tokens": rng.randint(*max_tokens),
            }
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-len", type=_span, default=(128, 128), help="N or LOW-HIGH")
    parser.add_argument("--max-tokens", type=_span, default=(64, 64), help="N or LOW-HIGH")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab-size", type=int, default=49152, help="SmolLM2: 49152")
    parser.add_argument("--min-token", type=int, default=100)
    parser.add_argument("-o", "--output", type=Path, help="file to write (default: stdout)")
    args = parser.parse_args(argv)
    workload = make_workload(
        args.requests, args.prompt_len, args.max_tokens, args.seed, args.vocab_size, args.min_token
    )
    text = json.dumps(workload)
    if args.output:
        args.output.write_text(text + "\n")
    else:
        sys.stdout.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
