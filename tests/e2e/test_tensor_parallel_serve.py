"""``kvfleet serve --tensor-parallel-size N`` as a process on the CPU with the real SmolLM2-135M
(9 attention heads, 3 KV heads): 3 ranks answer as the one-process engine does, and neither a
stopped nor a killed server leaves workers behind; 2 ranks exit 1 naming the option. The
engine's tensor parallelism in process: tests/unit/runtime/worker/test_executor.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from support.procfs import running, wait_gone, worker_pids
from support.serve import free_port, start_serve

from kvfleet.runtime.config import EngineConfig
from kvfleet.runtime.engine.llm_engine import LLMEngine
from kvfleet.runtime.sampling_params import SamplingParams

PROMPT = "The capital of France is"
MAX_TOKENS = 8


def _start_server(log: Path) -> tuple[subprocess.Popen, str]:
    return start_serve(["--tensor-parallel-size", "3", "--device", "cpu", "--dtype", "float32",
                        "--kv-cache-memory", "32MiB", "--log-level", "info"], log)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_kvfleet_serve_tp3_answers_and_leaves_no_workers(sig, smollm2, tmp_path):
    """``kvfleet serve --tensor-parallel-size 3`` answers as the tp=1 engine does. After
    SIGTERM (graceful: the engine stops its workers) and after SIGKILL (no clean-up code runs
    in the server; its workers notice their parent is gone) no worker is left."""
    log = tmp_path / "server.log"
    proc, base = _start_server(log)
    try:
        pids = worker_pids(proc.pid)
        assert len(pids) == 2 and all(running(p) for p in pids)
        body = {"model": "SmolLM2-135M-Instruct", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
        resp = httpx.post(base + "/v1/completions", json=body, timeout=120)
        assert resp.status_code == 200, resp.text
        ref_engine = LLMEngine(EngineConfig(device="cpu", dtype="float32", kv_cache_memory=32 * 2**20), loaded=smollm2)
        ref_engine.add_request("ref", PROMPT, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
        assert resp.json()["choices"][0]["text"] == ref_engine.run_until_done()["ref"].outputs[0].text
        proc.send_signal(sig)
        code = proc.wait(60)
        assert wait_gone(pids, 30), f"workers {pids} outlived the server:\n{log.read_text()}"
        if sig == signal.SIGTERM:  # uvicorn re-raises the signal after its graceful shutdown
            assert code == -signal.SIGTERM, log.read_text()
            # the engine sent the stop message: both workers exited by themselves, with status 0
            assert "tensor-parallel workers stopped (exit codes [0, 0])" in log.read_text()
            assert "worker failed" not in log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_kvfleet_serve_tp2_exits_1_naming_the_option(tmp_path):
    """``kvfleet serve --tensor-parallel-size 2`` on the default model (9 heads): status 1, the
    reason on the server's ERROR line, no worker started."""
    cmd = [sys.executable, "-m", "kvfleet.runtime.cli", "serve", "--host", "127.0.0.1", "--port", str(free_port()),
           "--tensor-parallel-size", "2", "--device", "cpu", "--kv-cache-memory", "32MiB"]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONSAFEPATH": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    errors = [line for line in proc.stderr.splitlines() if " ERROR " in line]
    expected = "the engine failed to start: ValueError: tensor_parallel_size (2) must divide"
    assert errors and expected in errors[0], errors
    assert "workers pids" not in proc.stderr  # no worker was started (runtime/worker/executor.py logs them)
