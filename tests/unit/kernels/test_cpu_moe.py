"""kvfleet.kernels.cpu_decoder's mixture of experts (kernels/cpu_moe.h): a fused step whose layers
route each token to its top-k experts, against a float64 torch reference (router softmax, top-k,
renormalisation as each scoring says; experts in fp32, bf16, int8, int4 and int8g; a dense layer
beside a MoE one, as Qwen3-MoE's ``mlp_only_layers`` make); batch invariance when the rows of one
step go to different experts (each row alone, in a batch, in another batch; a step of more rows
than one pass of the experts takes); the bf16 matmul kinds this CPU has, within bf16's rounding;
and the checks of :class:`MoeLayer`."""

from __future__ import annotations

import pytest
import torch

from kvfleet.kernels import cpu_woq

pytestmark = pytest.mark.skipif(not cpu_woq.available(), reason="AVX2/FMA kernels unavailable here")

from kvfleet.kernels.cpu_decoder import DecoderWeights, FusedDecoder, Layer, Linear, MoeLayer  # noqa: E402

from .test_cpu_decoder import (  # noqa: E402
    BF16_MATMULS,
    BS,
    FF,
    KVH,
    QH,
    D,
    H,
    _inputs,
    _linear,
    _rope,
)

E, IE = 6, 96   # experts per MoE layer, each expert's width
BLOCKS = 100    # cache blocks per layer (two per row of _separate_rows)
ROUTINGS = {    # (experts, top_k, norm_topk_prob, scoring): Mixtral, Qwen3-MoE (as shipped: norm off),
    "mixtral": (E, 2, True, "softmax"),     # GPT-OSS's order, and 16 of 20 (a pass of the experts: 256 rows)
    "qwen3_moe": (E, 3, False, "softmax"),
    "topk_softmax": (E, 2, True, "topk_softmax"),
    "top16": (20, 16, True, "softmax"),
}


def _moe(fmt: str, gen: torch.Generator, routing: str, router_bias: bool = False):
    """A random MoeLayer in ``fmt`` and its float64 reference (router, router bias, experts)."""
    count, top_k, norm, scoring = ROUTINGS[routing]
    router = torch.randn(count, H, generator=gen) * 0.3
    bias = torch.randn(count, generator=gen) * 0.3 if router_bias else None
    experts = [(_linear(fmt, 2 * IE, H, gen), _linear(fmt, H, IE, gen)) for _ in range(count)]
    layer = MoeLayer(Linear("fp32", router.contiguous(), bias=bias), [gu for (gu, _), _ in experts],
                     [d for _, (d, _) in experts], top_k, norm, scoring)
    ref = (router.double(), None if bias is None else bias.double(), [g for (_, g), _ in experts],
           [d for _, (_, d) in experts], top_k, norm, scoring)
    return layer, ref


def _model(fmt: str, routing: str = "mixtral", dense_layer: bool = True, router_bias: bool = False,
           blocks: int = BLOCKS, seed: int = 0, residual_scale: float = 1.0, mlp_out_norm: bool = False):
    """Layer 0 MoE, layer 1 dense (or MoE too): the decoder, its float64 reference, the head's.
    ``residual_scale``, ``mlp_out_norm``: Granite's multiplier, an RMSNorm on the MLP's output."""
    gen = torch.Generator().manual_seed(seed)
    built, ref = [], []
    for index in range(2):
        qkv, qkv_ref = _linear(fmt, (QH + 2 * KVH) * D, H, gen)
        o, o_ref = _linear(fmt, H, QH * D, gen)
        n1, n2 = 1 + 0.1 * torch.randn(H, generator=gen), 1 + 0.1 * torch.randn(H, generator=gen)
        kc, vc = torch.randn(blocks, BS, KVH, D, generator=gen), torch.randn(blocks, BS, KVH, D, generator=gen)
        n3 = 1 + 0.1 * torch.randn(H, generator=gen) if mlp_out_norm else None
        if index == 1 and dense_layer:
            (gu, gu_ref), (down, down_ref) = _linear(fmt, 2 * FF, H, gen), _linear(fmt, H, FF, gen)
            built.append(Layer(n1, n2, qkv, o, gu, down, kc, vc, mlp_out_norm=n3))
            ref.append((n1, n2, n3, qkv_ref, o_ref, ("dense", gu_ref, down_ref)))
        else:
            moe, moe_ref = _moe(fmt, gen, routing, router_bias)
            built.append(Layer(n1, n2, qkv, o, None, None, kc, vc, mlp_out_norm=n3, moe=moe))
            ref.append((n1, n2, n3, qkv_ref, o_ref, ("moe", *moe_ref)))
    head, head_ref = _linear(fmt, 304, H, gen)
    final = 1 + 0.1 * torch.randn(H, generator=gen)
    weights = DecoderWeights(QH, KVH, D, 1e-5, D ** -0.5, built, final, head, residual_scale=residual_scale)
    return weights, ref, head_ref


