"""Prompt logprobs (vLLM's ``SamplingParams.prompt_logprobs``; OpenAI completions ``echo`` +
``logprobs``) on the real default model, SmolLM2-135M-Instruct.

The reference is transformers' own forward pass on a separate plain copy of the same
weights: ``torch.log_softmax(model(input_ids).logits.float(), -1)``. Position ``i - 1``
of it scores prompt token ``i``. Tolerance: ``ATOL`` on every logprob (fp32 on CPU, the
engine's paged attention against transformers' sdpa; measured differences are ~4e-6).
Ranks and top-k ids are compared allowing only swaps between tokens whose reference
logprobs are within ``ATOL`` of each other.

Engine paths covered: a batch mixing prompt-logprob requests (k = 0, 1, 5) with others
(sampled logprobs, n = 2); chunked prefill (a token budget of 16 splits the prompt over
many steps); a request preempted (recompute) both in the middle of its prefill and after
its prompt was done (no entry lost or doubled, no position scored twice); the prefix cache
skipped; models whose forward changes the LM head's output (tiny Gemma 2,
Granite, Cohere). Server paths: ``/v1/completions`` with
``echo`` (+ ``logprobs``, streamed and not, ``max_tokens: 0``), vLLM's extra
``prompt_logprobs`` on completions and chat, its bad values (400 naming the field), and the
official ``openai`` client reading them.
"""

from __future__ import annotations

import json

import pytest
import torch
from fastapi.testclient import TestClient
from support.schedules import record_schedules

from kvfleet.runtime.config import EngineConfig
from kvfleet.runtime.engine.async_llm import AsyncLLMEngine
from kvfleet.runtime.engine.llm_engine import LLMEngine
from kvfleet.runtime.entrypoints.openai.api_server import create_app
from kvfleet.runtime.entrypoints.openai.serve_args import ServerSettings
from kvfleet.runtime.llm import LLM
from kvfleet.runtime.sampling_params import SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

ATOL = 1e-4
"""Largest allowed |engine logprob - transformers logprob| (natural log)."""

PROMPTS = [
    "The capital of France is Paris, and the capital of Germany is",
    "def fibonacci(n):\n    return",
    "Hello",
    "In 1492, Columbus sailed " + "across the ocean blue and " * 10,
]


@pytest.fixture(scope="module")
def hf_logprobs(smollm2):
    """``hf_logprobs(token_ids) -> [P, vocab]`` float32: log_softmax of transformers' own
    forward of a plain copy of the model over the whole prompt (memoized)."""
    from kvfleet.runtime.worker.model_loader import load_model

    ref = load_model(None, dtype="float32", device="cpu")
    cache: dict[tuple[int, ...], torch.Tensor] = {}

    def run(ids: list[int]) -> torch.Tensor:
        key = tuple(ids)
        if key not in cache:
            with torch.inference_mode():
                logits = ref.model(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long)).logits
            cache[key] = torch.log_softmax(logits[0].float(), dim=-1)
        return cache[key]

    return run


def make_engine(smollm2, **kw) -> LLMEngine:
    kw.setdefault("kv_cache_memory", 64 * 2**20)
    return LLMEngine(EngineConfig(**kw), loaded=smollm2)


def assert_prompt_logprobs(plp, ids: list[int], ref: torch.Tensor, k: int, tok) -> None:
    """``plp`` (RequestOutput.prompt_logprobs) against the reference ``ref`` [P, vocab]."""
    assert plp is not None and len(plp) == len(ids)
    assert plp[0] is None
    for i in range(1, len(ids)):
        row, entries, t = ref[i - 1], plp[i], ids[i]
        assert t in entries, f"position {i}: the prompt token is missing"
        assert list(entries)[0] == t, "the prompt token comes first (vLLM)"
        actual = entries[t]
        assert actual.logprob == pytest.approx(row[t].item(), abs=ATOL), f"position {i}"
        lo = int((row > row[t] + ATOL).sum()) + 1
        hi = int((row > row[t] - ATOL).sum()) + 1
        assert lo <= actual.rank <= hi, f"position {i}: rank {actual.rank}, reference {lo}..{hi}"
        assert actual.decoded_token == tok.decode([t])
        # The top k (ranks 1..k, the prompt token among them when it is one of them).
        top = sorted(((tid, lp) for tid, lp in entries.items() if lp.rank <= k), key=lambda e: e[1].rank)
        assert [lp.rank for _, lp in top] == list(range(1, k + 1)), f"position {i}: ranks of the top {k}"
        assert len(entries) == (k if actual.rank <= k else k + 1)
        if k:
            kth = row.topk(k).values[-1].item()
            for tid, lp in top:
                assert lp.logprob == pytest.approx(row[tid].item(), abs=ATOL)
                assert row[tid].item() >= kth - ATOL, f"position {i}: token {tid} is not in the reference top {k}"
            values = [lp.logprob for _, lp in top]
            assert values == sorted(values, reverse=True)


