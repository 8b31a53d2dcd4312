"""The fused CPU decode path (kvfleet.runtime.worker.cpu_decode) inside the engine: the same
greedy tokens and log-probabilities (within 1e-4) as transformers' modules over a workload that
chunks prefills, mixes prefill and decode, hits the prefix cache and preempts; decode steps run
fused and the others do not; with fused prefill every step runs fused, and a request's tokens
and log-probabilities are bitwise the same in a batch, chunked, from the prefix cache, or alone,
and with speculative decoding; and the path is off where it does not apply. The engines run the
default model cut to its first two decoder layers (conftest's ``smollm2_two_layers``); the
quantized engines of tests/unit/runtime/worker/test_quantization.py run it over all 30 layers.
Below, every family of runtime/worker/recipes.py as a tiny random checkpoint
(tests/support/tiny_models.py): transformers' greedy tokens in float32, the bf16 matmul kinds this
CPU has within stated tolerances, batch invariance, quantized weights, speculative steps over a
sliding window, and a family without a recipe left on transformers' modules."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from support.engine_workload import CONFIG, Recorder, count_fused_rows, prompts, run
from support.tiny_models import FAMILIES, hf_greedy

from kvfleet.kernels import BACKEND_ENV, cpu_woq
from kvfleet.kernels.cpu_decoder import MAX_ROWS, matmul_available
from kvfleet.runtime.config import EngineConfig
from kvfleet.runtime.engine.llm_engine import LLMEngine
from kvfleet.runtime.sampling_params import SamplingParams
from kvfleet.runtime.worker import cpu_decode

pytestmark = pytest.mark.skipif(not cpu_woq.available(), reason="AVX2/FMA kernels unavailable here")

BF16_CACHE_TOLERANCE = 5e-3
"""Log-probabilities of the fused and torch paths over one bf16 KV cache (the test below says why)."""


@pytest.fixture(scope="module")
def plain_run(smollm2_two_layers):
    """The workload through transformers' modules: (token ids, cached prompt tokens,
    log-probabilities, preemptions)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(cpu_decode.ENV, "0")
        rec = Recorder()
        plain = LLMEngine(EngineConfig(**CONFIG), [rec], loaded=smollm2_two_layers)
        assert plain.runner.cpu_decode is None
        return (*run(plain, prompts(smollm2_two_layers.tokenizer)), rec.preemptions)


def test_fused_decode_matches_the_transformers_path(smollm2_two_layers, plain_run, monkeypatch):
    batch = prompts(smollm2_two_layers.tokenizer)
    expected, plain_cached, expected_lp, plain_preemptions = plain_run
    monkeypatch.setenv(cpu_decode.PREFILL_ENV, "0")
    fused_rec = Recorder()
    fused = LLMEngine(EngineConfig(**CONFIG), [fused_rec], loaded=smollm2_two_layers)
    assert fused.runner.cpu_decode is not None and not fused.runner.cpu_decode.prefill
    rows = count_fused_rows(monkeypatch)
    got, cached, got_lp = run(fused, batch)
    assert got == expected
    worst = max(abs(x - y) for a, b in zip(got_lp, expected_lp) for x, y in zip(a, b))
    assert worst <= 1e-4, worst
    assert rows and max(rows) > 1, rows  # decode steps of several sequences ran fused
    # every token after each request's first came from a fused step or a mixed (unfused) one
    assert sum(rows) < sum(len(t) for t in got)
    assert cached > 0 and plain_cached > 0 and fused_rec.preemptions > 0 and plain_preemptions > 0


def _fused_prefill_engine(loaded, monkeypatch, recorder=None, **config) -> LLMEngine:
    """An engine whose every step must run fused (transformers' forward raises)."""
    monkeypatch.setenv(cpu_decode.PREFILL_ENV, "1")
    if "forward" in vars(loaded.model):  # an earlier engine's guard (the model is shared): start-up probes it
        monkeypatch.delattr(loaded.model, "forward")
    eng = LLMEngine(EngineConfig(**config), [recorder or Recorder()], loaded=loaded)
    assert eng.runner.cpu_decode is not None and eng.runner.cpu_decode.prefill

    def unfused(*args, **kwargs):
        raise AssertionError("a step ran transformers' modules")

    monkeypatch.setattr(eng.runner.model, "forward", unfused)
    return eng


