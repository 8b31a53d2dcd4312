"""The engine on the real default model: greedy outputs equal transformers' generate(),
also under preemption and chunked prefill; seeded sampling is batch- and
preemption-invariant; bad input raises ValueError naming the parameter and the engine
keeps serving."""

from __future__ import annotations

import pytest
import torch
from support.schedules import record_schedules

from kvfleet.runtime.config import EngineConfig
from kvfleet.runtime.engine.llm_engine import LLMEngine
from kvfleet.runtime.llm import LLM
from kvfleet.runtime.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

MAX_TOKENS = 24

# Eight prompts of very different lengths (3 to ~330 tokens).
PROMPTS = [
    "Hello, my name is",
    "The capital of France is a city that",
    "def fibonacci(n):\n    ",
    "Write a short poem about the sea. " * 3,
    "List three colours: red, green, and then",
    "In 1492, Columbus sailed " + "across the ocean blue and " * 12,
    "Q: What is 2 + 2? Answer briefly, then explain why.\nA:",
    "The history of the Roman Empire spans many centuries. " * 30,
]


class Recorder:
    """A stat logger that keeps everything it is given."""

    def __init__(self) -> None:
        self.scheduler: list = []
        self.iterations: list = []

    def record(self, scheduler_stats, iteration_stats) -> None:
        self.scheduler.append(scheduler_stats)
        self.iterations.append(iteration_stats)

    @property
    def preemptions(self) -> int:
        return sum(s.num_preemptions for s in self.scheduler)


def make_engine(smollm2, **kwargs) -> tuple[LLMEngine, Recorder]:
    kwargs.setdefault("kv_cache_memory", 128 * 2**20)
    recorder = Recorder()
    return LLMEngine(EngineConfig(**kwargs), [recorder], loaded=smollm2), recorder


@pytest.fixture(scope="module")
def hf_greedy(smollm2):
    """transformers generate(), greedy, one prompt at a time, on a separate plain copy of the model."""
    from kvfleet.runtime.worker.model_loader import load_model

    ref = load_model(None, dtype="float32", device="cpu")
    tok = ref.tokenizer
    expected = []
    with torch.inference_mode():
        for prompt in PROMPTS:
            ids = torch.tensor([tok.encode(prompt)])
            out = ref.model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, do_sample=False
            )
            expected.append(out[0, ids.shape[1] :].tolist())
    del ref
    return expected


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


def run_prompts(engine: LLMEngine, params=GREEDY) -> list[list[int]]:
    outs = LLM.from_engine(engine).generate(PROMPTS, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_greedy_matches_transformers(smollm2, hf_greedy):
    assert len({len(smollm2.tokenizer.encode(p)) for p in PROMPTS}) == len(PROMPTS)
    engine, recorder = make_engine(smollm2)
    assert run_prompts(engine) == hf_greedy
    assert recorder.preemptions == 0
    # Again in the same engine: prompts now come from the prefix cache, same tokens.
    outs = LLM.from_engine(engine).generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy
    assert max(o.num_cached_tokens for o in outs) >= 288  # 18 full blocks of the 301-token prompt
    assert engine.scheduler.kv_cache_manager.usage == 0.0


def test_greedy_matches_transformers_under_preemption(smollm2, hf_greedy):
    # 28 blocks of 16 tokens = 448 slots; the eight requests need 43 blocks together.
    # Longest first: it is admitted with the next few, which then outgrow the cache.
    engine, recorder = make_engine(smollm2, num_blocks=28, enable_prefix_caching=False)
    outs = LLM.from_engine(engine).generate(PROMPTS[::-1], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy[::-1]
    assert recorder.preemptions > 0


def test_greedy_matches_transformers_with_chunked_prefill(smollm2, hf_greedy):
    engine, _ = make_engine(smollm2, max_num_batched_tokens=64)
    schedules = record_schedules(engine)
    assert run_prompts(engine) == hf_greedy
    chunks = [sr for out in schedules for sr in out.scheduled if not sr.sample]
    assert chunks, "no prefill was chunked"
    assert all(out.total_num_scheduled_tokens <= 64 for out in schedules)
    # The longest prompt went through in several chunks.
    longest = max(len(smollm2.tokenizer.encode(p)) for p in PROMPTS)
    assert any(sr.start_pos > 0 and sr.start_pos < longest for sr in chunks)


SEEDED = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=1234, max_tokens=MAX_TOKENS, ignore_eos=True)


def test_seeded_sampling_alone_batched_and_preempted(smollm2):
    target = "Tell me a story about a dragon."
    engine, _ = make_engine(smollm2)
    llm = LLM.from_engine(engine)
    alone = llm.generate([target], SEEDED, use_tqdm=False)[0].outputs[0]
    assert len(alone.token_ids) == MAX_TOKENS

    # In a batch of 16 with other prompts, other seeds and unseeded requests.
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(15)] + [target]
    params = [
        SamplingParams(temperature=1.0, seed=(i if i % 2 else None), max_tokens=MAX_TOKENS - i, ignore_eos=True)
        for i in range(15)
    ] + [SEEDED]
    batched = llm.generate(prompts, params, use_tqdm=False)[-1].outputs[0]
    assert batched.token_ids == alone.token_ids
    assert batched.text == alone.text

    # Under memory pressure: the target arrives last, so it is the preemption victim.
    # 21 blocks: the 301-token prompt needs all of them by its end, so the target (which
    # runs beside it) is preempted midway and recomputed later.
    small, recorder = make_engine(smollm2, num_blocks=21, enable_prefix_caching=False)
    schedules = record_schedules(small)
    prompts = [PROMPTS[7], target]
    params = [SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True), SEEDED]
    preempted = LLM.from_engine(small).generate(prompts, params, use_tqdm=False)[-1]
    victims = {rid for out in schedules for rid in out.preempted_request_ids}
    assert preempted.request_id in victims, victims
    # It had sampled tokens before it was preempted (its generator state must carry over).
    cut = next(i for i, out in enumerate(schedules) if preempted.request_id in out.preempted_request_ids)
    sampled_before = sum(
        1 for out in schedules[:cut] for sr in out.scheduled if sr.request_id == preempted.request_id and sr.sample
    )
    assert 1 < sampled_before < MAX_TOKENS
    assert preempted.outputs[0].token_ids == alone.token_ids

    # A different seed gives different text (the seed is actually used).
    other = llm.generate([target], SEEDED.clone(seed=99), use_tqdm=False)[0].outputs[0]
    assert other.token_ids != alone.token_ids


