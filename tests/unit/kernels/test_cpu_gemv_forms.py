"""kernels/cpu_gemv_m1.h's compact weight forms (issue 41): float16 group scales and shifts
(``kv_matrix.scale_f16`` 1: GGUF's own Q8_0 / Q5_0 / Q5_1 / Q4_0 / Q4_1 ``d`` and ``m``), factored
ones (``scale_f16`` 2: GGUF Q4_K / Q5_K / Q6_K's int8 factors and float16 ``d`` / ``dmin`` per 256
weights, ``scale_d`` / ``shift_d``) and int8g's 5-bit form (``kv_matrix.hbits``: GGUF Q5_0's
nibbles and high bits as stored).

Each form, built by the GGUF loader from ``gguf``-dequantizable blocks (dequantized bit-equal to
``gguf.quants.dequantize``), runs on every kernel variant this CPU has (the ``avx2`` floor included)
and every matmul kind of the variant (the float32 kernels; the bf16 dot products; the AMX tiles):
its output must equal, bit for bit, the same weights in the float32-scale, one-byte-per-weight form
on the same kernels (both are widened to the same float32 weights before the same sums), and be
near float64 of the dequantized weights; and each row's bits must be the same alone, in the
few-rows path (5 rows) and in batches of 16 and 40 (batch invariance).
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from kvfleet.kernels import cpu_features, cpu_lib  # noqa: E402
from kvfleet.runtime.worker import gguf_tensors  # noqa: E402

T = gguf.GGMLQuantizationType
N, K = 96, 608   # 96 channels: the AMX tiles' groups of 48 + 32 + 16; 19 blocks of 32 (a 16-wide tail)
KK = 768   # the K-quants' K: 3 super-blocks of 256
FMT = {"int4": 2, "int8g": 4}
LEVEL = cpu_features.detect().isa_level
VARIANTS = [v for v in cpu_features.ISA_LEVELS if LEVEL and cpu_features.ISA_LEVELS.index(v)
            <= cpu_features.ISA_LEVELS.index(LEVEL)]
pytestmark = pytest.mark.skipif(not VARIANTS or cpu_lib.compiler() is None,
                                reason="no kernel variant runs here (or no C compiler)")


def _blocks(qtype, seed: int, k: int = K) -> np.ndarray:
    """Random ``[N, k]`` blocks of ``qtype``: random bytes, then each fp16 ``d`` (and ``m`` / ``dmin``)
    set to a finite value of either sign (a weight's size; Q6_K's ``d`` is the block's last 2 bytes)."""
    rng = np.random.default_rng(seed)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (N, k // block, size), dtype=np.uint8)
    halves = 2 if qtype in (T.Q5_1, T.Q4_1, T.Q4_K, T.Q5_K) else 1
    d = (rng.random((N, k // block, halves)) * 1e-2 + 1e-4) * rng.choice([-1.0, 1.0], (N, k // block, halves))
    at = size - 2 if qtype == T.Q6_K else 0
    raw[..., at: at + 2 * halves] = d.astype(np.float16).view(np.uint8).reshape(N, k // block, 2 * halves)
    return raw.reshape(N, k // block * size)


def _matrix(s: gguf_tensors.Stored) -> tuple[cpu_lib.Matrix, list[torch.Tensor]]:
    """``s`` as a kv_matrix (and the tensors it points into, kept alive by the caller)."""
    form = {torch.float32: 0, torch.float16: 1, torch.int8: 2}[s.scale.dtype]
    ptr = (lambda t: None if t is None else t.data_ptr())
    n, k = s.shape
    m = cpu_lib.Matrix(FMT[s.fmt], n, k, s.w.data_ptr(), ptr(s.scale), ptr(s.shift), s.group, None,
                       scale_f16=form, hbits=ptr(s.high), scale_d=ptr(s.scale_d), shift_d=ptr(s.shift_d),
                       super_group=0 if s.scale_d is None else k // s.scale_d.shape[1])
    return m, [s.w, s.scale, s.shift, s.high, s.scale_d, s.shift_d]


def _forms() -> dict[str, tuple[gguf_tensors.Stored, torch.Tensor]]:
    """name -> (the compact form, the float32 weights gguf dequantizes)."""
    out = {}
    for qtype in (T.Q5_0, T.Q8_0, T.Q5_1, T.Q4_0, T.Q4_1, T.Q4_K, T.Q5_K, T.Q6_K):
        k = KK if qtype in (T.Q4_K, T.Q5_K, T.Q6_K) else K
        data = _blocks(qtype, int(qtype), k)
        s = gguf_tensors.from_gguf(qtype, data, (N, k))
        if qtype in (T.Q4_0, T.Q4_1):   # the loader keeps int4's fp16 d, m as float32 (speed); the kernels take both
            s = gguf_tensors.Stored("int4", s.w, s.scale.half(), s.shift.half(), 32, qtype.name)
        out[qtype.name] = (s, torch.from_numpy(gguf.quants.dequantize(data, qtype).reshape(N, k)))
    return out


FORMS = _forms()


def test_the_loader_keeps_gguf_s_own_forms():
    q5, q8, q51 = FORMS["Q5_0"][0], FORMS["Q8_0"][0], FORMS["Q5_1"][0]
    assert q5.high is not None and q5.w.shape == (N, K // 2) and q5.high.shape == (N, K // 8)
    assert q5.scale.dtype == q8.scale.dtype == q51.scale.dtype == q51.shift.dtype == torch.float16
    assert q5.nbytes == N * K // 32 * 22   # Q5_0's own 22 bytes per 32 weights
    assert q8.nbytes == N * K // 32 * 34
    q41 = gguf_tensors.from_gguf(T.Q4_1, _blocks(T.Q4_1, 1), (N, K))   # int4: float32 scales (Int4Linear's speed)
    assert q41.scale.dtype == q41.shift.dtype == torch.float32
    q4k, q5k, q6k = FORMS["Q4_K"][0], FORMS["Q5_K"][0], FORMS["Q6_K"][0]
    assert q4k.scale.dtype == q4k.shift.dtype == q5k.scale.dtype == q6k.scale.dtype == torch.int8
    assert q4k.nbytes == N * KK // 256 * 148   # Q4_K: 144 bytes per 256 weights in the file, its 6-bit factors bytes
    assert q6k.nbytes == N * KK + N * KK // 16 + N * KK // 256 * 2 and q6k.shift_d is None
    for name, (s, want) in FORMS.items():
        assert torch.equal(s.dequantize(), want), name
        assert torch.equal(s.plain().dequantize(), want), name
        assert s.plain().high is None and s.plain().scale.dtype == torch.float32 and s.plain().scale_d is None


@pytest.mark.parametrize("variant", VARIANTS)
def test_each_form_on_each_kind_gives_the_float32_forms_bits_and_is_batch_invariant(kernels_build_root, variant):
    lib = cpu_lib.open_variant(variant, kernels_build_root)
    kinds = {"float32": 0}
    if lib.kv_dpbf16_available() == 1:
        kinds["avx512_bf16"] = 2
    if variant == "amx" and lib.kv_amx_available() == 1:
        kinds["amx"] = 1
    gen = torch.Generator().manual_seed(3)
    xs_by_k = {k: torch.randn(40, k, generator=gen) for k in (K, KK)}

    def run(m: cpu_lib.Matrix, rows: torch.Tensor, kind: int) -> torch.Tensor:
        y = torch.full((rows.shape[0], N), float("nan"))
        assert lib.kv_bf16_linear(ctypes.byref(m), rows.data_ptr(), rows.shape[0], rows.shape[1], y.data_ptr(),
                                  kind) == 0
        return y

    for name, (s, want) in FORMS.items():
        x = xs_by_k[s.shape[1]]
        compact, keep = _matrix(s)
        plain, keep_plain = _matrix(s.plain())
        for kind_name, kind in kinds.items():
            where = f"{name} {variant} {kind_name}"
            y40 = run(compact, x, kind)
            assert torch.equal(y40, run(plain, x, kind)), where
            for M in (16, 5):
                assert torch.equal(run(compact, x[:M].clone(), kind), y40[:M]), f"{where} M={M}"
            for r in (0, 7, 39):
                assert torch.equal(run(compact, x[r:r + 1].clone(), kind)[0], y40[r]), f"{where} row {r}"
            xs = x if kind == 0 else x.bfloat16().double()
            ws = want.double() if kind == 0 else want.bfloat16().double()
            ref = xs.double() @ ws.T
            tol = (1e-5 if kind == 0 else 1e-3) * ref.abs().max()
            assert (y40.double() - ref).abs().max() <= tol, where
        del keep, keep_plain
