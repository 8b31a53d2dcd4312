"""``python -m kvfleet.operator.fetch``: the init container that fetches an ``hf://`` model.

Downloads a Hugging Face hub repository into ``--dest`` with ``huggingface_hub``
(``snapshot_download``, only the files matching ``--allow-pattern``), each attempt bounded by
``--timeout`` seconds and up to ``--retries`` attempts with exponential back-off (10 s, 20 s,
40 s, ... capped at 300 s). The operator gives each ``repo@revision`` its own ``--dest``, so a
new revision never rewrites files under running pods. Replicas sharing a volume take an
exclusive lock (``DEST.lock``, ``flock``) first: one downloads, the others wait, then find
``DEST/.kvfleet-complete`` (the repo and revision) and skip the download. Exit status 0 on
success, 1 when every attempt failed (the kubelet then restarts the init container).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import multiprocessing
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

MARKER = ".kvfleet-complete"


def _download(repo: str, revision: str | None, dest: str,
              allow_patterns: Sequence[str] | None) -> None:  # pragma: no cover - needs the hub
    from huggingface_hub import snapshot_download

    snapshot_download(repo_id=repo, revision=revision, local_dir=dest,
                      allow_patterns=list(allow_patterns) if allow_patterns else None)


@contextlib.contextmanager
def download_lock(dest: str, log=print) -> Iterator[None]:
    """Hold the exclusive ``flock`` on ``DEST.lock`` (next to ``dest``): one downloader per
    cache directory across the pods sharing its volume."""
    path = Path(str(dest).rstrip("/") + ".lock")
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"another pod is downloading into {dest}; waiting for its lock")
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _complete(marker: Path, want: dict) -> bool:
    try:
        return json.loads(marker.read_text()) == want
    except (OSError, ValueError):
        return False


def fetch(repo: str, dest: str, *, revision: str | None = None, timeout: float = 3600, retries: int = 3,
          allow_patterns: Sequence[str] | None = None,
          download: Callable[[str, str | None, str, Sequence[str] | None], None] = _download,
          sleep: Callable[[float], None] = time.sleep, log=print) -> bool:
    """Fetch ``repo`` into ``dest`` under :func:`download_lock`; True on success (or when
    already complete).

    Each attempt runs ``download(repo, revision, dest, allow_patterns)`` in a child process
    killed after ``timeout`` seconds (a hung connection cannot block the pod forever).
    """
    marker = Path(dest) / MARKER
    want = {"repo": repo, "revision": revision}
    if _complete(marker, want):
        log(f"{repo}@{revision or 'main'} already in {dest}")
        return True
    with download_lock(dest, log=log):
        if _complete(marker, want):  # another pod finished it while this one waited
            log(f"{repo}@{revision or 'main'} already in {dest}")
            return True
        Path(dest).mkdir(parents=True, exist_ok=True)
        for attempt in range(1, retries + 1):
            proc = multiprocessing.get_context("fork").Process(target=download,
                                                               args=(repo, revision, dest, allow_patterns))
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
                sleep(backoff(attempt))
    return False


def backoff(attempt: int) -> float:
    """Seconds to wait after failed attempt number ``attempt`` (1-based)."""
    return min(300.0, 10.0 * 2 ** (attempt - 1))


def budget_seconds(timeout: float, retries: int) -> float:
    """The longest a fetch can take: every attempt timing out, plus the back-offs between them."""
    return timeout * retries + sum(backoff(a) for a in range(1, retries))


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    p = argparse.ArgumentParser(prog="python -m kvfleet.operator.fetch", description=__doc__.splitlines()[0])
    p.add_argument("--repo", required=True, help="hub repository, ORG/NAME")
    p.add_argument("--revision", default=None)
    p.add_argument("--dest", required=True)
    p.add_argument("--timeout", type=float, default=3600, help="seconds per attempt")
    p.add_argument("--retries", type=int, default=3)
    p.add_argument("--allow-pattern", action="append", default=[], dest="allow_patterns",
                   help="download only files matching this glob (repeatable; default: all)")
    a = p.parse_args(argv)
    ok = fetch(a.repo, a.dest, revision=a.revision, timeout=a.timeout, retries=a.retries,
               allow_patterns=a.allow_patterns or None)
    return 0 if ok else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
