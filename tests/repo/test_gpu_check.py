"""benchmarks/gpu_check.py on a machine without a GPU: it parses its options, reports
clearly that there is nothing to check, and its GPU lookup table answers."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
import torch
from support.paths import ROOT

SCRIPT = ROOT / "benchmarks" / "gpu_check.py"


def load():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_help_lists_options():
    r = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    for opt in ("--budget-s", "--quick", "--skip-engine", "--only"):
        assert opt in r.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: run the script itself")
def test_without_cuda_exits_2_and_says_why():
    r = subprocess.run([sys.executable, str(SCRIPT), "--quick"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "No CUDA device" in r.stdout


def test_peak_table():
    mod = load()
    assert mod.lookup_peaks("NVIDIA H200") == (4.8e12, 989e12)
    assert mod.lookup_peaks("NVIDIA H100 80GB HBM3")[0] == 3.35e12
    assert mod.lookup_peaks("NVIDIA H100 PCIe")[0] == 2.0e12
    assert mod.lookup_peaks("NVIDIA A100-SXM4-80GB")[0] == 2.039e12
    assert mod.lookup_peaks("NVIDIA A100-SXM4-40GB")[0] == 1.555e12
    assert mod.lookup_peaks("NVIDIA L4")[0] == 0.3e12
    assert mod.lookup_peaks("Some Future GPU") == (None, None)


def test_budget_counts_down():
    mod = load()
    b = mod.Budget(100.0)
    assert 99.0 < b.left() <= 100.0
    assert b.elapsed() >= 0.0


def test_smoke_mode_runs_every_kernel_section_on_cpu():
    # --smoke runs the correctness, decode and prefill sections with tiny shapes on CPU
    # under the Triton interpreter: the script's own code paths, not GPU speed. One shard of
    # sixteen of the correctness section (its smoke cases are 15: this is one grid case, 9 s
    # instead of 54 s): every case runs in test_device_scripts' run.sh smoke.
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--budget-s", "150", "--shard", "1/16"],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    out = r.stdout
    assert "correctness checks passed" in out and "FAIL" not in out.replace("PASS", "")
    assert "correctness=PASS, decode=PASS, prefill=PASS" in out
    assert "engine" not in out.split("Summary")[1]
