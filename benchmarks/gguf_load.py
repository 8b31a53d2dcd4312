"""Load time and peak memory of GGUF files: kvfleet's reader (tensors as stored) against the float32
conversion through transformers, first start and cached start. Not a test::

    python benchmarks/gguf_load.py [--reader-only] [FILE.gguf ...]   (default: the embedded default model)
    python benchmarks/gguf_load.py --phases FILE.gguf   (the reader's first start, phase by phase)

Each load runs in a fresh process (``load_model`` with ``--dtype auto`` for the reader, ``--dtype
float32`` for the conversion) against a fresh ``$KVFLEET_CACHE_DIR`` (first start), then again
against the filled one (cached start; the kernels library is built before either). Per load:
seconds of ``load_model`` (wall, and CPU time of the process: the steadier number on a shared
machine), the process's resident memory after its imports (torch, transformers),
its peak (``VmHWM``) and the peak less the imports', against the file's size. The first line
records the CPU. ``--phases``: one first start of the reader with ``VmHWM`` reset at each step of
the load (the tokenizer's build and load, the model on ``meta``, the tensors, the siblings'
unification, the assembly, the cache's write): each step's peak and resident memory above the
imports. Results: docs/performance.md, "GGUF files as stored".
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
phases, current = {}, ["between"]
def boundary(label):  # the phase ending now: its peak (and resident memory) above the imports; VmHWM reset
    p = phases.setdefault(current[0], [0.0, 0.0])
    p[0], p[1] = max(p[0], mem("VmHWM") - base), mem("VmRSS") - base
    with open("/proc/self/clear_refs", "w") as f: f.write("5")
    current[0] = label
def phase(owner, name, label):
    fn = getattr(owner, name)
    def timed(*a, **k):
        outer = current[0]
        boundary(label)
        try:
            return fn(*a, **k)
        finally:
            boundary(outer)
    setattr(owner, name, timed)
if len(sys.argv) > 3:
    from kvfleet.runtime.worker import gguf_tokenizer
    for owner, name, label in ((gguf_tokenizer, "build", "tokenizer build"), (gguf_tokenizer, "load", "tokenizer load"),
                               (gguf_model, "_empty_model", "model on meta"), (gguf_model, "stored_tensor", "tensors"),
                               (gguf_model, "unify_siblings", "unify siblings"), (gguf_model, "_assemble", "assemble"),
                               (gguf_model, "_write_cache", "cache write")):
        phase(owner, name, label)
t0, c0 = time.monotonic(), time.process_time()
loaded = model_loader.load_model(sys.argv[1], dtype=sys.argv[2], device="cpu")
boundary("end")
print(json.dumps({"seconds": time.monotonic() - t0, "cpu_seconds": time.process_time() - c0,
                  "base_mb": base, "peak_mb": max([mem("VmHWM")] + [base + p[0] for p in phases.values()]),
                  "weights_mb": loaded.weight_bytes / 2**20, "phases": phases}))
"""


def _run(path: str, dtype: str, cache: str, phases: bool = False) -> dict:
    env = {**os.environ, "KVFLEET_CACHE_DIR": cache, "HF_HUB_OFFLINE": "1", "PYTHONSAFEPATH": "1"}
    env.setdefault("KVFLEET_KERNELS_DIR", os.path.expanduser("~/.cache/kvfleet"))
    out = subprocess.run([sys.executable, "-c", CHILD, path, dtype, *(["phases"] if phases else [])], env=env,
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    from kvfleet.kernels import cpu_features, cpu_lib
    from kvfleet.runtime.worker import model_loader

    cpu_lib.load(Path.home() / ".cache" / "kvfleet")  # the kernels library, outside the timed loads
    args = sys.argv[1:]
    reader_only = "--reader-only" in args
    files = [a for a in args if a not in ("--reader-only", "--phases")] or [str(model_loader.default_model_path())]
    print(f"CPU: {cpu_features.detect().summary()}")
    if "--phases" in args:
        for path in files:
            with tempfile.TemporaryDirectory() as cache:
                r = _run(path, "auto", cache, phases=True)
            size = Path(path).stat().st_size / 2**20
            print(f"\n{Path(path).name} ({size:.0f} MB), first start, MB above the imports (load average "
                  f"{os.getloadavg()[0]:.1f})\n| phase | peak | resident after |\n| --- | ---: | ---: |")
            for label, (peak, rss) in r["phases"].items():
                print(f"| {label} | {peak:.1f} ({peak / size:.3f}x) | {rss:.1f} |")
        return
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
