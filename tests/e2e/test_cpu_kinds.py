"""The kernel-dependent tests as the other CPU kinds run them.

Sessions and users land on AVX2-only EPYCs, Zen 4s (AVX512-BF16 without AMX: the fused decoder's
matmuls as bf16 dot products) and Xeons with AMX tiles; each runs other kernels and the tests'
expectations are stated per kind. A machine can run every kind at or below its own
(``$KVFLEET_CPU_ISA`` caps the library variant and the CPU plan,
:mod:`kvfleet.kernels.cpu_features`), so this test reruns the ``cpu_kinds`` modules
(``CPU_KIND_MODULES`` in tests/conftest.py) in a child pytest as the AVX2 floor and as a Zen 4
would, wherever the machine is above them, and skips with the reason where it is not. The plain
AVX-512 level (no bf16) runs the same float32 kernels as the floor's code paths at 16 lanes and is
left to the machines that are that kind.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvfleet.kernels import cpu_features

ROOT = Path(__file__).resolve().parents[2]
KINDS = ("avx2", "avx512_bf16")

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("isa", KINDS)
def test_the_kernel_tests_pass_as_a_lower_cpu_kind_runs_them(isa):
    own = cpu_features.detect().isa_level
    levels = cpu_features.ISA_LEVELS
    if own is None or levels.index(own) <= levels.index(isa):
        pytest.skip(f"this CPU is {own or 'below avx2'}: the {isa} kind runs in the main suite or not at all")
    env = {**os.environ, cpu_features.ISA_ENV: isa, "PYTHONSAFEPATH": "1"}
    env.pop("KVFLEET_CPU_MATMUL", None)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-m", "cpu_kinds", "-q", "-p", "no:cacheprovider",
                           "-x", "--no-header"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-40:])
    assert proc.returncode == 0, f"as {isa}:\n{tail}"
    assert " passed" in tail, tail
