"""kvfleet.runtime.worker.gguf_tensors: each GGUF tensor type in kvfleet's format for it, its float32
dequantization bit-equal to ``gguf.quants.dequantize`` of the same bytes, and the kernels computing
with exactly those weights (one-hot rows of x read single weights out, bit for bit)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from kvfleet.kernels import cpu_woq  # noqa: E402
from kvfleet.runtime.worker import gguf_tensors  # noqa: E402

T = gguf.GGMLQuantizationType
EXPECT = {T.Q4_0: ("int4", 32), T.Q4_1: ("int4", 32), T.Q4_K: ("int4", 32), T.Q5_K: ("int8g", 32),
          T.Q6_K: ("int8g", 16), T.Q8_0: ("int8g", 32), T.Q5_0: ("int8g", 32), T.Q5_1: ("int8g", 32)}


def _quantized(qtype, n: int, k: int, seed: int) -> np.ndarray:
    """A random ``[n, k]`` tensor in ``qtype``: ``gguf.quants.quantize`` where it supports the type;
    else hand-built blocks (random bytes, with finite fp16 ``d`` / ``dmin`` of a weight's size)."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float32) * 0.05
    try:
        return gguf.quants.quantize(w, qtype)
    except NotImplementedError:
        pass
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)
    d = (rng.random((n, k // block, 2)) * 1e-3 + 1e-4).astype(np.float16).view(np.uint8)
    if qtype in (T.Q6_K, T.Q3_K):  # d last
        raw[..., -2:] = d[..., 0:2]
    else:  # Q4_K / Q5_K: d, dmin first
        raw[..., 0:4] = d.reshape(n, k // block, 4)
    return raw.reshape(n, k // block * size)


@pytest.mark.parametrize("qtype", list(EXPECT), ids=lambda t: t.name)
def test_each_type_dequantizes_bit_equal_to_gguf_and_the_kernels_use_those_weights(qtype):
    n, k = 24, 512
    data = _quantized(qtype, n, k, seed=int(qtype))
    stored = gguf_tensors.from_gguf(qtype, data, (n, k))
    assert (stored.fmt, stored.group) == EXPECT[qtype] and stored.shape == (n, k)
    want = torch.from_numpy(gguf.quants.dequantize(data, qtype).reshape(n, k))
    got = stored.dequantize()
    assert got.dtype == torch.float32 and torch.equal(got, want)
    assert torch.equal(stored.rows(torch.tensor([5, 0, 5])), want[[5, 0, 5]])  # an embedding's lookup
    # the kernels' own float32 widening, read out weight by weight with one-hot rows of x
    layer = stored.module()
    cols = torch.randperm(k, generator=torch.Generator().manual_seed(1))[:32]
    x = torch.zeros(32, k)
    x[torch.arange(32), cols] = 1.0
    assert torch.equal(layer(x), want[:, cols].T)
    assert torch.equal(layer(x[3:4]), want[:, cols[3:4]].T)  # one row: the one-row kernels
    assert torch.equal(layer.dequantized(), want)   # the torch fallback's weights (factored scales: products)
    if stored.fmt == "int4":  # the int4 dequantization for prefill
        assert torch.equal(cpu_woq.int4_dequantize(stored.w, *stored.scales(), 32), want)
    # against float64 on random activations
    xr = torch.randn(5, k, generator=torch.Generator().manual_seed(2))
    ref = xr.double() @ want.double().T
    assert (layer(xr).double() - ref).abs().max() < 1e-5 * ref.abs().max()


def test_float_types_and_reordered_rows():
    w = np.random.default_rng(0).standard_normal((6, 64)).astype(np.float32)
    f32 = gguf_tensors.from_gguf(T.F32, w, (6, 64))
    assert f32.fmt == "fp32" and torch.equal(f32.w, torch.from_numpy(w))
    f16 = gguf_tensors.from_gguf(T.F16, w.astype(np.float16), (6, 64))
    assert f16.fmt == "fp32" and torch.equal(f16.w, torch.from_numpy(w.astype(np.float16).astype(np.float32)))
    raw = torch.from_numpy(w).bfloat16().view(torch.int16).numpy().view(np.uint8).reshape(6, 128)
    bf = gguf_tensors.from_gguf(T.BF16, raw, (6, 64))
    assert bf.fmt == "bf16" and torch.equal(bf.w, torch.from_numpy(w).bfloat16())
    q = gguf_tensors.from_gguf(T.Q8_0, gguf.quants.quantize(w, T.Q8_0), (6, 64))
    order = torch.tensor([2, 0, 1, 5, 4, 3])
    assert torch.equal(q.take(order).dequantize(), q.dequantize()[order])


def test_other_types_become_bf16_with_a_log_line_and_unknown_ones_are_refused(caplog):
    n, k = 4, 256
    data = _quantized(T.Q3_K, n, k, seed=3)
    with caplog.at_level(logging.INFO, logger=gguf_tensors.__name__):
        stored = gguf_tensors.from_gguf(T.Q3_K, data, (n, k), name="blk.0.ffn_up.weight")
    assert stored.fmt == "bf16" and "blk.0.ffn_up.weight" in caplog.text and "Q3_K" in caplog.text
    want = torch.from_numpy(gguf.quants.dequantize(data, T.Q3_K).reshape(n, k))
    assert torch.equal(stored.w, want.bfloat16())
    with pytest.raises(ValueError, match="unknown GGUF tensor type 99"):
        gguf_tensors.from_gguf(99, data, (n, k), name="x")
    with pytest.raises(ValueError, match="expected uint8"):
        gguf_tensors.from_gguf(T.Q4_K, data, (n, k))


def test_mixed_siblings_become_one_int8g_format_with_the_same_weights():
    """A Q4_K_M layer: q and k in Q4_K (int4 G32), v in Q6_K (int8g G16) -> all int8g G16, so the
    fused decoder stacks them; the float32 weights stay bit for bit."""
    q4k = {n: gguf_tensors.from_gguf(T.Q4_K, _quantized(T.Q4_K, 8, 256, seed=i), (8, 256))
           for i, n in enumerate(("l.q_proj", "l.k_proj"))}
    v = gguf_tensors.from_gguf(T.Q6_K, _quantized(T.Q6_K, 8, 256, seed=9), (8, 256))
    gate = gguf_tensors.from_gguf(T.Q4_K, _quantized(T.Q4_K, 8, 256, seed=7), (8, 256))
    up = gguf_tensors.from_gguf(T.Q4_K, _quantized(T.Q4_K, 8, 256, seed=8), (8, 256))
    linears = {**q4k, "l.v_proj": v, "l.gate_proj": gate, "l.up_proj": up}
    out = gguf_tensors.unify_siblings(linears)
    assert {(out[n].fmt, out[n].group) for n in ("l.q_proj", "l.k_proj", "l.v_proj")} == {("int8g", 16)}
    for name in linears:
        assert torch.equal(out[name].dequantize(), linears[name].dequantize()), name
    assert out["l.gate_proj"] is gate and out["l.up_proj"] is up  # already one format: untouched
    # ... and the fused decoder stacks them into one int8g matrix (shifts where Q4_K had them, zeros for
    # Q6_K's), the modules becoming views of it with the same weights
    from kvfleet.runtime.worker.cpu_decode import _fuse

    modules = [out[n].module() for n in ("l.q_proj", "l.k_proj", "l.v_proj")]
    fused = _fuse(modules)
    assert fused is not None and (fused.fmt, fused.group) == ("int8g", 16) and fused.shift is not None
    fused.check("qkv", 24, 256)
    stacked = torch.cat([linears[n].dequantize() for n in ("l.q_proj", "l.k_proj", "l.v_proj")])
    deq = fused.w.float() * fused.scale.repeat_interleave(16, 1) + fused.shift.repeat_interleave(16, 1)
    assert torch.equal(deq, stacked)
    assert modules[2].weight.data_ptr() == fused.w[16:].data_ptr()
    # gate and up, both Q4_K: one int4 matrix with the factored scales as stored (int8 factors, float16 d)
    mlp = [out[n].module() for n in ("l.gate_proj", "l.up_proj")]
    both = _fuse(mlp)
    assert both is not None and both.fmt == "int4" and both.scale.dtype == both.shift.dtype == torch.int8
    assert both.scale_d.shape == both.shift_d.shape == (16, 1) and both.scale_d.dtype == torch.float16
    both.check("gate_up", 16, 256)
    assert mlp[1].qscale_d.data_ptr() == both.scale_d[8:].data_ptr()
    gu = torch.cat([gate.dequantize(), up.dequantize()])
    xg = torch.randn(3, 256, generator=torch.Generator().manual_seed(5))
    assert torch.equal(torch.cat([m.dequantized() for m in mlp]), gu)
    ref = xg.double() @ gu.double().T
    assert (torch.cat([m(xg) for m in mlp], dim=1).double() - ref).abs().max() < 1e-5 * ref.abs().max()
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(4))
    ref = x.double() @ stacked.double().T
    got = torch.cat([m(x) for m in modules], dim=1)  # the modules on their views
    assert (got.double() - ref).abs().max() < 1e-5 * ref.abs().max()


def test_siblings_that_differ_only_in_the_5_bit_form_keep_their_float16_scales_and_stack():
    """Gemma 3's Q4_K_M layers: q and k in Q5_0 (the 5-bit form), v in Q8_0 -> kept as stored by the
    loader's unification; the fused decoder's stacking takes q and k as int8 with their float16 scales
    into one int8g matrix (the modules becoming its views, 5-bit no more); all-Q5_0 siblings stack in
    the 5-bit form."""
    q5 = {n: gguf_tensors.from_gguf(T.Q5_0, _quantized(T.Q5_0, 8, 256, seed=i), (8, 256))
          for i, n in enumerate(("l.q_proj", "l.k_proj", "m.q_proj", "m.k_proj", "m.v_proj"))}
    v8 = gguf_tensors.from_gguf(T.Q8_0, _quantized(T.Q8_0, 8, 256, seed=9), (8, 256))
    linears = {**q5, "l.v_proj": v8}
    want = {n: s.dequantize() for n, s in linears.items()}
    seen = []
    out = gguf_tensors.unify_siblings(linears, in_place=True, after_each=lambda: seen.append(1))
    assert out is linears and seen == []
    assert all(out[n].high is not None for n in ("l.q_proj", "l.k_proj", "m.q_proj", "m.k_proj", "m.v_proj"))
    for name, w in want.items():
        assert torch.equal(out[name].dequantize(), w), name
    from kvfleet.runtime.worker.cpu_decode import _fuse

    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(4))
    for layer, five_bit in (("l", False), ("m", True)):
        names = [f"{layer}.{p}_proj" for p in "qkv"]
        modules = [out[n].module() for n in names]
        fused = _fuse(modules)
        assert fused is not None and fused.scale.dtype == torch.float16 and (fused.high is not None) == five_bit
        fused.check("qkv", 24, 256)
        assert all((m.qhigh is not None) == five_bit and m.weight.data_ptr() == fused.w[8 * i:].data_ptr()
                   for i, m in enumerate(modules))
        stacked = torch.cat([want[n] for n in names])
        ref = x.double() @ stacked.double().T
        got = torch.cat([m(x) for m in modules], dim=1)  # the modules on their views of the stacked matrix
        assert (got.double() - ref).abs().max() < 1e-5 * ref.abs().max()


def test_int4_layers_take_float16_scales_as_stored():
    """``Int4Linear`` keeps float16 scales and shifts as they are (GGUF Q4_1's own ``d``, ``m``; the
    loader hands it float32 ones, for speed) and runs them on every path to the same weights."""
    n, k = 8, 256
    s = gguf_tensors.from_gguf(T.Q4_1, _quantized(T.Q4_1, n, k, seed=3), (n, k))
    half = gguf_tensors.Stored("int4", s.w, s.scale.half(), s.shift.half(), 32, "Q4_1")
    layer, want = half.module(), s.dequantize()
    assert layer.qscale.dtype == layer.qshift.dtype == torch.float16 and half.nbytes < s.nbytes
    assert torch.equal(layer.dequantized(), want)
    x = torch.eye(k)[:40]
    assert torch.equal(layer(x), want[:, :40].T) and torch.equal(layer(x[5:6]), want[:, 5:6].T)
