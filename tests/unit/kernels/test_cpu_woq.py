"""kvfleet's AVX2 weight-only kernels (``kernels/cpu_woq``) and the layers that run them
(``runtime/worker/woq_linear``): against float64 references, torchao's quantization, the
layouts, the checks, and ``torch.compile``."""

from __future__ import annotations

import pytest
import torch

from kvfleet.kernels import cpu_woq

pytestmark = pytest.mark.skipif(not cpu_woq.available(), reason=f"AVX2 kernels: {cpu_woq.unavailable_reason()}")

SHAPES = [(192, 576), (1536, 576), (576, 1536), (33, 64), (7, 96)]


def _int4_reference(q: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, group: int) -> torch.Tensor:
    return q.double() * scale.double().repeat_interleave(group, 1) + shift.double().repeat_interleave(group, 1)


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 9, 40])
@pytest.mark.parametrize("shape", SHAPES)
def test_int8_and_int4_match_float64(rows, shape):
    gen = torch.Generator().manual_seed(rows * 1000 + shape[0])
    N, K = shape
    x = torch.randn(rows, K, generator=gen)
    bias = torch.randn(N, generator=gen)
    q8 = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=gen)
    s8 = torch.rand(N, generator=gen) * 0.02
    ref8 = x.double() @ (q8.double() * s8.double()[:, None]).T
    tol = 1e-6 * K ** 0.5 * ref8.abs().max().item() + 1e-6
    assert (cpu_woq.int8_linear(x, q8, s8, None).double() - ref8).abs().max() < tol
    assert (cpu_woq.int8_linear(x, q8, s8, bias).double() - ref8 - bias.double()).abs().max() < tol
    if K % 32:
        return
    group = 64 if K % 64 == 0 else 32
    q4 = torch.randint(0, 16, (N, K), dtype=torch.uint8, generator=gen)
    scale = torch.rand(N, K // group, generator=gen) * 0.05
    shift = torch.randn(N, K // group, generator=gen) * 0.1
    ref4 = x.double() @ _int4_reference(q4, scale, shift, group).T + bias.double()
    got = cpu_woq.int4_linear(x, cpu_woq.pack_int4(q4), scale, shift, group, bias)
    assert (got.double() - ref4).abs().max() < 1e-6 * K ** 0.5 * ref4.abs().max().item() + 1e-6


@pytest.mark.parametrize("shape", [(1536, 576), (96, 1536), (40, 584), (24, 608)])
def test_each_row_gives_the_same_bits_in_any_batch(shape):
    """Batch invariance: a row's output does not depend on the other rows of the call, bit for bit,
    in every weight format (several rows are summed in the one-row helpers' order). K = 584 and
    608 leave an 8- and a 32-weight tail after the 64-weight blocks."""
    gen = torch.Generator().manual_seed(shape[0])
    N, K = shape
    x = torch.randn(40, K, generator=gen)
    bias = torch.randn(N, generator=gen)
    layers = {
        "int8": lambda a: cpu_woq.int8_linear(a, torch.randint(-127, 128, (N, K), dtype=torch.int8,
                                                               generator=torch.Generator().manual_seed(1)),
                                              torch.rand(N, generator=torch.Generator().manual_seed(2)), bias),
        "bf16": lambda a: cpu_woq.bf16_linear(a, torch.randn(N, K, generator=torch.Generator().manual_seed(3))
                                              .bfloat16(), bias, path="kernel"),
    }
    if K % 32 == 0:
        q8 = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=gen)
        s8 = torch.rand(N, K // 32, generator=gen)
        layers["int8g"] = lambda a: cpu_woq.int8g_linear_unchecked(a, q8, s8, None, 32, bias)
        s16, t16 = torch.rand(N, K // 16, generator=gen), torch.randn(N, K // 16, generator=gen)
        layers["int8g G16 + shift"] = lambda a: cpu_woq.int8g_linear_unchecked(a, q8, s16, t16, 16, bias)
        q4 = cpu_woq.pack_int4(torch.randint(0, 16, (N, K), dtype=torch.uint8, generator=gen))
        scale, shift = torch.rand(N, K // 32, generator=gen), torch.randn(N, K // 32, generator=gen)
        layers["int4"] = lambda a: cpu_woq.int4_linear(a, q4, scale, shift, 32, bias)
    for name, layer in layers.items():
        alone = torch.cat([layer(x[i:i + 1]) for i in range(x.shape[0])])
        for rows in (2, 3, 5, 7, 13, 32):
            assert torch.equal(layer(x[:rows]), alone[:rows]), f"{name}, {rows} rows"


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 9, 40])
@pytest.mark.parametrize("shape", SHAPES)
def test_bf16_weights_match_float64(rows, shape):
    """The C kernel (and, above KERNEL_ROWS, the fp32 matmul on the widened weight) computes
    x @ w.T exactly up to float32 rounding: widening bf16 to float32 is exact."""
    gen = torch.Generator().manual_seed(rows * 7 + shape[1])
    N, K = shape
    x = torch.randn(rows, K, generator=gen)
    w = torch.randn(N, K, generator=gen).to(torch.bfloat16)
    bias = torch.randn(N, generator=gen)
    ref = x.double() @ w.double().T + bias.double()
    tol = 1e-6 * K ** 0.5 * ref.abs().max().item() + 1e-6
    # The automatic choice too, unless it is the native bf16 matmul (a CPU with AMX / AVX512-BF16
    # above KERNEL_ROWS), which rounds x to bf16: its own rule is the next test's.
    auto = () if cpu_woq.bf16_path(rows) == "native_bf16" else (None,)
    for path in ("kernel", "fp32", *auto):
        got = cpu_woq.bf16_linear(x, w, bias, path=path)
        assert got.dtype == torch.float32 and got.shape == (rows, N)
        assert (got.double() - ref).abs().max() < tol, path
    assert (cpu_woq.bf16_linear(x, w, None, path="kernel").double() - ref + bias.double()).abs().max() < tol


def test_bf16_native_path_rounds_activations_and_products():
    """The prefill path of CPUs with native bf16 (forced here: on a CPU without it oneDNN emulates
    bf16, slowly but with the same rounding): x rounded to bf16, products summed in float32, the
    sum rounded to bf16 (oneDNN's output dtype), then the float32 bias added."""
    gen = torch.Generator().manual_seed(5)
    x, w, bias = torch.randn(40, 576, generator=gen), torch.randn(192, 576, generator=gen).bfloat16(), torch.randn(192)
    got = cpu_woq.bf16_linear(x, w, bias, path="native_bf16")
    assert got.dtype == torch.float32
    exact_x = x.bfloat16().double() @ w.double().T
    assert ((got.double() - bias.double() - exact_x).abs() <= 2 ** -8 * exact_x.abs() + 1e-4).all()
    ref = x.double() @ w.double().T + bias.double()
    rel = (got.double() - ref).norm() / ref.norm()
    assert 1e-4 < rel < 1e-2  # the rounding shows (~2^-9 relative), and no more


def test_bf16_path_choice():
    rows = cpu_woq.KERNEL_ROWS
    assert cpu_woq.bf16_path(1, native_bf16=True) == cpu_woq.bf16_path(rows, native_bf16=False) == "kernel"
    assert cpu_woq.bf16_path(rows + 1, native_bf16=True) == "native_bf16"
    assert cpu_woq.bf16_path(rows + 1, native_bf16=False) == "fp32"
    from kvfleet.kernels import cpu_features

    assert cpu_woq.bf16_path(512) == ("native_bf16" if cpu_features.detect().native_bf16 else "fp32")


def test_bf16_activations_and_leading_dims():
    x = torch.randn(2, 3, 64).bfloat16()
    q8 = torch.randint(-127, 128, (16, 64), dtype=torch.int8)
    s8 = torch.rand(16) * 0.01
    y = cpu_woq.int8_linear(x, q8, s8, None)
    assert y.shape == (2, 3, 16) and y.dtype == torch.bfloat16
    ref = x.float() @ (q8.float() * s8[:, None]).T
    assert torch.allclose(y.float(), ref, rtol=1e-2, atol=1e-2)
    assert torch.equal(cpu_woq.int8_linear_unchecked(x, q8, s8, None), y)
    assert cpu_woq.int8_linear(x[:0], q8, s8, None).shape == (0, 3, 16)


@pytest.mark.parametrize("rows", [1, 5, 40, 300])
def test_grouped_int8_matches_float64_and_is_built_only_when_exact(rows):
    from kvfleet.runtime.worker.woq_linear import Int8GroupLinear

    gen = torch.Generator().manual_seed(rows)
    N, K = 200, 576
    q = torch.randint(-127, 128, (N, K), generator=gen).float()
    q.view(N, K // 32, 32)[..., 0] = 127  # Q8_0: each block's largest magnitude is 127 * d
    d = (torch.rand(N, K // 32, generator=gen) * 0.01).half().float()
    linear = torch.nn.Linear(K, N)
    linear.weight.data.copy_((q.view(N, K // 32, 32) * d[..., None]).view(N, K))
    layer = Int8GroupLinear.from_exact(linear)
    assert layer is not None and torch.equal(layer.dequantized(), linear.weight.detach())
    x = torch.randn(rows, K, generator=gen)
    ref = x.double() @ linear.weight.detach().double().T + linear.bias.detach().double()
    tol = 1e-6 * K ** 0.5 * ref.abs().max().item() + 1e-6
    assert (layer(x).double() - ref).abs().max() < tol
    linear.weight.data[3, 5] += 1e-3  # no longer q * d: refused, never approximated
    assert Int8GroupLinear.from_exact(linear) is None


@pytest.mark.parametrize("rows", [1, 3, 5, 9, 40, 300])
@pytest.mark.parametrize("group,shifted", [(16, False), (16, True), (32, True), (48, True), (64, False)])
def test_grouped_int8_with_groups_of_16_and_shifts_matches_float64(rows, group, shifted):
    """int8g's GGUF forms: Q6_K (G 16, q in -32..31), Q5_K (G 32, q in 0..31, a shift per group),
    a group that is no power of two (48): the kernel (few rows, buffered rows) and the torch
    fallback (more than KERNEL_ROWS rows) against float64 over the float32 dequantization
    (q * scale, then + shift, each rounded in float32)."""
    from kvfleet.runtime.worker.woq_linear import Int8GroupLinear

    gen = torch.Generator().manual_seed(rows * group)
    N, K = 72, 576
    q = torch.randint(-32, 32, (N, K), generator=gen, dtype=torch.int8)
    scale = torch.rand(N, K // group, generator=gen) * 0.02
    shift = -torch.rand(N, K // group, generator=gen) * 0.3 if shifted else None
    bias = torch.randn(N, generator=gen)
    layer = Int8GroupLinear.from_blocks((K, N), q, scale, shift, group, bias)
    deq = q.float() * scale.repeat_interleave(group, 1)
    if shifted:
        deq = deq + shift.repeat_interleave(group, 1)
    assert torch.equal(layer.dequantized(), deq)
    x = torch.randn(rows, K, generator=gen)
    ref = x.double() @ deq.double().T + bias.double()
    tol = 1e-6 * K ** 0.5 * ref.abs().max().item() + 1e-6
    got = layer(x)
    assert (got.double() - ref).abs().max() < tol
    if rows <= Int8GroupLinear.KERNEL_ROWS:  # batch invariance: each row alone gives its bits
        for i in {0, rows // 2, rows - 1}:
            assert torch.equal(layer(x[i:i + 1]), got[i:i + 1])
    with pytest.raises(ValueError, match="multiple of 16"):
        Int8GroupLinear.from_blocks((K, N), q, scale, shift, 8, bias)
    with pytest.raises(ValueError, match="shift"):
        Int8GroupLinear.from_blocks((K, N), q, scale, torch.zeros(N, 3), group, bias)


def test_int4_dequantized_to_bf16_rounds_to_nearest_even_and_runs_prefill():
    gen = torch.Generator().manual_seed(5)
    N, K = 96, 576
    q4 = cpu_woq.pack_int4(torch.randint(0, 16, (N, K), dtype=torch.uint8, generator=gen))
    scale, shift = torch.rand(N, K // 32, generator=gen) * 0.05, torch.randn(N, K // 32, generator=gen) * 0.1
    fp32 = cpu_woq.int4_dequantize(q4, scale, shift, 32)
    assert torch.equal(cpu_woq.int4_dequantize(q4, scale, shift, 32, dtype=torch.bfloat16), fp32.to(torch.bfloat16))
    assert torch.equal(cpu_woq.int4_dequantize(q4, scale, shift, 32, out=cpu_woq.bf16_scratch(N, K),
                                               dtype=torch.bfloat16), fp32.to(torch.bfloat16))
    # The layers' bf16 prefill (more than MAX_KERNEL_ROWS rows): bf16 rounding of weights and activations.
    from kvfleet.runtime.worker.woq_linear import Int4Linear, Int8Linear, set_bf16_prefill

    linear = torch.nn.Linear(K, N)
    model = torch.nn.Sequential(Int4Linear.from_linear(linear, 32), Int8Linear.from_float(linear.weight.detach(),
                                                                                          linear.bias.detach()))
    x = torch.randn(64, K, generator=gen)
    before, small = [m(x) for m in model], [m(x[:8]) for m in model]
    assert set_bf16_prefill(model, True) == 2 and all(m.prefill_bf16 for m in model)
    for m, fp, fp_small in zip(model, before, small):
        y = m(x)
        assert y.dtype == torch.float32 and not torch.equal(y, fp)
        torch.testing.assert_close(y, fp, rtol=0, atol=0.02 * fp.abs().max().item())
        assert torch.equal(m(x[:8]), fp_small)  # up to 32 rows (decode): the float32 C kernel, unchanged


def test_pack_int4_layout_and_round_trip():
    q = torch.arange(64, dtype=torch.uint8).remainder(16).reshape(1, 64)
    packed = cpu_woq.pack_int4(q)
    assert packed.shape == (1, 32) and packed.dtype == torch.uint8
    # Byte j of a 32-block holds k = j (low nibble) and k = 16 + j (high nibble).
    assert packed[0, 0].item() == q[0, 0].item() | (q[0, 16].item() << 4)
    assert packed[0, 16].item() == q[0, 32].item() | (q[0, 48].item() << 4)
    rand = torch.randint(0, 16, (5, 96), dtype=torch.uint8)
    assert torch.equal(cpu_woq.unpack_int4(cpu_woq.pack_int4(rand)), rand)
    with pytest.raises(ValueError, match="multiple of 32"):
        cpu_woq.pack_int4(torch.zeros(2, 48, dtype=torch.uint8))
    with pytest.raises(ValueError, match="0..15"):
        cpu_woq.pack_int4(torch.full((1, 32), 16, dtype=torch.int32))


def test_bad_arguments_raise_value_errors():
    x = torch.randn(2, 64)
    q8 = torch.randint(-127, 128, (8, 64), dtype=torch.int8)
    s8 = torch.rand(8)
    with pytest.raises(ValueError, match="input features"):
        cpu_woq.int8_linear(torch.randn(2, 32), q8, s8, None)
    with pytest.raises(ValueError, match="contiguous torch.int8"):
        cpu_woq.int8_linear(x, q8.float(), s8, None)
    with pytest.raises(ValueError, match="scale"):
        cpu_woq.int8_linear(x, q8, torch.rand(4), None)
    with pytest.raises(ValueError, match="bias"):
        cpu_woq.int8_linear(x, q8, s8, torch.rand(8, dtype=torch.float64))
    with pytest.raises(ValueError, match="floating point"):
        cpu_woq.int8_linear(x.long(), q8, s8, None)
    with pytest.raises(ValueError, match="contiguous torch.bfloat16"):
        cpu_woq.bf16_linear(x, torch.zeros(8, 64), None)
    with pytest.raises(ValueError, match="input features"):
        cpu_woq.bf16_linear(torch.randn(2, 32), torch.zeros(8, 64, dtype=torch.bfloat16), None)
    packed = cpu_woq.pack_int4(torch.zeros(8, 64, dtype=torch.uint8))
    with pytest.raises(ValueError, match="group_size"):
        cpu_woq.int4_linear(x, packed, torch.rand(8, 4), torch.rand(8, 4), 16, None)
    with pytest.raises(ValueError, match="shift"):
        cpu_woq.int4_linear(x, packed, torch.rand(8, 2), torch.rand(8, 3), 32, None)


def test_cpu_flags_and_a_missing_compiler(monkeypatch):
    from kvfleet.kernels import cpu_lib

    assert cpu_woq.cpu_supported("processor\t: 0\nflags\t\t: fpu sse2 avx2 fma f16c\n")
    assert not cpu_woq.cpu_supported("processor\t: 0\nflags\t\t: fpu sse2 avx f16c\n")
    assert not cpu_woq.cpu_supported("")
    monkeypatch.setattr(cpu_lib, "_lib", None)
    monkeypatch.setattr(cpu_lib, "_error", None)
    monkeypatch.setenv(cpu_lib.CACHE_DIR_ENV, "/nonexistent-kvfleet-cache")  # no cached build to fall back on
    monkeypatch.setattr(cpu_lib, "compiler", lambda: None)
    assert cpu_woq.load() is None and not cpu_woq.available()
    assert "no C compiler" in cpu_woq.unavailable_reason()


def test_layers_match_torchao_quantization():
    from torchao.quantization import Int8WeightOnlyConfig, quantize_
    from torchao.quantization.quant_primitives import (
        MappingType,
        _choose_qparams_affine_tinygemm,
        _dequantize_affine_tinygemm,
        _quantize_affine_tinygemm,
    )

    from kvfleet.runtime.worker.woq_linear import MAX_KERNEL_ROWS, Int4Linear, Int8Linear

    torch.manual_seed(0)
    lin = torch.nn.Linear(576, 192)
    ref8 = torch.nn.Sequential(torch.nn.Linear(576, 192))
    ref8.load_state_dict({"0." + k: v for k, v in lin.state_dict().items()})
    quantize_(ref8, Int8WeightOnlyConfig(set_inductor_config=False))
    mine8 = Int8Linear.from_float(lin.weight.detach(), lin.bias.detach())
    assert mine8.weight.dtype == torch.int8 and torch.equal(mine8.weight, ref8[0].weight.qdata)
    w = lin.weight.detach()
    scale, zero = _choose_qparams_affine_tinygemm(w, MappingType.ASYMMETRIC, [1, 64], torch.int32, 0, 15, 1e-6,
                                                  None, w.dtype)
    q = _quantize_affine_tinygemm(w, [1, 64], scale, zero, torch.int32, 0, 15)
    dq = _dequantize_affine_tinygemm(q, [1, 64], scale, zero, torch.int32, 0, 15)
    mine4 = Int4Linear.from_linear(lin, 64)
    assert torch.allclose(mine4.dequantized(), dq, atol=1e-6)
    assert mine4.weight.shape == (192, 288) and mine4.weight.dtype == torch.uint8
    with torch.no_grad():
        for rows in (1, 7, MAX_KERNEL_ROWS + 5):  # the last one runs dequantize + torch matmul
            x = torch.randn(rows, 576)
            assert torch.allclose(mine8(x), ref8(x), rtol=1e-5, atol=1e-5)
            assert torch.allclose(mine4(x), x @ dq.T + lin.bias, rtol=1e-5, atol=1e-5)


def test_prefill_scratch_works_in_and_out_of_inference_mode():
    """The dequantization buffer is shared by every layer of a thread. Made first under
    inference mode (an engine step), it must stay writable under plain no_grad."""
    from kvfleet.runtime.worker import woq_linear

    torch.manual_seed(2)
    lin = torch.nn.Linear(96, 40)
    layers = [woq_linear.Int8Linear.from_float(lin.weight.detach(), lin.bias.detach()),
              woq_linear.Int4Linear.from_linear(lin, 32)]
    x = torch.randn(woq_linear.MAX_KERNEL_ROWS + 3, 96)
    cpu_woq._scratch.__dict__.clear()  # a fresh buffer, made inside inference mode
    with torch.inference_mode():
        first = [m(x) for m in layers]
    with torch.no_grad():
        again = [m(x) for m in layers]
    for a, b in zip(first, again):
        assert torch.equal(a, b)
        with torch.no_grad():
            ref = lin(x)
        assert (a - ref).norm() / ref.norm() < 0.1  # quantized (int4: ~6 % here): close, not equal


def test_layers_compile_to_the_custom_ops():
    from kvfleet.runtime.worker.woq_linear import Bf16Linear, Int4Linear, Int8Linear

    torch.manual_seed(1)
    model = torch.nn.Sequential(Int8Linear.from_float(torch.randn(64, 96)),
                                Int4Linear.from_linear(torch.nn.Linear(64, 32, bias=False), 32),
                                Bf16Linear.from_linear(torch.nn.Linear(32, 24)))  # fmt: skip
    x = torch.randn(3, 96)
    graphs = []

    def backend(gm, _inputs):
        graphs.append(gm)
        return gm.forward

    with torch.no_grad():
        eager = model(x)
        compiled = torch.compile(model, backend=backend, fullgraph=True)(x)
    assert torch.equal(compiled, eager)
    code = graphs[0].code
    assert "kvfleet.woq_int8_linear" in code and "kvfleet.woq_int4_linear" in code
    assert "kvfleet.woq_bf16_linear" in code


def test_bf16_layers_and_the_model_conversion():
    from kvfleet.runtime.worker.woq_linear import Bf16Linear, to_bf16_weights

    torch.manual_seed(3)
    lin = torch.nn.Linear(96, 40)
    layer = Bf16Linear.from_linear(lin)
    assert layer.weight.dtype == torch.bfloat16 and layer.bias32.dtype == torch.float32
    ref_w = lin.weight.detach().bfloat16().double()
    with torch.no_grad():
        for rows in (1, cpu_woq.KERNEL_ROWS + 3):  # the kernel, then the large-step path
            x = torch.randn(rows, 96)
            ref = x.double() @ ref_w.T + lin.bias.double()
            got = layer(x)
            assert got.dtype == torch.float32
            tol = 2 ** -8 * (x.double().abs() @ ref_w.abs().T).max() if cpu_woq.bf16_path(rows) == "native_bf16" \
                else 1e-5
            assert (got.double() - ref).abs().max() < tol
    model = torch.nn.Sequential(torch.nn.Linear(96, 40), torch.nn.ReLU(), torch.nn.Linear(40, 8))
    assert to_bf16_weights(model) == 2
    assert all(isinstance(m, Bf16Linear) for m in (model[0], model[2]))
    with pytest.raises(ValueError, match="not a float32 nn.Linear"):
        to_bf16_weights(torch.nn.Sequential(torch.nn.Linear(8, 8, dtype=torch.float16)))
