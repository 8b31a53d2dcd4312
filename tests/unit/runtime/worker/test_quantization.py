"""Weight-only quantization (``--quantization int8|int4``, torchao) and ``--dtype auto``.

A quantized engine gives the greedy tokens of the same model quantized by torchao directly
(``quantize_`` with torchao's own config) and run by plain transformers ``generate``: the
library's own quantized reference. Where kvfleet's AVX2 kernels run (``kernels/cpu_woq``: also
the LM head, int8, and int4 with torchao's tinygemm parameters), the reference quantizes the
same way with torchao and computes with torchao's kernels (int8) or torchao's dequantization
(int4). Start-up errors name ``--quantization``.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from kvfleet.runtime.config import EngineConfig
from kvfleet.runtime.engine.llm_engine import LLMEngine
from kvfleet.runtime.llm import LLM
from kvfleet.runtime.sampling_params import SamplingParams
from kvfleet.runtime.worker import model_loader as ml
from kvfleet.runtime.worker import quantization as q

MAX_TOKENS = 12
PROMPTS = [
    "Hello, my name is",
    "The capital of France is a city that",
    "def fibonacci(n):\n    ",
    "Write a short poem about the sea. " * 3,
]


def _tinygemm_dequantized(weight: torch.Tensor, group_size: int) -> torch.Tensor:
    """torchao's int4 tinygemm quantization of ``weight``, dequantized by torchao."""
    from torchao.quantization.quant_primitives import (
        MappingType,
        _choose_qparams_affine_tinygemm,
        _dequantize_affine_tinygemm,
        _quantize_affine_tinygemm,
    )

    block = [1, group_size]
    scale, zero = _choose_qparams_affine_tinygemm(weight, MappingType.ASYMMETRIC, block, torch.int32, 0, 15, 1e-6,
                                                  None, weight.dtype)
    qdata = _quantize_affine_tinygemm(weight, block, scale, zero, torch.int32, 0, 15)
    return _dequantize_affine_tinygemm(qdata, block, scale, zero, torch.int32, 0, 15)


def _torchao_reference(method: str, kernels: bool) -> list[list[int]]:
    """A plain copy of the default model, quantized with torchao (decoder linears; with
    ``kernels``, kvfleet's AVX2 path, also the LM head as an untied int8 copy), greedy
    ``generate`` one prompt at a time."""
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    ref = ml.load_model(None, dtype="float32", device="cpu")
    model = ref.model
    if kernels:
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone(), requires_grad=False)
        quantize_(model, Int8WeightOnlyConfig(), filter_fn=lambda mod, fqn: fqn == "lm_head")
    if method == "int8":
        config = Int8WeightOnlyConfig()
    elif kernels:
        config = None
        with torch.no_grad():
            for mod in q.decoder_linears(model).values():
                mod.weight.copy_(_tinygemm_dequantized(mod.weight.detach(), 32))
    else:
        from torchao.prototype.quantization.int4 import PrototypeInt4WeightOnlyConfig

        config = PrototypeInt4WeightOnlyConfig(group_size=32)  # quantization.INT4_GROUP_SIZES
    if config is not None:
        quantize_(model, config, filter_fn=lambda mod, fqn: isinstance(mod, torch.nn.Linear) and fqn != "lm_head")
    expected = []
    with torch.inference_mode():
        for prompt in PROMPTS:
            ids = torch.tensor([ref.tokenizer.encode(prompt)])
            out = ref.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                                     do_sample=False)  # fmt: skip
            expected.append(out[0, ids.shape[1] :].tolist())
    return expected


