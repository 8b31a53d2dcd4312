"""``python -m kvfleet.operator.fetch``: the init container that fetches an ``hf://`` model.

Downloads a Hugging Face hub repository into ``--dest`` with ``huggingface_hub``
(``snapshot_download``), each attempt bounded by ``--timeout`` seconds and up to
``--retries`` attempts with exponential back-off (10 s, 20 s, 40 s, ... capped at 300 s).
A completed download leaves ``DEST/.kvfleet-complete`` holding the repo and revision, so a
restarted pod with a persistent volume skips the download. Exit status 0 on success, 1
when every attempt failed (the kubelet then restarts the init container with its own
back-off).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import time
from collections.abc import Callable
from pathlib import Path

MARKER = ".kvfleet-complete"


def _download(repo: str, revision: str | None, dest: str) -> None:  # pragma: no cover - needs the hub
    from huggingface_hub import snapshot_download

    snapshot_download(repo_id=repo, revision=revision, local_dir=dest)


def fetch(repo: str, dest: str, *, revision: str | None = None, timeout: float = 3600, retries: int = 3,
          download: Callable[[str, str | None, str], None] = _download,
          sleep: Callable[[float], None] = time.sleep, log=print) -> bool:
    """Fetch ``repo`` into ``dest``; True on success (or when already complete).

    Each attempt runs ``download(repo, revision, dest)`` in a child process killed after
    ``timeout`` seconds (a hung connection cannot block the pod forever).
    """
    marker = Path(dest) / MARKER
    want = {"repo": repo, "revision": revision}
    if marker.exists():
        try:
            if json.loads(marker.read_text()) == want:
                log(f"{repo}@{revision or 'main'} already in {dest}")
                return True
        except ValueError:
            pass
    Path(dest).mkdir(parents=True, exist_ok=True)
    for attempt in range(1, retries + 1):
        proc = multiprocessing.get_context("fork").Process(target=download, args=(repo, revision, dest))
        proc.start()
        proc.join(timeout)
        if proc.is_alive():
            proc.kill()
            proc.join()
            log(f"attempt {attempt}/{retries}: timed out after {timeout} s")
        elif proc.exitcode == 0:
            marker.write_text(json.dumps(want))
            log(f"fetched {repo}@{revision or 'main'} into {dest}")
            return True
        else:
            log(f"attempt {attempt}/{retries}: failed with exit code {proc.exitcode}")
        if attempt < retries:
            sleep(min(300.0, 10.0 * 2 ** (attempt - 1)))
    return False


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    p = argparse.ArgumentParser(prog="python -m kvfleet.operator.fetch", description=__doc__.splitlines()[0])
    p.add_argument("--repo", required=True, help="hub repository, ORG/NAME")
    p.add_argument("--revision", default=None)
    p.add_argument("--dest", required=True)
    p.add_argument("--timeout", type=float, default=3600, help="seconds per attempt")
    p.add_argument("--retries", type=int, default=3)
    a = p.parse_args(argv)
    ok = fetch(a.repo, a.dest, revision=a.revision, timeout=a.timeout, retries=a.retries)
    return 0 if ok else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
