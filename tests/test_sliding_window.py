"""Sliding-window and soft-capped attention through the whole engine, against transformers.

Tiny randomly initialised transformers models (no download) are built from configs, saved
with ``save_pretrained`` into a temporary checkpoint directory (with a small word-level
tokenizer), loaded with kvfleet's loader (``--model <dir>``) and served by the engine with
blocks smaller than the window and chunked prefill; their greedy tokens for prompts longer
than the window must equal ``model.generate`` of transformers with its own eager attention:

- Mistral: ``sliding_window=8`` on every layer (no ``layer_types``);
- Qwen2: ``use_sliding_window`` with ``max_window_layers=1`` (layer 0 full, layer 1 sliding);
- Gemma 2: alternating sliding/full layers, ``attn_logit_softcapping``,
  ``final_logit_softcapping`` and ``query_pre_attn_scalar``.

Each case also checks that the feature matters (a copy of the weights without the window,
or without the cap, generates other tokens), so the comparison cannot pass vacuously.
Configs with attention features the paged kernels lack are refused at load with a
ValueError naming the config field (before any weight is read), and a model whose attention
modules pass what the config does not reveal (gpt-oss's attention sinks) is refused when the
engine starts.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

from kvfleet.kernels import BACKEND_ENV

VOCAB = 96
GEN = 10
# Token-id prompts (29, 21 and 12 tokens) longer than the window of 8.
PROMPTS = [[(7 * i + 3) % (VOCAB - 2) + 2 for i in range(29)], [(5 * i + 11) % (VOCAB - 2) + 2 for i in range(21)],
           [(3 * i + 1) % (VOCAB - 2) + 2 for i in range(12)]]
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.3, tie_word_embeddings=False,
              bos_token_id=0, eos_token_id=1, pad_token_id=1)


def _configs():
    from transformers import Gemma2Config, MistralConfig, Qwen2Config

    return {
        "mistral": MistralConfig(sliding_window=8, **COMMON),
        "qwen2": Qwen2Config(use_sliding_window=True, sliding_window=8, max_window_layers=1, **COMMON),
        "gemma2": Gemma2Config(sliding_window=8, head_dim=16, query_pre_attn_scalar=24, attn_logit_softcapping=2.0,
                               final_logit_softcapping=3.0, **COMMON),
    }


def _save_tokenizer(path) -> None:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    vocab = {"<s>": 0, "</s>": 1, **{f"w{i}": i for i in range(2, VOCAB)}}
    tok = Tokenizer(WordLevel(vocab, unk_token="</s>"))
    tok.pre_tokenizer = WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="</s>").save_pretrained(
        path)


def _build(config, path, seed: int = 0):
    """A randomly initialised model of ``config`` saved (with a tokenizer) at ``path``; returns
    the eager-attention transformers model that serves as the reference."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = copy.deepcopy(config)
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    model.save_pretrained(path)
    _save_tokenizer(path)
    return model


def _hf_greedy(model, prompts=PROMPTS, n: int = GEN) -> list[list[int]]:
    """transformers' own greedy ``generate`` (eager attention, its own mask), one prompt at
    a time, never stopping early."""
    model.generation_config.eos_token_id = None
    out = []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.no_grad():
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                                 min_new_tokens=n, pad_token_id=1)
        out.append(gen[0, len(p):].tolist())
    return out