# ----------------------------------------------------------------------------- engine


def test_batch_mixing_prompt_logprobs_with_other_requests(smollm2, hf_logprobs):
    engine = make_engine(smollm2)
    tok = engine.tokenizer
    ks = [0, 1, 5, 2]
    for j, (prompt, k) in enumerate(zip(PROMPTS, ks)):
        engine.add_request(f"p{j}", prompt, SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=k, logprobs=1))
    engine.add_request("plain", PROMPTS[0], SamplingParams(temperature=0, max_tokens=4, logprobs=2))
    engine.add_request("n2", PROMPTS[1], SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=3, prompt_logprobs=3))
    first = engine.step()  # everything fits in one step: one packed batch
    assert {o.request_id for o in first} == {"p0", "p1", "p2", "p3", "plain", "n2"}
    final = engine.run_until_done()
    for j, (prompt, k) in enumerate(zip(PROMPTS, ks)):
        ids = tok.encode(prompt)
        assert_prompt_logprobs(final[f"p{j}"].prompt_logprobs, ids, hf_logprobs(ids), k, tok)
        assert len(final[f"p{j}"].outputs[0].logprobs) == 4  # the output logprobs are still there
    assert final["plain"].prompt_logprobs is None
    ids = tok.encode(PROMPTS[1])
    assert_prompt_logprobs(final["n2"].prompt_logprobs, ids, hf_logprobs(ids), 3, tok)
    assert len(final["n2"].outputs) == 2
    # The prompt-logprob request's greedy text is the one without prompt logprobs.
    assert final["p0"].outputs[0].token_ids == final["plain"].outputs[0].token_ids
    assert engine.scheduler.kv_cache_manager.usage == 0.0


def test_one_token_prompt_has_only_the_leading_none(smollm2):
    engine = make_engine(smollm2)
    engine.add_request("one", [9906], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=4))
    assert engine.run_until_done()["one"].prompt_logprobs == [None]


def test_a_failure_in_prompt_logprobs_aborts_only_that_request(smollm2, monkeypatch):
    engine = make_engine(smollm2)

    def boom(*_args):
        raise RuntimeError("boom")

    monkeypatch.setattr(engine.output_processor, "add_prompt_logprobs", boom)
    engine.add_request("bad", PROMPTS[0], SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=1))
    engine.add_request("good", PROMPTS[1], SamplingParams(temperature=0, max_tokens=3))
    outs = engine.run_until_done()
    bad = outs["bad"]
    assert bad.finished and bad.outputs[0].finish_reason == "abort"
    assert bad.extra["error"] == "RuntimeError: boom"
    assert outs["good"].outputs[0].finish_reason == "length" and len(outs["good"].outputs[0].token_ids) == 3
    assert engine.scheduler.kv_cache_manager.usage == 0.0


def test_chunked_prefill_accumulates(smollm2, hf_logprobs):
    engine = make_engine(smollm2, max_num_batched_tokens=16)
    schedules = record_schedules(engine)
    tok = engine.tokenizer
    prompt = PROMPTS[3] + " then the story went on, " * 3
    ids = tok.encode(prompt)
    engine.add_request("long", prompt, SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2))
    engine.add_request("other", PROMPTS[0], SamplingParams(temperature=0, max_tokens=6, prompt_logprobs=1))
    outputs = []
    while engine.has_unfinished_requests():
        outputs.extend(o for o in engine.step() if o.request_id == "long")
    chunks = [sr for out in schedules for sr in out.scheduled if sr.request_id == "long" and not sr.sample]
    assert len(chunks) >= len(ids) // 16 - 1, "the prompt was not chunked"
    # From its first output on, the prompt logprobs are complete (and stay so).
    assert all(len(o.prompt_logprobs) == len(ids) for o in outputs)
    assert_prompt_logprobs(outputs[-1].prompt_logprobs, ids, hf_logprobs(ids), 2, tok)