def test_fused_prefill_matches_the_transformers_path(smollm2_two_layers, plain_run, monkeypatch):
    """Prefill chunks and mixed steps fused (the same workload: chunked prefills, prefix-cache
    hits, preemption): the greedy tokens of transformers' modules, log-probabilities within 1e-4
    (each request's first token comes from the fused prefill's logits)."""
    expected, _, expected_lp, _ = plain_run
    rows = count_fused_rows(monkeypatch)
    fused = _fused_prefill_engine(smollm2_two_layers, monkeypatch, **CONFIG)
    got, cached, got_lp = run(fused, prompts(smollm2_two_layers.tokenizer))
    assert got == expected
    worst = max(abs(x - y) for a, b in zip(got_lp, expected_lp) for x, y in zip(a, b))
    assert worst <= 1e-4, worst
    assert max(rows) == CONFIG["max_num_batched_tokens"] and cached > 0  # whole chunks ran fused


def test_fused_prefill_gives_a_request_the_same_bits_in_any_batch(smollm2_two_layers, monkeypatch):
    """Batch invariance of the whole engine: each request's greedy tokens and log-probabilities
    in one batch (prefills chunked into 64-token steps, mixed with decodes, the shared system
    prompt from the prefix cache) equal, bit for bit, those of the request alone in an engine that
    prefills it in one step without the prefix cache."""
    batch = prompts(smollm2_two_layers.tokenizer)[:5]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0)
    together, cached, together_lp = run(
        _fused_prefill_engine(smollm2_two_layers, monkeypatch, **CONFIG), batch, params)
    assert cached > 0
    alone_engine = _fused_prefill_engine(smollm2_two_layers, monkeypatch, num_blocks=64,
                                         enable_prefix_caching=False)
    for i, prompt in enumerate(batch):
        alone, _, alone_lp = run(alone_engine, [prompt], params)
        assert alone[0] == together[i] and alone_lp[0] == together_lp[i], f"request {i} differs in the batch"


def test_fused_prefill_with_speculative_decoding(smollm2_two_layers, monkeypatch):
    """n-gram drafts verified by fused steps that also prefill: the greedy tokens of the same
    engine without speculation, and drafts were verified."""
    tok = smollm2_two_layers.tokenizer
    text = "one two three four five six seven eight nine ten " * 4
    batch = [tok(text, add_special_tokens=False)["input_ids"], tok("Count: " + text, add_special_tokens=False)["input_ids"]]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    expected, _, _ = run(_fused_prefill_engine(smollm2_two_layers, monkeypatch, num_blocks=64), batch, params)
    drafts = []

    class Drafts:
        def record(self, scheduler_stats, iteration_stats) -> None:
            if scheduler_stats.spec_decoding is not None:
                drafts.append(scheduler_stats.spec_decoding.num_draft_tokens)

    spec = _fused_prefill_engine(smollm2_two_layers, monkeypatch, Drafts(), num_blocks=64, max_num_batched_tokens=48,
                                 speculative_config='{"method": "ngram", "num_speculative_tokens": 4}')
    got, _, _ = run(spec, batch, params)
    assert got == expected
    assert sum(drafts) > 0


