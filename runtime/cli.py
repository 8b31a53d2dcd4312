"""The ``kvfleet`` command: ``kvfleet serve``, ``kvfleet operator``, ``kvfleet bench``, ``kvfleet router``.

Each subcommand owns its options; this module only dispatches, so that
``kvfleet operator`` and ``kvfleet router`` never import torch and ``kvfleet serve`` never imports kopf.
"""

from __future__ import annotations

import sys

_SUBCOMMANDS = {
    "serve": ("kvfleet.runtime.entrypoints.openai.api_server", "Run the OpenAI-compatible inference server."),
    "operator": ("kvfleet.operator.main", "Run the Kubernetes operator (kopf)."),
    "bench": ("kvfleet.runtime.bench.cli", "Serving benchmarks: `bench serve`, `bench compare`."),
    "router": ("kvfleet.runtime.router.app", "Route requests over replicas (prefix affinity, failover, hold)."),
}


def _usage() -> str:
    lines = ["usage: kvfleet {serve,operator,bench,router} [options]", "", "commands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, help_) in _SUBCOMMANDS.items()]
    lines.append("\nRun `kvfleet COMMAND --help` for a command's options.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``kvfleet`` console script.

    Returns the process exit status (0 on success, 2 on a usage error).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in _SUBCOMMANDS:
        print(f"kvfleet: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    from kvfleet.runtime import env

    bad = env.check_all()
    if bad:
        for message in bad:
            print(f"kvfleet: {message}", file=sys.stderr)
        return 2
    import importlib

    module = importlib.import_module(_SUBCOMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