def test_preempted_request_neither_duplicates_nor_loses_entries(smollm2, hf_logprobs):
    # 14 blocks of 16 tokens, 8 tokens a step: A (121-token prompt, 60 tokens out), C
    # (13-token prompt, 16 out) and B (60-token prompt, priority 1 so that it is the victim)
    # do not fit together. The scheduler admits B only when its whole prompt fits beside
    # the others' next tokens (see docs/scheduling.md), but A's and C's later growth still
    # preempts B once in the middle of its prefill and, after C finished, once after its
    # prompt was done (mid-decode).
    engine = make_engine(smollm2, num_blocks=14, block_size=16, max_num_batched_tokens=8, enable_prefix_caching=False)
    schedules = record_schedules(engine)
    scored = []  # the prompt tokens of B whose logprobs the model runner computed, step by step
    execute = engine.runner.execute_model

    def recording(scheduler_output):
        result = execute(scheduler_output)
        plp = result.prompt_logprobs.get("B")
        if plp is not None:
            scored.extend(range(plp.first_token, plp.first_token + len(plp.token_logprobs)))
        return result

    engine.runner.execute_model = recording
    tok = engine.tokenizer
    a = "The history of the Roman Empire spans many centuries. " * 12
    ids = tok.encode(PROMPTS[3])
    engine.add_request("A", a, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
    engine.add_request("C", PROMPTS[0], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    engine.add_request("B", PROMPTS[3], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=3),
                       priority=1)  # fmt: skip
    final = engine.run_until_done()
    preempted_at = []
    computed = 0
    for out in schedules:
        if "B" in out.preempted_request_ids:
            preempted_at.append(computed)
            computed = 0
        for sr in out.scheduled:
            if sr.request_id == "B":
                computed = sr.seq_len
    assert any(c > len(ids) for c in preempted_at), f"B was not preempted after its prompt: {preempted_at}"
    assert any(0 < c < len(ids) for c in preempted_at), f"B was not preempted during its prefill: {preempted_at}"
    assert_prompt_logprobs(final["B"].prompt_logprobs, ids, hf_logprobs(ids), 3, tok)
    # Recomputing its prompt after a preemption, B's positions already scored are not scored again.
    assert sorted(scored) == list(range(1, len(ids)))
    alone = LLM.from_engine(make_engine(smollm2)).generate(
        PROMPTS[3], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False
    )[0]
    assert final["B"].outputs[0].token_ids == alone.outputs[0].token_ids


def test_prompt_logprobs_skip_the_prefix_cache(smollm2, hf_logprobs):
    engine = make_engine(smollm2)
    tok = engine.tokenizer
    ids = tok.encode(PROMPTS[3])
    llm = LLM.from_engine(engine)
    llm.generate(PROMPTS[3], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    again = llm.generate(PROMPTS[3], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0]
    assert again.num_cached_tokens == 0
    assert_prompt_logprobs(again.prompt_logprobs, ids, hf_logprobs(ids), 1, tok)


@pytest.mark.parametrize("value", [-1, 21, -2, 2.5])
def test_bad_prompt_logprobs_raise_naming_the_field(smollm2, value):
    with pytest.raises(ValueError, match="^prompt_logprobs"):
        SamplingParams(prompt_logprobs=value)


# ----------------------------------------------------------------------------- server


@pytest.fixture(scope="module")
def client(smollm2):
    def real_engine(cfg: EngineConfig, stat_loggers: list) -> AsyncLLMEngine:
        return AsyncLLMEngine(cfg, stat_loggers, loaded=smollm2)

    config = EngineConfig(kv_cache_memory=32 * 2**20, max_model_len=128)
    app = create_app(config, ServerSettings(), engine_factory=real_engine)
    with TestClient(app) as c:
        for _ in range(1200):
            if c.get("/ready").status_code == 200:
                break
            import time

            time.sleep(0.1)
        yield c


def sse_events(resp) -> list:
    events = []
    for line in resp.text.split("\n"):
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def assert_echo_logprobs(lp: dict, ids: list[int], ref: torch.Tensor, k: int, tok) -> None:
    """Legacy completions logprobs of the echoed prompt (the first len(ids) entries)."""
    assert lp["tokens"][: len(ids)] == [tok.decode([t]) for t in ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    want = [ref[i - 1, ids[i]].item() for i in range(1, len(ids))]
    assert lp["token_logprobs"][1 : len(ids)] == pytest.approx(want, abs=ATOL)
    for i in range(1, len(ids)):
        top = lp["top_logprobs"][i]
        assert tok.decode([ids[i]]) in top and k <= len(top) <= k + 1
    n = len(lp["tokens"])
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:j]) for j in range(n)]


