"""Compile the Triton kernels for real GPUs (Hopper sm_90, Ampere sm_80) without a GPU.

The interpreter tests check what the kernels compute; they cannot see what only the
compiler sees (non-constexpr globals, loop-carried type changes, unsupported constructs)
nor how the code will run. Here ``triton.compile`` lowers each kernel to PTX and a
cubin with the tile configuration the wrapper would pick (``launch_config`` /
``kernel_constexprs``), with the 16-byte-divisibility specialisation Triton applies at
launch to the pointers and strides, and the test checks that

* it compiles for every dtype, with GQA and a padded head size;
* K/V tiles are fetched with asynchronous 16-byte copies (``cp.async``) or vectorised
  loads (``ld.global.v4``), not one predicated 2-byte load per element;
* prefill tiles use Hopper's ``wgmma`` tensor-core instructions on sm_90;
* no registers spill (cubin resource usage, via the bundled ``cuobjdump``).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile

import pytest
import torch

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

if "nvidia" not in getattr(triton.backends, "backends", {}):  # pragma: no cover - triton without CUDA backend
    pytest.skip("triton has no NVIDIA backend", allow_module_level=True)

from kvfleet.kernels import triton_attention as ta  # noqa: E402
from kvfleet.kernels import triton_cache as tc  # noqa: E402

TRITON_DTYPE = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def compile_kernel(fn, signature: dict, constexprs: dict, arch: int, num_warps: int, num_stages: int):
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, name in enumerate(fn.arg_names)
        if signature[name].startswith("*") or (name.startswith("stride_") and name != "stride_bt")
    }
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages))


def resource_usage(kernel) -> dict[str, int] | None:
    if not os.path.exists(CUOBJDUMP):
        return None
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(kernel.asm["cubin"])
        r = subprocess.run([CUOBJDUMP, "-res-usage", path], capture_output=True, text=True, timeout=60)
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", r.stdout)
    assert m, r.stdout + r.stderr
    return dict(zip(("reg", "stack", "shared", "local"), map(int, m.groups())))


def attention_signature(dtype: torch.dtype) -> dict:
    t = TRITON_DTYPE[dtype]
    ptrs = {"q_ptr": t, "k_cache_ptr": t, "v_cache_ptr": t, "out_ptr": t, "part_acc_ptr": "fp32",
            "part_ml_ptr": "fp32", "block_tables_ptr": "i32", "seq_lens_ptr": "i32", "qsl_ptr": "i32"}
    sig = {}
    for name in ta._paged_attention_kernel.arg_names:
        if name in ptrs:
            sig[name] = "*" + ptrs[name]
        elif name == "scale_log2e":
            sig[name] = "fp32"
        elif name.isupper():
            sig[name] = "constexpr"
        else:
            sig[name] = "i32"
    return sig


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


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_attention_compiles_vectorised_without_spills(case):
    label, dtype, h, kvh, d, bs, T, B, mq, ms = case
    cfg = ta.launch_config(T, B, h, kvh, d, max_query_len=mq, max_seq_len=ms, device=torch.device("cuda"),
                           num_sms=132)  # an H100/H200
    assert cfg.num_splits > 1 if "split" in label else True
    meta = ta.kernel_constexprs(cfg, head_size=d, block_size=bs, group=h // kvh, cache_dtype=dtype)
    for arch in (90, 80):
        k = compile_kernel(ta._paged_attention_kernel, attention_signature(dtype), meta, arch, cfg.num_warps,
                           cfg.num_stages)
        ptx = k.asm["ptx"]
        assert "cp.async" in ptx or "ld.global.v4" in ptx or "ld.global.nc.v4" in ptx, f"{label}: unvectorised loads"
        if arch == 90 and cfg.block_m >= 64 and dtype != torch.float32:
            assert "wgmma" in ptx, f"{label}: prefill tile does not use wgmma on sm_90"
        use = resource_usage(k)
        if use is not None:
            assert use["stack"] == 0 and use["local"] == 0, f"{label} sm_{arch}: register spills {use}"


def test_reduce_and_cache_kernels_compile():
    sig = {n: ("*fp32" if n.endswith("_ptr") else ("constexpr" if n.isupper() else "i32"))
           for n in ta._reduce_splits_kernel.arg_names}
    compile_kernel(ta._reduce_splits_kernel, sig, dict(HEAD_SIZE=96, HEAD_PAD=128, SPLITS_PAD=64), 90, 4, 2)
    for dtype in TRITON_DTYPE.values():
        sig = {}
        for n in tc._reshape_and_cache_kernel.arg_names:
            if n in ("key_ptr", "value_ptr", "key_cache_ptr", "value_cache_ptr"):
                sig[n] = "*" + dtype
            elif n == "slot_ptr":
                sig[n] = "*i64"
            else:
                sig[n] = "constexpr" if n.isupper() else "i32"
        k = compile_kernel(tc._reshape_and_cache_kernel, sig,
                           dict(NUM_KV_HEADS=8, HEAD_SIZE=128, HEADS_PAD=8, HEAD_PAD=128), 90, 4, 1)
        assert "st.global.v4" in k.asm["ptx"] or "st.global.v2" in k.asm["ptx"], "cache writes not vectorised"


def test_cuobjdump_available_or_reported():
    # Spill checks need the cuobjdump shipped in triton's wheel; say so if it is missing.
    assert os.path.exists(CUOBJDUMP) or shutil.which("cuobjdump"), "no cuobjdump: spill checks are skipped"
