"""Tensor parallelism (``tensor_parallel_size``, :mod:`kvfleet.runtime.worker.executor`) on the
CPU with the real SmolLM2-135M: 9 attention heads and 3 KV heads, so 3 ranks split it
(3 query heads and 1 KV head each) and 2 ranks are refused.

The TP engine runs 3 real processes (this one is rank 0, the driver worker; two workers)
over gloo, with transformers' own tensor-parallel plan for Llama (decode steps run the fused C
step on each rank's shard, its all-reduces inside the step: runtime/worker/cpu_decode_tp.py). Its greedy tokens and
prompt logprobs are compared with the ``tensor_parallel_size=1`` engine's, through
continuous batching (requests added while others decode). The fault tests kill real
processes: a dead worker must be an engine error (not a hang). Through ``kvfleet serve``:
tests/e2e/test_tensor_parallel_serve.py.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
from support.procfs import children, running, worker_pids

from kvfleet.runtime.config import EngineConfig
from kvfleet.runtime.engine.llm_engine import LLMEngine
from kvfleet.runtime.entrypoints.openai.serve_args import parse_serve_args
from kvfleet.runtime.sampling_params import SamplingParams
from kvfleet.runtime.worker.executor import TensorParallelError, check_tensor_parallel

KV_CACHE_MEMORY = 32 * 2**20
"""A small KV cache (bytes, all ranks together): the test needs a few blocks, not 2 GiB."""
PROMPTS = [
    "The capital of France is",
    "1, 2, 3, 4,",
    "Hello, my name is",
    "def fibonacci(n):",
]
MAX_TOKENS = 8


def _config(tp: int, **kw) -> EngineConfig:
    return EngineConfig(tensor_parallel_size=tp, device="cpu", dtype="float32", kv_cache_memory=KV_CACHE_MEMORY, **kw)


def _generate_staggered(engine: LLMEngine, params: SamplingParams) -> tuple[dict[str, list[int]], int, dict]:
    """Two requests first, two more after two steps (they join a running batch).

    Returns: token ids per request id, the largest number of running requests in one step,
    and the final outputs."""
    for i in range(2):
        engine.add_request(f"r{i}", PROMPTS[i], params)
    most_running = 0
    final = {}
    for step in range(200):
        if step == 2:
            for i in range(2, len(PROMPTS)):
                engine.add_request(f"r{i}", PROMPTS[i], params)
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        most_running = max(most_running, engine.num_running)
    tokens = {rid: out.outputs[0].token_ids for rid, out in final.items()}
    return tokens, most_running, final


# ------------------------------------------------------------------ configuration (fast)
def test_field_flag_and_env_var():
    assert EngineConfig().tensor_parallel_size == 1
    assert parse_serve_args(["--tensor-parallel-size", "3"], environ={}).engine.tensor_parallel_size == 3
    assert parse_serve_args([], environ={"KVFLEET_TENSOR_PARALLEL_SIZE": "4"}).engine.tensor_parallel_size == 4
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(tensor_parallel_size=0)


def test_heads_must_divide(smollm2):
    hf_config = smollm2.model.config
    check_tensor_parallel(hf_config, 3, "SmolLM2")
    check_tensor_parallel(hf_config, 1, "SmolLM2")
    heads_msg = r"tensor_parallel_size \(2\) must divide the model's num_attention_heads \(9\)"
    with pytest.raises(ValueError, match=heads_msg):
        check_tensor_parallel(hf_config, 2, "SmolLM2")
    kv_heads_msg = r"tensor_parallel_size \(9\) must divide the model's num_key_value_heads \(3\)"
    with pytest.raises(ValueError, match=kv_heads_msg):
        check_tensor_parallel(hf_config, 9, "SmolLM2")


@pytest.mark.parametrize("family", ["phi3", "olmo2"])
def test_a_plan_that_gathers_the_attention_projections_is_refused(family):
    """Phi-3's (qkv_proj) and OLMo 2's (q/k/v) plans gather the projections' outputs: every rank
    would compute all KV heads into a cache sized for its share (it failed at the first step)."""
    from support.tiny_models import family_config

    with pytest.raises(ValueError, match=r"tensor_parallel_size \(2\): M's tensor-parallel plan gathers its attention "
                                         r"projections .*colwise_gather_output.*all 2 KV heads.* holds 1"):
        check_tensor_parallel(family_config(family), 2, "M")
    check_tensor_parallel(family_config("llama"), 2, "M")
    check_tensor_parallel(family_config("glm4"), 2, "M")   # q/k/v colwise (its gate_up gathered: fine)


def test_engine_refuses_tp2_before_starting_any_process():
    before = set(children(os.getpid()))
    with pytest.raises(ValueError, match=r"tensor_parallel_size \(2\) must divide .*num_attention_heads \(9\)"):
        LLMEngine(_config(2))
    assert set(children(os.getpid())) == before


def test_engine_refuses_a_shared_model_and_a_single_cuda_device(smollm2):
    with pytest.raises(ValueError, match="tensor_parallel_size > 1: the engine loads its own shards"):
        LLMEngine(_config(3), loaded=smollm2)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLMEngine(_config(3).model_copy(update={"device": "cuda:1"}))


def test_operator_configmap_carries_tensor_parallel_size(tmp_path):
    """The operator writes ``engine.tensorParallelSize`` into the runtime's config file now
    that EngineConfig knows the key, and ``kvfleet serve --config`` reads it back."""
    import yaml
    from support.paths import ROOT

    from kvfleet.operator import builders, crd

    isvc = yaml.safe_load((ROOT / "examples/inferenceservice-gpu-tp2.yaml").read_text())
    isvc["metadata"].update(uid="0000", generation=1)
    cm = next(c for c in builders.desired_children(crd.apply_defaults(isvc)) if c["kind"] == "ConfigMap")
    config_file = tmp_path / "config.yaml"
    config_file.write_text(cm["data"]["config.yaml"])
    assert yaml.safe_load(config_file.read_text())["tensor_parallel_size"] == 2
    assert parse_serve_args(["--config", str(config_file)], environ={}).engine.tensor_parallel_size == 2
    isvc["spec"]["engine"]["tensorParallelSize"] = 1  # the runtime default is not written
    assert "tensor_parallel_size" not in builders.engine_config(crd.apply_defaults(isvc))


# ------------------------------------------------------------------ 3 processes (slow)
@pytest.fixture(scope="module")
def tp_engine():
    engine = LLMEngine(_config(3))
    yield engine
    engine.shutdown()


@pytest.mark.slow
def test_tp3_greedy_tokens_equal_tp1_through_continuous_batching(tp_engine, smollm2):
    ref_engine = LLMEngine(_config(1), loaded=smollm2)
    # Each rank caches 1 of the 3 KV heads in a third of the budget: as many blocks as tp=1.
    assert tp_engine.runner.num_kv_heads == 1 and tp_engine.runner.num_heads == 3
    assert tp_engine.runner.kv_caches[0][0].shape[2] == 1
    assert tp_engine.num_blocks == ref_engine.num_blocks
    assert tp_engine.model_name == ref_engine.model_name == "SmolLM2-135M-Instruct"
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    tp_tokens, tp_running, _ = _generate_staggered(tp_engine, params)
    ref_tokens, _, ref_final = _generate_staggered(ref_engine, params)
    assert tp_running >= 3  # requests joined a running batch
    assert set(tp_tokens) == {f"r{i}" for i in range(len(PROMPTS))}
    assert all(len(t) == MAX_TOKENS for t in tp_tokens.values())
    assert tp_tokens == ref_tokens
    assert "Paris" in ref_final["r0"].outputs[0].text
    # decode ran the fused C step on each rank's shard, 3 ranks: the partials all-gathered, added in rank order
    fused = tp_engine.runner.cpu_decode
    assert fused is not None and fused._fused.all_reduce.world == 3 and fused._fused.all_reduce.calls > 0


@pytest.mark.slow
def test_tp3_prompt_logprobs_equal_tp1(tp_engine, smollm2):
    """Prompt logprobs run the LM head outside the model's forward: its all-gather must
    reach the workers too."""
    ref_engine = LLMEngine(_config(1), loaded=smollm2)
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3)
    results = []
    for engine in (tp_engine, ref_engine):
        engine.add_request("p", PROMPTS[0], params)
        results.append(engine.run_until_done()["p"])
    tp_out, ref_out = results
    assert tp_out.outputs[0].token_ids == ref_out.outputs[0].token_ids
    assert len(tp_out.prompt_logprobs) == len(ref_out.prompt_logprobs) == len(tp_out.prompt_token_ids)
    for tp_pos, ref_pos in zip(tp_out.prompt_logprobs[1:], ref_out.prompt_logprobs[1:]):
        assert set(tp_pos) == set(ref_pos)
        for tid, lp in ref_pos.items():
            assert abs(tp_pos[tid].logprob - lp.logprob) < 1e-4


@pytest.mark.slow
def test_dead_worker_is_an_engine_error_and_shutdown_reaps_all(tp_engine):
    """Runs last on the module's TP engine (it kills a worker)."""
    procs = list(tp_engine.executor.procs)
    assert all(running(p.pid) for p in procs)
    tp_engine.add_request("x", PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=50))
    tp_engine.step()
    os.kill(procs[1].pid, signal.SIGKILL)
    with pytest.raises(TensorParallelError, match=rf"rank 2 \(pid {procs[1].pid}\)"):
        for _ in range(50):  # the first step after the kill fails (a collective or the liveness check)
            tp_engine.step()
    tp_engine.shutdown()
    assert all(p.poll() is not None for p in procs)
    assert not any(running(p.pid) for p in procs)
    tp_engine.abort_request("x")
    tp_engine.add_request("y", PROMPTS[1], SamplingParams(max_tokens=1))
    with pytest.raises(TensorParallelError, match="shut down"):
        tp_engine.step()


