"""LoRA adapters in the engine (issue 17), on the real default model with random PEFT adapters
made here: greedy tokens equal PEFT's merged model; base and two adapters in one batch equal each
alone; adapter steps run the fused CPU decoder (issue 40), a mixed batch's rows bitwise as alone; no prefix-cache block shared across adapters; the host-memory LRU re-reads an evicted
adapter; bad checkpoints and ranks over --max-lora-rank are refused naming why."""

from __future__ import annotations

import pytest
from support.lora import double_rank, edit_config, make_adapter

from kvfleet.runtime.config import EngineConfig
from kvfleet.runtime.engine.llm_engine import LLMEngine
from kvfleet.runtime.llm import LLM
from kvfleet.runtime.lora_request import LoRALoadError, LoRANotFoundError, LoRARequest
from kvfleet.runtime.sampling_params import SamplingParams
from kvfleet.runtime.spec_decode.config import SpeculativeConfig

pytestmark = pytest.mark.slow

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
TEXTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]


class Recorder:
    def __init__(self) -> None:
        self.stats = []

    def record(self, scheduler_stats, iteration_stats) -> None:
        self.stats.append(scheduler_stats)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """Two adapters (plain and rsLoRA scaling) with PEFT's merged-model tokens, and an engine
    (its own copy of the model: wrapping its layers must not touch the session's shared one)."""
    from kvfleet.runtime.worker.model_loader import load_model

    root = tmp_path_factory.mktemp("lora")
    loaded = load_model(None, dtype="float32", device="cpu")
    prompts = [loaded.tokenizer.encode(t) for t in TEXTS]
    refs = {
        "a1": make_adapter(root / "a1", 1, prompts, MAX_TOKENS),
        "a2": make_adapter(root / "a2", 2, prompts, MAX_TOKENS, alpha=4, use_rslora=True),
    }
    recorder = Recorder()
    config = EngineConfig(enable_lora=True, max_loras=2, max_lora_rank=8, max_cpu_loras=2, kv_cache_memory=64 * 2**20,
                          lora_modules=[f"a1={root / 'a1'}", {"name": "a2", "path": str(root / "a2")}])
    engine = LLMEngine(config, [recorder], loaded=loaded)
    return LLM.from_engine(engine), prompts, refs, root, recorder


def tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_adapters_give_peft_merged_tokens_and_mixed_batch_equals_alone(setup):
    llm, prompts, refs, _, _ = setup
    base_alone = tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
    # Each adapter alone: PEFT's merged model, token for token.
    assert tokens(llm.generate(prompts, GREEDY, lora_request="a1", use_tqdm=False)) == refs["a1"]
    assert refs["a1"] != base_alone and refs["a2"] != base_alone and refs["a1"] != refs["a2"]
    # Base and both adapters interleaved in one continuous batch (same packed forward passes).
    mixed = llm.generate(prompts * 3, GREEDY, lora_request=[None, "a1", "a2"] * 3, use_tqdm=False)
    got = tokens(mixed)
    for i, who in enumerate([None, "a1", "a2"] * 3):
        want = base_alone if who is None else refs[who]
        assert got[i] == want[i % 3], (i, who)
    assert llm.llm_engine.runner.lora.num_slot_loads <= 3  # slots reused, not reloaded every step


def _fused_steps(monkeypatch) -> list[tuple[int, int]]:
    """Record ``(rows, adapter rows)`` of every fused C step from now on."""
    from kvfleet.kernels.cpu_decoder import FusedDecoder

    steps: list[tuple[int, int]] = []
    step = FusedDecoder.step

    def recording(self, x, cos, sin, slots, block_tables, seq_lens, logits_indices=None, lora_slots=None):
        steps.append((x.shape[0], 0 if lora_slots is None else int((lora_slots >= 0).sum())))
        return step(self, x, cos, sin, slots, block_tables, seq_lens, logits_indices, lora_slots)

    monkeypatch.setattr(FusedDecoder, "step", recording)
    return steps


