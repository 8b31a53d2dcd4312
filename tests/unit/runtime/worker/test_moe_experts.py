"""Mixture of experts on the CPU (kvfleet.runtime.worker.moe_experts and the fused path's MoE
layers): a small random Mixtral (4 experts, top-2) and Qwen3-MoE, saved and loaded as the engine
loads any model.

- :class:`LinearExperts` computes bitwise what transformers' eager experts compute, over views of
  the same weights; float32 models keep transformers' experts, whose 3-D weights the fused path
  reads as views;
- Mixtral runs on the fused decoder (asserted: its steps go through the C step, its layers carry
  experts) with transformers' greedy tokens (``generate``, float32), fused prefill off and on;
- ``--quantization int8/int4`` and bf16 weights turn the experts into the same kernel layers as
  the dense ones, and the fused path reads them: the greedy tokens and log-probabilities (within
  1e-4) of transformers' modules over the same weights;
- the bf16 matmul kinds this CPU has: log-probabilities close to the float32 kernels', tolerance
  per kind;
- Qwen3-MoE (per-head q/k norms, a dense layer beside the MoE one) on the fused path with
  transformers' greedy tokens.
"""

from __future__ import annotations

import copy

import pytest
import torch
from support.engine_workload import Recorder, count_fused_rows, run
from support.tiny_models import COMMON, GEN, PROMPTS, build, hf_greedy

from kvfleet.kernels import cpu_woq
from kvfleet.kernels.cpu_decoder import matmul_available
from kvfleet.runtime.config import EngineConfig
from kvfleet.runtime.engine.llm_engine import LLMEngine
from kvfleet.runtime.sampling_params import SamplingParams
from kvfleet.runtime.worker import cpu_decode
from kvfleet.runtime.worker.model_loader import load_model
from kvfleet.runtime.worker.moe_experts import LinearExperts, split_experts

pytestmark = pytest.mark.skipif(not cpu_woq.available(), reason="AVX2/FMA kernels unavailable here")

MOE = dict(COMMON, initializer_range=0.1)
CONFIG = dict(block_size=4, max_num_batched_tokens=16, kv_cache_memory=4 * 2**20)
GREEDY = SamplingParams(temperature=0, max_tokens=GEN, ignore_eos=True, logprobs=0)


