"""kernels/cpu_amx.h: the accumulation order of the AMX tiles that the ``amx`` matmul kind's
batch invariance rests on, measured on this CPU; and bf16 weights, tile-loaded as stored, giving
the bits of the same values widened (the path every other format takes).

``tests/data/amx/tile_order.c`` runs TDPBF16PS on random bf16 operands (exponent ranges 2^0 to
2^±60, zeros, a loaded accumulator, two instructions per output) and compares every output with
the order docs/performance.md states ("AMX tiles at one row": per instruction ``c + (E + O)``, E
and O sequential fp32 sums of the even and odd products, FTZ/DAZ), with its AVX512-BF16
emulation (two ``vdpbf16ps`` chains), and with ``vdpbf16ps``'s own sequential order, which must
differ (so the comparison can fail). Skipped where the CPU (or ``$KVFLEET_CPU_ISA``) has no AMX
or no C compiler is found.
"""

from __future__ import annotations

import ctypes
import subprocess

import pytest
import torch
from support.paths import DATA

from kvfleet.kernels import cpu_features, cpu_lib

SOURCE = DATA / "amx" / "tile_order.c"
AMX = pytest.mark.skipif(cpu_features.detect().isa_level != "amx", reason="no AMX on this CPU (or capped)")
FLAGS = ("-O2", "-ffp-contract=off", "-mavx512f", "-mavx512bw", "-mavx512bf16", "-mamx-tile", "-mamx-bf16")


@AMX
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


@AMX
@pytest.mark.skipif(cpu_lib.compiler() is None, reason="no C compiler")
@pytest.mark.parametrize("N", [80, 112])
def test_bf16_weights_loaded_as_stored_give_the_widened_bits(kernels_build_root, N):
    """bf16 rows are A tiles as stored (amx_direct: no widening copy); fp32 weights holding the
    same bf16 values go through the widening copy. Both must give the same bits, on the narrow
    path (<= 16 rows; kv_bf16_linear's calls of 96 channels: groups of 48 + 32, resp. 48 + 48 and
    16) and the wide one (32-channel pairs, a lone 16), from a matrix whose rows are not 64-byte
    aligned, with a bias; and match float64 (a mistake shared by both paths)."""
    lib = cpu_lib.open_variant("amx", kernels_build_root)
    if lib.kv_amx_available() != 1:
        pytest.skip("the kernel refused this process the AMX tile state")
    gen = torch.Generator().manual_seed(5)
    K = 608  # 19 blocks of 32
    store = (torch.randn(N * K + 1, generator=gen) * 0.1).bfloat16()
    wb = store[1:].view(N, K)  # 2 bytes past the allocation's start: rows at no 64-byte boundary
    wf = wb.float().contiguous()
    bias = torch.randn(N, generator=gen)
    bf16 = cpu_lib.Matrix(3, N, K, wb.data_ptr(), None, None, 0, bias.data_ptr())
    fp32 = cpu_lib.Matrix(0, N, K, wf.data_ptr(), None, None, 0, bias.data_ptr())
    x = torch.randn(40, K, generator=gen)

    def run(m: cpu_lib.Matrix, rows: torch.Tensor) -> torch.Tensor:
        y = torch.empty(rows.shape[0], N)
        assert lib.kv_bf16_linear(ctypes.byref(m), rows.data_ptr(), rows.shape[0], K, y.data_ptr(), 1) == 0
        return y

    for M in (1, 5, 16, 17, 40):
        rows = x[:M].clone()
        assert torch.equal(run(bf16, rows), run(fp32, rows)), M
    ref = x.bfloat16().double() @ wb.double().T + bias.double()
    assert (run(bf16, x).double() - ref).abs().max() <= 1e-3 * ref.abs().max()