def test_completions_echo_with_logprobs(client, smollm2, hf_logprobs):
    tok = smollm2.tokenizer
    prompt = PROMPTS[0]
    ids = tok.encode(prompt)
    plain = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4, "temperature": 0, "logprobs": 2})
    r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4, "temperature": 0, "logprobs": 2, "echo": True})
    assert plain.status_code == 200 and r.status_code == 200, r.text
    choice, completion = r.json()["choices"][0], plain.json()["choices"][0]
    assert choice["text"] == prompt + completion["text"]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 4
    assert_echo_logprobs(lp, ids, hf_logprobs(ids), 2, tok)
    # The completion's own logprobs follow the prompt's, unchanged.
    assert lp["tokens"][len(ids):] == completion["logprobs"]["tokens"]
    assert lp["token_logprobs"][len(ids):] == pytest.approx(completion["logprobs"]["token_logprobs"], abs=1e-5)
    # vLLM also returns the raw prompt_logprobs on the choice (echo implies prompt_logprobs=logprobs).
    plp = choice["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids)
    assert plp[1][str(ids[1])]["logprob"] == pytest.approx(hf_logprobs(ids)[0, ids[1]].item(), abs=ATOL)
    assert r.json()["usage"]["prompt_tokens"] == len(ids) and r.json()["usage"]["completion_tokens"] == 4

    # Streamed: the prompt (text and logprobs) is the first chunk of the choice.
    s = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4, "temperature": 0, "logprobs": 2,
                                             "echo": True, "stream": True})  # fmt: skip
    events = [e for e in sse_events(s) if e != "[DONE]"]
    assert events[0]["choices"][0]["text"] == prompt
    assert "".join(e["choices"][0]["text"] for e in events) == choice["text"]
    merged = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for e in events:
        part = e["choices"][0]["logprobs"]
        for key in merged:
            merged[key] += part[key] if part else []
    assert merged["tokens"] == lp["tokens"] and merged["text_offset"] == lp["text_offset"]
    assert merged["token_logprobs"][1:] == pytest.approx(lp["token_logprobs"][1:], abs=1e-5)


def test_completions_echo_without_logprobs_and_max_tokens_zero(client, smollm2, hf_logprobs):
    tok = smollm2.tokenizer
    r = client.post("/v1/completions", json={"prompt": "Hello there", "max_tokens": 3, "temperature": 0, "echo": True})
    plain = client.post("/v1/completions", json={"prompt": "Hello there", "max_tokens": 3, "temperature": 0})
    assert r.json()["choices"][0]["text"] == "Hello there" + plain.json()["choices"][0]["text"]
    assert r.json()["choices"][0]["logprobs"] is None and r.json()["choices"][0]["prompt_logprobs"] is None
    # Token-id prompts are echoed as their decoded text.
    ids = tok.encode(PROMPTS[1])
    r = client.post("/v1/completions", json={"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 1})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"] == tok.decode(ids)  # max_tokens 0: the prompt only (scoring, as lm-eval-harness asks)
    assert len(choice["logprobs"]["tokens"]) == len(ids)
    assert_echo_logprobs(choice["logprobs"], ids, hf_logprobs(ids), 1, tok)
    s = client.post("/v1/completions", json={"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 1, "stream": True})
    events = [e for e in sse_events(s) if e != "[DONE]"]
    assert "".join(e["choices"][0]["text"] for e in events) == tok.decode(ids)
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    # Without echo, max_tokens 0 is still an error.
    bad = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 0})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"


def test_prompt_logprobs_extra_parameter(client, smollm2, hf_logprobs):
    tok = smollm2.tokenizer
    prompt = PROMPTS[1]
    ids = tok.encode(prompt)
    r = client.post("/v1/completions", json={"prompt": [prompt, "Hello"], "max_tokens": 2, "temperature": 0,
                                             "prompt_logprobs": 3, "n": 2})  # fmt: skip
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert len(choices) == 4 and all(c["logprobs"] is None for c in choices)
    for c in choices[:2]:
        plp = c["prompt_logprobs"]
        assert len(plp) == len(ids) and plp[0] is None
        ref = hf_logprobs(ids)
        for i in range(1, len(ids)):
            entry = plp[i][str(ids[i])]
            assert entry["logprob"] == pytest.approx(ref[i - 1, ids[i]].item(), abs=ATOL)
            assert entry["decoded_token"] == tok.decode([ids[i]])
            ranks = sorted(v["rank"] for key, v in plp[i].items() if key != str(ids[i]) or v["rank"] <= 3)
            assert [x for x in ranks if x <= 3] == [1, 2, 3]
    assert choices[2]["prompt_logprobs"] == [None]  # "Hello" is one token

    chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 2,
                                                     "prompt_logprobs": 0})  # fmt: skip
    assert chat.status_code == 200, chat.text
    text = tok.apply_chat_template([{"role": "user", "content": "Hi!"}], tokenize=False, add_generation_prompt=True)
    chat_ids = tok.encode(text, add_special_tokens=False)
    plp = chat.json()["prompt_logprobs"]  # on the response, as vLLM's chat
    assert len(plp) == len(chat_ids) and plp[0] is None
    assert all(list(entry) == [str(t)] for entry, t in zip(plp[1:], chat_ids[1:]))  # k = 0: the prompt token only
    want = [hf_logprobs(chat_ids)[i - 1, chat_ids[i]].item() for i in range(1, len(chat_ids))]
    assert [entry[str(t)]["logprob"] for entry, t in zip(plp[1:], chat_ids[1:])] == pytest.approx(want, abs=ATOL)


