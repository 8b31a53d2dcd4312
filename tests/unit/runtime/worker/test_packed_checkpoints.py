"""AWQ (GEMM), GPTQ v1 (with and without act-order, symmetric and asymmetric) and compressed-tensors
pack-quantized (W4A16) and int-quantized (W8A8's int8 weights) checkpoints, written here from a reference quantizer in each format's own layout,
loaded by kvfleet (runtime/worker/packed_checkpoints.py through model_loader): every layer's weights
equal the reference's dequantization, the logits equal the dequantized float32 model's (its LM head
rounded to bf16 where the CPU plan stores the checkpoint's unquantized head so: CPUs with native
bf16), and the engine's greedy tokens (on the fused decoder's float32 kernels) equal that model's. An act-order GPTQ checkpoint runs
on the fused decoder with its input permutations (kernels/cpu_perm.h): its logits, with every
matmul kind, equal the dequantized model's (float32 kernels: to rounding; bf16 matmuls: within a
tenth of the quantization's own error) and the torch PermutedInt4Linear path's; layers of one
input quantized in different orders keep the fused path off, with the reason logged."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from support import packed_writer

from kvfleet.kernels.cpu_decoder import FusedDecoder, matmul_available
from kvfleet.runtime.worker import model_loader, packed_checkpoints
from kvfleet.runtime.worker.cpu_decode import matmul_asked
from kvfleet.runtime.worker.woq_linear import Bf16Linear, Int4Linear, Int8Linear

pytestmark = pytest.mark.skipif(
    not model_loader.cpu_facts().kernels, reason="kvfleet's C kernels do not build on this machine"
)

LINEARS = packed_writer.LINEARS


def _config():
    from transformers import AutoConfig

    return AutoConfig.for_model("llama", hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, vocab_size=49152,
                                initializer_range=0.1, tie_word_embeddings=False, max_position_embeddings=512)


def _original():
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(_config()).float().eval()


def _write(path, fmt: str, group: int, sym: bool, act_order: bool, **kw):
    """A small random Llama checkpoint in ``fmt`` at ``path``; returns the dequantized float32 model."""
    return packed_writer.write(path, _original(), fmt, group, sym, act_order, **kw)


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
    # the unquantized LM head: bf16 where the plan stores it so (CPUs with native bf16), else float32 as stored
    head = model.get_output_embeddings()
    assert type(head) is (Bf16Linear if loaded.cpu_plan.bf16_weights else torch.nn.Linear)
    ref = _plan_head(ref, loaded.cpu_plan)
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


def test_a_g_idx_out_of_range_or_a_truncated_file_is_a_one_line_error(tmp_path):
    """A g_idx naming a group the scales do not have, and a safetensors file cut short, are
    PackedErrors naming the layer / file (were an IndexError and safetensors' own error)."""
    from safetensors.torch import load_file, save_file

    _write(tmp_path, "gptq", 32, False, True)
    cfg = _config()
    cfg.quantization_config = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True}
    st = tmp_path / "model.safetensors"
    good = st.read_bytes()
    tensors = load_file(str(st))
    key = "model.layers.1.self_attn.q_proj.g_idx"
    tensors[key] = tensors[key].clone()
    tensors[key][0] = 999
    save_file(tensors, str(st))
    with pytest.raises(packed_checkpoints.PackedError, match=r"layers\.1\.self_attn\.q_proj: g_idx must hold 128 "
                                                             r"group indices in 0\.\.3"):
        packed_checkpoints.load(tmp_path, cfg)
    st.write_bytes(good[: len(good) // 2])
    with pytest.raises(packed_checkpoints.PackedError, match="model.safetensors: not a readable safetensors file"):
        packed_checkpoints.load(tmp_path, cfg)


def test_a_config_the_tensors_contradict_is_refused_or_read_as_stored(tmp_path):
    """A group_size the scales do not match (was read silently, the kernels indexing past the
    scales), an act-order checkpoint missing a layer's g_idx (was taken for groups in order: wrong
    weights) are PackedErrors naming the folder and layer; compressed-tensors zero points stored
    under ``symmetric: true`` are used, as its own decompressor does (were ignored: wrong weights)."""
    from safetensors.torch import load_file, save_file

    _write(tmp_path, "gptq", 32, False, True)
    cfg = _config()
    cfg.quantization_config = {"quant_method": "gptq", "bits": 4, "group_size": 64, "desc_act": True}
    with pytest.raises(packed_checkpoints.PackedError, match=rf"^{tmp_path}: model\.layers\.\d\.\S+: "
                                                             "quantization_config's group_size 64 does not match"):
        packed_checkpoints.load(tmp_path, cfg)
    cfg.quantization_config["group_size"] = 32
    st = tmp_path / "model.safetensors"
    tensors = load_file(str(st))
    del tensors["model.layers.1.mlp.down_proj.g_idx"]
    save_file(tensors, str(st))
    with pytest.raises(packed_checkpoints.PackedError, match=r"layers\.1\.mlp\.down_proj: the checkpoint is "
                                                             "act-order .* no g_idx"):
        packed_checkpoints.load(tmp_path, cfg)
    cfg.quantization_config["desc_act"] = False  # without act-order a missing g_idx means groups in order
    packed_checkpoints.load(tmp_path, cfg)

    ct = tmp_path / "ct"
    ct.mkdir()
    ref = _write(ct, "ct", 32, False, False)
    cfg.quantization_config = {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {
        "group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                                       "strategy": "group", "group_size": 32}}}}
    model = packed_checkpoints.load(ct, cfg)
    layer = model.get_submodule("model.layers.0.self_attn.q_proj")
    assert torch.equal(layer.dequantized(), ref.get_submodule("model.layers.0.self_attn.q_proj").weight)


def _plan_head(ref, plan):
    """``ref`` (the dequantized float32 model) with its LM head as the plan stores a packed
    checkpoint's: rounded to bf16 (nearest even) where ``plan.bf16_weights``, else itself."""
    if not plan.bf16_weights:
        return ref
    ref = copy.deepcopy(ref)
    head = ref.get_output_embeddings()
    head.weight = torch.nn.Parameter(head.weight.detach().to(torch.bfloat16).float(), requires_grad=False)
    return ref


def _engine(path, monkeypatch):
    from kvfleet.runtime.config import EngineConfig
    from kvfleet.runtime.engine.llm_engine import LLMEngine

    monkeypatch.setenv("KVFLEET_CPU_DECODER", "1")
    return LLMEngine(EngineConfig(num_blocks=8, max_num_batched_tokens=32),
                     loaded=model_loader.load_model(str(path), device="cpu"))


@pytest.fixture(scope="module")
def act_order(tmp_path_factory, smollm2):
    """An act-order GPTQ checkpoint (asymmetric, groups of 32), the float32 model it quantizes, its
    dequantized float32 model, an engine over the checkpoint and a plain load of it (the torch path)."""
    path = tmp_path_factory.mktemp("gptq-act")
    original = _original()
    ref = packed_writer.write(path, copy.deepcopy(original), "gptq", 32, False, True)
    smollm2.tokenizer.save_pretrained(path)
    with pytest.MonkeyPatch.context() as mp:
        eng = _engine(path, mp)
    return path, original, _plan_head(ref, eng.loaded.cpu_plan), eng, model_loader.load_model(str(path),
                                                                                             device="cpu").model


BF16 = [pytest.param(k, marks=pytest.mark.skipif(not matmul_available(k), reason=f"no {k} kernels here"))
        for k in ("avx512_bf16", "amx")]


@pytest.mark.parametrize("kind", ["float32", *BF16])
def test_an_act_order_checkpoint_runs_fused_with_the_dequantized_models_logits(act_order, kind):
    _, original, ref, eng, plain = act_order
    path = eng.runner.cpu_decode
    assert path is not None, "the fused decoder is off for the act-order checkpoint"
    weights = path._fused.weights
    plan = eng.loaded.cpu_plan   # as served: the plan's matmul kind ($KVFLEET_CPU_MATMUL's), its head bf16 where
    assert path.matmul == matmul_asked(eng.runner)
    assert weights.head.fmt == ("bf16" if plan.bf16_weights else "fp32")
    assert all(m.perm is not None for layer in weights.layers for m in (layer.qkv, layer.o, layer.gate_up, layer.down))
    fused = FusedDecoder(weights, threads=2, matmul=kind)
    assert fused.matmul == kind
    T = 24
    ids = torch.randint(0, 49152, (T,), generator=torch.Generator().manual_seed(2))
    x = path._embed(ids).float().contiguous()
    cos, sin = path._rope(x, torch.arange(T)[None])
    block = weights.layers[0].k_cache.shape[1]
    tables = torch.arange((T + block - 1) // block, dtype=torch.int32).repeat(T, 1).contiguous()
    _, got = fused.step(x, cos, sin, torch.arange(T), tables, torch.arange(1, T + 1, dtype=torch.int32))
    with torch.no_grad():
        deq, torch_path, full = (m(ids[None]).logits[0] for m in (ref, plain, original))
    scale = deq.abs().max()
    assert (torch_path - deq).abs().max() <= 1e-4 * scale   # PermutedInt4Linear through torch
    quant_error = (full - deq).abs().max()
    err = (got - deq).abs().max()
    if kind == "float32" and weights.layers[0].k_cache.dtype == torch.float32:   # the same sums in another order
        assert err <= 1e-4 * scale and (got - torch_path).abs().max() <= 1e-4 * scale
    else:   # activations and weights rounded to bf16, or keys and values (the bf16 cache of the plan's bf16 kinds)
        assert err <= 0.1 * quant_error, (float(err), float(quant_error))


def test_layers_of_one_input_in_different_orders_keep_the_fused_path_off(tmp_path, smollm2, monkeypatch, caplog):
    _write(tmp_path, "gptq", 32, True, True, shared_orders=False)
    smollm2.tokenizer.save_pretrained(tmp_path)
    with caplog.at_level(logging.INFO, logger="kvfleet.runtime.worker.cpu_decode"):
        eng = _engine(tmp_path, monkeypatch)
    assert eng.runner.cpu_decode is None
    assert "layer 0: act-order layers with different input permutations cannot be one matrix" in caplog.text


@pytest.mark.slow
@pytest.mark.parametrize("fmt,act_order", [("awq", False), ("gptq", True)])
def test_the_engine_serves_a_packed_checkpoint_with_the_dequantized_models_greedy_tokens(fmt, act_order, tmp_path,
                                                                                         smollm2, monkeypatch):
    """Exact tokens on the float32 kernels (``$KVFLEET_CPU_MATMUL=float32``; the bf16 kinds' logits are
    checked within the quantization's error above), the reference's head as the plan stores it."""
    from kvfleet.runtime.llm import LLM
    from kvfleet.runtime.sampling_params import SamplingParams

    ref = _write(tmp_path, fmt, 32, False, act_order)
    smollm2.tokenizer.save_pretrained(tmp_path)
    monkeypatch.setenv("KVFLEET_CPU_MATMUL", "float32")
    llm = LLM(model=str(tmp_path), max_model_len=256)
    ref = _plan_head(ref, llm.llm_engine.loaded.cpu_plan)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    fused = llm.llm_engine.runner.cpu_decode is not None
    assert fused  # the fused decoder runs the int4 layers, act-order ones with their input permutations
    for prompt, out in zip(prompts, outs):
        ids = smollm2.tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            want = ref.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1]:].tolist()
        assert out.outputs[0].token_ids == want, (fmt, fused)


def test_lora_adapters_on_an_act_order_checkpoint_run_fused_with_the_merged_models_tokens(act_order, tmp_path,
                                                                                         monkeypatch, smollm2):
    """--enable-lora on an act-order GPTQ checkpoint: the adapters wrap each act-order layer (their
    input in natural order), the fused decoder builds (was an AttributeError at start: the LoRA
    wrapper sat on the layer's inner int4 layer), and base and adapter rows in one batch give the
    greedy tokens of the dequantized model, without and with the adapter merged."""
    import json

    from safetensors.torch import save_file

    from kvfleet.runtime.llm import LLM
    from kvfleet.runtime.sampling_params import SamplingParams
    from kvfleet.runtime.worker.lora_layers import LoRALinear

    path, _, ref, _, _ = act_order
    gen = torch.Generator().manual_seed(3)
    merged = copy.deepcopy(ref)
    tensors = {}
    for name, module in merged.named_modules():
        if any(name.endswith(lin) for lin in LINEARS):
            n, k = module.weight.shape
            a, b = torch.randn(8, k, generator=gen) / k**0.5, torch.randn(n, 8, generator=gen) * 0.3
            tensors[f"base_model.model.{name}.lora_A.weight"], tensors[f"base_model.model.{name}.lora_B.weight"] = a, b
            with torch.no_grad():
                module.weight += 2.0 * (b @ a)   # lora_alpha 16 / r 8
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    save_file(tensors, str(adapter / "adapter_model.safetensors"))
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8, "lora_alpha": 16, "bias": "none",
                                                             "target_modules": [n.split(".")[-1] for n in LINEARS]}))
    monkeypatch.setenv("KVFLEET_CPU_DECODER", "1")
    monkeypatch.setenv("KVFLEET_CPU_MATMUL", "float32")
    llm = LLM(model=str(path), max_model_len=256, enable_lora=True, max_lora_rank=8, lora_modules=[f"a={adapter}"])
    q = llm.llm_engine.runner.model.model.layers[0].self_attn.q_proj
    assert isinstance(q, LoRALinear) and isinstance(q.base_layer, packed_checkpoints.PermutedInt4Linear)
    assert llm.llm_engine.runner.cpu_decode is not None
    adapter_rows = []
    step = FusedDecoder.step

    def recording(self, *args, **kw):
        lora_slots = kw.get("lora_slots", args[7] if len(args) > 7 else None)
        adapter_rows.append(0 if lora_slots is None else int((lora_slots >= 0).sum()))
        return step(self, *args, **kw)

    monkeypatch.setattr(FusedDecoder, "step", recording)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    outs = llm.generate(prompts * 2, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
                        lora_request=[None, None, "a", "a"], use_tqdm=False)
    assert sum(adapter_rows) > 0  # adapter rows ran in the C step
    for i, (model, out) in enumerate(zip([ref, ref, merged, merged], outs)):
        ids = smollm2.tokenizer(prompts[i % 2], return_tensors="pt").input_ids
        with torch.no_grad():
            want = model.generate(ids, max_new_tokens=6, do_sample=False)[0, ids.shape[1]:].tolist()
        assert list(out.outputs[0].token_ids) == want, i
    assert outs[0].outputs[0].token_ids != outs[2].outputs[0].token_ids