def test_the_path_is_off_where_it_does_not_apply(smollm2_two_layers, monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, "triton")  # the user's attention backend wins
    assert LLMEngine(EngineConfig(num_blocks=8), loaded=smollm2_two_layers).runner.cpu_decode is None
    monkeypatch.delenv(BACKEND_ENV)
    monkeypatch.setenv(cpu_decode.PREFILL_ENV, "0")
    path = LLMEngine(EngineConfig(num_blocks=8), loaded=smollm2_two_layers).runner.cpu_decode
    assert path is not None and not path.prefill
    assert path.applies(4, 4, prompt_logprobs=False, padded=False)
    assert not path.applies(5, 4, prompt_logprobs=False, padded=False)  # a prefill chunk
    # Speculative decoding: a sequence's last token and its drafts, up to 1 + k rows.
    assert path.applies(7, 4, False, False, max_query_len=4, max_query=5)
    assert not path.applies(9, 4, False, False, max_query_len=6, max_query=5)
    assert not path.applies(4, 4, prompt_logprobs=True, padded=False)
    assert not path.applies(65, 65, prompt_logprobs=False, padded=False)
    path.prefill = True  # prefill chunks and mixed steps too, up to MAX_ROWS tokens
    assert path.applies(5, 4, False, False, max_query_len=2) and path.applies(MAX_ROWS, 3, False, False, 4000)
    assert not path.applies(MAX_ROWS + 1, 3, False, False, 4000)
    assert not path.applies(400, 1, prompt_logprobs=True, padded=False)
    assert not path.applies(400, 1, prompt_logprobs=False, padded=True)
    # LoRA keeps the path (tests/unit/runtime/engine/test_lora.py): it reads the LoRA layers' base weights, and
    # their slots as the C step's tables; a step with adapter tokens gets each token's slot, unless one of its
    # adapters adapts a layer without a table (then None: transformers' modules)
    eng = LLMEngine(EngineConfig(num_blocks=8, enable_lora=True, max_lora_rank=8), loaded=smollm2_two_layers)
    path = eng.runner.cpu_decode
    assert path is not None and len(path.lora_modules) == 2 * 7 and path._fused.lora_rank == 8
    covered = next(iter(path.lora_modules))

    class Manager:
        def adapted_modules(self, lora_int_id):
            return frozenset([covered] if lora_int_id == 1 else [covered, "model.layers.0.mlp.experts.0"])

        def token_slots(self, scheduled):
            return torch.tensor([0, -1]), 1

    path._lora = Manager()
    rows = [SimpleNamespace(request=SimpleNamespace(lora_int_id=i)) for i in (1, 0)]
    assert path.lora_slots(rows).tolist() == [0, -1]
    rows[1].request.lora_int_id = 2
    assert path.lora_slots(rows) is None


def test_bf16_weights_keep_the_fused_path(smollm2_two_layers, monkeypatch):
    """A float32 model whose decoder linears and LM head hold bf16 weights
    (woq_linear.to_bf16_weights) decodes fused, with the same greedy tokens and log-probabilities
    (within 1e-4) as transformers' modules over the same bf16 weights."""
    import torch

    from kvfleet.runtime.worker.model_loader import load_model
    from kvfleet.runtime.worker.woq_linear import Bf16Linear, to_bf16_weights

    # a fresh copy: the fixture's model is shared (the LoRA engine above wraps its layers)
    loaded = load_model(smollm2_two_layers.source, dtype="float32", device="cpu")
    assert to_bf16_weights(loaded.model) == 2 * 7 + 1  # q k v o gate up down per layer, and the head
    head = loaded.model.get_output_embeddings()
    assert isinstance(head, Bf16Linear) and head.weight.dtype == torch.bfloat16
    assert loaded.model.get_input_embeddings().weight.dtype == torch.float32  # lookups stay float32
    batch = prompts(loaded.tokenizer)
    monkeypatch.setenv(cpu_decode.ENV, "0")
    plain = LLMEngine(EngineConfig(**CONFIG), [Recorder()], loaded=loaded)
    expected, _, expected_lp = run(plain, batch)
    monkeypatch.delenv(cpu_decode.ENV)
    fused = LLMEngine(EngineConfig(**CONFIG), [Recorder()], loaded=loaded)
    assert fused.runner.cpu_decode is not None
    assert fused.runner.cpu_decode._fused.weights.layers[0].qkv.fmt == "bf16"
    assert fused.runner.cpu_decode._fused.weights.head.fmt == "bf16"
    got, _, got_lp = run(fused, batch)
    assert got == expected
    worst = max(abs(x - y) for a, b in zip(got_lp, expected_lp) for x, y in zip(a, b))
    assert worst <= 1e-4, worst


@pytest.fixture(scope="module")
def plain_two_layers(smollm2_two_layers):
    """A fresh copy of the two-layer model (the LoRA engine above wraps the shared one's layers)."""
    from kvfleet.runtime.worker.model_loader import load_model

    return load_model(smollm2_two_layers.source, dtype="float32", device="cpu")


