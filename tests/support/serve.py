"""Small helpers shared by the test modules (imported as ``support``; tests/ is on sys.path)."""

from __future__ import annotations

import http.server
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kvfleet.runtime.metrics import CONTENT_TYPE, exposition


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


def prometheus_binary() -> str:
    """Path of Debian's ``prometheus`` server; skips the test without it, fails in CI."""
    found = shutil.which("prometheus")
    if found:
        return found
    message = ("the `prometheus` server binary is not installed (Debian package `prometheus`, installed by "
               "`bash .ci/setup --test`)")
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(message + " -- required in CI", pytrace=False)
    pytest.skip(message)


class _Exposition(http.server.BaseHTTPRequestHandler):
    """Serves ``/metrics`` exactly as the runtime's server does: ``exposition(registry)``
    with its content type (text format 0.0.4, whatever the scraper's Accept header; a
    negotiated OpenMetrics answer from prometheus-client would escape the ``:`` in names)."""

    registry = None

    def do_GET(self):
        body = exposition(self.registry)
        self.send_response(200)
        self.send_header("Content-Type", CONTENT_TYPE)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def serve_registry(registry) -> http.server.ThreadingHTTPServer:
    """Serve a prometheus-client registry's exposition on a free loopback port, in a thread.
    Call ``shutdown()`` and ``server_close()`` on the result when done."""
    handler = type("Handler", (_Exposition,), {"registry": registry})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def record_schedules(engine) -> list:
    """Wrap ``engine.scheduler.schedule`` (an ``LLMEngine``'s) so that every
    ``SchedulerOutput`` it returns is also appended to the returned list."""
    outputs = []
    schedule = engine.scheduler.schedule

    def wrapped():
        out = schedule()
        outputs.append(out)
        return out

    engine.scheduler.schedule = wrapped
    return outputs