@pytest.mark.slow
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_engine_matches_torchao_reference(smollm2, method):
    engine = LLMEngine(EngineConfig(quantization=method, dtype="float32", device="cpu",
                                    kv_cache_memory=64 * 2**20, max_num_batched_tokens=64))  # fmt: skip
    loaded = engine.loaded
    assert loaded.quantization == method
    layers = q.decoder_linears(loaded.model)
    assert len(layers) == 7 * loaded.model.config.num_hidden_layers  # q, k, v, o, gate, up, down
    assert all(type(m.weight).__name__ != "Parameter" or type(m.weight.data) is not torch.Tensor
               for m in layers.values())  # fmt: skip
    kernels = q.use_cpu_kernels(loaded.model)
    head = loaded.model.get_output_embeddings()
    if kernels:  # the LM head is an untied int8 copy; the input embedding stays fp32
        from kvfleet.runtime.worker.woq_linear import Int4Linear, Int8Linear

        assert isinstance(head, Int8Linear) and head.weight.dtype == torch.int8
        assert all(isinstance(m, Int8Linear if method == "int8" else Int4Linear) for m in layers.values())
        assert loaded.model.get_input_embeddings().weight.dtype == torch.float32
    else:
        assert type(head.weight.data) is torch.Tensor  # the LM head stays fp32
    # Weight bytes: decoder linears 4 -> ~1 (int8) or ~0.6 (int4) bytes per weight; the tied
    # embedding (28M of the 135M parameters) stays fp32 (plus its int8 copy with the kernels).
    fp32 = q.weight_bytes(smollm2.model)
    bound = (0.45 if method == "int8" else 0.38) + (0.06 if kernels else 0.0)
    assert loaded.weight_bytes < bound * fp32, (loaded.weight_bytes, fp32)
    # A decode token reads the untied int8 head, not the fp32 embedding table (one row of it).
    table = loaded.model.get_input_embeddings().weight
    skipped = table.numel() * 4 - table.shape[1] * 4 if kernels else 0
    assert loaded.decode_weight_bytes == loaded.weight_bytes - skipped
    info = engine.cache_config_info()
    assert info["quantization"] == method and info["cache_dtype"] == "float32"
    # Mixed prefill/decode steps (64-token chunks): the paged engine against plain transformers.
    outs = LLM.from_engine(engine).generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                                            use_tqdm=False)  # fmt: skip
    assert [o.outputs[0].token_ids for o in outs] == _torchao_reference(method, kernels)


def test_unknown_quantization_is_refused_naming_the_option():
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(quantization="int3")
    with pytest.raises(ValueError, match=r"^--quantization must be one of int8, int4"):
        q.check_quantization("fp8", torch.device("cpu"), torch.float32)
    from kvfleet.runtime.entrypoints.openai.serve_args import parse_serve_args

    with pytest.raises(SystemExit) as exc:
        parse_serve_args(["--quantization", "int3"], environ={})
    assert exc.value.code == 2
    with pytest.raises(SystemExit):  # environment and config file values are checked too
        parse_serve_args([], environ={"KVFLEET_QUANTIZATION": "awq"})
    assert parse_serve_args(["--quantization", "int4"], environ={}).engine.quantization == "int4"
    assert EngineConfig().quantization is None


def test_unsupported_combinations_are_refused_before_loading(smollm2):
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match=r"^--quantization int4: only on the CPU"):
        q.check_quantization("int4", torch.device("cuda"), torch.bfloat16)
    with pytest.raises(ValueError, match=r"^--quantization int8: not supported with tensor_parallel_size"):
        q.check_quantization("int8", cpu, torch.float32, tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r"^--quantization int8: not supported with tensor_parallel_size"):
        LLMEngine(EngineConfig(quantization="int8", tensor_parallel_size=2, device="cpu", dtype="float32"))
    q.check_quantization(None, cpu, torch.float16)  # nothing asked, nothing checked
    # An engine handed a model loaded without the quantization its config asks for.
    with pytest.raises(ValueError, match=r"^--quantization int8: the engine was given a model loaded with"):
        LLMEngine(EngineConfig(quantization="int8", kv_cache_memory=16 * 2**20), loaded=smollm2)