def test_a_bf16_kv_cache_is_shared_by_the_fused_and_torch_paths(plain_two_layers, monkeypatch):
    """``kv_cache_dtype="bfloat16"`` on the float32 model: prefill, mixed steps and the prefix cache
    (torch) and decode (fused) read and write one bf16 cache, with the same greedy tokens and
    log-probabilities as the torch path alone over a bf16 cache: within :data:`BF16_CACHE_TOLERANCE`,
    not float32's 1e-4, because the two paths' float32 keys differ by ~1e-7 and one that falls on the
    other side of a bf16 rounding step moves by 2^-8 of itself. How many keys fall so depends on
    torch's float32 matmuls, which are the CPU vendor's BLAS code (measured 2.1e-4 on a Xeon with
    MKL's AVX-512 kernels, 3.6e-3 on a Zen 4, where MKL runs its AVX2 ones: 3.58e-3 on the Xeon
    with them, as tests/e2e/test_cpu_kinds.py runs this module); bf16 against a float32 cache moves
    them ~1e-2, and a cache misread far more (the greedy tokens then differ)."""
    import torch

    batch = prompts(plain_two_layers.tokenizer)
    config = EngineConfig(**CONFIG, kv_cache_dtype="bfloat16")
    monkeypatch.setenv(cpu_decode.ENV, "0")
    plain = LLMEngine(config, [Recorder()], loaded=plain_two_layers)
    assert plain.runner.cpu_decode is None and plain.runner.kv_caches[0][0].dtype == torch.bfloat16
    expected, _, expected_lp = run(plain, batch)
    monkeypatch.delenv(cpu_decode.ENV)
    fused = LLMEngine(config, [Recorder()], loaded=plain_two_layers)
    assert fused.runner.cpu_decode._fused.cache_dtype == torch.bfloat16
    assert fused.runner.kv_caches[0][0].dtype == torch.bfloat16 and fused.runner.dtype == torch.float32
    r = fused.runner  # 2 bytes per element: twice the blocks in a kv_cache_memory budget
    assert r.bytes_per_block == 2 * r.num_layers * r.block_size * r.num_kv_heads * r.head_size * 2
    got, cached, got_lp = run(fused, batch)
    assert got == expected
    worst = max(abs(x - y) for a, b in zip(got_lp, expected_lp) for x, y in zip(a, b))
    assert worst <= BF16_CACHE_TOLERANCE, worst
    assert cached > 0


def test_kv_cache_dtype_auto_follows_the_fused_path_and_cuda_refuses_another_dtype(plain_two_layers,
                                                                                   monkeypatch):
    """``auto`` is ``CPU_AUTO_KV_CACHE_DTYPE`` exactly where the fused decoder runs (here set to bf16)
    and the activation dtype elsewhere; on CUDA only the activation dtype is accepted."""
    from types import SimpleNamespace

    import torch

    from kvfleet.runtime.worker import model_runner

    monkeypatch.setattr(model_runner, "CPU_AUTO_KV_CACHE_DTYPE", torch.bfloat16)
    fused = LLMEngine(EngineConfig(num_blocks=8), loaded=plain_two_layers).runner
    assert fused.kv_cache_dtype == torch.bfloat16 and fused.cpu_decode._fused.cache_dtype == torch.bfloat16
    monkeypatch.setenv(cpu_decode.ENV, "0")
    plain = LLMEngine(EngineConfig(num_blocks=8), loaded=plain_two_layers).runner
    assert plain.kv_cache_dtype == torch.float32 and plain.kv_caches[0][0].dtype == torch.float32
    gpu = SimpleNamespace(device=torch.device("cuda"), dtype=torch.float16)
    assert model_runner.ModelRunner._kv_cache_dtype(gpu, "auto") == torch.float16
    with pytest.raises(ValueError, match="kv_cache_dtype=bfloat16: on CUDA"):
        model_runner.ModelRunner._kv_cache_dtype(gpu, "bfloat16")