BAD = [
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": -1}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": -3}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": "2"}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 2, "stream": True}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "hi", "echo": True, "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "echo": "yes"}, "echo"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 30}, "prompt_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 1, "stream": True},
     "prompt_logprobs"),
]


@pytest.mark.parametrize("path,body,param", BAD)
def test_bad_values_are_400_naming_the_field(client, path, body, param):
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"]
    ok = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "prompt_logprobs": 1})
    assert ok.status_code == 200 and len(ok.json()["choices"][0]["prompt_logprobs"]) == 1


def test_official_openai_client_reads_echo_and_prompt_logprobs(client, smollm2, hf_logprobs):
    import openai

    tok = smollm2.tokenizer
    prompt = "Hello there, how are you"
    ids = tok.encode(prompt)
    oc = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=client, max_retries=0)
    r = oc.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    choice = r.choices[0]
    assert choice.text == prompt
    assert choice.logprobs.tokens == [tok.decode([t]) for t in ids]
    assert choice.logprobs.token_logprobs[0] is None
    want = [hf_logprobs(ids)[i - 1, ids[i]].item() for i in range(1, len(ids))]
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(want, abs=ATOL)
    r = oc.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=1, extra_body={"prompt_logprobs": 0})
    plp = r.choices[0].model_extra["prompt_logprobs"]
    assert plp[0] is None and [list(e) for e in plp[1:]] == [[str(t)] for t in ids[1:]]


def _tiny_config(name: str):
    """Tiny random configs (support/tiny_models.py's sizes) of models whose forward
    changes the LM head's output: Gemma 2 soft-caps it (tanh(x / cap) * cap), Granite divides
    it by ``logits_scaling``, Cohere multiplies it by ``logit_scale``."""
    from support.tiny_models import COMMON, configs
    from transformers import CohereConfig, GraniteConfig

    if name == "gemma2":
        config = configs()["gemma2"]
        assert config.final_logit_softcapping == 3.0
        return config
    if name == "granite":
        return GraniteConfig(logits_scaling=4.0, **COMMON)
    return CohereConfig(logit_scale=0.25, **COMMON)