def _separate_rows(M: int, seed: int):
    """test_cpu_decoder's _separate_rows over :data:`BLOCKS` blocks: M rows of distinct sequences,
    two blocks each, disjoint (no row reads another's new key)."""
    x, cos, sin, _, _, lens = _inputs(M, seed=seed)
    tables = torch.randperm(BLOCKS, generator=torch.Generator().manual_seed(seed + 1))[: M * 2].view(M, 2)
    lens = lens.clamp(max=2 * BS)
    slots = torch.tensor([int(tables[i, (n - 1) // BS]) * BS + (n - 1) % BS for i, n in enumerate(lens.tolist())])
    return x, cos, sin, slots, tables.to(torch.int32).contiguous(), lens


def route(logits: torch.Tensor, top_k: int, norm: bool, scoring: str) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 reference of the routing (cpu_decoder.MOE_SCORINGS): ``(ids, weights) [M, k]``."""
    if scoring == "softmax":
        weights, ids = torch.topk(torch.softmax(logits, -1), top_k, -1)
        if norm:
            weights = weights / weights.sum(-1, keepdim=True)
    else:
        top, ids = torch.topk(logits, top_k, -1)
        weights = torch.softmax(top, -1)
    return ids, weights


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.float().to(torch.bfloat16).double()


def _reference(weights, ref, head_ref, x, cos, sin, slots, tables, lens, bf16: str | None = None):
    """float64: the decoder over the paged caches (updated as the kernel does), each layer's MLP
    dense or routed (every routed expert's output times its weight, summed). ``bf16`` (a weight
    format): the bf16 matmul kinds' roundings -- every matmul's input activations rounded to bf16
    (the router's excepted), and int4 weights dequantized to bf16 (bf16 weights are exact; int8's
    values are, their scale applies to the float32 sum)."""
    def norm(v, w):
        return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + weights.eps) * w.double()

    def mm(a, w):
        return (_bf16(a) @ (_bf16(w) if bf16 == "int4" else w).T) if bf16 else a @ w.T

    x, cos, sin = x.double(), cos.double()[:, None], sin.double()[:, None]
    routed = []
    rs = weights.residual_scale
    for layer, (n1, n2, n3, wqkv, wo, mlp) in zip(weights.layers, ref):
        qkv = mm(norm(x, n1), wqkv)
        q = _rope(qkv[:, : QH * D].view(-1, QH, D), cos, sin)
        k = _rope(qkv[:, QH * D : (QH + KVH) * D].view(-1, KVH, D), cos, sin)
        v = qkv[:, (QH + KVH) * D :].view(-1, KVH, D)
        for i, slot in enumerate(slots.tolist()):
            layer.k_cache.view(-1, KVH, D)[slot] = k[i].float()
            layer.v_cache.view(-1, KVH, D)[slot] = v[i].float()
        out = []
        for i, n in enumerate(lens.tolist()):
            pos = torch.arange(n)
            flat = tables[i, pos // BS].long() * BS + pos % BS
            keys = layer.k_cache.view(-1, KVH, D)[flat].double().repeat_interleave(QH // KVH, 1)
            vals = layer.v_cache.view(-1, KVH, D)[flat].double().repeat_interleave(QH // KVH, 1)
            p = torch.softmax(torch.einsum("hd,nhd->hn", q[i], keys) * weights.scale, -1)
            out.append(torch.einsum("hn,nhd->hd", p, vals).reshape(-1))
        x = x + rs * mm(torch.stack(out), wo)
        h = norm(x, n2)
        if mlp[0] == "dense":
            gu = mm(h, mlp[1])
            y = mm(torch.nn.functional.silu(gu[:, :FF]) * gu[:, FF:], mlp[2])
            x = x + rs * (y if n3 is None else norm(y, n3))
            continue
        router, bias, gate_up, down, top_k, norm_topk, scoring = mlp[1:]
        ids, w = route(h @ router.T + (0 if bias is None else bias), top_k, norm_topk, scoring)
        routed.append(ids)
        y = torch.zeros_like(x)
        for m in range(x.shape[0]):
            for e, we in zip(ids[m].tolist(), w[m]):
                gu = mm(h[m:m + 1], gate_up[e])[0]
                y[m] += we * mm((torch.nn.functional.silu(gu[:IE]) * gu[IE:])[None], down[e])[0]
        x = x + rs * (y if n3 is None else norm(y, n3))
    hidden = norm(x, weights.final_norm)
    return hidden, mm(hidden, head_ref), routed


def _restore(weights, snapshot):
    for layer, (kc, vc) in zip(weights.layers, snapshot):
        layer.k_cache.copy_(kc)
        layer.v_cache.copy_(vc)


def _check_reference(weights, ref, head_ref, rows, matmul="float32", tol=None, bf16=None):
    """Step ``rows`` fused and in float64 (``bf16``: :func:`_reference`'s); returns the routed
    experts of the reference and the rows' largest differences relative to the largest value."""
    x, cos, sin, slots, tables, lens = rows
    snapshot = [(layer.k_cache.clone(), layer.v_cache.clone()) for layer in weights.layers]
    fused = FusedDecoder(weights, threads=2, matmul=matmul)
    assert fused.matmul == matmul
    hidden, logits = fused.step(x.clone(), cos, sin, slots, tables, lens)
    _restore(weights, snapshot)
    want_hidden, want_logits, routed = _reference(weights, ref, head_ref, x, cos, sin, slots, tables, lens, bf16)
    for got, want in ((hidden, want_hidden), (logits, want_logits)):
        if tol is None:
            torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)
        else:
            assert (got.double() - want).abs().max() <= tol * want.abs().max()
    return routed, (hidden.double() - want_hidden).abs().amax(1) / want_hidden.abs().max()


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "int8", "int4", "int8g"])
@pytest.mark.parametrize("M", [1, 7, 40])
def test_moe_step_matches_the_float64_reference(fmt, M):
    """Mixtral's routing over 6 experts, layer 1 dense: every format, one row (decode) and more
    (rows of several experts' groups, groups padded to 16 rows), within 1e-4 of float64."""
    weights, ref, head_ref = _model(fmt)
    routed, _ = _check_reference(weights, ref, head_ref, _separate_rows(M, seed=2))
    if M == 40:
        assert len(routed[0].unique()) == E   # every expert had rows


@pytest.mark.parametrize("routing", sorted(ROUTINGS))
@pytest.mark.parametrize("router_bias", [False, True])
def test_each_routing_matches_the_float64_reference(routing, router_bias):
    """softmax then top-k with and without renormalisation (Mixtral, Qwen3-MoE), top-k then
    softmax (GPT-OSS's order), 16 of 20 experts; with and without a router bias; both layers MoE."""
    weights, ref, head_ref = _model("fp32", routing, dense_layer=False, router_bias=router_bias, seed=3)
    _check_reference(weights, ref, head_ref, _separate_rows(12, seed=4))


@pytest.mark.parametrize("fmt", ["fp32", "int4"])
def test_the_experts_output_takes_the_residual_scale_and_the_mlp_output_norm(fmt):
    """As the dense MLP's: times Granite's residual multiplier, or through an RMSNorm on the MLP's
    output before the residual add (Gemma 3 / GLM-4 / OLMo 2's mlp_out), layer 1 dense beside it."""
    for scale, out_norm in ((0.25, False), (1.0, True), (0.5, True)):
        weights, ref, head_ref = _model(fmt, residual_scale=scale, mlp_out_norm=out_norm, seed=7)
        _check_reference(weights, ref, head_ref, _separate_rows(9, seed=8))


@pytest.mark.parametrize("matmul", BF16_MATMULS)
@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4"])
def test_bf16_matmul_kinds_match_the_float64_reference(fmt, matmul):
    """The experts on AMX tiles / AVX512-BF16 dot products (activations and weights rounded to
    bf16, float32 sums; the router stays float32), 1 row and 24 (on tiles the narrow and wide
    paths over the expert groups). Against float64 with the same bf16 roundings: most rows
    within 1e-4 of the largest value, every row within 1 % (measured: at most 0.62 %, in the
    rows where one activation lands on a bf16 rounding boundary and rounds the other way, which
    moves that row's routing weights too); against plain float64 within 5 % (measured <= 3.5 %:
    the routing weights amplify bf16's rounding; the dense layers' test allows 2 %)."""
    weights, ref, head_ref = _model(fmt)
    for M in (1, 24):
        rows = _separate_rows(M, seed=5)
        _, worst = _check_reference(weights, ref, head_ref, rows, matmul, tol=1e-2, bf16=fmt)
        assert (worst <= 1e-4).sum() >= 0.75 * M, worst
        _check_reference(weights, ref, head_ref, rows, matmul, tol=5e-2)


@pytest.mark.parametrize("matmul", ["float32", *BF16_MATMULS])
@pytest.mark.parametrize("fmt", ["fp32", "int4", "int8g"])
def test_rows_routed_to_different_experts_give_the_same_bits_alone_and_in_any_batch(fmt, matmul):
    """Batch invariance with experts: the rows of one step go to different experts (checked), and
    each row's hidden state and logits are bitwise the same stepped alone, in the 20-row step, and
    in a 5-row step of other rows (other expert groups, other group sizes)."""
    weights, ref, head_ref = _model(fmt, dense_layer=False)
    rows = _separate_rows(20, seed=6)
    x, cos, sin, slots, tables, lens = rows
    snapshot = [(layer.k_cache.clone(), layer.v_cache.clone()) for layer in weights.layers]
    fused = FusedDecoder(weights, threads=2, matmul=matmul)
    assert fused.matmul == matmul

    def step(index):
        _restore(weights, snapshot)
        return fused.step(x[index].clone(), cos[index], sin[index], slots[index], tables[index].contiguous(),
                          lens[index])

    hidden, logits = step(slice(0, 20))
    routed = _reference(weights, ref, head_ref, x, cos, sin, slots, tables, lens)[2][0]
    assert len({tuple(r) for r in routed.sort(-1).values.tolist()}) >= 5, routed  # different experts
    for index in (slice(7, 12), [19, 3, 11, 0, 8]):
        h5, l5 = step(index)
        assert torch.equal(h5, hidden[index]) and torch.equal(l5, logits[index])
    for i in (0, 4, 13, 19):
        h1, l1 = step(slice(i, i + 1))
        assert torch.equal(h1[0], hidden[i]) and torch.equal(l1[0], logits[i]), f"row {i} differs alone"


def _prompt_rows(seqs: list[tuple[int, int]], blocks: int, gen: torch.Generator):
    """test_cpu_decoder's _prefill_rows over ``blocks`` cache blocks: sequence ``i``'s tokens at
    positions ``start .. start + n - 1`` (``seqs[i] = (start, n)``), its own blocks, rows in order."""
    width = max(s + n for s, n in seqs) // BS + 1
    table = torch.randperm(blocks, generator=gen)[: width * len(seqs)].view(len(seqs), width).to(torch.int32)
    pos = torch.cat([torch.arange(s, s + n) for s, n in seqs])
    tables = torch.cat([table[i].repeat(n, 1) for i, (_, n) in enumerate(seqs)]).contiguous()
    slots = torch.tensor([int(tables[r, p // BS]) * BS + p % BS for r, p in enumerate(pos.tolist())])
    freqs = 1.0 / (10000 ** (torch.arange(0, D, 2).double() / D))
    angles = torch.cat([pos.double()[:, None] * freqs, pos.double()[:, None] * freqs], -1)
    x = torch.randn(pos.numel(), H, generator=gen)
    return x, angles.cos().float(), angles.sin().float(), slots, tables, (pos + 1).to(torch.int32)


@pytest.mark.parametrize("matmul", ["float32", *BF16_MATMULS])
@pytest.mark.parametrize("routing", ["mixtral", "top16"])
def test_a_prefill_sized_step_equals_one_row_steps(matmul, routing):
    """Prompt chunks of 600 rows in one step: with top-2 one pass of the experts, whose groups
    span several row blocks (64 rows; bf16 kinds 256); with top-16 of 20 three passes (4096 / 16 =
    256 step rows each). Each row's hidden state and logits are bitwise those of stepping its
    tokens one at a time, in order."""
    weights, _, _ = _model("fp32" if matmul == "float32" else "int4", routing, blocks=120)
    x, cos, sin, slots, tables, lens = _prompt_rows([(0, 250), (40, 200), (7, 150)], 120,
                                                    torch.Generator().manual_seed(8))
    snapshot = [(layer.k_cache.clone(), layer.v_cache.clone()) for layer in weights.layers]
    fused = FusedDecoder(weights, threads=2, matmul=matmul)
    assert fused.matmul == matmul
    hidden, together = fused.step(x.clone(), cos, sin, slots, tables, lens)
    _restore(weights, snapshot)
    for j in range(x.shape[0]):
        h, alone = fused.step(x[j:j + 1].clone(), cos[j:j + 1], sin[j:j + 1], slots[j:j + 1],
                              tables[j:j + 1].clone(), lens[j:j + 1])
        assert torch.equal(h[0], hidden[j]) and torch.equal(alone[0], together[j]), f"row {j} differs"


def test_moe_layers_are_checked():
    """ValueErrors, before any C call: experts of two formats, top_k out of range, a quantized
    router, an unknown scoring, an expert of the wrong shape, a layer with neither MLP."""
    gen = torch.Generator().manual_seed(9)

    def build(change):
        weights, _, _ = _model("fp32", dense_layer=False)
        change(weights.layers[0])
        return weights

    def mixed(layer):
        layer.moe.down[2] = _linear("bf16", H, IE, gen)[0]

    def bad_k(layer):
        layer.moe.top_k = E + 1

    def int8_router(layer):
        layer.moe.router = _linear("int8", E, H, gen)[0]

    def scoring(layer):
        layer.moe.scoring = "sigmoid"

    def shape(layer):
        layer.moe.gate_up[1] = _linear("fp32", 2 * IE + 32, H, gen)[0]

    def neither(layer):
        layer.moe = None

    for change, message in ((mixed, "one format"), (bad_k, "top_k"), (int8_router, "router must be fp32"),
                            (scoring, "scoring"), (shape, "expert 1 gate_up"), (neither, "neither")):
        with pytest.raises(ValueError, match=message):
            FusedDecoder(build(change))