# --- every dense family of runtime/worker/recipes.py on the fused path -------------------------
# Tiny random checkpoints of each family (tests/support/tiny_models.py: hidden 64, 2 layers, the
# family's features on: sliding windows of 8 below the 29-token prompts, Gemma 3's sandwich norms
# and local/global RoPE, GLM-4's and Phi-3's partial rotary, Granite's multipliers, ...).

FAMILY_PARAMS = [pytest.param(f, id=f) for f in FAMILIES]
BF16_MATMUL_KINDS = [pytest.param(k, id=k, marks=pytest.mark.skipif(
    not matmul_available(k), reason=f"no {k} kernels on this CPU")) for k in ("avx512_bf16", "amx")]


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    """family -> (checkpoint dir, transformers' greedy tokens of PROMPTS, eager reference model)."""
    from support.tiny_models import build, family_config

    out = {}
    for family in FAMILIES:
        path = tmp_path_factory.mktemp(family)
        ref = build(family_config(family), path)
        out[family] = (path, hf_greedy(ref), ref)
    return out


def _family_engine(path, monkeypatch, prefill: bool, matmul: str = "float32", **config) -> LLMEngine:
    """An engine over the checkpoint at ``path`` whose fused path runs ``matmul`` kernels; with
    ``prefill`` every step must run fused (transformers' forward raises)."""
    from kvfleet.runtime.worker.model_loader import load_model

    monkeypatch.setenv(cpu_decode.PREFILL_ENV, "1" if prefill else "0")
    monkeypatch.setattr(cpu_decode, "matmul_asked", lambda runner: matmul)
    loaded = load_model(str(path), dtype="float32", device="cpu")
    eng = LLMEngine(EngineConfig(**{"num_blocks": 64, "max_num_batched_tokens": 16, **config}), loaded=loaded)
    path_ = eng.runner.cpu_decode
    assert path_ is not None and path_.prefill == prefill and path_.matmul == matmul
    if prefill:
        def unfused(*args, **kwargs):
            raise AssertionError("a step ran transformers' modules")

        monkeypatch.setattr(eng.runner.model, "forward", unfused)
    return eng


def _tokens(eng: LLMEngine, n: int = 10, logprobs: int | None = None):
    from support.tiny_models import PROMPTS

    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=logprobs)
    return run(eng, [list(p) for p in PROMPTS], params)


@pytest.mark.parametrize("family", FAMILY_PARAMS)
@pytest.mark.parametrize("prefill", [True, False], ids=["fused-prefill", "torch-prefill"])
def test_each_family_gives_transformers_greedy_tokens(families, family, prefill, monkeypatch):
    """float32 kernels: the greedy tokens of transformers' ``generate`` (eager attention), every
    step fused (prefill chunks of 16 tokens included), or prefill in torch and decode fused over
    one cache; the path runs the family's recipe."""
    path, expected, _ = families[family]
    eng = _family_engine(path, monkeypatch, prefill)
    assert eng.runner.cpu_decode.recipe.family == family
    got, _, _ = _tokens(eng)
    assert got == expected


def test_gemma3_sliding_window_is_honoured(families, monkeypatch):
    """Gemma 3's local layer (window 8, RoPE base 10k) and global layer (base 1M) over prompts of
    12-29 tokens and 10 more: the fused tokens equal transformers', whose tokens without the
    window differ (so the window is exercised, not vacuous)."""
    import copy

    from support.tiny_models import PROMPTS
    from transformers import AutoModelForCausalLM

    path, expected, ref = families["gemma3_text"]
    fused = _family_engine(path, monkeypatch, prefill=True)
    recipe = fused.runner.cpu_decode.recipe
    assert recipe.windows == (8, 0) and recipe.rope_keys == ("full_attention", "sliding_attention")
    assert max(len(p) for p in PROMPTS) > 3 * 8
    assert _tokens(fused)[0] == expected
    config = copy.deepcopy(ref.config)
    config.layer_types = ["full_attention"] * 2
    unwindowed = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    unwindowed.load_state_dict(ref.state_dict())
    assert hf_greedy(unwindowed) != expected


