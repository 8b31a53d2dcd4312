"""``kvfleet operator`` as a process against the Kubernetes emulator (support/kube_emulator.py),
and the InferenceService objects the end-to-end tests give it.

``running_operator(tmp)``: the emulator and a ``--standalone`` operator on it (a context manager);
``OperatorProcess``: one operator process to start and stop; ``start_operator`` / ``stop_operator``:
the bare process (autoscaler loop every second), for tests that bring their own emulator.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import yaml

from support.kube_emulator import ISVC, EmulatorThread
from support.paths import ROOT
from support.serve import free_port

NS = "default"


def kvfleet_command() -> list[str]:
    exe = Path(sys.executable).with_name("kvfleet")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "kvfleet.runtime.cli"]


class OperatorProcess:
    """``kvfleet operator`` in a subprocess, logging to a file."""

    def __init__(self, kubeconfig: Path, log: Path, *extra: str):
        self.health_port = free_port()
        self.log = log
        self.args = [*kvfleet_command(), "operator", "--kubeconfig", str(kubeconfig),
                     "--health-port", str(self.health_port), *extra]
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 60) -> OperatorProcess:
        env = {**os.environ, "KVFLEET_PEERING_LIFETIME": "10"}
        self._fh = open(self.log, "a")
        self.proc = subprocess.Popen(self.args, stdout=self._fh, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"operator exited:\n{self.log.read_text()[-4000:]}"
            try:
                if httpx.get(f"http://127.0.0.1:{self.health_port}/healthz", timeout=1).status_code == 200:
                    time.sleep(1.0)  # watch-streams start right after the probe server
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise AssertionError(f"operator not healthy in {timeout} s:\n{self.log.read_text()[-4000:]}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if getattr(self, "_fh", None):
            self._fh.close()


@contextlib.contextmanager
def running_operator(tmp: Path):
    """The emulator and a ``kvfleet operator --standalone`` process on it; the log tail is
    printed at the end."""
    with EmulatorThread() as emu:
        op = OperatorProcess(emu.write_kubeconfig(tmp / "kubeconfig"), tmp / "operator.log", "--standalone")
        try:
            op.start()
            yield emu, op
        finally:
            op.stop()
            print("---- operator log (tail) ----\n" + op.log.read_text()[-6000:])



def start_operator(kubeconfig: Path, log: Path, *args: str) -> tuple[subprocess.Popen, int]:
    """``kvfleet operator --kubeconfig KUBECONFIG *args`` with its autoscaler loop every second, output
    appended to ``log``; returns ``(process, health port)`` once ``/healthz`` answers."""
    port = free_port()
    exe = Path(sys.executable).with_name("kvfleet")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "kvfleet.runtime.cli"]
    proc = subprocess.Popen([*cmd, "operator", "--kubeconfig", str(kubeconfig), "--health-port", str(port), *args],
                            stdout=log.open("a"), stderr=subprocess.STDOUT,
                            # the autoscaler loop every second, so that its requests happen in the test
                            env={**os.environ, "KVFLEET_AUTOSCALER_INTERVAL": "1"})
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"operator exited:\n{log.read_text()[-4000:]}"
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                time.sleep(1.0)
                return proc, port
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise AssertionError(f"operator not healthy:\n{log.read_text()[-4000:]}")


def stop_operator(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL after 20 s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def manifest(name: str, **spec) -> dict:
    obj = yaml.safe_load((ROOT / "examples/inferenceservice-minimal.yaml").read_text())
    obj["metadata"]["name"] = name
    obj["spec"].update(spec)
    return obj


def condition(emu: EmulatorThread, name: str, type_: str) -> dict | None:
    isvc = emu.get(ISVC, NS, name) or {}
    return next((c for c in (isvc.get("status") or {}).get("conditions") or [] if c["type"] == type_), None)
