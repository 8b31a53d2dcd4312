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
from support.tiny_models import COMMON, GEN, PROMPTS, VOCAB, build, configs, hf_greedy

from kvfleet.kernels import BACKEND_ENV


def _engine_greedy(path, *, block_size: int = 4, max_num_batched_tokens: int = 16, prompts=PROMPTS,
                   n: int = GEN) -> list[list[int]]:
    from kvfleet.runtime.config import EngineConfig
    from kvfleet.runtime.engine.llm_engine import LLMEngine
    from kvfleet.runtime.llm import LLM
    from kvfleet.runtime.sampling_params import SamplingParams
    from kvfleet.runtime.worker.model_loader import load_model

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
    for name, config in configs().items():
        path = tmp_path_factory.mktemp(name)
        ref = build(config, path)
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
        out[name] = (path, ref, hf_greedy(plain_model))
    return out


def test_layer_windows_follow_the_config():
    from kvfleet.runtime.worker.attention import check_attention_support, layer_sliding_windows

    cfgs = configs()
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
    expected = hf_greedy(ref)
    assert expected != plain_tokens, "the window/soft-cap does not change this model's tokens: the test is vacuous"
    # Blocks of 4 < window 8; 16-token steps: the 29- and 21-token prompts are prefilled in chunks.
    assert _engine_greedy(path) == expected
    # A block larger than the window, and the whole prompt in one step.
    assert _engine_greedy(path, block_size=16, max_num_batched_tokens=256) == expected


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mistral", "gemma2"])
def test_engine_greedy_with_triton_kernels(models, name, monkeypatch):
    # The Triton kernel (interpreted on CPU) in the engine: same tokens as transformers.
    from kvfleet.kernels.testing import record_calls, triton_kernels

    path, ref, _ = models[name]
    expected = hf_greedy(ref, prompts=PROMPTS[:2], n=4)
    with triton_kernels(interpret=not torch.cuda.is_available()) as (_, attn_mod):
        calls = record_calls(monkeypatch, attn_mod, "paged_attention_triton")
        monkeypatch.setenv(BACKEND_ENV, "triton")
        got = _engine_greedy(path, prompts=PROMPTS[:2], n=4)
    assert 8 in [c.get("sliding_window") for c in calls], "the Triton kernel never ran a sliding-window layer"
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

    from kvfleet.runtime.worker.model_loader import load_model

    getattr(transformers, cls)(**kwargs).save_pretrained(tmp_path)
    assert not list(tmp_path.glob("*.safetensors"))
    with pytest.raises(ValueError, match=field.replace(".", r"\.").replace("(", r"\(")) as e:
        load_model(str(tmp_path), dtype="float32", device="cpu")
    assert "not implemented" in str(e.value)


def test_unknown_layer_type_is_refused(tmp_path):
    from kvfleet.runtime.worker.model_loader import load_model

    config = configs()["qwen2"].to_dict()
    config["layer_types"] = ["full_attention", "linear_attention"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"layer_types\[1\]='linear_attention'"):
        load_model(str(tmp_path), dtype="float32", device="cpu")


def test_attention_sinks_are_refused_when_the_engine_starts(tmp_path):
    # gpt-oss passes its learned attention sinks as s_aux=: nothing in the config names
    # them, so the engine's one-forward probe refuses the model before serving anything.
    from transformers import GptOssConfig

    from kvfleet.runtime.config import EngineConfig
    from kvfleet.runtime.engine.llm_engine import LLMEngine
    from kvfleet.runtime.worker.model_loader import load_model

    config = GptOssConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                          num_experts_per_tok=2, sliding_window=8, max_position_embeddings=256)
    build(config, tmp_path)
    loaded = load_model(str(tmp_path), dtype="float32", device="cpu")
    with pytest.raises(ValueError, match="s_aux"):
        LLMEngine(EngineConfig(block_size=4, kv_cache_memory=2**20), loaded=loaded)


def test_paged_attention_forward_refuses_a_disagreeing_window():
    # The config says layer 0 is full attention; a module that passes sliding_window=4
    # there means kvfleet misread the model: refuse, do not guess.
    from kvfleet.runtime.worker.attention import AttentionMetadata, paged_attention_forward

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


# -- out-of-window blocks go back to the pool (Mistral: one window on every layer) ---------
LONG_PROMPTS = [[(11 * i + 5) % (VOCAB - 2) + 2 for i in range(60)], [(13 * i + 7) % (VOCAB - 2) + 2 for i in range(9)]]
LONG_GEN = 14


