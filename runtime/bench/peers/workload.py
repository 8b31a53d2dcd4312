"""The peers' benchmark workload: a JSON list of ``{prompt_token_ids, max_tokens}``.

Stdlib only, deterministic for a seed, so every system gets the very same token ids.
``kvfleet bench peers`` makes its workloads with :func:`make_workload`; by hand::

    python -m kvfleet.runtime.bench.peers.workload --requests 16 --prompt-len 128 --max-tokens 64 \\
        -o /tmp/peers-w16.json
    python -m kvfleet.runtime.bench.peers.workload --requests 1 --prompt-len 128 --max-tokens 128 \\
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


def parse_span(text: str) -> tuple[int, int]:
    """``"128"`` -> ``(128, 128)``, ``"16-512"`` -> ``(16, 512)``."""
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
    rng: random.Random | None = None,
) -> list[dict]:
    """``requests`` entries of random prompt token ids, reproducible for ``seed`` (or drawn from
    ``rng``, which then goes on for the caller's next workload)."""
    rng = rng or random.Random(seed)
    out = []
    for _ in range(requests):
        n = rng.randint(*prompt_len)
        out.append({"prompt_token_ids": prompt_ids(rng, n, vocab_size, min_token),
                    "max_tokens": rng.randint(*max_tokens)})
    return out


def prompt_ids(rng: random.Random, n: int, vocab_size: int = 49152, min_token: int = 100) -> list[int]:
    """``n`` token ids drawn uniformly from ``[min_token, vocab_size)``."""
    return [rng.randrange(min_token, vocab_size) for _ in range(n)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-len", type=parse_span, default=(128, 128), help="N or LOW-HIGH")
    parser.add_argument("--max-tokens", type=parse_span, default=(64, 64), help="N or LOW-HIGH")
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