def test_n_samples_logprobs_and_stops(smollm2):
    engine, _ = make_engine(smollm2)
    llm = LLM.from_engine(engine)
    out = llm.generate(
        "Once upon a time",
        SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, logprobs=2, ignore_eos=True),
        use_tqdm=False,
    )[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    for c in out.outputs:
        assert len(c.token_ids) == 8 and len(c.logprobs) == 8
        for token, entry in zip(c.token_ids, c.logprobs):
            assert token in entry and entry[token].logprob <= 0 and entry[token].rank >= 1
            assert len(entry) <= 3
        assert c.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(c.token_ids, c.logprobs)))

    # Greedy: the sampled token is rank 1 and equals the top logprob.
    g = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=4, logprobs=1), use_tqdm=False)
    for t, e in zip(g[0].outputs[0].token_ids, g[0].outputs[0].logprobs):
        assert e[t].rank == 1

    # Stop string, excluded and included; min_tokens keeps EOS away.
    base = llm.generate("The capital of France is", GREEDY, use_tqdm=False)[0].outputs[0]
    assert "Paris" in base.text
    cut = llm.generate("The capital of France is", GREEDY.clone(stop=["aris"]), use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == "aris"
    assert cut.text == base.text[: base.text.index("aris")]
    inc = llm.generate(
        "The capital of France is", GREEDY.clone(stop=["aris"], include_stop_str_in_output=True), use_tqdm=False
    )[0].outputs[0]
    assert inc.text == base.text[: base.text.index("aris") + 4]
    stop_id = base.token_ids[2]
    by_id = llm.generate("The capital of France is", GREEDY.clone(stop_token_ids=[stop_id]), use_tqdm=False)[0]
    assert by_id.outputs[0].token_ids == base.token_ids[:3] and by_id.outputs[0].stop_reason == stop_id

    chat = llm.chat([{"role": "user", "content": "What is the capital of France?"}], GREEDY, use_tqdm=False)
    assert "Paris" in chat[0].outputs[0].text


@pytest.mark.parametrize(
    "prompt, params, name",
    [
        ("", None, "prompt"),
        ([], None, "prompt"),
        ("Hi", lambda: SamplingParams(max_tokens=0), "max_tokens"),
        ("Hi", lambda: SamplingParams(temperature=-0.5), "temperature"),
        ("Hi", lambda: SamplingParams(top_p=0.0), "top_p"),
        ("Hi", lambda: SamplingParams(top_p=1.5), "top_p"),
        ("word " * 300, None, "max_model_len"),
        ([10**6], None, "prompt"),
    ],
)
def test_bad_input_raises_and_engine_keeps_serving(smollm2, prompt, params, name):
    engine, _ = make_engine(smollm2, max_model_len=256)
    llm = LLM.from_engine(engine)
    engine.add_request("ok", "The capital of France is", GREEDY.clone(max_tokens=4))
    engine.step()
    with pytest.raises(ValueError, match=name):
        llm.generate(prompt, params() if params else None, use_tqdm=False)
    if name == "max_model_len":
        with pytest.raises(ValueError, match="prompt"):
            engine.add_request("long", "word " * 300)
    final = engine.run_until_done()
    assert final["ok"].finished and len(final["ok"].outputs[0].token_ids) == 4
    out = llm.generate("Hello", GREEDY.clone(max_tokens=2), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 2
    assert not engine.has_unfinished_requests()
    assert engine.scheduler.kv_cache_manager.usage == 0.0


def test_abort_frees_blocks_and_stats(smollm2):
    engine, recorder = make_engine(smollm2)
    engine.add_request("a", PROMPTS[7], GREEDY)
    engine.add_request("b", PROMPTS[0], SamplingParams(max_tokens=3, temperature=0, n=2))
    engine.step()
    assert engine.scheduler.kv_cache_manager.usage > 0
    final = engine.abort_request("a")
    assert final[0].finished and final[0].outputs[0].finish_reason == "abort"
    assert any(f.finish_reason == "abort" for it in recorder.iterations for f in it.finished_requests)
    done = engine.run_until_done()
    assert set(done) == {"b"} and len(done["b"].outputs) == 2
    assert engine.scheduler.kv_cache_manager.usage == 0.0
    iters = recorder.iterations
    assert sum(len(it.time_to_first_tokens) for it in iters) == 3  # a, b-0, b-1
    assert sum(it.num_generation_tokens for it in iters) == 1 + 6
    assert sum(len(it.inter_token_latencies) for it in iters) == 4
    assert {f.finish_reason for it in iters for f in it.finished_requests} == {"abort", "length"}
    info = engine.cache_config_info()
    assert info["block_size"] == "16" and int(info["num_blocks"]) == engine.num_blocks