def _config(model_type: str):
    from transformers import AutoConfig

    if model_type == "mixtral":
        return AutoConfig.for_model("mixtral", num_local_experts=4, num_experts_per_tok=2, **MOE)
    return AutoConfig.for_model("qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                                norm_topk_prob=True, head_dim=16, mlp_only_layers=[1], **MOE)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """model type -> (checkpoint dir, transformers' eager reference model, its greedy tokens)."""
    out = {}
    for model_type in ("mixtral", "qwen3_moe"):
        path = tmp_path_factory.mktemp(model_type)
        ref = build(_config(model_type), path)
        ref.set_experts_implementation("eager")
        out[model_type] = (path, ref, hf_greedy(ref))
    return out


def _engine(loaded, monkeypatch, fused: bool = True, prefill: str = "0") -> LLMEngine:
    monkeypatch.setenv(cpu_decode.ENV, "1" if fused else "0")
    monkeypatch.setenv(cpu_decode.PREFILL_ENV, prefill)
    return LLMEngine(EngineConfig(**CONFIG, quantization=loaded.quantization), [Recorder()], loaded=loaded)


def _counting(monkeypatch) -> list[int]:
    return count_fused_rows(monkeypatch)


def test_linear_experts_compute_what_transformers_computes(checkpoints):
    """Over views of the fused 3-D weights (no copy), bitwise transformers' eager experts."""
    _, ref, _ = checkpoints["mixtral"]
    block = copy.deepcopy(ref.model.layers[0].mlp)
    experts = block.experts
    split = LinearExperts.from_fused(experts)
    assert split.gate_up[2].weight.data_ptr() == experts.gate_up_proj[2].data_ptr()
    assert split.down[3].weight.data_ptr() == experts.down_proj[3].data_ptr()
    x = torch.randn(9, MOE["hidden_size"], generator=torch.Generator().manual_seed(0))
    _, weights, index = block.gate(x)
    assert len(index.unique()) == 4  # every expert has tokens
    with torch.no_grad():
        assert torch.equal(split(x, index, weights), experts(x, index, weights))
    assert split_experts(block) == 1 and isinstance(block.experts, LinearExperts)


def test_mixtral_runs_fused_with_transformers_greedy_tokens(checkpoints, monkeypatch):
    """Decode steps fused (prefill in torch, the float32 kernels' default), then every step fused:
    the greedy tokens of transformers' ``generate`` in float32."""
    path, _, expected = checkpoints["mixtral"]
    loaded = load_model(str(path), dtype="float32", device="cpu")
    experts = loaded.model.model.layers[0].mlp.experts
    assert not isinstance(experts, LinearExperts)   # float32: transformers' module, its 3-D weights read as views
    for prefill in ("0", "1"):
        rows = _counting(monkeypatch)
        engine = _engine(loaded, monkeypatch, prefill=prefill)
        path_ = engine.runner.cpu_decode
        assert path_ is not None and path_.prefill == (prefill == "1")
        moes = [layer.moe for layer in path_._fused.weights.layers]
        assert all(m is not None and len(m.gate_up) == 4 and m.top_k == 2 and m.norm_topk_prob for m in moes)
        assert moes[0].gate_up[1].w.data_ptr() == experts.gate_up_proj[1].data_ptr()
        got, _, _ = run(engine, [list(p) for p in PROMPTS], GREEDY)
        assert got == expected, prefill
        assert len(rows) >= GEN - 1 and max(rows) > 1   # the decode steps of all three ran fused
        if prefill == "1":
            assert sum(rows) == sum(len(p) for p in PROMPTS) + len(PROMPTS) * (GEN - 1)   # every token fused


@pytest.mark.parametrize("weights", ["int8", "int4", "bf16"])
def test_quantized_and_bf16_experts_stay_on_the_fused_path(checkpoints, monkeypatch, weights):
    """The experts become the kernels' layers like the dense ones (``--quantization``, bf16
    storage) and the fused path reads them: transformers' modules over the same weights give the
    same greedy tokens and log-probabilities within 1e-4."""
    from kvfleet.runtime.worker.woq_linear import Bf16Linear, Int4Linear, Int8Linear, to_bf16_weights

    path, _, _ = checkpoints["mixtral"]
    if weights == "bf16":
        loaded = load_model(str(path), dtype="float32", device="cpu")
        to_bf16_weights(loaded.model)
    else:
        loaded = load_model(str(path), dtype="float32", device="cpu", quantization=weights)
    kind = {"int8": Int8Linear, "int4": Int4Linear, "bf16": Bf16Linear}[weights]
    experts = loaded.model.model.layers[1].mlp.experts
    assert all(isinstance(m, kind) for m in (*experts.gate_up, *experts.down))
    assert loaded.model.model.layers[1].mlp.gate.weight.dtype == torch.float32   # the router stays float32
    batch = [list(p) for p in PROMPTS]
    expected, _, expected_lp = run(_engine(loaded, monkeypatch, fused=False), batch, GREEDY)
    engine = _engine(loaded, monkeypatch)
    assert engine.runner.cpu_decode is not None
    moe = engine.runner.cpu_decode._fused.weights.layers[1].moe
    assert {m.fmt for m in (*moe.gate_up, *moe.down)} == {weights}
    got, _, got_lp = run(engine, batch, GREEDY)
    assert got == expected
    worst = max(abs(x - y) for a, b in zip(got_lp, expected_lp) for x, y in zip(a, b))
    assert worst <= 1e-4, worst


BF16_TOLERANCE = {"amx": 3e-2, "avx512_bf16": 3e-2}
"""Largest difference of a sampled token's log-probability from the float32 kernels', per bf16
matmul kind, every step fused (measured on a Xeon with AMX: see the test's docstring)."""


@pytest.mark.parametrize("kind", [pytest.param(k, marks=pytest.mark.skipif(not matmul_available(k),
                                                                            reason=f"no {k} kernels here"))
                                  for k in BF16_TOLERANCE])
def test_bf16_matmul_kinds_keep_the_log_probabilities_close(checkpoints, monkeypatch, kind):
    """Every step fused on the bf16 matmul kinds (activations and weights rounded to bf16, the
    router float32): each sampled token's log-probability within :data:`BF16_TOLERANCE` of the
    float32 kernels' (measured 1.6e-2 with either kind on a Xeon with AMX, over 3 x 10 tokens)."""
    path, _, _ = checkpoints["mixtral"]
    loaded = load_model(str(path), dtype="float32", device="cpu")
    batch = [list(p) for p in PROMPTS]
    _, _, expected_lp = run(_engine(loaded, monkeypatch, prefill="1"), batch, GREEDY)
    monkeypatch.setattr(cpu_decode, "matmul_asked", lambda runner: kind)
    engine = _engine(loaded, monkeypatch, prefill="1")
    assert engine.runner.cpu_decode.matmul == kind
    _, _, got_lp = run(engine, batch, GREEDY)
    worst = max(abs(x - y) for a, b in zip(got_lp, expected_lp) for x, y in zip(a, b))
    assert worst <= BF16_TOLERANCE[kind], worst


def test_qwen3_moe_runs_fused_with_transformers_greedy_tokens(checkpoints, monkeypatch):
    """Qwen3-MoE (per-head q/k norms, ``norm_topk_prob``; layer 1 dense through ``mlp_only_layers``,
    128 wide beside experts of 64): every step fused, the greedy tokens of transformers' ``generate``."""
    from kvfleet.runtime.worker.moe_experts import moe_layer

    path, _, expected = checkpoints["qwen3_moe"]
    loaded = load_model(str(path), dtype="float32", device="cpu")
    block = loaded.model.model.layers[0].mlp
    moe = moe_layer(block, cpu_decode._linear)
    assert moe.top_k == 2 and moe.norm_topk_prob and moe.intermediate == 64
    rows = _counting(monkeypatch)
    engine = _engine(loaded, monkeypatch, prefill="1")
    layers = engine.runner.cpu_decode._fused.weights.layers
    assert layers[0].moe is not None and layers[1].moe is None and layers[1].gate_up.shape == (256, 64)
    assert layers[0].q_norm is not None
    got, _, _ = run(engine, [list(p) for p in PROMPTS], GREEDY)
    assert got == expected
    assert sum(rows) == sum(len(p) for p in PROMPTS) + len(PROMPTS) * (GEN - 1)   # every token fused
