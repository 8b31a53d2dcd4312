"""Compile the Triton kernels ahead of time for NVIDIA GPUs, on any machine (no GPU needed).

``python -m kvfleet.kernels.aot`` lowers every kernel, with the tile configuration the
wrappers would pick for representative shapes (``CASES``), to PTX and a cubin for sm_90 and
sm_80 (with Triton's 16-byte-divisibility specialisation), and reports whether K/V loads are
vectorised (``cp.async`` / ``ld.global.v4``), whether the tensor-core instruction is
``wgmma``, and registers / stack / local memory per thread (``cuobjdump``; stack or local > 0
means spills). ``--json``: one JSON object per line. Used by ``tests/unit/kernels/test_aot.py``
(in a subprocess) and by hand when changing tile sizes. Must be run without
``TRITON_INTERPRET=1`` (raises RuntimeError otherwise).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

import torch

__all__ = ["CASES", "compile_all"]

# (label, dtype, num_heads, num_kv_heads, head_size, block_size, num_tokens, num_seqs, max_query_len, max_seq_len)
CASES = [
    ("decode llama8b split", torch.bfloat16, 32, 8, 128, 16, 1, 1, 1, 32768),
    ("decode llama8b batch", torch.bfloat16, 32, 8, 128, 16, 256, 256, 1, 4096),
    ("prefill llama8b", torch.bfloat16, 32, 8, 128, 16, 4096, 1, 4096, 4096),
    ("decode smollm fp16", torch.float16, 9, 3, 64, 16, 64, 64, 1, 512),
    ("prefill smollm fp16", torch.float16, 9, 3, 64, 32, 2048, 4, 512, 2048),
    ("prefill head 96 gqa 8 bf16", torch.bfloat16, 16, 2, 96, 8, 1024, 2, 512, 2048),
    ("decode mqa fp32", torch.float32, 8, 1, 64, 16, 8, 8, 1, 8192),
]
ARCHS = (90, 80)
_TRITON_DTYPE = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def _compile(fn, signature: dict, constexprs: dict, arch: int, num_warps: int, num_stages: int):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, name in enumerate(fn.arg_names)
        if signature[name].startswith("*") or (name.startswith("stride_") and name != "stride_bt")
    }
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(num_warps=num_warps,
                                                                                   num_stages=num_stages))


def _resource_usage(kernel) -> dict | None:
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        return None
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(kernel.asm["cubin"])
        r = subprocess.run([tool, "-res-usage", path], capture_output=True, text=True, timeout=60)
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", r.stdout)
    if not m:
        return None
    return dict(zip(("reg", "stack", "shared", "local"), map(int, m.groups())))


def _describe(kernel) -> dict:
    ptx = kernel.asm["ptx"]
    info = {
        "vectorised": bool(re.search(r"cp\.async|ld\.global(\.nc)?\.v[24]", ptx)),
        "vector_stores": bool(re.search(r"st\.global\.v[24]", ptx)),
        "wgmma": "wgmma" in ptx,
        "shared_bytes": kernel.metadata.shared,
    }
    info.update(_resource_usage(kernel) or {})
    return info


def _attention_signature(fn, dtype: torch.dtype) -> dict:
    t = _TRITON_DTYPE[dtype]
    ptrs = {"q_ptr": t, "k_cache_ptr": t, "v_cache_ptr": t, "out_ptr": t, "part_acc_ptr": "fp32",
            "part_ml_ptr": "fp32", "block_tables_ptr": "i32", "seq_lens_ptr": "i32", "qsl_ptr": "i32"}
    sig = {}
    for name in fn.arg_names:
        if name in ptrs:
            sig[name] = "*" + ptrs[name]
        elif name == "scale_log2e":
            sig[name] = "fp32"
        else:
            sig[name] = "constexpr" if name.isupper() else "i32"
    return sig


def compile_all(num_sms: int = 132):
    """Yield one dict per (kernel configuration, arch): label, arch, ok, error, tile
    config and :func:`_describe`'s fields."""
    import triton

    if triton.knobs.runtime.interpret:
        raise RuntimeError("TRITON_INTERPRET is set: unset it to compile for a GPU target")
    from kvfleet.kernels import triton_attention as ta
    from kvfleet.kernels import triton_cache as tc

    for label, dtype, h, kvh, d, bs, T, B, mq, ms in CASES:
        cfg = ta.launch_config(T, B, h, kvh, d, max_query_len=mq, max_seq_len=ms, device=torch.device("cuda"),
                               num_sms=num_sms)
        meta = ta.kernel_constexprs(cfg, head_size=d, block_size=bs, group=h // kvh, cache_dtype=dtype)
        for arch in ARCHS:
            row = {"label": label, "arch": arch, "block_m": cfg.block_m, "block_n": cfg.block_n,
                   "num_splits": cfg.num_splits, "num_warps": cfg.num_warps, "prefill_tile": cfg.block_m >= 64,
                   "dtype": str(dtype).replace("torch.", "")}
            try:
                k = _compile(ta._paged_attention_kernel, _attention_signature(ta._paged_attention_kernel, dtype),
                             meta, arch, cfg.num_warps, cfg.num_stages)
                row.update(ok=True, **_describe(k))
            except Exception as e:
                row.update(ok=False, error=f"{type(e).__name__}: {e}"[:3000])
            yield row
    sig = {n: ("*fp32" if n.endswith("_ptr") else ("constexpr" if n.isupper() else "i32"))
           for n in ta._reduce_splits_kernel.arg_names}
    for arch in ARCHS:
        row = {"label": "reduce splits", "arch": arch}
        try:
            k = _compile(ta._reduce_splits_kernel, sig, dict(HEAD_SIZE=96, HEAD_PAD=128, SPLITS_PAD=64), arch, 4, 2)
            row.update(ok=True, **_describe(k))
        except Exception as e:
            row.update(ok=False, error=f"{type(e).__name__}: {e}"[:3000])
        yield row
    for t in _TRITON_DTYPE.values():
        sig = {}
        for n in tc._reshape_and_cache_kernel.arg_names:
            if n in ("key_ptr", "value_ptr", "key_cache_ptr", "value_cache_ptr"):
                sig[n] = "*" + t
            elif n == "slot_ptr":
                sig[n] = "*i64"
            else:
                sig[n] = "constexpr" if n.isupper() else "i32"
        row = {"label": f"reshape_and_cache {t}", "arch": 90}
        try:
            k = _compile(tc._reshape_and_cache_kernel, sig,
                         dict(NUM_KV_HEADS=8, HEAD_SIZE=128, HEADS_PAD=8, HEAD_PAD=128), 90, 4, 1)
            row.update(ok=True, **_describe(k))
        except Exception as e:
            row.update(ok=False, error=f"{type(e).__name__}: {e}"[:3000])
        yield row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="one JSON object per line")
    ap.add_argument("--num-sms", type=int, default=132, help="SM count used to size KV splits (default: H100/H200)")
    args = ap.parse_args(argv)
    failed = False
    for row in compile_all(args.num_sms):
        failed |= not row["ok"]
        if args.json:
            print(json.dumps(row), flush=True)
        else:
            if row["ok"]:
                print(f"{row['label']:28s} sm_{row['arch']}  regs {row.get('reg', '?'):>3} "
                      f"stack {row.get('stack', '?'):>4} local {row.get('local', '?'):>3} "
                      f"smem {row.get('shared_bytes', '?'):>6}  vec {row['vectorised']!s:5s} wgmma {row['wgmma']}",
                      flush=True)
            else:
                print(f"{row['label']:28s} sm_{row['arch']}  FAILED {row['error']}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
