"""One matrix on each of the fused decoder's kernel kinds, at one row and at 48: the measurements
behind the per-matrix rule of ``runtime/worker/cpu_plan.py`` (:func:`matrix_matmul`). Not a test::

    python benchmarks/matrix_kinds.py [--threads 1] [NAME:FMT:N:K:G ...]

Each matrix is random weights in ``FMT`` (``int8g``: grouped int8, GGUF Q8_0 / Q5_0 / Q6_K as
stored; ``int4``: Q4_K's layout with a shift; ``bf16``), ``[N, K]``, group ``G``; the default list
is Gemma 3 270M's Q4_K_M matrices and SmolLM2-135M's bf16 ones. Prints the best ms per call of 5
rounds of 3 calls for the float32 kernels (``kv_woq_*_linear``: ``kv_matrix_rows``), the AMX tiles
and the AVX512-BF16 dot products (``kv_bf16_linear``), where the loaded library and the CPU have
them. Results: docs/performance.md, "Which kernels each matrix runs".
"""

from __future__ import annotations

import argparse
import ctypes
import os
import time
from functools import partial

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

from kvfleet.kernels import cpu_features, cpu_lib, cpu_woq
from kvfleet.kernels.cpu_decoder import matmul_available

DEFAULT = ("qkv:int8g:1536:640:32", "o:int4:640:1024:32", "gate_up:int8g:4096:640:32", "down:int8g:640:2048:16",
           "head:int8g:262144:640:32", "smollm2_gate_up:bf16:3072:576:0", "smollm2_head:bf16:49152:576:0")
BF16_CODES = {"amx": 1, "avx512_bf16": 2}   # kv_bf16_linear's `matmul`
FORMATS = {"int4": 2, "bf16": 3, "int8g": 4}   # cpu_gemv_m1.h's KV_*


def best_ms(fn, rounds: int = 5, calls: int = 3) -> float:
    fn()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best * 1e3


def matrix(lib, fmt: str, N: int, K: int, G: int, gen: torch.Generator):
    """(kv_matrix, the float32 kernels' call (x, y, rows), the tensors it points to)."""
    scale = torch.rand(N, K // G if G else 1, generator=gen)
    if fmt == "int8g":
        w = torch.randint(-127, 127, (N, K), dtype=torch.int8, generator=gen)
        shift = None
        f32 = lambda x, y, M: lib.kv_woq_int8g_linear(x.data_ptr(), M, K, K, w.data_ptr(), N, scale.data_ptr(),
                                                      None, G, None, y.data_ptr(), 0, None)
    elif fmt == "int4":
        w = cpu_woq.pack_int4(torch.randint(0, 16, (N, K), dtype=torch.uint8, generator=gen))
        shift = -torch.rand(N, K // G, generator=gen)
        f32 = lambda x, y, M: lib.kv_woq_int4_linear(x.data_ptr(), M, K, K, w.data_ptr(), N, scale.data_ptr(),
                                                     shift.data_ptr(), G, None, y.data_ptr())
    elif fmt == "bf16":
        w, scale, shift = torch.randn(N, K, generator=gen).to(torch.bfloat16), None, None
        f32 = lambda x, y, M: lib.kv_woq_bf16_linear(x.data_ptr(), M, K, K, w.data_ptr(), N, None,
                                                     y.data_ptr())
    else:
        raise SystemExit(f"unknown format {fmt!r}: one of {', '.join(FORMATS)}")
    m = cpu_lib.Matrix(FORMATS[fmt], N, K, w.data_ptr(), None if scale is None else scale.data_ptr(),
                       None if shift is None else shift.data_ptr(), G, None)
    return m, f32, (w, scale, shift)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("matrices", nargs="*", default=list(DEFAULT), metavar="NAME:FMT:N:K:G")
    ap.add_argument("--threads", type=int, default=1, help="OpenMP threads (default 1: a shared CPU's noise)")
    args = ap.parse_args(argv)
    lib = cpu_lib.load()
    if lib is None:
        raise SystemExit(f"kvfleet CPU kernels unavailable: {cpu_lib.unavailable_reason()}")
    torch.set_num_threads(args.threads)
    kinds = [k for k in BF16_CODES if matmul_available(k)]
    gen = torch.Generator().manual_seed(0)
    print(f"CPU: {cpu_features.detect().summary()}; {args.threads} thread(s); load {os.getloadavg()[0]:.1f}")
    print("| matrix | format | rows | float32 ms | " + " | ".join(f"{k} ms" for k in kinds) + " |")
    print("|---|---|---:|---:|" + "---:|" * len(kinds))
    for spec in args.matrices:
        name, fmt, N, K, G = spec.split(":")
        N, K, G = int(N), int(K), int(G)
        m, f32, _keep = matrix(lib, fmt, N, K, G, gen)
        for M in (1, 48):
            x, y = torch.randn(M, K, generator=gen), torch.empty(M, N)
            cells = [best_ms(partial(f32, x, y, M))]
            for kind in kinds:
                cells.append(best_ms(partial(lib.kv_bf16_linear, ctypes.byref(m), x.data_ptr(), M, K, y.data_ptr(),
                                             BF16_CODES[kind])))
            group = f" G{G}" if G else ""
            print(f"| {name} [{N}, {K}] | {fmt}{group} | {M} | " + " | ".join(f"{v:.3f}" for v in cells) + " |",
                  flush=True)


if __name__ == "__main__":
    main()
