"""The fused CPU decode path under tensor parallelism (runtime/worker/cpu_decode_tp.py,
kernels/cpu_tp.h): which transformers tensor-parallel plans it follows (every family of the
recipes, from its own config), then real 2-rank engines (this process is rank 0, one worker
process, gloo) over tiny random checkpoints (tests/support/tiny_models.py): a Llama and a Qwen3
(q/k norms) with every step fused, prefill chunks of 16 included (transformers' forward raises on
rank 0), and a Llama of 97 tokens (LM head shards of 49 and 48 rows) and a Gemma 3 (sandwich
norms, a sliding window, two RoPE tables) with prefill in torch and decode fused over the same
cache. The LM head runs in the C step on each rank's vocabulary rows, its logits gathered. Each gives transformers' greedy tokens
(float32) and the tensor_parallel_size=1 fused path's; the C step's all-reduce ran (its call count)
and multi-row steps ran fused. Under tensor parallelism a request's tokens and log-probabilities
are bitwise the same alone and in a batch. A GLM-4 (its plan gathers gate_up) keeps transformers'
modules on both ranks, the reason logged. The matmul kind is float32 (tensor parallelism keeps
float32 weights; tests/unit/kernels/test_cpu_tp.py steps shards on every kind this CPU has)."""

from __future__ import annotations

import pytest
from support.engine_workload import count_fused_rows, run
from support.tiny_models import FAMILIES, PROMPTS, build, family_config, hf_greedy

from kvfleet.kernels import cpu_woq
from kvfleet.runtime.config import EngineConfig
from kvfleet.runtime.engine.llm_engine import LLMEngine
from kvfleet.runtime.sampling_params import SamplingParams
from kvfleet.runtime.worker import cpu_decode
from kvfleet.runtime.worker.cpu_decode_tp import plan_unsupported
from kvfleet.runtime.worker.recipes import recipe_for

pytestmark = pytest.mark.skipif(not cpu_woq.available(), reason="AVX2/FMA kernels unavailable here")

FOLLOWED = {"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma3_text", "granite"}
"""Families whose transformers tensor-parallel plan the fused step follows (cpu_decode_tp's docstring)."""
NOT_FOLLOWED = {"phi3": "one matrix", "glm": "one matrix", "glm4": "one matrix", "olmo2": "colwise_gather_output",
                "mixtral": "mixture-of-experts", "qwen3_moe": "mixture-of-experts"}
PARAMS = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=0)


def _model_plan(model_type: str) -> dict[str, str]:
    """The plan a loaded model carries (``model.tp_plan``): the config's layer plan under ``model.``,
    the embedding's and the LM head's entries."""
    config = family_config(model_type)
    plan = {f"model.{k}": v for k, v in (config.base_model_tp_plan or {}).items()}
    return plan | {"model.embed_tokens": "embedding_rowwise", "lm_head": "colwise_gather_output"}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_which_families_plans_the_fused_step_follows(family):
    recipe = recipe_for(family_config(family))
    why = plan_unsupported(_model_plan(family), recipe, "model.embed_tokens", "lm_head")
    if family in FOLLOWED:
        assert why is None
    else:
        assert why is not None and NOT_FOLLOWED[family] in why, why


def test_a_plan_it_cannot_follow_is_refused_with_its_entry():
    recipe = recipe_for(family_config("llama"))
    plan = _model_plan("llama")
    follow = lambda p: plan_unsupported(p, recipe, "model.embed_tokens", "lm_head")
    assert follow(plan) is None
    assert "model.norm" in follow(plan | {"model.norm": "sequence_parallel"})
    assert "self_attn.o_proj 'replicated'" in follow({k: v for k, v in plan.items() if "o_proj" not in k})
    assert "'rowwise'" in follow(plan | {"model.layers.*.mlp.down_proj": "rowwise_split_input"})
    assert "self_attn.q_norm" in follow(plan | {"model.layers.*.self_attn.q_norm": "colwise"})
    assert follow(plan | {"model.layers.*.self_attn.q_norm": "replicated_with_grad_allreduce"}) is None
    assert "no tensor-parallel plan" in follow({})


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """family -> (checkpoint dir, transformers' greedy tokens of PROMPTS)."""
    out = {}
    for name, family, sizes in (("llama", "llama", {}), ("qwen3", "qwen3", {}), ("gemma3_text", "gemma3_text", {}),
                                ("llama97", "llama", {"vocab_size": 97}), ("glm4", "glm4", {})):   # 97: shards 49 + 48
        path = tmp_path_factory.mktemp(name)
        out[name] = (path, hf_greedy(build(family_config(family, **sizes), path)))
    return out