def _poisoned_null_engine(path, *, num_blocks: int, block_size: int, max_num_batched_tokens: int,
                          enable_prefix_caching: bool = True):
    """An engine whose null block's K/V is NaN in every layer: a kernel that read it (even
    masked) would make the logits NaN and the greedy tokens wrong."""
    from kvfleet.runtime.config import EngineConfig
    from kvfleet.runtime.engine.llm_engine import LLMEngine
    from kvfleet.runtime.worker.model_loader import load_model

    loaded = load_model(str(path), dtype="float32", device="cpu")
    engine = LLMEngine(EngineConfig(block_size=block_size, max_num_batched_tokens=max_num_batched_tokens,
                                    num_blocks=num_blocks, enable_prefix_caching=enable_prefix_caching),
                       loaded=loaded)
    null_id = engine.scheduler.kv_cache_manager.null_block.block_id
    assert null_id == num_blocks - 1
    for k, v in engine.runner.kv_caches:
        # Zeros as allocated: the Triton kernel's straddling tile loads it with weight 0.
        assert not k[null_id].any() and not v[null_id].any()
        k[null_id] = float("nan")
        v[null_id] = float("nan")
    return engine


def _run_checking_the_pool(engine, prompts, n):
    """Greedy tokens of ``prompts``, asserting after every step that each running request
    holds only its window's blocks and the pool's free count is the rest."""
    from kvfleet.runtime.core.kv_cache_manager import cdiv
    from kvfleet.runtime.sampling_params import SamplingParams

    sched = engine.scheduler
    kv = sched.kv_cache_manager
    bs, window, budget = kv.block_size, kv.sliding_window, sched.max_num_batched_tokens
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", list(p), params)
    final, max_live, steps = {}, 0, 0
    cached = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = list(out.outputs[0].token_ids)
                cached[out.request_id] = out.num_cached_tokens
        steps += 1
        live_total = 0
        for req in sched.running:
            table = kv.get_block_ids(req.request_id)
            skipped = max(0, req.num_computed_tokens + 1 - window) // bs
            assert table[:skipped] == [kv.null_block.block_id] * skipped, f"step {steps}: {req.request_id}"
            live = len(table) - skipped
            assert live <= cdiv(window - 1 + budget, bs) + 1
            live_total += live
            max_live = max(max_live, live)
        assert kv.num_free_blocks == kv.num_usable_blocks - live_total, f"step {steps}"
    assert kv.num_free_blocks == kv.num_usable_blocks
    _run_checking_the_pool.num_cached_tokens = [cached[f"r{i}"] for i in range(len(prompts))]
    return [final[f"r{i}"] for i in range(len(prompts))], max_live


@pytest.mark.parametrize("caching", [True, False])
def test_window_frees_blocks_and_runs_prompts_longer_than_the_cache(models, caching, monkeypatch):
    # 8 blocks of 4 tokens, one of them the null block: 28 tokens of cache for a 60-token
    # prompt + 14 tokens (and a second request beside it), window 8, 8-token prefill chunks.
    monkeypatch.setenv(BACKEND_ENV, "torch")
    path, ref, plain_tokens = models["mistral"]
    expected = hf_greedy(ref, prompts=LONG_PROMPTS, n=LONG_GEN)
    engine = _poisoned_null_engine(path, num_blocks=8, block_size=4, max_num_batched_tokens=8,
                                   enable_prefix_caching=caching)
    assert engine.sliding_window == 8 and engine.max_model_len == 256  # not capped by the 28-token cache
    got, max_live = _run_checking_the_pool(engine, LONG_PROMPTS, LONG_GEN)
    assert got == expected
    assert max_live <= 5  # cdiv(8 - 1 + 8, 4) + 1
    # The null block was never written (still NaN): the kernels never read it.
    null_id = engine.scheduler.kv_cache_manager.null_block.block_id
    assert all(torch.isnan(k[null_id]).all() and torch.isnan(v[null_id]).all() for k, v in engine.runner.kv_caches)


def test_window_prefix_hit_on_the_real_model(models, monkeypatch):
    # 15 usable blocks of 4 (60 tokens) for a 60-token prompt + 14 tokens: its earliest
    # blocks are evicted on the way, its last window's are not, so the same prompt again
    # gets 56 tokens from the cache (the last 14 full blocks' hit needs only blocks 12-13
    # cached) and the same greedy tokens.
    monkeypatch.setenv(BACKEND_ENV, "torch")
    path, ref, _ = models["mistral"]
    expected = hf_greedy(ref, prompts=LONG_PROMPTS[:1], n=LONG_GEN)
    engine = _poisoned_null_engine(path, num_blocks=16, block_size=4, max_num_batched_tokens=8)
    first, _ = _run_checking_the_pool(engine, LONG_PROMPTS[:1], LONG_GEN)
    assert first == expected and _run_checking_the_pool.num_cached_tokens == [0]
    pool = engine.scheduler.kv_cache_manager.block_pool
    assert 0 < len(pool.cached_blocks) < 74 // 4  # some of its 18 full blocks were evicted
    again, _ = _run_checking_the_pool(engine, LONG_PROMPTS[:1], LONG_GEN)
    assert again == expected and _run_checking_the_pool.num_cached_tokens == [56]


