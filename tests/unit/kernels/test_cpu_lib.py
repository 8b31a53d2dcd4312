"""kvfleet.kernels.cpu_lib: the variant each recorded CPU gets, every variant compiles here, each
variant's kernels against float64 where this CPU runs them (skipped with the reason where it does
not), and the ABI check refusing a library whose structs differ from their ctypes mirrors."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest
import torch
from support.paths import DATA as _DATA

from kvfleet.kernels import cpu_features, cpu_lib

DATA = _DATA / "cpuinfo"
LEVEL = cpu_features.detect().isa_level
HAS_CC = cpu_lib.compiler() is not None
X86 = cpu_features.detect().x86_64


@pytest.mark.parametrize(("name", "variant"), [("avx2_epyc_zen3.txt", "avx2"),
                                               ("avx512bf16_epyc_zen4.txt", "avx512_bf16"),
                                               ("amx_xeon_sapphire_rapids.txt", "amx")])
def test_variant_of_recorded_machines(name, variant):
    f = cpu_features.CpuFeatures.from_cpuinfo((DATA / name).read_text())
    assert cpu_lib.variant_for(f) == variant
    assert cpu_lib.variant_for(f.capped("avx2")) == "avx2"  # $KVFLEET_CPU_ISA=avx2 runs the floor


def test_no_variant_below_the_floor():
    assert cpu_lib.variant_for(cpu_features.CpuFeatures.from_cpuinfo("flags\t: sse2 avx fma\n")) is None
    assert cpu_lib.variant_for(cpu_features.CpuFeatures("arm", frozenset({"avx2", "fma", "f16c"}), False)) is None
    zen4 = cpu_features.CpuFeatures.from_cpuinfo((DATA / "avx512bf16_epyc_zen4.txt").read_text())
    assert cpu_lib.variant_for(zen4.capped("avx512")) == "avx512"


@pytest.fixture(scope="module")
def cache(kernels_build_root) -> Path:
    """One build folder for the session (tests/conftest.py): each variant compiles once."""
    return kernels_build_root


@pytest.mark.skipif(not (HAS_CC and X86), reason="needs a C compiler on x86-64")
@pytest.mark.parametrize("variant", sorted(cpu_lib.VARIANT_FLAGS))
def test_every_variant_compiles_here(variant, cache):
    """Compile-only: the AVX-512 variants build on any x86-64 machine (run where the CPU has them)."""
    so = cpu_lib.build(variant, cache)
    assert so.name.startswith(f"kvfleet_cpu-{variant}-") and so.stat().st_size > 0
    assert cpu_lib.build(variant, cache) == so  # cached by variant and source hash
    with pytest.raises(ValueError, match="unknown variant"):
        cpu_lib.build("sse2", cache)


@pytest.mark.skipif(not (HAS_CC and X86), reason="needs a C compiler on x86-64")
def test_prebuild_of_chosen_variants_and_an_unknown_one_refused(cache, capsys):
    """``--prebuild DIR --variants a,b`` (the image check's trimmed build: its own CPU's only)."""
    folder = cache / "kernels"  # the session's: a variant compiled already is not compiled again
    assert cpu_lib.prebuild(folder, ["avx2"]) == [folder / cpu_lib.library_name("avx2")]
    with pytest.raises(ValueError, match=r"unknown variant\(s\) \['sse2'\]"):
        cpu_lib.prebuild(folder, ["avx2", "sse2"])
    with pytest.raises(SystemExit) as exit_info:
        cpu_lib.main(["--prebuild", str(folder), "--variants", "avx2,sse2"])
    assert exit_info.value.code == 2 and "unknown variant" in capsys.readouterr().err


def _runs(variant: str) -> str | None:
    """Why this machine cannot run ``variant`` (None: it can)."""
    if not (HAS_CC and X86) or LEVEL is None:
        return "no C compiler, not x86-64, or below AVX2"
    have = cpu_features.ISA_LEVELS.index(LEVEL)
    if have < cpu_features.ISA_LEVELS.index(variant):
        return f"this CPU's level is {LEVEL}; the {variant} variant needs {variant}"
    return None


@pytest.mark.parametrize("variant", [pytest.param(v, marks=pytest.mark.skipif(_runs(v) is not None, reason=str(_runs(v))))
                                     for v in sorted(cpu_lib.VARIANT_FLAGS)])
@pytest.mark.parametrize("rows", [1, 5])
def test_each_variant_matches_float64(variant, rows, cache):
    """The variant's one-row (16 wide on AVX-512) and several-row paths, bf16 and int8 weights,
    K = 8 mod 16 included (the 8-wide tail)."""
    lib = cpu_lib.open_variant(variant, cache)
    gen = torch.Generator().manual_seed(rows)
    for N, K in ((40, 584), (33, 1536)):
        x = torch.randn(rows, K, generator=gen)
        bias = torch.randn(N, generator=gen)
        wb = torch.randn(N, K, generator=gen).bfloat16()
        q8 = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=gen)
        s8 = torch.rand(N, generator=gen) * 0.02
        y = torch.empty(rows, N)
        lib.kv_woq_bf16_linear(x.data_ptr(), rows, K, K, wb.data_ptr(), N, bias.data_ptr(), y.data_ptr())
        ref = x.double() @ wb.double().T + bias.double()
        assert (y.double() - ref).abs().max() < 1e-6 * K ** 0.5 * ref.abs().max() + 1e-6
        lib.kv_woq_int8_linear(x.data_ptr(), rows, K, K, q8.data_ptr(), N, s8.data_ptr(), None, y.data_ptr())
        ref = x.double() @ (q8.double() * s8.double()[:, None]).T
        assert (y.double() - ref).abs().max() < 1e-6 * K ** 0.5 * ref.abs().max() + 1e-6
        if K % 32 == 0:  # grouped int8: Q6_K's groups of 16, Q5_K's shift
            s16, t16 = torch.rand(N, K // 16, generator=gen) * 0.02, torch.randn(N, K // 16, generator=gen) * 0.1
            lib.kv_woq_int8g_linear(x.data_ptr(), rows, K, K, q8.data_ptr(), N, s16.data_ptr(), t16.data_ptr(), 16,
                                    bias.data_ptr(), y.data_ptr())
            deq = q8.float() * s16.repeat_interleave(16, 1) + t16.repeat_interleave(16, 1)
            ref = x.double() @ deq.double().T + bias.double()
            assert (y.double() - ref).abs().max() < 1e-6 * K ** 0.5 * ref.abs().max() + 1e-6


@pytest.mark.skipif(_runs("avx2") is not None, reason=str(_runs("avx2")))
def test_the_abi_check_refuses_a_mismatch(cache, monkeypatch):
    lib = cpu_lib.open_variant("avx2", cache)
    cpu_lib.check_abi(lib)  # the real mirrors agree

    class Wider(ctypes.Structure):
        _fields_ = [*cpu_lib.Matrix._fields_, ("extra", ctypes.c_int64)]

    size = ctypes.sizeof(cpu_lib.Matrix)   # (fields are appended by the branches: no number here)
    with pytest.raises(cpu_lib.AbiMismatch, match=rf"kv_matrix: C {size} bytes, ctypes {size + 8}"):
        cpu_lib.check_abi(lib, (("kv_matrix", Wider), *cpu_lib.STRUCTS[1:]))
    with pytest.raises(cpu_lib.AbiMismatch, match=f"describes {len(cpu_lib.STRUCTS)} structs"):
        cpu_lib.check_abi(lib, cpu_lib.STRUCTS[:2])
    # load() turns the refusal into an unavailable library with the reason
    monkeypatch.setattr(cpu_lib, "_lib", None)
    monkeypatch.setattr(cpu_lib, "_error", None)
    monkeypatch.setattr(cpu_lib, "STRUCTS", (("kv_matrix", Wider), *cpu_lib.STRUCTS[1:]))
    monkeypatch.setenv(cpu_features.ISA_ENV, "avx2")
    assert cpu_lib.load(cache) is None and not cpu_lib.available()
    assert "differ" in cpu_lib.unavailable_reason() and "kv_matrix" in cpu_lib.unavailable_reason()


BF16_KERNELS = [pytest.param("amx", 1, marks=pytest.mark.skipif(_runs("amx") is not None, reason=str(_runs("amx")))),
                pytest.param("avx512_bf16", 2, marks=pytest.mark.skipif(_runs("avx512_bf16") is not None,
                                                                      reason=str(_runs("avx512_bf16"))))]


@pytest.mark.parametrize("variant,matmul", BF16_KERNELS)
@pytest.mark.parametrize("fmt", ["bf16", "int8", "int8g", "int8g16", "int8g32s", "int4"])
def test_bf16_kernel_matches_float64_and_each_row_is_alone(variant, matmul, fmt, cache):
    """cpu_amx.h (tiles) and cpu_dpbf16.h (vdpbf16ps): each kernel against float64 over the
    bf16-rounded activations and dequantized weights, and each row's bits alone equal to its bits
    among 40 (AMX: the narrow path against the wide one; dot products: every tile shape)."""
    lib = cpu_lib.open_variant(variant, cache)
    assert (lib.kv_amx_available() if matmul == 1 else lib.kv_dpbf16_available()) == 1
    gen = torch.Generator().manual_seed(3)
    N, K, G = 48 if matmul == 1 else 46, 576, 32
    w = torch.randn(N, K, generator=gen) * 0.1
    if fmt == "bf16":
        wb = w.bfloat16()
        m, deq = cpu_lib.Matrix(3, N, K, wb.data_ptr(), None, None, 0, None), wb.double()
    elif fmt == "int8":
        s = (w.abs().amax(1) / 127).contiguous()
        q = torch.round(w / s[:, None]).to(torch.int8)
        m, deq = cpu_lib.Matrix(1, N, K, q.data_ptr(), s.data_ptr(), None, 0, None), q.double()
    elif fmt == "int8g":
        s = (w.view(N, K // G, G).abs().amax(-1) / 127).contiguous()
        q = torch.round(w / s.repeat_interleave(G, 1)).to(torch.int8)
        m, deq = cpu_lib.Matrix(4, N, K, q.data_ptr(), s.data_ptr(), None, G, None), q.double() * s.double().repeat_interleave(G, 1)
    elif fmt in ("int8g16", "int8g32s"):  # Q6_K's layout (G 16), Q5_K's (G 32 with a shift)
        G = 16 if fmt == "int8g16" else 32
        q = torch.randint(-32 if G == 16 else 0, 32, (N, K), generator=gen, dtype=torch.int8)
        s = torch.rand(N, K // G, generator=gen) * 0.01
        t = -torch.rand(N, K // G, generator=gen) * 0.2 if G == 32 else None
        m = cpu_lib.Matrix(4, N, K, q.data_ptr(), s.data_ptr(), None if t is None else t.data_ptr(), G, None)
        deq = q.float() * s.repeat_interleave(G, 1)
        deq = (deq if t is None else deq + t.repeat_interleave(G, 1)).double()
    else:
        from kvfleet.kernels import cpu_woq

        q = torch.randint(0, 16, (N, K), generator=gen, dtype=torch.uint8)
        s, t = torch.rand(N, K // G, generator=gen) * 0.02, -torch.rand(N, K // G, generator=gen) * 0.1
        packed = cpu_woq.pack_int4(q)
        m = cpu_lib.Matrix(2, N, K, packed.data_ptr(), s.data_ptr(), t.data_ptr(), G, None)
        deq = q.double() * s.double().repeat_interleave(G, 1) + t.double().repeat_interleave(G, 1)
    x = torch.randn(40, K, generator=gen)

    def run(rows: torch.Tensor) -> torch.Tensor:
        y = torch.empty(rows.shape[0], N)
        assert lib.kv_bf16_linear(ctypes.byref(m), rows.data_ptr(), rows.shape[0], K, y.data_ptr(), matmul) == 0
        return y

    y = run(x)
    ref = x.bfloat16().double() @ deq.bfloat16().double().T
    if fmt == "int8":
        ref = ref * s.double()   # int8's per-channel scale, applied after the sum
    assert (y.double() - ref).abs().max() <= 1e-2 * ref.abs().max()
    for i in (0, 17, 39):
        assert torch.equal(run(x[i:i + 1].clone())[0], y[i])
    assert torch.equal(run(x[3:24].clone()), y[3:24])


@pytest.mark.skipif(not (X86 and HAS_CC and LEVEL), reason="the kernels do not run here")
def test_the_profile_clock_counts_the_callers_cpu_time_or_wall_time():
    """kv_decode_profile_clock: with the thread's CPU clock the phases never exceed the caller's CPU
    time, even while a busy process shares its core; the wall clock counts that wait too."""
    import os
    import subprocess
    import sys
    import time

    from kvfleet.kernels.cpu_decoder import FusedDecoder
    from unit.kernels.test_cpu_decoder import _inputs, _model

    weights, _, _ = _model("int8", layers=8)
    dec = FusedDecoder(weights, threads=1)
    x, cos, sin, slots, tables, lens = _inputs(8)
    before = os.sched_getaffinity(0)
    core = min(before)

    def measure(thread_cpu: bool) -> tuple[float, float]:
        cpu_lib.set_profile_clock(thread_cpu)
        dec.profile()
        c = time.thread_time()
        for _ in range(10):
            dec.step(x.clone(), cos, sin, slots, tables, lens)
        spent = (time.thread_time() - c) * 1e3 / 10
        return sum(v for k, v in dec.profile().items() if k != "steps"), spent

    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        os.sched_setaffinity(busy.pid, {core})
        os.sched_setaffinity(0, {core})
        time.sleep(0.05)
        cpu_phases, cpu_spent = measure(True)
        wall_phases, wall_spent = measure(False)
    finally:
        busy.kill()
        busy.wait()
        cpu_lib.set_profile_clock(False)
        os.sched_setaffinity(0, before)
    assert 0 < cpu_phases <= cpu_spent * 1.02 + 0.05
    assert wall_phases > 1.3 * wall_spent   # the busy process held the core about half of the time
