"""Start-up to ready of ``kvfleet serve`` and the server's peak memory, first start and cached start.
Not a test::

    python benchmarks/startup.py [--max-model-len 4096] [--phases] [MODEL ...]   (``default``: the default model)

Per model: a fresh ``$KVFLEET_CACHE_DIR`` (first start: the GGUF file read, its derived files
cached), then the same one again (cached start). Each start is ``python -m kvfleet.runtime.cli serve
--model MODEL`` (no other flags but ``--max-model-len``) polled on ``GET /ready`` every 0.2 s: the
seconds from the process's start to the first 200, the process's CPU seconds by then, its peak
resident memory (``VmHWM``) and its resident memory at ready, the KV cache it allocated (its log
line), and a plain ``python -c "import torch, transformers"`` process's resident memory (the
imports' floor, not the model's). The first line records the CPU. Results: docs/performance.md,
"GGUF files as stored".

``--phases``: the server's start cut into phases by its own log lines (:data:`PHASES`), the log
tailed every 20 ms; at each phase's line the process's ``VmHWM`` (the phase's peak) and ``VmRSS``
are read and ``VmHWM`` reset (``/proc/PID/clear_refs`` <- 5, as benchmarks/gguf_load.py does in
its own process). A phase's peak is thus within ~20 ms of its end line; the table lists each
phase's peak and RSS at its end in MB.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx


def _status(pid: int, key: str) -> float:
    return int(Path(f"/proc/{pid}/status").read_text().split(key + ":")[1].split()[0]) / 1024


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


PHASES = (
    ("imports + app", re.compile(r"kvfleet.server: serving ")),
    ("load (weights + tokenizer)", re.compile(r"model_loader: loaded ")),
    ("runner (probe) + KV cache", re.compile(r"model_runner: KV cache: ")),
    ("fused decoder build", re.compile(r"cpu_decode: fused CPU decode")),
    ("engine rest + API layer", re.compile(r"kvfleet.server: model .* ready in ")),
)
"""(phase, the log line that ends it), in order; the last phase runs to the first 200 of ``/ready``."""


class _Phases:
    """Tails the server's log; at each phase's end line reads and resets the process's peak."""

    def __init__(self, pid: int, log: Path):
        self.pid, self.log, self.pos, self.rows = pid, log, 0, []
        self.next = 0
        self.buf = ""

    def _mark(self, name: str) -> None:
        self.rows.append((name, _status(self.pid, "VmHWM"), _status(self.pid, "VmRSS")))
        Path(f"/proc/{self.pid}/clear_refs").write_text("5")

    def poll(self) -> None:
        with open(self.log, errors="replace") as fh:
            fh.seek(self.pos)
            self.buf += fh.read()
            self.pos = fh.tell()
        *lines, self.buf = self.buf.split("\n")
        for line in lines:
            if self.next < len(PHASES) and PHASES[self.next][1].search(line):
                self._mark(PHASES[self.next][0])
                self.next += 1

    def finish(self) -> None:
        self.poll()
        self._mark("to /ready 200" if self.next == len(PHASES) else f"to /ready 200 (from {PHASES[self.next][0]})")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(model: str | None, cache: str, max_len: int, log: Path, phases: bool = False) -> dict:
    port = _port()
    cmd = [sys.executable, "-m", "kvfleet.runtime.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--max-model-len", str(max_len), *(["--model", model] if model else [])]
    env = {**os.environ, "KVFLEET_CACHE_DIR": cache, "HF_HUB_OFFLINE": "1", "PYTHONSAFEPATH": "1"}
    t0 = time.monotonic()
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env)
    tail = _Phases(proc.pid, log) if phases else None
    try:
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"serve exited {proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() - t0 > 1200:
                raise SystemExit(f"not ready in 1200 s:\n{log.read_text()[-3000:]}")
            for _ in range(10):  # the log every 20 ms, /ready every 0.2 s
                if tail is not None:
                    tail.poll()
                time.sleep(0.02)
        ready = time.monotonic() - t0
        if tail is not None:
            tail.finish()
        out = {"ready_s": ready, "cpu_s": _cpu_seconds(proc.pid), "peak_mb": _status(proc.pid, "VmHWM"),
               "rss_mb": _status(proc.pid, "VmRSS")}
        if tail is not None:
            out["peak_mb"] = max(peak for _, peak, _ in tail.rows)  # VmHWM was reset at each phase
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    kv = re.search(r"KV cache: .*\(([\d.]+) MiB\)", log.read_text(errors="replace"))
    out["kv_mb"] = float(kv.group(1)) if kv else float("nan")
    out["phases"] = tail.rows if tail is not None else []
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--phases", action="store_true", help="each phase's peak and RSS (see the docstring)")
    parser.add_argument("models", nargs="*")
    args = parser.parse_args()
    from kvfleet.kernels import cpu_features, cpu_lib

    cpu_lib.load(Path.home() / ".cache" / "kvfleet")  # the kernels library, built before any timed start
    floor = subprocess.run([sys.executable, "-c", "import torch, transformers; "
                            "print(open('/proc/self/status').read().split('VmRSS:')[1].split()[0])"],
                           capture_output=True, text=True, check=True)
    print(f"CPU: {cpu_features.detect().summary()}")
    print(f"imports' floor (python -c 'import torch, transformers'): {int(floor.stdout) / 1024:.0f} MB RSS")
    print("| model (file MB) | start | ready s (wall) | CPU s | peak RSS MB | RSS at ready MB | KV cache MB |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for model in [None if m == "default" else m for m in args.models or ["default"]]:
        if model is None:
            from kvfleet.runtime.worker import model_loader

            path = model_loader.default_model_path()
        else:
            path = Path(model)
        size = f"{path.stat().st_size / 2**20:.0f}" if path.is_file() else "-"
        with tempfile.TemporaryDirectory() as cache:
            for start in ("first", "cached"):
                r = _start(model, cache, args.max_model_len, Path(cache) / f"serve-{start}.log", args.phases)
                print(f"| {path.name if model else 'default (' + path.name + ')'} ({size}) | {start} | "
                      f"{r['ready_s']:.1f} | {r['cpu_s']:.1f} | {r['peak_mb']:.0f} | {r['rss_mb']:.0f} | "
                      f"{r['kv_mb']:.0f} |", flush=True)
                for phase, peak, rss in r["phases"]:
                    print(f"|   phase: {phase} | | | | {peak:.0f} | {rss:.0f} | |", flush=True)


if __name__ == "__main__":
    main()