def test_adapter_steps_run_the_fused_decoder(setup, monkeypatch):
    """With LoRA on, base-model steps and steps with adapter tokens run the fused C decoder over the
    LoRA layers' base weights and slot tensors (kernels/cpu_lora.h); with its float32 kernels an
    adapter's greedy tokens are PEFT's merged model's."""
    from kvfleet.kernels import cpu_woq

    llm, prompts, refs, _, _ = setup
    if not cpu_woq.available():
        pytest.skip("no AVX2 kernels: no fused decoder here")
    path = llm.llm_engine.runner.cpu_decode
    assert path is not None and len(path.lora_modules) == 30 * 7  # every projection of every layer
    steps = _fused_steps(monkeypatch)
    base = tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
    assert steps and all(adapted == 0 for _, adapted in steps), "no base-model step ran fused"
    steps.clear()
    got = tokens(llm.generate(prompts, GREEDY, lora_request=["a2", None, "a2"], use_tqdm=False))
    assert sum(adapted for _, adapted in steps) >= 2 * (MAX_TOKENS - 1), "adapter tokens did not run fused"
    if path.matmul == "float32":  # bf16 matmuls round the base weights: the tokens may part from PEFT's
        assert [got[0], got[2]] == [refs["a2"][0], refs["a2"][2]]
    assert got[1] == base[1] and base != refs["a2"]


def test_a_mixed_batch_gives_each_request_the_bits_it_gets_alone(setup, monkeypatch):
    """Every step fused (prefill too, $KVFLEET_CPU_FUSED_PREFILL=1): base and adapter requests
    interleaved in one continuous batch get each the tokens and log-probabilities, bit for bit,
    they get alone (the fused step's rows are batch-invariant, adapter deltas included)."""
    from kvfleet.kernels import cpu_woq
    from kvfleet.runtime.worker import cpu_decode

    if not cpu_woq.available():
        pytest.skip("no AVX2 kernels: no fused decoder here")
    llm, prompts, _, _, _ = setup
    monkeypatch.setenv(cpu_decode.PREFILL_ENV, "1")
    fused = LLM.from_engine(LLMEngine(llm.llm_engine.config, loaded=llm.llm_engine.loaded))
    assert fused.llm_engine.runner.cpu_decode.prefill
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0)
    who = [None, "a1", "a2", "a1"]

    def run(indices):
        outs = fused.generate([prompts[i % 3] for i in indices], params, lora_request=[who[i] for i in indices],
                              use_tqdm=False)
        return [(list(o.outputs[0].token_ids), [e[t].logprob for t, e in zip(o.outputs[0].token_ids,
                                                                            o.outputs[0].logprobs)]) for o in outs]

    steps = _fused_steps(monkeypatch)
    together = run(range(4))
    assert any(adapted and adapted < rows for rows, adapted in steps), "no step mixed base and adapter rows"
    for i in range(4):
        assert run([i])[0] == together[i], f"request {i} ({who[i]}) differs in the mixed batch"


def test_no_prefix_cache_hit_across_adapters(setup):
    llm, prompts, _, _, recorder = setup
    prompt = prompts[0] * 12  # several full blocks
    one = SamplingParams(temperature=0, max_tokens=1)

    def hits(lora):
        recorder.stats.clear()
        llm.generate([prompt], one, lora_request=lora, use_tqdm=False)
        return sum(s.prefix_cache_hits for s in recorder.stats)

    assert hits("a1") == 0
    assert hits("a2") == 0  # same tokens, other adapter: nothing reused
    assert hits(None) == 0  # nor by the base model
    assert hits("a1") > 0  # the same adapter again: its own blocks are reused


def test_cpu_lru_rereads_an_evicted_adapter_and_runtime_load_unload(setup):
    llm, prompts, refs, root, _ = setup
    engine = llm.llm_engine
    lora = engine.add_lora("a3", str(root / "a1"))  # max_cpu_loras=2: a1's host copy is evicted
    manager = engine.runner.lora
    assert engine.loras["a1"].lora_int_id not in manager.resident_ids
    assert {o.lora_name for o in engine.loras.values()} == {"a1", "a2", "a3"}
    assert tokens(llm.generate(prompts[:1], GREEDY, lora_request="a1", use_tqdm=False)) == refs["a1"][:1]
    got = llm.generate(prompts[:1], GREEDY, lora_request=LoRARequest("a3", 99, str(root / "a1")), use_tqdm=False)
    assert tokens(got) == refs["a1"][:1]
    engine.remove_lora("a3")
    assert lora.lora_int_id not in manager.registered and "a3" not in engine.loras
    with pytest.raises(LoRANotFoundError):
        engine.add_request("gone", prompts[0], GREEDY, lora_name="a3")
    with pytest.raises(LoRANotFoundError):
        engine.remove_lora("a3")