def test_int4_refuses_a_model_without_a_fitting_group_size(smollm2, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    tiny = LlamaConfig(hidden_size=40, intermediate_size=80, num_hidden_layers=1, num_attention_heads=2,
                       num_key_value_heads=2, vocab_size=smollm2.model.config.vocab_size)  # fmt: skip
    LlamaForCausalLM(tiny).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"^--quantization int4: the model's linear input sizes \[40, 80\]"):
        ml.load_model(str(tmp_path), tokenizer=smollm2.source, dtype="float32", device="cpu", quantization="int4")
    loaded = ml.load_model(str(tmp_path), tokenizer=smollm2.source, dtype="float32", device="cpu",
                           quantization="int8")  # fmt: skip
    assert loaded.quantization == "int8"


def test_serve_prints_the_quantization_error_and_exits_1(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "KVFLEET_PORT": "0"}
    done = subprocess.run([sys.executable, "-m", "kvfleet.runtime.cli", "serve", "--log-level", "warning",
                           "--quantization", "int8", "--tensor-parallel-size", "2", "--device", "cpu"],
                          env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 1, done.stderr[-3000:]
    line = next(ln for ln in done.stderr.splitlines() if "the engine failed to start" in ln)
    assert "ValueError: --quantization int8: not supported with tensor_parallel_size > 1" in line
    bad = subprocess.run([sys.executable, "-m", "kvfleet.runtime.cli", "serve", "--quantization", "int3"],
                         env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert bad.returncode == 2 and "--quantization" in bad.stderr


# --- dtype auto ------------------------------------------------------------------------

def test_dtype_auto_is_float32_on_the_cpu_with_or_without_quantization():
    """The CPU plan (tests/test_cpu_plan.py: every recorded CPU): float32 activations, the fused
    decoder's; an explicit dtype wins."""
    cpu = torch.device("cpu")
    for method in (None, *q.QUANTIZATIONS):
        assert ml.resolve_dtype("auto", cpu, method) == torch.float32
    assert ml.resolve_dtype("float32", cpu) == torch.float32
    # explicit bf16: bf16 weight storage with float32 compute where the C kernels run, else bf16
    kernels = ml.cpu_facts().kernels and ml.cpu_features.detect().isa_level is not None
    assert ml.resolve_dtype("bfloat16", cpu) == (torch.float32 if kernels else torch.bfloat16)
    assert EngineConfig().dtype == "auto"


@pytest.mark.slow
def test_bf16_engine_is_visible_and_logits_stay_fp32(monkeypatch, caplog):
    """An explicit ``--dtype bfloat16`` on the CPU: with kvfleet's C kernels, bf16 weight storage
    and float32 activations and KV cache (the fused decoder keeps running); without them, bf16
    weights and KV cache through torch. The plan is logged, the cache dtype is in
    ``cache_config_info``; the sampler gets float32 logits either way."""
    with caplog.at_level("INFO", logger="kvfleet.runtime.worker.model_loader"):
        engine = LLMEngine(EngineConfig(device="cpu", dtype="bfloat16", kv_cache_memory=16 * 2**20))
    if engine.loaded.cpu_plan.bf16_weights:
        assert "CPU plan: activations float32, weights bf16, fused decoder expected" in caplog.text
        assert engine.loaded.dtype == torch.float32 and engine.cache_config_info()["cache_dtype"] == "float32"
        model = engine.loaded.model
        assert torch.bfloat16 in {t.dtype for t in [*model.parameters(), *model.buffers()]}
    else:
        assert "CPU plan: activations bfloat16, weights bf16, fused decoder off" in caplog.text
        assert engine.loaded.dtype == torch.bfloat16 and engine.cache_config_info()["cache_dtype"] == "bfloat16"
    seen = []
    real = engine.runner.sampler

    def sampler(logits, requests):
        seen.append(logits.dtype)
        return real(logits, requests)

    monkeypatch.setattr(engine.runner, "sampler", sampler)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    out = LLM.from_engine(engine).chat(chat, SamplingParams(temperature=0, max_tokens=16))
    assert "Paris" in out[0].outputs[0].text
    assert seen and set(seen) == {torch.float32}
