"""The AMX tile kernel alone (``kernels/cpu_amx.h`` through ``kv_bf16_linear``), one thread. Not a test::

    python benchmarks/amx_rows.py [--rows 1 12 48] [--matrices 24] [--formats bf16 fp32 int8 int4]
        [--library A.so --library B.so]

Per weight format, milliseconds per call and weight bytes per second for ``--rows`` rows against
``--matrices`` random [N, K] matrices (default SmolLM2-135M's gate_up of one expert: [1536, 576]),
called in turn so that they are read from wherever that many bytes live (24 x 1.7 MiB of bf16: L3
on a 2 MiB-L2 core; 1 matrix: L2; 150: memory). Formats: ``bf16`` weights, tile-loaded as stored;
``fp32`` weights holding the same bf16 values, each call widening them into the tiles' order (what
bf16 weights took before, and the same bits); ``int8`` per channel, ``int4`` in groups of 32.
Each format's best of ``--rounds`` passes, the formats interleaved within a round so that a shared
machine's load hits them alike. ``--library`` (repeated) compares builds of the kernels the same
way, in one process, and checks that they give the same bits: build the other one from another
checkout's sources (``git stash; python -c "from kvfleet.kernels import cpu_lib;
print(cpu_lib.build('amx'))"; git stash pop`` prints its path). Default: this checkout's. OpenMP
is held to one thread (``kv_bf16_linear`` splits its channels over OpenMP threads otherwise).
Results: docs/performance.md, "bf16 weights as A tiles".
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import ctypes
import time

import torch

from kvfleet.kernels import cpu_features, cpu_lib

FORMATS = ("bf16", "fp32", "int8", "int4")


def matrix(fmt: str, N: int, K: int, gen: torch.Generator) -> tuple[cpu_lib.Matrix, list[torch.Tensor], int]:
    """A kv_matrix of ``fmt`` over random weights, the tensors it points into, and its weight bytes."""
    w = (torch.randn(N, K, generator=gen) * 0.05).bfloat16()
    if fmt == "bf16":
        return cpu_lib.Matrix(3, N, K, w.data_ptr(), None, None, 0, None), [w], 2 * N * K
    if fmt == "fp32":
        f = w.float().contiguous()
        return cpu_lib.Matrix(0, N, K, f.data_ptr(), None, None, 0, None), [f], 4 * N * K
    if fmt == "int8":
        s = (w.float().abs().amax(1) / 127).contiguous()
        q = torch.round(w.float() / s[:, None]).to(torch.int8)
        return cpu_lib.Matrix(1, N, K, q.data_ptr(), s.data_ptr(), None, 0, None), [q, s], N * K
    from kvfleet.kernels import cpu_woq

    q = torch.randint(0, 16, (N, K), generator=gen, dtype=torch.uint8)
    s, t = torch.rand(N, K // 32, generator=gen) * 0.01, -torch.rand(N, K // 32, generator=gen) * 0.05
    packed = cpu_woq.pack_int4(q)
    return cpu_lib.Matrix(2, N, K, packed.data_ptr(), s.data_ptr(), t.data_ptr(), 32, None), [packed, s, t], N * K // 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 12, 48])
    parser.add_argument("--matrices", type=int, default=24)
    parser.add_argument("--shape", type=int, nargs=2, default=[1536, 576], metavar=("N", "K"))
    parser.add_argument("--formats", nargs="+", choices=FORMATS, default=["bf16", "fp32"])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--library", action="append", default=None, help="a kernels .so (amx variant); repeat to A/B")
    args = parser.parse_args()
    paths = args.library or [str(cpu_lib.build("amx"))]
    libs = {}
    for path in paths:
        lib = ctypes.CDLL(path)
        cpu_lib.check_abi(lib)
        cpu_lib.bind(lib)
        libs[path.rsplit("/", 1)[-1]] = lib
    if cpu_features.detect().isa_level != "amx" or any(lib.kv_amx_available() != 1 for lib in libs.values()):
        raise SystemExit(f"needs AMX and the tile state (CPU: {cpu_features.detect().summary()})")
    N, K = args.shape
    gen = torch.Generator().manual_seed(0)
    mats = {f: [matrix(f, N, K, gen) for _ in range(args.matrices)] for f in args.formats}
    print(f"CPU: {cpu_features.detect().summary()}; one thread; [{N}, {K}] x {args.matrices}")
    runs = [(f, name) for f in args.formats for name in libs]
    for M in args.rows:
        x = torch.randn(M, K, generator=gen)
        best, out = dict.fromkeys(runs, float("inf")), {}
        for _ in range(args.rounds):
            for f, name in runs:
                y = out.setdefault((f, name), torch.empty(M, N))
                start = time.perf_counter()
                for m, _, _ in mats[f]:
                    if libs[name].kv_bf16_linear(ctypes.byref(m), x.data_ptr(), M, K, y.data_ptr(), 1) != 0:
                        raise SystemExit("kv_bf16_linear refused the call")
                best[f, name] = min(best[f, name], time.perf_counter() - start)
        for f in args.formats:
            if any(not torch.equal(out[f, name], out[f, runs[0][1]]) for name in libs):
                raise SystemExit(f"the libraries give different bits for {f} at {M} rows")
        print(
            f"{M:3d} rows: "
            + "; ".join(
                f"{f}{' ' + name if len(libs) > 1 else ''} {best[f, name] / args.matrices * 1e3:.3f} ms/call, "
                f"{sum(b for *_, b in mats[f]) / best[f, name] / 1e9:.1f} GB/s"
                for f, name in runs
            )
        )


if __name__ == "__main__":
    main()