def _engine(path, monkeypatch, prefill: bool, tp: int) -> LLMEngine:
    monkeypatch.setenv(cpu_decode.PREFILL_ENV, "1" if prefill else "0")   # (the worker inherits it)
    return LLMEngine(EngineConfig(model=str(path), tensor_parallel_size=tp, device="cpu", dtype="float32",
                                  num_blocks=64, max_num_batched_tokens=16))


def _tp_tokens(path, monkeypatch, prefill: bool, alone: bool = False):
    """A 2-rank engine's greedy tokens and log-probabilities of PROMPTS (and with ``alone`` each
    prompt's by itself after them), asserting that its steps ran fused."""
    eng = _engine(path, monkeypatch, prefill, 2)
    try:
        path_ = eng.runner.cpu_decode
        assert path_ is not None and path_.prefill == prefill and path_.matmul == "float32"
        assert path_._gather is not None   # the LM head ran in C on the rank's vocabulary rows, gathered
        if prefill:
            def unfused(*args, **kwargs):
                raise AssertionError("a step ran transformers' modules")

            monkeypatch.setattr(eng.runner.model, "forward", unfused)
        rows = count_fused_rows(monkeypatch)
        got, _, lps = run(eng, [list(p) for p in PROMPTS], PARAMS)
        assert path_._fused.all_reduce.calls == 2 * len(path_._fused.weights.layers) * len(rows) > 0
        assert max(rows) > (3 if prefill else 1), rows   # multi-row steps (prefill chunks) ran fused
        single = [run(eng, [list(p)], PARAMS) for p in PROMPTS] if alone else None
        return got, lps, single
    finally:
        eng.shutdown()


@pytest.mark.parametrize("family,prefill", [("qwen3", True), ("llama97", False), ("gemma3_text", False)],
                         ids=["qwen3-fused-prefill", "llama-vocab97-torch-prefill", "gemma3-torch-prefill"])
def test_two_ranks_give_transformers_and_one_ranks_tokens(checkpoints, family, prefill, monkeypatch):
    path, expected = checkpoints[family]
    got, _, _ = _tp_tokens(path, monkeypatch, prefill)
    assert got == expected
    _check_one_rank(path, expected, prefill, monkeypatch)


def _check_one_rank(path, expected, prefill: bool, monkeypatch) -> None:
    one = _engine(path, monkeypatch, prefill, 1)
    assert one.runner.cpu_decode is not None and one.runner.cpu_decode.prefill == prefill
    assert run(one, [list(p) for p in PROMPTS], PARAMS)[0] == expected


def test_llama_every_step_fused_on_two_ranks_and_a_request_has_the_same_bits_alone(checkpoints, monkeypatch):
    """Every step fused on 2 ranks: transformers' and one rank's tokens, and each request's tokens
    and log-probabilities in the batch (chunked prefills beside other requests' decode rows) equal,
    bit for bit, those of the request alone (batch invariance within tensor parallelism)."""
    path, expected = checkpoints["llama"]
    together, together_lp, single = _tp_tokens(path, monkeypatch, True, alone=True)
    assert together == expected
    for i, (alone, _, alone_lp) in enumerate(single):
        assert alone[0] == together[i] and alone_lp[0] == together_lp[i], f"request {i} differs in the batch"
    _check_one_rank(path, expected, True, monkeypatch)


def test_a_family_whose_plan_it_cannot_follow_keeps_transformers_modules(checkpoints, monkeypatch, caplog):
    """GLM-4's plan gathers its stored gate_up_proj: both ranks run transformers' modules, the
    reason in rank 0's log, and the tokens are still transformers'."""
    import logging

    path, expected = checkpoints["glm4"]
    with caplog.at_level(logging.INFO, logger=cpu_decode.__name__):
        eng = _engine(path, monkeypatch, False, 2)
    try:
        assert eng.runner.cpu_decode is None
        assert "fused CPU decode: off (tensor parallelism: glm4 stores q|k|v or gate|up as one matrix" in caplog.text
        assert run(eng, [list(p) for p in PROMPTS], PARAMS)[0] == expected
    finally:
        eng.shutdown()
