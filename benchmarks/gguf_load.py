"""Load time and peak memory of GGUF files: kvfleet's reader (tensors as stored) against the float32
conversion through transformers, first start and cached start. Not a test::

    python benchmarks/gguf_load.py [--reader-only] [FILE.gguf ...]   (default: the embedded default model)

Each load runs in a fresh process (``load_model`` with ``--dtype auto`` for the reader, ``--dtype
float32`` for the conversion) against a fresh ``$KVFLEET_CACHE_DIR`` (first start), then again
against the filled one (cached start; the kernels library is built before either). Per load:
seconds of ``load_model`` (wall, and CPU time of the process: the steadier number on a shared
machine), the process's resident memory after its imports (torch, transformers),
its peak (``VmHWM``) and the peak less the imports', against the file's size. The first line
records the CPU. Results: docs/performance.md, "GGUF files as stored".
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import json, os, sys, time
os.environ.setdefault("HF_HUB_OFFLINE", "1")
def mem(key):
    return int(open("/proc/self/status").read().split(key + ":")[1].split()[0]) / 1024
import torch, transformers
from kvfleet.runtime.worker import model_loader, gguf_model, woq_linear, quantization
from kvfleet.kernels import cpu_woq
cpu_woq.load()
import accelerate, safetensors.torch, tokenizers  # the load's lazy imports, outside it: the models' code too
from transformers.models.llama import modeling_llama
from transformers.models.gemma3 import modeling_gemma3
import ctypes, gc; gc.collect(); ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed import-time heap back
with open("/proc/self/clear_refs", "w") as f: f.write("5")  # VmHWM from here
base = mem("VmRSS")
t0, c0 = time.monotonic(), time.process_time()
loaded = model_loader.load_model(sys.argv[1], dtype=sys.argv[2], device="cpu")
print(json.dumps({"seconds": time.monotonic() - t0, "cpu_seconds": time.process_time() - c0,
                  "base_mb": base, "peak_mb": mem("VmHWM"),
                  "weights_mb": loaded.weight_bytes / 2**20}))
"""


def _run(path: str, dtype: str, cache: str) -> dict:
    env = {**os.environ, "KVFLEET_CACHE_DIR": cache, "HF_HUB_OFFLINE": "1", "PYTHONSAFEPATH": "1"}
    env.setdefault("KVFLEET_KERNELS_DIR", os.path.expanduser("~/.cache/kvfleet"))
    out = subprocess.run([sys.executable, "-c", CHILD, path, dtype], env=env, capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    from kvfleet.kernels import cpu_features, cpu_lib
    from kvfleet.runtime.worker import model_loader

    cpu_lib.load(Path.home() / ".cache" / "kvfleet")  # the kernels library, outside the timed loads
    args = sys.argv[1:]
    reader_only = "--reader-only" in args
    files = [a for a in args if a != "--reader-only"] or [str(model_loader.default_model_path())]
    print(f"CPU: {cpu_features.detect().summary()}")
    print("| file (MB) | path | start | load s (wall) | load CPU s | RSS after imports MB | peak RSS MB | "
          "peak - imports MB | weights MB | (peak - imports) / file |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for path in files:
        size = Path(path).stat().st_size / 2**20
        paths = (("reader, as stored", "auto"),) + (() if reader_only else (("transformers float32", "float32"),))
        for label, dtype in paths:
            with tempfile.TemporaryDirectory() as cache:
                for start in ("first", "cached"):
                    r = _run(path, dtype, cache)
                    print(f"| {Path(path).name} ({size:.0f}) | {label} | {start} | {r['seconds']:.1f} | "
                          f"{r['cpu_seconds']:.1f} | "
                          f"{r['base_mb']:.0f} | {r['peak_mb']:.0f} | {r['peak_mb'] - r['base_mb']:.0f} | "
                          f"{r['weights_mb']:.0f} | {(r['peak_mb'] - r['base_mb']) / size:.2f} |", flush=True)


if __name__ == "__main__":
    main()
