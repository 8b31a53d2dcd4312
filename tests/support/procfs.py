"""Processes seen through /proc: alive or not, their children, and the tensor-parallel workers
among them (kvfleet.runtime.worker.executor)."""

from __future__ import annotations

import time
from pathlib import Path


def running(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def children(pid: int) -> list[int]:
    """The child processes of ``pid`` (every thread's)."""
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        children = (task / "children").read_text().split()
        out.extend(int(c) for c in children)
    return out


def worker_pids(pid: int) -> list[int]:
    """The tensor-parallel workers among ``pid``'s children."""
    found = []
    for child in children(pid):
        try:
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
        except FileNotFoundError:
            continue
        if b"kvfleet.runtime.worker.executor" in cmdline:
            found.append(child)
    return found


def wait_gone(pids: list[int], seconds: float) -> bool:
    """Wait up to ``seconds`` for every one of ``pids`` to be gone; True when they are."""
    deadline = time.monotonic() + seconds
    while any(running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not any(running(p) for p in pids)