@pytest.mark.parametrize("name", ["gemma2", "granite", "cohere"])
def test_models_that_change_the_lm_head_output(tmp_path, name):
    # The prompt logprobs repeat what the model's forward does after its LM head (the
    # soft-cap from the config; a constant factor fitted at load), against the model's own
    # eager transformers forward.
    from support.tiny_models import PROMPTS as TOKEN_PROMPTS
    from support.tiny_models import build

    from kvfleet.runtime.worker.model_loader import load_model

    ref = build(_tiny_config(name), tmp_path)
    loaded = load_model(str(tmp_path), dtype="float32", device="cpu")
    engine = LLMEngine(EngineConfig(block_size=4, max_num_batched_tokens=8, kv_cache_memory=4 * 2**20), loaded=loaded)
    assert engine.runner.prompt_logprobs_error is None
    expected_scale = {"gemma2": 1.0, "granite": 1 / 4.0, "cohere": 0.25}[name]
    assert engine.runner._logit_scale == pytest.approx(expected_scale, rel=1e-5)
    for j, ids in enumerate(TOKEN_PROMPTS):
        engine.add_request(f"g{j}", list(ids), SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3))
    final = engine.run_until_done()
    for j, ids in enumerate(TOKEN_PROMPTS):
        with torch.no_grad():
            logits = ref(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long)).logits[0]
        if name == "gemma2":
            assert logits.abs().max() < 3.0  # capped
        assert_prompt_logprobs(final[f"g{j}"].prompt_logprobs, list(ids), torch.log_softmax(logits.float(), -1), 3,
                               loaded.tokenizer)  # fmt: skip


def test_streamed_echo_of_several_prompts_and_choices(client, smollm2):
    tok = smollm2.tokenizer
    prompts = ["The capital of France is", "def add(a, b):"]
    body = {"prompt": prompts, "n": 2, "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 1,
            "prompt_logprobs": 4}  # fmt: skip
    full = client.post("/v1/completions", json=body)
    assert full.status_code == 200, full.text
    choices = full.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    for c in choices:
        prompt = prompts[c["index"] // 2]
        n = len(tok.encode(prompt))
        assert c["text"].startswith(prompt) and len(c["logprobs"]["tokens"]) == n + 3
        # The legacy top_logprobs keep logprobs=1 (the token and the best one), while the raw
        # prompt_logprobs hold the explicit prompt_logprobs=4.
        assert all(1 <= len(top) <= 2 for top in c["logprobs"]["top_logprobs"][1:])
        assert all(len(entry) in (4, 5) for entry in c["prompt_logprobs"][1:])
    s = client.post("/v1/completions", json={**body, "prompt_logprobs": None, "stream": True,
                                             "stream_options": {"include_usage": True}})  # fmt: skip
    events = [e for e in sse_events(s) if e != "[DONE]"]
    texts: dict[int, str] = {}
    for e in events:
        for c in e["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
    assert texts == {c["index"]: c["text"] for c in choices}
    assert events[-1]["choices"] == [] and events[-1]["usage"] == full.json()["usage"]


def test_echo_top_logprobs_follow_logprobs_when_prompt_logprobs_is_smaller(client, smollm2, hf_logprobs):
    """``echo`` + ``logprobs: 3`` + ``prompt_logprobs: 0``: the echoed prompt's legacy
    top_logprobs still hold the top 3 (as without ``prompt_logprobs``), while the raw
    ``prompt_logprobs`` hold what they asked for, the prompt token only."""
    tok = smollm2.tokenizer
    prompt = PROMPTS[0]
    ids = tok.encode(prompt)
    body = {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 3, "temperature": 0}
    r = client.post("/v1/completions", json={**body, "prompt_logprobs": 0})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert_echo_logprobs(choice["logprobs"], ids, hf_logprobs(ids), 3, tok)
    ref = hf_logprobs(ids)
    for i in range(1, len(ids)):
        best = ref[i - 1].topk(3).indices.tolist()
        assert {tok.decode([t]) for t in best} <= set(choice["logprobs"]["top_logprobs"][i]), f"position {i}"
    plp = choice["prompt_logprobs"]
    assert plp[0] is None and [list(entry) for entry in plp[1:]] == [[str(t)] for t in ids[1:]]
    without = client.post("/v1/completions", json=body).json()["choices"][0]
    assert without["logprobs"]["top_logprobs"][1:] == [pytest.approx(t, abs=1e-5) for t in choice["logprobs"]["top_logprobs"][1:]]
    assert all(len(entry) in (3, 4) for entry in without["prompt_logprobs"][1:])
    # A larger prompt_logprobs is returned whole, the legacy top_logprobs keep logprobs.
    more = client.post("/v1/completions", json={**body, "prompt_logprobs": 5}).json()["choices"][0]
    assert all(len(entry) in (5, 6) for entry in more["prompt_logprobs"][1:])
    assert all(3 <= len(top) <= 4 for top in more["logprobs"]["top_logprobs"][1:])
    # Out-of-range values are still refused, naming the field sent.
    bad = client.post("/v1/completions", json={**body, "prompt_logprobs": -1})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt_logprobs"
