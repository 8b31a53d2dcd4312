"""kvfleet.kernels.cpu_decoder: the layer variants the recipes of runtime/worker/recipes.py ask of
the fused C step, against a float64 torch reference written from transformers' modules: RMSNorms
at any of the four positions (Gemma 3 and GLM-4: all four; OLMo 2: only after each sublayer),
q/k RMSNorm per head (Qwen3, Gemma 3) or over the projection (OLMo 2), GELU-tanh, rotary over part
of the head in halves or interleaved pairs (GLM-4), a sliding window on one layer and two RoPE
tables (Gemma 3's local and global layers), Granite's residual scale; head sizes 32 (the AVX-512
transposed-key scores) and 40 (dot4). Batch invariance with all of them: a row alone equals the
row in a batch, and one sequence's consecutive rows (speculative drafts) equal one-row steps."""

from __future__ import annotations

import pytest
import torch

from kvfleet.kernels import cpu_woq

pytestmark = pytest.mark.skipif(not cpu_woq.available(), reason="AVX2/FMA kernels unavailable here")

from kvfleet.kernels.cpu_decoder import DecoderWeights, FusedDecoder, Layer, Linear, matmul_available  # noqa: E402

H, QH, KVH, FF, V, BS, BLOCKS, WINDOW = 128, 4, 2, 192, 96, 8, 64, 11
VARIANTS = {
    # norms at the four positions, qk_norm, act, rotary part of D and style, residual scale, bias
    "gemma3": dict(norms=("attn_in", "attn_out", "mlp_in", "mlp_out"), qk_norm="head", act="gelu_tanh"),
    "glm4": dict(norms=("attn_in", "attn_out", "mlp_in", "mlp_out"), rotary=0.5, interleaved=True, bias=True),
    "olmo2": dict(norms=("attn_out", "mlp_out"), qk_norm="proj"),
    "granite": dict(residual_scale=0.5),
}
BF16_MATMULS = [pytest.param(k, marks=pytest.mark.skipif(not matmul_available(k), reason=f"no {k} kernels here"))
                for k in ("avx512_bf16", "amx")]


def _linear(fmt: str, n: int, k: int, gen: torch.Generator, bias: bool = False):
    w = torch.randn(n, k, generator=gen) * 0.15
    b = torch.randn(n, generator=gen) * 0.1 if bias else None
    if fmt == "fp32":
        return Linear("fp32", w.contiguous(), bias=b), w.double()
    scale = w.abs().amax(1) / 127
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return Linear("int8", q, scale.contiguous(), bias=b), q.double() * scale.double()[:, None]


def _model(variant: str, D: int, fmt: str = "fp32", seed: int = 0):
    """Two layers: layer 0 local (window WINDOW, RoPE table 1), layer 1 global (table 0)."""
    spec = {"norms": ("attn_in", "mlp_in"), "qk_norm": "none", "act": "silu", "rotary": 1.0, "interleaved": False,
            "residual_scale": 1.0, "bias": False, **VARIANTS[variant]}
    gen = torch.Generator().manual_seed(seed)

    def norm(n: int) -> torch.Tensor:
        return (1 + 0.2 * torch.randn(n, generator=gen)).contiguous()
    qk = {"none": (None, None), "head": (D, D), "proj": (QH * D, KVH * D)}[spec["qk_norm"]]
    layers, refs = [], []
    for index in range(2):
        qkv, qkv_ref = _linear(fmt, (QH + 2 * KVH) * D, H, gen, spec["bias"])
        o, o_ref = _linear(fmt, H, QH * D, gen)
        gu, gu_ref = _linear(fmt, 2 * FF, H, gen)
        down, down_ref = _linear(fmt, H, FF, gen)
        norms = {p: norm(H) if p in spec["norms"] else None for p in ("attn_in", "attn_out", "mlp_in", "mlp_out")}
        qn, kn = (norm(n) if n else None for n in qk)
        caches = [torch.randn(BLOCKS, BS, KVH, D, generator=gen) for _ in range(2)]
        layers.append(Layer(norms["attn_in"], norms["mlp_in"], qkv, o, gu, down, *caches, norms["attn_out"],
                            norms["mlp_out"], qn, kn, window=WINDOW if index == 0 else 0, rope=1 - index))
        refs.append((qkv_ref, qkv.bias, o_ref, gu_ref, down_ref))
    head, head_ref = _linear(fmt, V, H, gen)
    weights = DecoderWeights(QH, KVH, D, 1e-5, D ** -0.5, layers, norm(H), head, qk_norm=spec["qk_norm"],
                             act=spec["act"], rotary_dim=int(D * spec["rotary"]),
                             rotary_interleaved=spec["interleaved"], residual_scale=spec["residual_scale"])
    return weights, refs, head_ref


