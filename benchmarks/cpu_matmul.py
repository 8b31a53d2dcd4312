"""The fused decoder's matmul kernels side by side on this CPU: float32 (``cpu_gemv.h``), bf16 dot
products (``cpu_dpbf16.h``, AVX512-BF16) and AMX tiles (``cpu_amx.h``), each where the loaded
library and the CPU have it, on the default model's Q4_1 gate|up shape (N 3072, K 576, group 32)
at several row counts. Not a test::

    python benchmarks/cpu_matmul.py [--rows 1 16 64 256] [--repeat 7] [--threads 2]

Prints, per row count, the best time per call over ``--repeat`` rounds of 5 calls and its
GFLOP/s (2 M N K / time). The library is the CPU's own variant (``$KVFLEET_CPU_ISA`` caps it).
What it tells: which kernels the CPU plan should put the bf16 matmuls on (one row: decode, widening-
bound; 256 rows: prefill, compute-bound). Results: docs/performance.md, "AVX512-BF16 dot products".
"""

from __future__ import annotations

import argparse
import ctypes
import os
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

from kvfleet.kernels import cpu_features, cpu_lib, cpu_woq
from kvfleet.kernels.cpu_decoder import matmul_available

N, K, G = 3072, 576, 32
BF16_CODES = {"amx": 1, "avx512_bf16": 2}   # kv_bf16_linear's `matmul`


def best_ms(fn, repeat: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(5):
            fn()
        best = min(best, (time.perf_counter() - t0) / 5)
    return best * 1e3


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None, help="OpenMP threads (default: torch's)")
    args = ap.parse_args(argv)
    lib = cpu_lib.load()
    if lib is None:
        raise SystemExit(f"kvfleet CPU kernels unavailable: {cpu_lib.unavailable_reason()}")
    if args.threads:
        torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (N, K), generator=gen, dtype=torch.uint8)
    scale, shift = torch.rand(N, K // G, generator=gen) * 0.02, -torch.rand(N, K // G, generator=gen) * 0.1
    packed = cpu_woq.pack_int4(q)
    m = cpu_lib.Matrix(2, N, K, packed.data_ptr(), scale.data_ptr(), shift.data_ptr(), G, None)
    kinds = ["float32"] + [k for k in ("avx512_bf16", "amx") if matmul_available(k)]
    print(f"CPU: {cpu_features.detect().summary()}; library {cpu_lib.variant_for(cpu_features.detect())}; "
          f"{torch.get_num_threads()} threads; int4 [{N}, {K}], group {G}")
    print("| rows | " + " | ".join(f"{k} ms (GFLOP/s)" for k in kinds) + " |")
    print("|---:|" + "---:|" * len(kinds))
    for rows in args.rows:
        x = torch.randn(rows, K, generator=gen)
        y = torch.empty(rows, N)

        def call(kind: str, x=x, y=y, rows=rows):
            if kind == "float32":
                return lambda: lib.kv_woq_int4_linear(x.data_ptr(), rows, K, K, packed.data_ptr(), N,
                                                      scale.data_ptr(), shift.data_ptr(), G, None, y.data_ptr())
            code = BF16_CODES[kind]
            return lambda: lib.kv_bf16_linear(ctypes.byref(m), x.data_ptr(), rows, K, y.data_ptr(), code)

        cells = []
        for kind in kinds:
            ms = best_ms(call(kind), args.repeat)
            cells.append(f"{ms:.3f} ({2 * rows * N * K / ms / 1e6:.0f})")
        print(f"| {rows} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
