"""A real Prometheus server's binary, and a prometheus-client registry served over HTTP as the
runtime serves its own ``/metrics``."""

from __future__ import annotations

import http.server
import os
import shutil
import threading

import pytest

from kvfleet.runtime.metrics import CONTENT_TYPE, exposition


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