def _engine_greedy(path, *, block_size: int = 4, max_num_batched_tokens: int = 16, prompts=PROMPTS,
                   n: int = GEN) -> list[list[int]]:
    from kvfleet.runtime.config import EngineConfig
    from kvfleet.runtime.engine import LLMEngine
    from kvfleet.runtime.llm import LLM
    from kvfleet.runtime.model_loader import load_model
    from kvfleet.runtime.sampling_params import SamplingParams

    loaded = load_model(str(path), dtype="float32", device="cpu")
    engine = LLMEngine(EngineConfig(block_size=block_size, max_num_batched_tokens=max_num_batched_tokens,
                                    kv_cache_memory=4 * 2**20), loaded=loaded)
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    outs = LLM.from_engine(engine).generate([list(p) for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> (checkpoint dir, eager reference model, the same weights' reference tokens
    without the feature under test)."""
    out = {}
    for name, config in _configs().items():
        path = tmp_path_factory.mktemp(name)
        ref = _build(config, path)
        plain = copy.deepcopy(config)
        plain.sliding_window = None
        if name == "gemma2":  # every layer full, and no attention soft-capping
            plain.sliding_window = 4096  # Gemma 2 always builds its sliding mask
            plain.layer_types = ["full_attention"] * plain.num_hidden_layers
            plain.attn_logit_softcapping = None
        elif hasattr(plain, "layer_types"):
            plain.layer_types = ["full_attention"] * plain.num_hidden_layers
        from transformers import AutoModelForCausalLM

        plain._attn_implementation = "eager"
        plain_model = AutoModelForCausalLM.from_config(plain, attn_implementation="eager").eval()
        plain_model.load_state_dict(ref.state_dict())
        out[name] = (path, ref, _hf_greedy(plain_model))
    return out


def test_layer_windows_follow_the_config():
    from kvfleet.runtime.attention import check_attention_support, layer_sliding_windows

    cfgs = _configs()
    assert layer_sliding_windows(cfgs["mistral"]) == [8, 8]
    assert layer_sliding_windows(cfgs["qwen2"]) == [None, 8]
    assert check_attention_support(cfgs["gemma2"]) == [8, None]
    from transformers import MistralConfig, Qwen2Config

    assert layer_sliding_windows(MistralConfig(sliding_window=None, **COMMON)) == [None, None]
    assert layer_sliding_windows(Qwen2Config(use_sliding_window=False, sliding_window=8, **COMMON)) == [None, None]


@pytest.mark.parametrize("name", ["mistral", "qwen2", "gemma2"])
def test_engine_greedy_equals_transformers_generate(models, name, monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, "torch")
    path, ref, plain_tokens = models[name]
    expected = _hf_greedy(ref)
    assert expected != plain_tokens, "the window/soft-cap does not change this model's tokens: the test is vacuous"
    # Blocks of 4 < window 8; 16-token steps: the 29- and 21-token prompts are prefilled in chunks.
    assert _engine_greedy(path) == expected
    # A block larger than the window, and the whole prompt in one step.
    assert _engine_greedy(path, block_size=16, max_num_batched_tokens=256) == expected


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mistral", "gemma2"])
def test_engine_greedy_with_triton_kernels(models, name, monkeypatch):
    # The Triton kernel (interpreted on CPU) in the engine: same tokens as transformers.
    from kvfleet.kernels.testing import triton_kernels

    path, ref, _ = models[name]
    expected = _hf_greedy(ref, prompts=PROMPTS[:2], n=4)
    with triton_kernels(interpret=not torch.cuda.is_available()) as (_, attn_mod):
        calls = []
        real = attn_mod.paged_attention_triton

        def counting(*args, **kwargs):
            calls.append(kwargs.get("sliding_window"))
            return real(*args, **kwargs)

        monkeypatch.setattr(attn_mod, "paged_attention_triton", counting)
        monkeypatch.setenv(BACKEND_ENV, "triton")
        got = _engine_greedy(path, prompts=PROMPTS[:2], n=4)
    assert 8 in calls, "the Triton kernel never ran a sliding-window layer"
    assert got == expected


REFUSED = [
    ("FalconConfig", dict(alibi=True), "alibi"),
    ("MptConfig", dict(), "attn_config.alibi"),
    ("BloomConfig", dict(), "model_type='bloom'"),
    ("DeepseekV3Config", dict(), "kv_lora_rank"),
    ("Llama4TextConfig", dict(attention_chunk_size=64), "attention_chunk_size"),
    ("Gemma3TextConfig", dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
    ("T5Config", dict(), "is_encoder_decoder"),
    ("LlamaConfig", dict(add_cross_attention=True), "add_cross_attention"),
]


@pytest.mark.parametrize("cls,kwargs,field", REFUSED, ids=[r[0] for r in REFUSED])
def test_unsupported_attention_config_is_refused_at_load(tmp_path, cls, kwargs, field):
    # Only config.json: the check runs on the config, before any weight is looked for.
    import transformers

    from kvfleet.runtime.model_loader import load_model

    getattr(transformers, cls)(**kwargs).save_pretrained(tmp_path)
    assert not list(tmp_path.glob("*.safetensors"))
    with pytest.raises(ValueError, match=field.replace(".", r"\.").replace("(", r"\(")) as e:
        load_model(str(tmp_path), dtype="float32", device="cpu")
    assert "not implemented" in str(e.value)


def test_unknown_layer_type_is_refused(tmp_path):
    from kvfleet.runtime.model_loader import load_model

    config = _configs()["qwen2"].to_dict()
    config["layer_types"] = ["full_attention", "linear_attention"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"layer_types\[1\]='linear_attention'"):
        load_model(str(tmp_path), dtype="float32", device="cpu")


def test_attention_sinks_are_refused_when_the_engine_starts(tmp_path):
    # gpt-oss passes its learned attention sinks as s_aux=: nothing in the config names
    # them, so the engine's one-forward probe refuses the model before serving anything.
    from transformers import GptOssConfig

    from kvfleet.runtime.config import EngineConfig
    from kvfleet.runtime.engine import LLMEngine
    from kvfleet.runtime.model_loader import load_model

    config = GptOssConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                          num_experts_per_tok=2, sliding_window=8, max_position_embeddings=256)
    _build(config, tmp_path)
    loaded = load_model(str(tmp_path), dtype="float32", device="cpu")
    with pytest.raises(ValueError, match="s_aux"):
        LLMEngine(EngineConfig(block_size=4, kv_cache_memory=2**20), loaded=loaded)


def test_paged_attention_forward_refuses_a_disagreeing_window():
    # The config says layer 0 is full attention; a module that passes sliding_window=4
    # there means kvfleet misread the model: refuse, do not guess.
    from kvfleet.runtime.attention import AttentionMetadata, paged_attention_forward

    class Module(torch.nn.Module):
        layer_idx = 0

    cache = torch.zeros(2, 4, 1, 8)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(2), block_tables=torch.zeros((1, 1), dtype=torch.int32),
        seq_lens=torch.tensor([2], dtype=torch.int32), query_start_loc=torch.tensor([0, 2], dtype=torch.int32),
        max_query_len=2, max_seq_len=2, kv_caches=[(cache, cache.clone())], sliding_windows=[None],
    )
    q = torch.randn(1, 2, 2, 8)
    kv = torch.randn(1, 1, 2, 8)
    with pytest.raises(ValueError, match="sliding_window=4"):
        paged_attention_forward(Module(), q, kv, kv, None, kvfleet_attn=meta, sliding_window=4)
    with pytest.raises(ValueError, match="attention mask"):
        paged_attention_forward(Module(), q, kv, kv, torch.ones(1, 1, 2, 2), kvfleet_attn=meta)
    out, _ = paged_attention_forward(Module(), q, kv, kv, None, kvfleet_attn=meta, sliding_window=None)
    assert out.shape == (1, 2, 2, 8) and meta.calls == 3
