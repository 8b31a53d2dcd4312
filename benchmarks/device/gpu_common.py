"""Shared pieces of benchmarks/gpu_check.py: the GPUs' datasheet peaks, the time budget, timers and
the shapes of the checks (real on a GPU, tiny for ``--smoke``). Imported by gpu_check.py and
engine_sections.py (which put this folder on ``sys.path``); never by kvfleet itself."""

from __future__ import annotations

import time

# Peak DRAM bandwidth (bytes/s) and dense bf16 tensor-core peak (FLOP/s) by device-name
# substring, first match wins (vendor datasheets).
GPU_PEAKS: list[tuple[str, float, float | None]] = [
    ("H200", 4.8e12, 989e12),
    ("GH200", 4.0e12, 989e12),
    ("H100 NVL", 3.9e12, 835e12),
    ("H100 PCIe", 2.0e12, 756e12),
    ("H100", 3.35e12, 989e12),  # H100 SXM5 ("NVIDIA H100 80GB HBM3")
    ("H800", 3.35e12, 989e12),
    ("B200", 8.0e12, 2250e12),
    ("A100-SXM4-80GB", 2.039e12, 312e12),
    ("A100 80GB PCIe", 1.935e12, 312e12),
    ("A100", 1.555e12, 312e12),  # 40 GB parts
    ("A800", 2.039e12, 312e12),
    ("L40S", 0.864e12, 362e12),
    ("L40", 0.864e12, 181e12),
    ("L4", 0.3e12, 121e12),
    ("A10G", 0.6e12, 70e12),
    ("A10", 0.6e12, 125e12),
    ("RTX 4090", 1.008e12, 165e12),
    ("RTX 3090", 0.936e12, 71e12),
    ("V100", 0.9e12, None),
    ("T4", 0.32e12, None),
]


ENGINE_LOGPROB_ATOL = 1e-3
"""Largest |difference| of a log-probability between the two engine runs (fp32 weights and
activations; different reduction orders alone give about 1e-5)."""


class Budget:
    def __init__(self, seconds: float):
        self.t0 = time.monotonic()
        self.seconds = seconds

    def left(self) -> float:
        return self.seconds - (time.monotonic() - self.t0)

    def elapsed(self) -> float:
        return time.monotonic() - self.t0


def log(msg: str = "") -> None:
    print(msg, flush=True)


def lookup_peaks(name: str) -> tuple[float | None, float | None]:
    for key, bw, flops in GPU_PEAKS:
        if key.lower() in name.lower():
            return bw, flops
    return None, None


def measured_copy_bandwidth(torch, device) -> float:
    """Device-to-device copy bandwidth, bytes/s (read + write), 1 GiB buffers."""
    n = 1 << 28  # 256 Mi fp32 = 1 GiB
    a = torch.empty(n, dtype=torch.float32, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    torch.cuda.synchronize()
    t = cuda_time(torch, lambda a=a, b=b: b.copy_(a), iters=10)
    del a, b
    return 2 * n * 4 / t


def cuda_time(torch, fn, iters: int = 20, warmup: int = 3) -> float:
    """Median seconds per call: CUDA events on a GPU, wall clock otherwise (--smoke)."""
    for _ in range(warmup):
        fn()
    if not torch.cuda.is_available():
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        times.sort()
        return times[len(times) // 2]
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        s = torch.cuda.Event(enable_timing=True)
        e = torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    times.sort()
    return times[len(times) // 2]


def sync(torch, device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Sizes:
    """Shapes of the checks: the real ones on a GPU, tiny ones for --smoke (CPU, interpreter)."""

    def __init__(self, smoke: bool, quick: bool):
        self.smoke = smoke
        if smoke:
            self.grid_block_sizes = (8,)
            self.grid_head_sizes = (64,)
            self.grid_heads = ((2, 2), (3, 1))
            self.long_seqs = [(40, 1), (30, 12)]
            self.split_options = (1, 3)
            self.decode_shape = dict(heads=4, kv_heads=2, head_size=64, block_size=16)
            self.decode_batches = (1, 2)
            self.decode_contexts = (16, 48)
            self.prefill_shape = dict(heads=4, kv_heads=2, head_size=64)
            self.prefill_cases = [("1 x 24 prompt", [(24, 24)]),
                                  ("chunk 8 after 16 cached + 2 decodes", [(24, 8), (9, 1), (5, 1)])]
            self.cache_shapes = ((8, 2, 64),)
            self.iters = 2
        else:
            self.grid_block_sizes = (8, 16, 32)
            self.grid_head_sizes = (64, 96, 128)
            self.grid_heads = ((4, 4), (6, 2), (16, 2))
            self.long_seqs = [(700, 1), (300, 120), (130, 0)]
            self.split_options = (None, 1, 4)
            self.decode_shape = dict(heads=32, kv_heads=8, head_size=128, block_size=16)
            self.decode_batches = (1, 32, 256)
            self.decode_contexts = (512, 4096) if quick else (512, 4096, 32768)
            self.prefill_shape = dict(heads=32, kv_heads=8, head_size=128)
            self.prefill_cases = [
                ("1 x 4096 prompt", [(4096, 4096)]),
                ("8 x 1024 prompts", [(1024, 1024)] * 8),
                ("chunk 2048 after 6144 cached", [(8192, 2048)]),
                ("4 x 512 chunks after 3584 cached + 64 decodes ctx 2048", [(4096, 512)] * 4 + [(2048, 1)] * 64),
            ][: 2 if quick else 4]
            self.cache_shapes = ((8, 2, 64), (16, 8, 128), (32, 1, 96))
            self.iters = None  # per case