def test_a_read_of_the_null_block_would_be_caught():
    # The poisoning is not vacuous: the torch kernel on a block table whose first entries
    # are the NaN null block gives NaN without a window and the exact result with one.
    from kvfleet.kernels.reference import paged_attention_torch
    from kvfleet.kernels.testing import make_paged_batch, naive_attention

    b = make_paged_batch([(40, 1), (33, 5)], num_heads=4, num_kv_heads=2, head_size=16, block_size=4, seed=3)
    q, kc, vc, bt, sl, qsl, scale = b.attn_args
    expected = naive_attention(b, sliding_window=8)
    used = {int(x) for s, L in enumerate(sl.tolist()) for x in bt[s, :-(-L // 4)]}
    null_id = max(set(range(kc.shape[0])) - used)  # a spare block, as the engine's null block
    kc[null_id] = float("nan")
    vc[null_id] = float("nan")
    bt = bt.clone()
    # Entries wholly before every query's window: positions < 40 - 8 and < 28 + 1 - 8.
    bt[0, :(40 - 8) // 4] = null_id
    bt[1, :(28 + 1 - 8) // 4] = null_id
    with torch.inference_mode():  # as the engine calls it
        out = paged_attention_torch(q, kc, vc, bt, sl, qsl, scale, sliding_window=8)
        full = paged_attention_torch(q, kc, vc, bt, sl, qsl, scale)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    assert torch.isnan(full).any()


def test_hybrid_and_full_attention_models_keep_every_block(models):
    from kvfleet.runtime.config import EngineConfig
    from kvfleet.runtime.core.kv_cache_manager import uniform_sliding_window
    from kvfleet.runtime.engine.llm_engine import LLMEngine
    from kvfleet.runtime.worker.model_loader import load_model

    # The engines: only Mistral (one window on every layer) gives its scheduler a window to
    # free blocks behind; the hybrid models (Qwen2 max_window_layers, Gemma 2) give none.
    for name, window in (("mistral", 8), ("qwen2", None), ("gemma2", None)):
        loaded = load_model(str(models[name][0]), dtype="float32", device="cpu")
        engine = LLMEngine(EngineConfig(block_size=4, max_num_batched_tokens=8, kv_cache_memory=2**20), loaded=loaded)
        assert engine.sliding_window == window, name
    assert uniform_sliding_window([8, 8]) == 8
    assert uniform_sliding_window([None, 8]) is None  # Qwen2 max_window_layers / Gemma 2: one table for both
    assert uniform_sliding_window([8, None]) is None
    assert uniform_sliding_window([None, None]) is None
    assert uniform_sliding_window([8, 16]) is None


@pytest.mark.parametrize("num_splits", [1, 3])
def test_triton_never_reads_null_entries_behind_the_window(num_splits):
    # The Triton kernel skips whole KV tiles (block_n keys) before a query block's window,
    # split-K included, and in the tile that straddles the window's lower edge it masks the
    # loads of keys before the first row's window: with 4-token blocks and 16-key tiles, the
    # null-block entries of that tile are never read. NaN in the null block shows any read.
    from kvfleet.kernels.testing import make_paged_batch, naive_attention, triton_kernels

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    b = make_paged_batch([(70, 1), (45, 6)], num_heads=4, num_kv_heads=2, head_size=32, block_size=4, seed=5,
                         device=dev)
    q, kc, vc, bt, sl, qsl, scale = b.attn_args
    expected = naive_attention(b, sliding_window=8)
    used = {int(x) for s, L in enumerate(sl.tolist()) for x in bt[s, :-(-L // 4)]}
    null_id = max(set(range(kc.shape[0])) - used)
    bt = bt.clone()
    bt[0, :(70 - 8) // 4] = null_id  # decode query at 69: keys 62..69
    bt[1, :(39 + 1 - 8) // 4] = null_id  # first query at 39: keys 32..
    with triton_kernels(interpret=not torch.cuda.is_available()) as (_, attn_mod):
        def run():
            return attn_mod.paged_attention_triton(q, kc, vc, bt, sl, qsl, scale, sliding_window=8,
                                                   num_splits=num_splits, block_n=16, max_seq_len=70)

        kc[null_id] = float("nan")
        vc[null_id] = float("nan")
        torch.testing.assert_close(run().double().cpu(), expected, atol=1e-5, rtol=1e-5)


def test_window_engine_sizes_max_model_len_by_the_window(models):
    # Mistral (window 8), blocks of 4, 8-token steps: a request holds at most 5 blocks, so
    # 6 blocks (5 usable) serve the model's whole context (256 tokens, 64 blocks' worth);
    # 5 blocks (4 usable) only what fits in them; 1 block cannot hold the null block too.
    from kvfleet.runtime.config import EngineConfig
    from kvfleet.runtime.engine.llm_engine import LLMEngine
    from kvfleet.runtime.worker.model_loader import load_model

    path, _, _ = models["mistral"]
    loaded = load_model(str(path), dtype="float32", device="cpu")

    def engine(num_blocks, **kw):
        return LLMEngine(EngineConfig(block_size=4, max_num_batched_tokens=8, num_blocks=num_blocks, **kw),
                         loaded=loaded)

    assert engine(6).max_model_len == 256
    assert engine(6, max_model_len=200).max_model_len == 200
    assert engine(5).max_model_len == 16
    with pytest.raises(ValueError, match="longer than the KV cache"):
        engine(5, max_model_len=17)
    with pytest.raises(ValueError, match="at least 2 KV blocks"):
        engine(1)