@pytest.mark.parametrize("family", FAMILY_PARAMS)
@pytest.mark.parametrize("kind", BF16_MATMUL_KINDS)
def test_bf16_matmuls_stay_close_to_the_float32_kernels(families, family, kind, monkeypatch):
    """The fused prefill's top-20 log-probabilities with the matmuls in bf16 (AVX512-BF16 dot
    products or AMX tiles: activations and weights rounded to bf16, float32 sums) against the
    float32 kernels' on the same model: within 0.25 (measured up to 0.19, GLM-4; these random
    models' logits span tens of nats, and bf16 keeps 8 bits), and the same first token wherever
    the float32 margin between the two best is over 0.5."""
    path = families[family][0]
    ref_lp, got_lp = ([{k: v.logprob for k, v in out.items()} for out in _first_logprobs(
        _family_engine(path, monkeypatch, True, matmul))] for matmul in ("float32", kind))
    worst = max(abs(got[t] - lp) for ref, got in zip(ref_lp, got_lp) for t, lp in ref.items() if t in got)
    assert worst <= 0.25, worst
    for ref, got in zip(ref_lp, got_lp):
        best = sorted(ref.values(), reverse=True)
        if best[0] - best[1] > 0.5:
            assert max(got, key=got.get) == max(ref, key=ref.get)


def _first_logprobs(eng: LLMEngine):
    from support.tiny_models import PROMPTS

    params = SamplingParams(temperature=0, max_tokens=1, logprobs=20)
    for i, p in enumerate(PROMPTS):
        eng.add_request(f"lp{i}", list(p), params)
    out = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                out[o.request_id] = o.outputs[0].logprobs[0]
    return [out[f"lp{i}"] for i in range(len(PROMPTS))]


@pytest.mark.parametrize("family", [pytest.param("gemma3_text", id="gemma3_text"), pytest.param("glm4", id="glm4")])
@pytest.mark.parametrize("kind", [pytest.param("float32", id="float32"), *BF16_MATMUL_KINDS])
def test_a_family_request_has_the_same_bits_alone_and_in_a_batch(families, family, kind, monkeypatch):
    """Batch invariance of the new layers (sandwich norms, q/k norms, GELU-tanh, windows, two
    RoPE tables; GLM-4's biases and interleaved partial rotary): each request's greedy tokens and
    log-probabilities in a batch with chunked prefills equal, bit for bit, those of the request
    alone, prefilled in one step."""
    from support.tiny_models import PROMPTS

    path = families[family][0]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=0)
    together, _, together_lp = run(_family_engine(path, monkeypatch, True, kind), [list(p) for p in PROMPTS], params)
    alone_engine = _family_engine(path, monkeypatch, True, kind, max_num_batched_tokens=64)
    for i, prompt in enumerate(PROMPTS):
        alone, _, alone_lp = run(alone_engine, [list(prompt)], params)
        assert alone[0] == together[i] and alone_lp[0] == together_lp[i], f"request {i} differs in the batch"


@pytest.mark.parametrize("family", [pytest.param(f, id=f) for f in ("qwen3", "gemma3_text", "glm4", "phi3", "olmo2")])
@pytest.mark.parametrize("weights", ["int8", "int4", "bf16"])
def test_quantized_families_decode_fused_as_their_torch_path(families, family, weights, monkeypatch):
    """int8 / int4 (--quantization) and bf16 weights of a family: the fused decode (float32
    kernels, prefill in torch) gives the greedy tokens of transformers' modules over the same
    weights, log-probabilities within 1e-3."""
    from kvfleet.runtime.worker.model_loader import load_model
    from kvfleet.runtime.worker.woq_linear import to_bf16_weights

    path = families[family][0]
    monkeypatch.setattr(cpu_decode, "matmul_asked", lambda runner: "float32")
    monkeypatch.setenv(cpu_decode.PREFILL_ENV, "0")
    results = []
    for env in ("0", ""):
        monkeypatch.setenv(cpu_decode.ENV, env)
        loaded = load_model(str(path), dtype="float32", device="cpu",
                            quantization=None if weights == "bf16" else weights)
        if weights == "bf16":
            to_bf16_weights(loaded.model)
        eng = LLMEngine(EngineConfig(num_blocks=64, max_num_batched_tokens=16, quantization=loaded.quantization),
                        loaded=loaded)
        assert (eng.runner.cpu_decode is None) == (env == "0")
        if env != "0":
            assert eng.runner.cpu_decode._fused.weights.layers[0].qkv.fmt == weights
        results.append(_tokens(eng, logprobs=0))
    (expected, _, expected_lp), (got, _, got_lp) = results
    assert got == expected
    worst = max(abs(x - y) for a, b in zip(got_lp, expected_lp) for x, y in zip(a, b))
    assert worst <= 1e-3, worst