def test_bad_adapters_are_refused_naming_why(setup, tmp_path):
    llm, _, _, root, _ = setup
    engine = llm.llm_engine
    cases = {
        "no such directory": tmp_path / "missing",
        "DoRA": edit_config(root / "a1", tmp_path / "dora", use_dora=True),
        "embedding or LM head": edit_config(root / "a1", tmp_path / "head", target_modules=["q_proj", "lm_head"]),
        "modules_to_save": edit_config(root / "a1", tmp_path / "save", modules_to_save=["lm_head"]),
        "peft_type": edit_config(root / "a1", tmp_path / "ia3", peft_type="IA3"),
    }
    for why, path in cases.items():
        with pytest.raises(LoRALoadError, match=why):
            engine.add_lora("bad", str(path))
    double_rank(root / "a1", tmp_path / "r16")
    with pytest.raises(LoRALoadError, match="over --max-lora-rank"):
        engine.add_lora("big", str(tmp_path / "r16"))
    with pytest.raises(LoRALoadError, match="already in use"):
        engine.add_lora("a1", str(root / "a1"))
    assert set(engine.loras) == {"a1", "a2"}
    # At start-up: the engine does not start with an adapter it cannot serve.
    with pytest.raises(LoRALoadError, match="over --max-lora-rank"):
        LLMEngine(EngineConfig(enable_lora=True, max_loras=2, max_lora_rank=8, kv_cache_memory=2**24,
                               lora_modules=[f"big={tmp_path / 'r16'}"]), loaded=engine.loaded)
    # ... unless told to skip what fails (the operator's pods): the others are served.
    tolerant = LLMEngine(EngineConfig(enable_lora=True, max_loras=2, max_lora_rank=8, kv_cache_memory=2**24,
                                      skip_failed_lora_modules=True,
                                      lora_modules=[f"big={tmp_path / 'r16'}", f"a9={root / 'a1'}"]),
                         loaded=engine.loaded)
    assert set(tolerant.loras) == {"a9"} and "over --max-lora-rank" in tolerant.lora_load_errors["big"]
    tolerant.remove_lora("a9")


def test_lora_refuses_what_it_cannot_run():
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLMEngine(EngineConfig(enable_lora=True, tensor_parallel_size=2))
    with pytest.raises(ValueError, match="enforce-eager"):
        LLMEngine(EngineConfig(enable_lora=True, enforce_eager=False))
    with pytest.raises(ValueError, match="enable-lora"):
        EngineConfig(lora_modules=["a=/x"])
    with pytest.raises(ValueError, match="max_cpu_loras"):
        EngineConfig(enable_lora=True, max_loras=4, max_cpu_loras=2)


def test_lora_over_an_int8_quantized_base(setup):
    """The base layers stay quantized under their LoRALinear (torchao's tensor, or the int8 of
    kvfleet's AVX2 kernels where they run); the adapter still applies."""
    import torch

    from kvfleet.runtime.worker.lora_layers import LoRALinear
    from kvfleet.runtime.worker.woq_linear import Int8Linear

    _, prompts, refs, root, _ = setup
    llm = LLM(quantization="int8", dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8,
              kv_cache_memory=2**24, lora_modules=[f"a1={root / 'a1'}"])
    layers = [m for m in llm.llm_engine.loaded.model.modules() if isinstance(m, LoRALinear)]
    quantized = [type(m.base_layer.weight).__name__ == "Int8Tensor"
                 or (isinstance(m.base_layer, Int8Linear) and m.base_layer.weight.dtype == torch.int8) for m in layers]
    assert len(layers) == 30 * 7 and all(quantized)
    out = tokens(llm.generate([prompts[0]] * 2, GREEDY, lora_request=["a1", None], use_tqdm=False))
    assert out[0] != out[1]
    assert out[0][:2] == refs["a1"][0][:2]  # int8 rounding may move later tokens


def test_speculative_decoding_with_an_adapter_gives_the_same_tokens(setup):
    # Issue 30: drafts verified in one step through the adapters' per-token deltas (on the fused CPU
    # decoder, the last token and its drafts as rows with the request's slot) give the tokens plain decoding gives.
    llm, _, _, _, _ = setup
    base = llm.llm_engine
    recorder = Recorder()
    spec = LLMEngine(base.config.model_copy(update={"speculative_config": SpeculativeConfig(method="ngram")}),
                     [recorder], loaded=base.loaded)
    text = "one two three four, one two three four, one two three four, one two"
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = tokens(llm.generate([text], params, lora_request="a1", use_tqdm=False))
    got = tokens(LLM.from_engine(spec).generate([text], params, lora_request="a1", use_tqdm=False))
    assert got == want
    assert sum(s.spec_decoding.num_accepted_tokens for s in recorder.stats if s.spec_decoding) > 0
    assert spec.scheduler.kv_cache_manager.usage == 0.0
