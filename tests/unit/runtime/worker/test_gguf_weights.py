"""A GGUF file's own Q4_1 weights on the int4 kernels (runtime/worker/gguf_weights.py): every layer
of the default model matches the float32 weights transformers dequantized from the same file, the
check guards against a layout it does not know, the verified layers are cached, and the default
engine's greedy tokens equal ``--dtype float32``'s (its LM head the file's Q8_0 tensor as grouped int8)."""

from __future__ import annotations

import logging

import pytest
import torch

from kvfleet.runtime.worker import gguf_weights, model_loader
from kvfleet.runtime.worker.woq_linear import Int4Linear, Int8GroupLinear

pytestmark = pytest.mark.skipif(
    not model_loader.cpu_facts().kernels, reason="kvfleet's C kernels do not build on this machine"
)


def _fp32_default():
    return model_loader.load_model(None, dtype="float32", device="cpu").model


def _int4_layers(model) -> dict[str, Int4Linear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, Int4Linear)}


def test_every_q4_1_layer_matches_and_is_cached(tmp_path):
    gguf = model_loader.default_model_path()
    model = _fp32_default()
    want = {n: m.weight.detach().clone() for n, m in model.named_modules() if type(m) is torch.nn.Linear}
    assert gguf_weights.use_q4_1_weights(model, gguf, tmp_path) == 210  # 30 layers x 7 linears
    layers = _int4_layers(model)
    assert len(layers) == 210 and "lm_head" not in layers  # the Q8_0 embedding / LM head stays float32
    for name, layer in layers.items():
        torch.testing.assert_close(layer.dequantized(), want[name], rtol=1e-6, atol=1e-7)
    assert (tmp_path / gguf_weights.CACHE_FILE).is_file()
    assert not list(tmp_path.glob("*.safetensors"))  # other servers load that folder's *.safetensors
    # From the cache: the same layers, without reading the GGUF file again.
    again = _fp32_default()
    assert gguf_weights.use_q4_1_weights(again, gguf, tmp_path) == 210
    for name, layer in _int4_layers(again).items():
        assert torch.equal(layer.weight, layers[name].weight) and torch.equal(layer.qshift, layers[name].qshift)


def test_a_layout_it_does_not_know_keeps_float32(tmp_path, monkeypatch, caplog):
    # Without the un-permutation of the q and k rows, those layers no longer match: kept float32.
    monkeypatch.setattr(gguf_weights, "_unpermute_rows", lambda n, heads: torch.arange(n))
    model = _fp32_default()
    with caplog.at_level(logging.WARNING, logger=gguf_weights.__name__):
        replaced = gguf_weights.use_q4_1_weights(model, model_loader.default_model_path(), tmp_path)
    assert replaced == 210 - 2 * 30
    assert type(model.model.layers[0].self_attn.q_proj) is torch.nn.Linear
    assert "does not match" in caplog.text
    assert not (tmp_path / gguf_weights.CACHE_FILE).exists()  # only a fully verified set is cached


@pytest.mark.slow
def test_the_default_engine_runs_the_files_weights_with_float32_greedy_tokens():
    from kvfleet.runtime.llm import LLM
    from kvfleet.runtime.sampling_params import SamplingParams

    prompts = ["The capital of France is", "def fibonacci(n):", "List the planets of the solar system:"]
    params = SamplingParams(max_tokens=32, temperature=0)
    default = LLM()
    plan = default.llm_engine.loaded.cpu_plan
    assert plan.gguf_q4_1 and plan.weights == "int4"
    # the file's Q8_0 output tensor kept as grouped int8 (exact: the same weights as the float32 head)
    assert isinstance(default.llm_engine.loaded.model.get_output_embeddings(), Int8GroupLinear)
    native = [o.outputs[0].token_ids for o in default.generate(prompts, params)]
    fp32 = [o.outputs[0].token_ids for o in LLM(dtype="float32").generate(prompts, params)]
    assert native == fp32