def _rope(x, cos, sin, R, interleaved):
    rot, rest = x[..., :R], x[..., R:]
    if interleaved:  # GLM-4: cos[:R/2] repeated per pair, rotate_half over (even, odd)
        cos, sin = cos[..., : R // 2].repeat_interleave(2, -1), sin[..., : R // 2].repeat_interleave(2, -1)
        turned = torch.stack([-rot[..., 1::2], rot[..., 0::2]], -1).flatten(-2)
    else:
        turned = torch.cat([-rot[..., R // 2:], rot[..., : R // 2]], -1)
    return torch.cat([rot * cos + turned * sin, rest], -1)


def _reference(w: DecoderWeights, refs, head_ref, x, cos, sin, slots, tables, lens):
    """float64, as transformers' modules compute the layer; writes the new keys and values into
    the caches as the kernel does."""
    def norm(v, g):
        return v if g is None else v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + w.eps) * g.double()

    D, R, rs = w.head_size, w.rotary_dim, w.residual_scale
    x, cos, sin = x.double(), cos.double(), sin.double()
    for layer, (wqkv, bqkv, wo, wgu, wd) in zip(w.layers, refs):
        qkv = norm(x, layer.attn_in_norm) @ wqkv.T + (0 if bqkv is None else bqkv.double())
        q, k, v = qkv[:, : QH * D], qkv[:, QH * D: (QH + KVH) * D], qkv[:, (QH + KVH) * D:]
        if w.qk_norm == "proj":
            q, k = norm(q, layer.q_norm), norm(k, layer.k_norm)
        q, k, v = q.reshape(-1, QH, D), k.reshape(-1, KVH, D), v.reshape(-1, KVH, D)
        if w.qk_norm == "head":
            q, k = norm(q, layer.q_norm), norm(k, layer.k_norm)
        c, s = cos[layer.rope][:, None], sin[layer.rope][:, None]
        q, k = _rope(q, c, s, R, w.rotary_interleaved), _rope(k, c, s, R, w.rotary_interleaved)
        for i, slot in enumerate(slots.tolist()):
            layer.k_cache.view(-1, KVH, D)[slot] = k[i].float()
            layer.v_cache.view(-1, KVH, D)[slot] = v[i].float()
        out = []
        for i, n in enumerate(lens.tolist()):
            pos = torch.arange(max(0, n - layer.window) if layer.window else 0, n)
            flat = tables[i, pos // BS].long() * BS + pos % BS
            keys = layer.k_cache.view(-1, KVH, D)[flat].double().repeat_interleave(QH // KVH, 1)
            vals = layer.v_cache.view(-1, KVH, D)[flat].double().repeat_interleave(QH // KVH, 1)
            p = torch.softmax(torch.einsum("hd,nhd->hn", q[i], keys) * w.scale, -1)
            out.append(torch.einsum("hn,nhd->hd", p, vals).reshape(-1))
        x = x + norm(torch.stack(out) @ wo.T, layer.attn_out_norm) * rs
        gu = norm(x, layer.mlp_in_norm) @ wgu.T
        act = torch.nn.functional.gelu(gu[:, :FF], approximate="tanh") if w.act == "gelu_tanh" else \
            torch.nn.functional.silu(gu[:, :FF])
        x = x + norm((act * gu[:, FF:]) @ wd.T, layer.mlp_out_norm) * rs
    hidden = norm(x, w.final_norm)
    return hidden, hidden @ head_ref.T


def _inputs(M: int, R: int, seed: int = 1):
    """M sequences with disjoint block tables, each at its own length (some inside the window,
    most past it); cos/sin [2, M, R] of two RoPE bases."""
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 6 * BS, (M,), generator=gen, dtype=torch.int32)
    tables = torch.randperm(BLOCKS, generator=gen)[: M * 7].view(M, 7).to(torch.int32)
    slots = torch.tensor([int(tables[i, (n - 1) // BS]) * BS + (n - 1) % BS for i, n in enumerate(lens.tolist())])
    pos = (lens - 1).double()[:, None]
    tables_cs = []
    for base in (1e6, 1e4):
        freqs = 1.0 / (base ** (torch.arange(0, R, 2).double() / R))
        tables_cs.append(torch.cat([pos * freqs, pos * freqs], -1))
    angles = torch.stack(tables_cs)
    return torch.randn(M, H, generator=gen), angles.cos().float(), angles.sin().float(), slots, tables, lens


def _step_and_reference(weights, refs, head_ref, M, matmul="float32"):
    x, cos, sin, slots, tables, lens = _inputs(M, weights.rotary_dim)
    snapshot = [(layer.k_cache.clone(), layer.v_cache.clone()) for layer in weights.layers]
    fused = FusedDecoder(weights, threads=2, matmul=matmul)
    assert fused.matmul == matmul and fused.num_ropes == 2
    hidden, logits = fused.step(x.clone(), cos, sin, slots, tables, lens)
    for layer, (kc, vc) in zip(weights.layers, snapshot):
        layer.k_cache.copy_(kc)
        layer.v_cache.copy_(vc)
    return (hidden, logits), _reference(weights, refs, head_ref, x, cos, sin, slots, tables, lens)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("D", [32, 40])
@pytest.mark.parametrize("M", [1, 7])
def test_layer_variants_match_the_float64_reference(variant, D, M):
    weights, refs, head_ref = _model(variant, D)
    (hidden, logits), (want_hidden, want_logits) = _step_and_reference(weights, refs, head_ref, M)
    torch.testing.assert_close(hidden.double(), want_hidden, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits.double(), want_logits, rtol=1e-4, atol=1e-4)


def test_the_window_and_the_rope_tables_matter():
    """The reference is sensitive to what is tested: without the window, or with the tables
    swapped, the step's logits move far beyond the tolerance."""
    weights, refs, head_ref = _model("gemma3", 32)
    (_, logits), (_, want) = _step_and_reference(weights, refs, head_ref, 7)
    for change in ("window", "rope"):
        weights, refs, head_ref = _model("gemma3", 32)
        if change == "window":
            weights.layers[0].window = 0
        else:
            weights.layers[0].rope, weights.layers[1].rope = 0, 1
        (_, other), _ = _step_and_reference(weights, refs, head_ref, 7)
        assert (other.double() - want).abs().max() > 1e-2, change
    torch.testing.assert_close(logits.double(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("matmul", BF16_MATMULS)
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("fmt", ["fp32", "int8"])
def test_bf16_matmuls_stay_within_bf16_rounding(variant, fmt, matmul):
    """AVX512-BF16 dot products and AMX tiles (activations and weights rounded to bf16, float32
    sums): within 2 % of the largest value of the float64 reference, as for the Llama layer."""
    weights, refs, head_ref = _model(variant, 32, fmt)
    got, want = _step_and_reference(weights, refs, head_ref, 7, matmul)
    for g, w in zip(got, want):
        assert (g.double() - w).abs().max() <= 2e-2 * w.abs().max()


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("matmul", ["float32", *BF16_MATMULS])
def test_a_row_gives_the_same_bits_in_any_batch(variant, matmul):
    """Each row of a 6-row step (windowed layer included) equals the row stepped alone, bit for bit."""
    weights, _, _ = _model(variant, 32)
    x, cos, sin, slots, tables, lens = _inputs(6, weights.rotary_dim, seed=5)
    snapshot = [(layer.k_cache.clone(), layer.v_cache.clone()) for layer in weights.layers]
    fused = FusedDecoder(weights, threads=2, matmul=matmul)
    _, together = fused.step(x.clone(), cos, sin, slots, tables, lens)
    for i in range(6):
        for layer, (kc, vc) in zip(weights.layers, snapshot):
            layer.k_cache.copy_(kc)
            layer.v_cache.copy_(vc)
        _, alone = fused.step(x[i:i + 1].clone(), cos[:, i:i + 1].contiguous(), sin[:, i:i + 1].contiguous(),
                              slots[i:i + 1], tables[i:i + 1], lens[i:i + 1])
        assert torch.equal(alone[0], together[i]), f"row {i} (len {int(lens[i])}) differs in the batch"


@pytest.mark.parametrize("variant", ["gemma3", "glm4"])
def test_a_sequences_rows_in_one_step_equal_one_row_steps(variant):
    """Speculative verification over a windowed layer: one sequence's 5 tokens at consecutive
    positions as the rows of one step give, bit for bit, what 5 one-row steps give."""
    weights, _, _ = _model(variant, 32)
    gen = torch.Generator().manual_seed(9)
    table = torch.randperm(BLOCKS, generator=gen)[:7].to(torch.int32)
    lens = torch.arange(20, 25, dtype=torch.int32)
    x = torch.randn(5, H, generator=gen)
    _, cos, sin, _, _, _ = _inputs(5, weights.rotary_dim)
    slots = torch.tensor([int(table[(n - 1) // BS]) * BS + (n - 1) % BS for n in lens.tolist()])
    tables = table.repeat(5, 1).contiguous()
    snapshot = [(layer.k_cache.clone(), layer.v_cache.clone()) for layer in weights.layers]
    fused = FusedDecoder(weights, threads=2)
    _, together = fused.step(x.clone(), cos, sin, slots, tables, lens)
    for layer, (kc, vc) in zip(weights.layers, snapshot):
        layer.k_cache.copy_(kc)
        layer.v_cache.copy_(vc)
    for i in range(5):
        _, alone = fused.step(x[i:i + 1].clone(), cos[:, i:i + 1].contiguous(), sin[:, i:i + 1].contiguous(),
                              slots[i:i + 1], tables[i:i + 1], lens[i:i + 1])
        assert torch.equal(alone[0], together[i]), f"row {i} differs"


def test_bad_layer_variants_are_value_errors():
    weights, _, _ = _model("olmo2", 32)
    weights.layers[1].q_norm = None
    with pytest.raises(ValueError, match="q_norm is missing"):
        FusedDecoder(weights)
    weights, _, _ = _model("gemma3", 32)
    weights.layers[0].q_norm = torch.ones(QH * 32)
    with pytest.raises(ValueError, match="q_norm must be None or a contiguous float32"):
        FusedDecoder(weights)
    weights, _, _ = _model("glm4", 32)
    weights.rotary_dim = 33
    with pytest.raises(ValueError, match="rotary_dim"):
        FusedDecoder(weights)
    weights.rotary_dim, weights.act = 16, "relu"
    with pytest.raises(ValueError, match="act one of"):
        FusedDecoder(weights)
    weights, _, _ = _model("granite", 32)
    x, cos, sin, slots, tables, lens = _inputs(2, 32)
    with pytest.raises(ValueError, match="cos must be"):
        FusedDecoder(weights).step(x, cos[0], sin[0], slots, tables, lens)   # two tables asked, one given