@pytest.mark.slow
def test_failure_on_the_driver_alone_is_an_error_not_a_hang():
    """A forward pass that fails on rank 0 mid-way leaves the workers waiting in a collective:
    the step raises the driver's error, later steps refuse to run, and shutdown terminates the
    workers instead of talking to them. (The failure is injected with a forward pre-hook on
    rank 0's 4th decoder layer.)"""
    engine = LLMEngine(_config(3))
    try:
        procs = list(engine.executor.procs)
        layer = engine.runner.model.get_decoder().layers[3]

        def fail(_module, _args):
            raise RuntimeError("injected failure on rank 0")

        handle = layer.register_forward_pre_hook(fail)
        engine.add_request("a", PROMPTS[0], SamplingParams(max_tokens=4))
        with pytest.raises(RuntimeError, match="injected failure on rank 0"):
            engine.step()
        handle.remove()
        engine.add_request("b", PROMPTS[1], SamplingParams(max_tokens=4))
        with pytest.raises(TensorParallelError, match="out of step"):
            engine.step()
        t0 = time.monotonic()
        engine.shutdown()
        assert time.monotonic() - t0 < 8  # terminated at once, no 10 s wait for a stop
        assert not any(running(p.pid) for p in procs)
    finally:
        engine.shutdown()


@pytest.mark.slow
def test_failed_start_stops_the_workers():
    """A configuration error found after the workers started (max_model_len beyond the
    model's context) is a ValueError, and no worker or process group is left behind."""
    import torch.distributed as dist

    with pytest.raises(ValueError, match=r"max_model_len \(100000\) is longer than the model's context"):
        LLMEngine(_config(3, max_model_len=100_000))
    assert worker_pids(os.getpid()) == []
    assert not dist.is_initialized()
