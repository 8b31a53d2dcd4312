"""Start-up to ready of ``kvfleet serve`` and the server's peak memory, first start and cached start.
Not a test::

    python benchmarks/startup.py [--max-model-len 4096] [MODEL ...]   (``default``: the embedded default model)

Per model: a fresh ``$KVFLEET_CACHE_DIR`` (first start: the GGUF file read, its derived files
cached), then the same one again (cached start). Each start is ``python -m kvfleet.runtime.cli serve
--model MODEL`` (no other flags but ``--max-model-len``) polled on ``GET /ready`` every 0.2 s: the
seconds from the process's start to the first 200, the process's CPU seconds by then, its peak
resident memory (``VmHWM``) and its resident memory at ready, the KV cache it allocated (its log
line), and a plain ``python -c "import torch, transformers"`` process's resident memory (the
imports' floor, not the model's). The first line records the CPU. Results: docs/performance.md,
"GGUF files as stored".
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


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(model: str | None, cache: str, max_len: int, log: Path) -> dict:
    port = _port()
    cmd = [sys.executable, "-m", "kvfleet.runtime.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--max-model-len", str(max_len), *(["--model", model] if model else [])]
    env = {**os.environ, "KVFLEET_CACHE_DIR": cache, "HF_HUB_OFFLINE": "1", "PYTHONSAFEPATH": "1"}
    t0 = time.monotonic()
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env)
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
            time.sleep(0.2)
        ready = time.monotonic() - t0
        out = {"ready_s": ready, "cpu_s": _cpu_seconds(proc.pid), "peak_mb": _status(proc.pid, "VmHWM"),
               "rss_mb": _status(proc.pid, "VmRSS")}
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    kv = re.search(r"KV cache: .*\(([\d.]+) MiB\)", log.read_text(errors="replace"))
    out["kv_mb"] = float(kv.group(1)) if kv else float("nan")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max-model-len", type=int, default=4096)
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
                r = _start(model, cache, args.max_model_len, Path(cache) / f"serve-{start}.log")
                print(f"| {path.name if model else 'default (' + path.name + ')'} ({size}) | {start} | "
                      f"{r['ready_s']:.1f} | {r['cpu_s']:.1f} | {r['peak_mb']:.0f} | {r['rss_mb']:.0f} | "
                      f"{r['kv_mb']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
