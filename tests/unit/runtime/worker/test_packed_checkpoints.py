"""AWQ (GEMM), GPTQ v1 (with and without act-order, symmetric and asymmetric) and compressed-tensors
pack-quantized (W4A16) and int-quantized (W8A8's int8 weights) checkpoints, written here from a reference quantizer in each format's own layout,
loaded by kvfleet (runtime/worker/packed_checkpoints.py through model_loader): every layer's weights
equal the reference's dequantization, the logits equal the dequantized float32 model's, and the
engine's greedy tokens (the fused decoder where the layout allows) equal that model's."""

from __future__ import annotations

import pytest
import torch
from support import packed_writer

from kvfleet.runtime.worker import model_loader, packed_checkpoints
from kvfleet.runtime.worker.woq_linear import Int4Linear, Int8Linear

pytestmark = pytest.mark.skipif(
    not model_loader.cpu_facts().kernels, reason="kvfleet's C kernels do not build on this machine"
)

LINEARS = packed_writer.LINEARS


def _config():
    from transformers import AutoConfig

    return AutoConfig.for_model("llama", hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, vocab_size=49152,
                                initializer_range=0.1, tie_word_embeddings=False, max_position_embeddings=512)


def _write(path, fmt: str, group: int, sym: bool, act_order: bool):
    """A small random Llama checkpoint in ``fmt`` at ``path``; returns the dequantized float32 model."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = _config()
    return packed_writer.write(path, AutoModelForCausalLM.from_config(cfg).float().eval(), fmt, group, sym, act_order)


CASES = [("awq", 32, False, False), ("awq", 128, False, False), ("gptq", 64, True, False),
         ("gptq", 32, False, False), ("gptq", 32, True, True), ("gptq", 64, False, True), ("ct", 32, True, False),
         ("ct", 64, False, False), ("ct8", 0, True, False)]


@pytest.mark.parametrize("fmt,group,sym,act_order", CASES)
def test_a_packed_checkpoint_loads_with_the_reference_weights_and_logits(fmt, group, sym, act_order, tmp_path,
                                                                         smollm2):
    ref = _write(tmp_path, fmt, group, sym, act_order)
    smollm2.tokenizer.save_pretrained(tmp_path)
    loaded = model_loader.load_model(str(tmp_path), device="cpu")
    assert loaded.cpu_plan.packed_int4 and loaded.dtype == torch.float32
    model = loaded.model
    want = dict(ref.named_parameters())
    layers = 0
    for name, module in model.named_modules():
        if isinstance(module, packed_checkpoints.PermutedInt4Linear):
            w = torch.empty_like(want[f"{name}.weight"])
            w[:, module.perm] = module.inner.dequantized()
            assert torch.equal(w, want[f"{name}.weight"]), name
            layers += 1
        elif isinstance(module, Int4Linear) and not name.endswith(".inner"):
            assert torch.equal(module.dequantized(), want[f"{name}.weight"]), name
            layers += 1
        elif isinstance(module, Int8Linear):  # W8A8's int8 weights as stored
            assert torch.equal(module.weight.float() * module.qscale[:, None], want[f"{name}.weight"]), name
            layers += 1
    assert layers == 2 * len(LINEARS)
    assert any(isinstance(m, packed_checkpoints.PermutedInt4Linear) for m in model.modules()) == act_order
    ids = torch.randint(0, 49152, (1, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got, expect = model(ids).logits, ref(ids).logits
    assert (got - expect).abs().max() <= 1e-4 * expect.abs().max()


def test_formats_kvfleet_does_not_read_are_one_line_errors(tmp_path):
    from types import SimpleNamespace as NS

    with pytest.raises(packed_checkpoints.PackedError, match="kvfleet reads 4-bit GEMM packing only"):
        packed_checkpoints.method_of(NS(quantization_config={"quant_method": "awq", "version": "gemv"}), "m")
    with pytest.raises(packed_checkpoints.PackedError, match="v1 packing only"):
        packed_checkpoints.method_of(NS(quantization_config={"quant_method": "gptq", "bits": 8}), "m")
    with pytest.raises(packed_checkpoints.PackedError, match="'bitsandbytes' is not one kvfleet loads"):
        packed_checkpoints.method_of(NS(quantization_config={"quant_method": "bitsandbytes"}), "m")
    assert packed_checkpoints.method_of(NS(), "m") is None
    _write(tmp_path, "awq", 32, False, False)
    with pytest.raises(packed_checkpoints.PackedError, match="runs on the CPU with --dtype auto or float32"):
        model_loader.load_model(str(tmp_path), device="cpu", quantization="int8")


@pytest.mark.slow
@pytest.mark.parametrize("fmt,act_order", [("awq", False), ("gptq", True)])
def test_the_engine_serves_a_packed_checkpoint_with_the_dequantized_models_greedy_tokens(fmt, act_order, tmp_path,
                                                                                         smollm2):
    from kvfleet.runtime.llm import LLM
    from kvfleet.runtime.sampling_params import SamplingParams

    ref = _write(tmp_path, fmt, 32, False, act_order)
    smollm2.tokenizer.save_pretrained(tmp_path)
    llm = LLM(model=str(tmp_path), max_model_len=256)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    fused = llm.llm_engine.runner.cpu_decode is not None
    assert fused == (not act_order)  # the fused decoder runs the int4 layers; an input permutation it has not
    for prompt, out in zip(prompts, outs):
        ids = smollm2.tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            want = ref.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1]:].tolist()
        assert out.outputs[0].token_ids == want, (fmt, fused)
