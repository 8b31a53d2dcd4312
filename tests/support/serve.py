"""Free ports and ``kvfleet serve`` as a subprocess: start it, wait until ready, stop it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest


def bare_env() -> dict[str, str]:
    """A near-empty environment (a process that must need nothing of this one's), with the
    fleet secret's sources kept: every kvfleet process of the suite is one fleet (tests/conftest.py)."""
    fleet = {k: os.environ[k] for k in ("XDG_CONFIG_HOME", "KVFLEET_FLEET_SECRET") if k in os.environ}
    return {"PYTHONSAFEPATH": "1", "PATH": "", **fleet}


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_serve(args: list[str], log: Path, env: dict[str, str] | None = None,
                timeout: float = 300, port: int | None = None) -> tuple[subprocess.Popen, str]:
    """Start ``kvfleet serve --host 127.0.0.1 --port <free> *args`` as a subprocess (output to
    ``log``; ``env`` added to this process's environment with the hub offline) and wait until
    ``GET /ready`` answers 200. Returns ``(process, base_url)``; fails the test, with the log's
    tail, when the server exits or is not ready within ``timeout`` seconds. ``port``: listen there
    instead of a free port (a restart at the same address)."""
    import httpx

    port = port or free_port()
    cmd = [sys.executable, "-m", "kvfleet.runtime.cli", "serve", "--host", "127.0.0.1", "--port", str(port), *args]
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONSAFEPATH": "1", "TOKENIZERS_PARALLELISM": "false",
                **(env or {})}
    with open(log, "wb") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=full_env)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            pytest.fail(f"server exited with {proc.returncode}:\n{log.read_text(errors='replace')[-3000:]}")
        if time.monotonic() > deadline:
            stop_serve(proc)
            pytest.fail(f"server not ready in {timeout} s:\n{log.read_text(errors='replace')[-3000:]}")
        try:
            if httpx.get(base + "/ready", timeout=5).status_code == 200:
                return proc, base
        except httpx.TransportError:
            pass
        time.sleep(0.1)


def stop_serve(proc: subprocess.Popen, grace: float = 20) -> None:
    """SIGTERM, then SIGKILL after ``grace`` seconds; waits for the process to end."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
