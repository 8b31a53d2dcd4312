"""kernels/cpu_amx.h: the accumulation order of the AMX tiles that the ``amx`` matmul kind's
batch invariance rests on, measured on this CPU.

``tests/data/amx/tile_order.c`` runs TDPBF16PS on random bf16 operands (exponent ranges 2^0 to
2^±60, zeros, a loaded accumulator, two instructions per output) and compares every output with
the order docs/performance.md states ("AMX tiles at one row": per instruction ``c + (E + O)``, E
and O sequential fp32 sums of the even and odd products, FTZ/DAZ), with its AVX512-BF16
emulation (two ``vdpbf16ps`` chains), and with ``vdpbf16ps``'s own sequential order, which must
differ (so the comparison can fail). Skipped where the CPU (or ``$KVFLEET_CPU_ISA``) has no AMX
or no C compiler is found.
"""

from __future__ import annotations

import subprocess

import pytest
from support.paths import DATA

from kvfleet.kernels import cpu_features, cpu_lib

SOURCE = DATA / "amx" / "tile_order.c"
FLAGS = ("-O2", "-ffp-contract=off", "-mavx512f", "-mavx512bw", "-mavx512bf16", "-mamx-tile", "-mamx-bf16")


@pytest.mark.skipif(cpu_features.detect().isa_level != "amx", reason="no AMX on this CPU (or capped)")
@pytest.mark.skipif(cpu_lib.compiler() is None, reason="no C compiler")
def test_tile_sums_follow_the_documented_order(tmp_path):
    exe = tmp_path / "tile_order"
    subprocess.run([cpu_lib.compiler(), *FLAGS, str(SOURCE), "-o", str(exe), "-lm"], check=True)
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    if run.returncode == 2:
        pytest.skip("the kernel refused this process the AMX tile state")
    assert run.returncode == 0, run.stderr
    fields = run.stdout.split()
    counts = dict(zip(fields[::2], map(int, fields[1::2])))
    assert counts["cases"] == 51200
    assert counts["model"] == 0, run.stdout  # c + (E + O), bit for bit
    assert counts["emul"] == 0, run.stdout  # two vdpbf16ps chains + two vaddps under FTZ/DAZ
    assert counts["seq"] > counts["cases"] // 10, run.stdout  # vdpbf16ps's own order is another sum