def test_speculative_decoding_on_a_windowed_family(families, monkeypatch):
    """Gemma 3 (a window of 8 on its local layer) with n-gram drafts verified by fused steps: the
    greedy tokens of the same engine without speculation, and drafts were verified (a sequence's
    last token and drafts as rows of one step, each attending within its own window)."""
    path = families["gemma3_text"][0]
    text = [5 + i % 7 for i in range(40)]  # repetitive: the n-gram proposer finds drafts
    batch = [text, [3, 4] + text]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    expected, _, _ = run(_family_engine(path, monkeypatch, True), batch, params)
    drafts = []

    class Drafts:
        def record(self, scheduler_stats, iteration_stats) -> None:
            if scheduler_stats.spec_decoding is not None:
                drafts.append(scheduler_stats.spec_decoding.num_draft_tokens)

    spec = _family_engine(path, monkeypatch, True, speculative_config='{"method": "ngram", "num_speculative_tokens": 4}')
    spec.stat_loggers.append(Drafts())
    got, _, _ = run(spec, batch, params)
    assert got == expected
    assert sum(drafts) > 0


def test_a_family_without_a_recipe_runs_transformers_modules(tmp_path, monkeypatch, caplog):
    """StarCoder2 (LayerNorm and an ungated MLP: no layer recipe) keeps the engine on
    transformers' modules, and the start-up line says why."""
    import logging

    from support.tiny_models import COMMON, build
    from transformers import AutoConfig

    from kvfleet.runtime.worker.model_loader import load_model

    build(AutoConfig.for_model("starcoder2", **COMMON), tmp_path)
    with caplog.at_level(logging.INFO, logger=cpu_decode.logger.name):
        eng = LLMEngine(EngineConfig(num_blocks=16), loaded=load_model(str(tmp_path), dtype="float32", device="cpu"))
    assert eng.runner.cpu_decode is None
    assert "fused CPU decode: off (model type 'starcoder2' has no layer recipe" in caplog.text


@pytest.mark.parametrize("family,fields", [("granite", {}), ("gemma3_text", {"final_logit_softcapping": 3.0})],
                         ids=["granite-logit-scale", "gemma3-softcap"])
def test_logit_scale_and_softcap_match_the_torch_path(family, fields, tmp_path, monkeypatch):
    """The C step's logits finished in Python as the engine's torch path finishes its own:
    Granite's 1 / logits_scaling and a soft-cap of 3 (which squeezes the logits into -3..3, so a
    missing or doubled cap moves every log-probability): the same greedy tokens and
    log-probabilities within 1e-4 as transformers' modules in the engine."""
    from support.tiny_models import build, family_config

    build(family_config(family, **fields), tmp_path)
    monkeypatch.setenv(cpu_decode.ENV, "0")
    from kvfleet.runtime.worker.model_loader import load_model

    plain = LLMEngine(EngineConfig(num_blocks=64, max_num_batched_tokens=16),
                      loaded=load_model(str(tmp_path), dtype="float32", device="cpu"))
    assert plain.runner.cpu_decode is None
    expected, _, expected_lp = _tokens(plain, logprobs=0)
    monkeypatch.delenv(cpu_decode.ENV)
    got, _, got_lp = _tokens(_family_engine(tmp_path, monkeypatch, True), logprobs=0)
    assert got == expected
    worst = max(abs(x - y) for a, b in zip(got_lp, expected_lp) for x, y in zip(a, b))
    assert worst <= 1e-4, worst
