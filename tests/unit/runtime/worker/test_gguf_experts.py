"""A GGUF file's mixture-of-experts layers (runtime/worker/gguf_experts.py): a tiny random Qwen3-MoE
(``qwen3moe``) and Mixtral (``llama`` with ``expert_count``, q / k rows permuted as llama.cpp's
converter writes them) written by ``gguf.GGUFWriter`` the way llama.cpp lays them out
(``ffn_{gate,up,down}_exps [E, ...]``, the router ``ffn_gate_inp``; Qwen3-MoE's experts' gate Q4_0,
up Q8_0 or Q4_0, down Q8_0, Mixtral's all Q4_0) is read with each expert as stored (a layer's mixed Q4_0 and
Q8_0 experts all as grouped int8, all-Q4_0 ones int4, bit-equal to the ``gguf`` package's
dequantization),
cached, and run on the fused decoder with the greedy tokens of transformers' model over the same
(dequantized) weights; the fused step's matmuls in float32 (``KVFLEET_CPU_MATMUL=float32``: exact
products of the int8 weights, so token equality is the expectation)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from support.engine_workload import run
from support.tiny_models import COMMON, GEN, PROMPTS, VOCAB, hf_greedy

from kvfleet.kernels import cpu_woq
from kvfleet.kernels.cpu_decoder import matmul_available
from kvfleet.runtime.config import EngineConfig
from kvfleet.runtime.engine.llm_engine import LLMEngine
from kvfleet.runtime.sampling_params import SamplingParams
from kvfleet.runtime.worker import cpu_decode, gguf_experts, gguf_model
from kvfleet.runtime.worker.moe_experts import LinearExperts
from kvfleet.runtime.worker.woq_linear import Int4Linear, Int8GroupLinear

pytestmark = pytest.mark.skipif(not cpu_woq.available(), reason="AVX2/FMA kernels unavailable here")

T = gguf.GGMLQuantizationType
E = 4
UP_TYPE = {("qwen3moe", 0): T.Q8_0, ("qwen3moe", 1): T.Q4_0, ("llama", 0): T.Q4_0, ("llama", 1): T.Q4_0}
DOWN_TYPE = {"qwen3moe": T.Q8_0, "llama": T.Q4_0}
GATE_UP_LAYER = {"qwen3moe": Int8GroupLinear, "llama": Int4Linear}
"""The experts' layers (gate Q4_0 always): Qwen3-MoE's layer 0 a Q8_0 up beside it (gate and up as
grouped int8), its layer 1 a Q4_0 up (an int4 gate_up beside a Q8_0 down: the layer all grouped
int8, the fused MoE step's one format), Mixtral's all-Q4_0 experts int4."""
GREEDY = SamplingParams(temperature=0, max_tokens=GEN, ignore_eos=True, logprobs=0)


def _quantized(w: torch.Tensor, qtype) -> tuple[np.ndarray, torch.Tensor]:
    """``w`` in ``qtype``'s bytes, and the float32 weights they hold (``gguf``'s dequantization)."""
    raw = gguf.quants.quantize(w.detach().float().numpy(), qtype)
    return raw, torch.from_numpy(gguf.quants.dequantize(raw, qtype)).reshape(w.shape)


def _permuted(raw: np.ndarray, n_head: int) -> np.ndarray:
    """Rows in llama.cpp's q / k order (``convert_hf_to_gguf.py``'s ``LlamaModel.permute``)."""
    return raw.reshape(n_head, 2, raw.shape[0] // n_head // 2, *raw.shape[1:]).swapaxes(1, 2).reshape(raw.shape)


@pytest.fixture(scope="module", params=["qwen3moe", "llama"])
def moe_file(request, tmp_path_factory):
    """(the file, its experts' width, transformers' model over the file's dequantized weights, that
    model's greedy tokens)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    arch = request.param
    tiny = dict(COMMON, initializer_range=0.1)
    if arch == "qwen3moe":
        width = 64
        config = AutoConfig.for_model("qwen3_moe", num_experts=E, num_experts_per_tok=2, moe_intermediate_size=width,
                                      norm_topk_prob=True, head_dim=16, **tiny)
    else:
        width = COMMON["intermediate_size"]
        config = AutoConfig.for_model("mixtral", num_local_experts=E, num_experts_per_tok=2, **tiny)
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    path = tmp_path_factory.mktemp("moe") / f"tiny-{arch}-moe.gguf"
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(COMMON["max_position_embeddings"])
    w.add_embedding_length(COMMON["hidden_size"])
    w.add_block_count(COMMON["num_hidden_layers"])
    w.add_feed_forward_length(COMMON["intermediate_size"])
    w.add_head_count(COMMON["num_attention_heads"])
    w.add_head_count_kv(COMMON["num_key_value_heads"])
    w.add_key_length(16)
    w.add_value_length(16)
    w.add_rope_dimension_count(16)
    w.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_expert_count(E)
    w.add_expert_used_count(2)
    if arch == "qwen3moe":
        w.add_expert_feed_forward_length(width)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(["<s>", "</s>"] + [chr(c) for c in range(33, 33 + VOCAB - 3)] + ['!"'])
    w.add_token_types([3, 3] + [1] * (VOCAB - 2))
    w.add_token_merges(["! \""])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    params = dict(ref.named_parameters())

    def put(name: str, hf: str, qtype=None, heads: int = 0):
        t = params[hf]
        if qtype is None:
            w.add_tensor(name, t.detach().float().numpy())
            return
        raw, deq = _quantized(t, qtype)
        w.add_tensor(name, _permuted(raw, heads) if heads else raw, raw_dtype=qtype)
        with torch.no_grad():
            t.copy_(deq)

    put("token_embd.weight", "model.embed_tokens.weight")
    put("output_norm.weight", "model.norm.weight")
    put("output.weight", "lm_head.weight", T.Q8_0)
    for i in range(COMMON["num_hidden_layers"]):
        p = f"model.layers.{i}."
        put(f"blk.{i}.attn_norm.weight", p + "input_layernorm.weight")
        put(f"blk.{i}.ffn_norm.weight", p + "post_attention_layernorm.weight")
        if arch == "qwen3moe":
            put(f"blk.{i}.attn_q_norm.weight", p + "self_attn.q_norm.weight")
            put(f"blk.{i}.attn_k_norm.weight", p + "self_attn.k_norm.weight")
        permute = {"attn_q": COMMON["num_attention_heads"], "attn_k": COMMON["num_key_value_heads"]}
        for g, h in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj"), ("attn_output", "o_proj")):
            put(f"blk.{i}.{g}.weight", p + f"self_attn.{h}.weight", T.Q8_0, permute.get(g, 0) * (arch == "llama"))
        put(f"blk.{i}.ffn_gate_inp.weight", p + "mlp.gate.weight")
        gate_up, down = params[p + "mlp.experts.gate_up_proj"], params[p + "mlp.experts.down_proj"]
        up_type = UP_TYPE[arch, i]
        raw_g, deq_g = _quantized(gate_up[:, :width], T.Q4_0)    # [E, I, H]
        raw_u, deq_u = _quantized(gate_up[:, width:], up_type)
        raw_d, deq_d = _quantized(down, DOWN_TYPE[arch])            # [E, H, I]
        w.add_tensor(f"blk.{i}.ffn_gate_exps.weight", raw_g, raw_dtype=T.Q4_0)
        w.add_tensor(f"blk.{i}.ffn_up_exps.weight", raw_u, raw_dtype=up_type)
        w.add_tensor(f"blk.{i}.ffn_down_exps.weight", raw_d, raw_dtype=DOWN_TYPE[arch])
        with torch.no_grad():
            gate_up.copy_(torch.cat([deq_g, deq_u], dim=1))
            down.copy_(deq_d)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ref.set_experts_implementation("eager")
    return path, width, ref, hf_greedy(ref)


def test_the_experts_are_read_as_stored_bit_equal_to_the_files_weights(moe_file, tmp_path):
    path, width, ref, _ = moe_file
    model, _ = gguf_model.load(path, tmp_path / "cache")
    assert model.config.model_type == ref.config.model_type   # "llama" with experts: Mixtral
    for name, p in ref.named_parameters():   # attention (q / k un-permuted), norms, head: the file's weights
        if "experts" not in name:
            got = model.get_submodule(name.rpartition(".")[0])
            got = got.dequantized() if hasattr(got, "dequantized") else getattr(got, name.rpartition(".")[2])
            assert torch.equal(got, p), name
    for i in range(COMMON["num_hidden_layers"]):
        experts = model.model.layers[i].mlp.experts
        want = ref.model.layers[i].mlp.experts
        assert isinstance(experts, LinearExperts) and experts.num_experts == E
        for e in range(E):
            layer_type = GATE_UP_LAYER[path.name.split("-")[1]]
            assert isinstance(experts.gate_up[e], layer_type) and isinstance(experts.down[e], layer_type)
            assert torch.equal(experts.gate_up[e].dequantized(), want.gate_up_proj[e])
            assert torch.equal(experts.down[e].dequantized(), want.down_proj[e])
        assert torch.equal(model.model.layers[i].mlp.gate.weight, ref.model.layers[i].mlp.gate.weight)
    again, _ = gguf_model.load(path, tmp_path / "cache")   # from the cache: the same experts
    a, b = again.model.layers[1].mlp.experts, model.model.layers[1].mlp.experts
    assert torch.equal(a.gate_up[3].dequantized(), b.gate_up[3].dequantized())
    assert torch.equal(a.down[2].dequantized(), b.down[2].dequantized())


def _fused_run(path, monkeypatch, tmp_path, kind: str):
    from kvfleet.runtime.worker.model_loader import load_model

    monkeypatch.setenv("KVFLEET_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("KVFLEET_CPU_MATMUL", kind)
    monkeypatch.setenv(cpu_decode.ENV, "1")
    monkeypatch.setenv(cpu_decode.PREFILL_ENV, "1")
    loaded = load_model(str(path), dtype="auto", device="cpu")
    engine = LLMEngine(EngineConfig(block_size=4, max_num_batched_tokens=16, kv_cache_memory=4 * 2**20,
                                    quantization=loaded.quantization), [], loaded=loaded)
    fused = engine.runner.cpu_decode
    assert fused is not None and fused.matmul == kind
    layers = fused._fused.weights.layers
    assert all(layer.moe is not None and len(layer.moe.gate_up) == E and layer.moe.top_k == 2 for layer in layers)
    got, _, logprobs = run(engine, [list(p) for p in PROMPTS], GREEDY)
    return got, logprobs


def test_the_file_runs_fused_with_transformers_greedy_tokens(moe_file, monkeypatch, tmp_path):
    """The float32 matmul kind: the int8 weights' products exact, transformers' greedy tokens."""
    path, _, _, expected = moe_file
    got, _ = _fused_run(path, monkeypatch, tmp_path, "float32")
    assert got == expected


BF16_TOLERANCE = {"amx": 1e-1, "avx512_bf16": 1e-1}
"""Largest difference of a sampled token's log-probability from the float32 kind's, per bf16 matmul
kind (activations rounded to bf16; measured on a Xeon with AMX, either kind, while tokens agree:
1.7e-2 Mixtral, 6.2e-2 Qwen3-MoE, whose int8 attention and per-head q / k norms see bf16 inputs;
wrong weights part the tokens at once)."""


@pytest.mark.parametrize("kind", [pytest.param(k, marks=pytest.mark.skipif(not matmul_available(k),
                                                                            reason=f"no {k} kernels here"))
                                  for k in BF16_TOLERANCE])
def test_bf16_matmul_kinds_keep_the_log_probabilities_close(moe_file, monkeypatch, tmp_path, kind):
    """Every step fused on the bf16 matmul kinds: each sampled token's log-probability within
    :data:`BF16_TOLERANCE` of the float32 kind's while their tokens agree; where they part (a near
    tie in a tiny random model: measured once, Qwen3-MoE's second prompt at its 5th token, the two
    tokens' log-probabilities 0.011 apart), the greedy choices' log-probabilities within it too, and
    nothing compared after."""
    path = moe_file[0]
    want, want_lp = _fused_run(path, monkeypatch, tmp_path, "float32")
    got, got_lp = _fused_run(path, monkeypatch, tmp_path, kind)
    compared = 0
    for a, b, la, lb in zip(got, want, got_lp, want_lp):
        for x, y, p, q in zip(a, b, la, lb):
            assert abs(p - q) <= BF16_TOLERANCE[kind], (x, y, p, q)
            compared += 1
            if x != y:
                break
    assert compared >= 2 * GEN


def test_incomplete_experts_are_a_one_line_error(moe_file, tmp_path):
    reader = gguf_model.open_reader(moe_file[0])
    t = next(t for t in reader.tensors if t.name == "blk.0.ffn_down_exps.weight")
    assert gguf_experts.match(t.name) == (0, "down") and gguf_experts.match("blk.0.ffn_down.weight") is None
    model, _ = gguf_model.load(moe_file[0], None)
    assert model.model.layers[0].mlp.experts.gate_up[0].out_features == 2 * moe_file[1]
    with pytest.raises(ValueError, match=r"layer 0: experts tensors incomplete \(missing up"):
        gguf_experts.combine(model, {0: {"gate": [None] * E, "down": [None] * E}})
