"""runtime/worker/pipeline.py: vLLM's layer split and its override, and a real pipeline-parallel
engine (rank 0 here, rank 1 its own process, gloo on 127.0.0.1) over a tiny 3-layer Llama: greedy
tokens equal to one process through continuous batching, each stage holding only its layers'
weights and KV cache, two micro-batches in flight, the clear refusals, and a killed stage
failing the engine within seconds.
Across two "nodes" with the launch flags, PP x TP included: tests/e2e/test_multinode_serve.py."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from support import tiny_models

from kvfleet.runtime.config import EngineConfig
from kvfleet.runtime.engine.llm_engine import LLMEngine
from kvfleet.runtime.sampling_params import SamplingParams
from kvfleet.runtime.worker.executor import TensorParallelError
from kvfleet.runtime.worker.pipeline import PARTITION_ENV, get_pp_indices, layer_partition

GEN = 6


@pytest.mark.parametrize(("layers", "pp", "parts"), [
    (32, 4, [8, 8, 8, 8]), (32, 3, [11, 11, 10]), (3, 2, [2, 1]), (5, 4, [1, 1, 2, 1]), (2, 2, [1, 1]),
])
def test_layer_partition_is_vllms(layers, pp, parts, monkeypatch):
    """vLLM's get_pp_indices: the remainder one layer each to the stages before the last."""
    monkeypatch.delenv(PARTITION_ENV, raising=False)
    assert layer_partition(layers, pp) == parts
    starts = [sum(parts[:i]) for i in range(pp)]
    assert [get_pp_indices(layers, r, pp) for r in range(pp)] == [(s, s + n) for s, n in zip(starts, parts)]


def test_layer_partition_override_and_its_errors(monkeypatch):
    monkeypatch.setenv(PARTITION_ENV, "1,2")
    assert get_pp_indices(3, 0, 2) == (0, 1) and get_pp_indices(3, 1, 2) == (1, 3)
    for text, message in (("1,x", "comma-separated"), ("1,1,1", "3 stages, pipeline_parallel_size is 2"),
                          ("3,0", "at least one layer"), ("1,1", "2 layers, the model has 3")):
        with pytest.raises(ValueError, match=f"{PARTITION_ENV}=.*{message}"):
            layer_partition(3, 2, text)
    with pytest.raises(ValueError, match=r"pipeline_parallel_size \(4\) is more than the model's 3 layers"):
        layer_partition(3, 4, "")


def test_pipeline_refuses_what_it_cannot_run():
    for opts in ({"enable_lora": True, "enforce_eager": True}, {"quantization": "int8"},
                 {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}):
        with pytest.raises(ValueError, match="pipeline_parallel_size > 1: not supported"):
            EngineConfig(pipeline_parallel_size=2, **opts).check_engine_support()


@pytest.fixture(scope="module")
def tiny3(tmp_path_factory):
    from transformers import LlamaConfig

    path = tmp_path_factory.mktemp("llama-3-layers")
    tiny_models.build(LlamaConfig(**{**tiny_models.COMMON, "num_hidden_layers": 3}), path)
    return path


def _config(path, **kw) -> EngineConfig:
    return EngineConfig(model=str(path), device="cpu", dtype="float32", kv_cache_memory=8 * 2**20, **kw)


def _greedy(engine: LLMEngine) -> dict[str, list[int]]:
    """The tiny prompts through continuous batching: the third joins a step late (with two
    micro-batches, while the first two requests' step is in flight)."""
    params = SamplingParams(temperature=0.0, max_tokens=GEN, ignore_eos=True)
    engine.add_request("0", tiny_models.PROMPTS[0], params)
    engine.add_request("1", tiny_models.PROMPTS[1], params)
    final = {}
    for step in range(100):
        if step == 1:
            engine.add_request("2", tiny_models.PROMPTS[2], params)
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out.outputs[0].token_ids
        if not engine.has_unfinished_requests():
            break
    return final


@pytest.fixture(scope="module")
def one_process(tiny3):
    engine = LLMEngine(_config(tiny3))
    try:
        return _greedy(engine)
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def pp_engine(tiny3):
    engine = LLMEngine(_config(tiny3, pipeline_parallel_size=2))
    yield engine
    engine.shutdown()


@pytest.mark.slow  # processes: the module's engine starts ~10-30 s on 2 shared cores
def test_pp2_greedy_tokens_equal_one_process_with_two_micro_batches_in_flight(pp_engine, one_process):
    """Once the third request joins, two micro-batches are in flight (the stages overlap) and a
    request is never in both (engine/micro_batches, the scheduler's ``in_flight``)."""
    assert len(one_process) == 3 and all(len(t) == GEN for t in one_process.values())
    scheduler, schedules = pp_engine.scheduler, []
    schedule = scheduler.schedule

    def recording():
        out = schedule()
        schedules.append((set(scheduler.in_flight), {sr.request_id for sr in out.scheduled}))
        return out

    scheduler.schedule = recording
    try:
        assert _greedy(pp_engine) == one_process
    finally:
        del scheduler.schedule
    assert pp_engine.micro_batches.depth == 2
    assert all(not (flying & ids) for flying, ids in schedules), schedules
    assert any(flying and ids for flying, ids in schedules), schedules  # a second one launched


@pytest.mark.slow  # processes: the module's engine starts ~10-30 s on 2 shared cores
def test_stage_0_holds_only_its_layers_weights_and_kv(pp_engine):
    runner = pp_engine.runner
    assert (runner.pp.start, runner.pp.end, runner.pp.pp_rank) == (0, 2, 0)
    layers = runner.model.get_decoder().layers
    assert [sum(p.numel() for p in layer.parameters()) > 0 for layer in layers] == [True, True, False]
    assert [k.numel() > 0 for k, _ in runner.kv_caches] == [True, True, False]
    assert sum(p.numel() for p in runner.model.get_output_embeddings().parameters()) == 0  # the last stage's
    assert runner.cpu_decode is None and pp_engine.executor.world == 2
    with pytest.raises(ValueError, match="prompt logprobs are not supported with pipeline_parallel_size > 1"):
        pp_engine.add_request("plp", [5, 6, 7], SamplingParams(max_tokens=1, prompt_logprobs=1))


@pytest.mark.slow  # processes: the module's engine starts ~10-30 s on 2 shared cores
def test_killed_stage_fails_the_engine_within_seconds(pp_engine):
    """Runs after the tests that use the module's engine: it breaks it."""
    worker = pp_engine.executor.procs[0]
    pp_engine.add_request("k", tiny_models.PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=50))
    pp_engine.step()
    os.kill(worker.pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(TensorParallelError, match="rank 1"):
        for _ in range(100):
            pp_engine.step()
    assert time.monotonic() - t0 < 10
    pp_engine.shutdown()
    assert worker.poll() is not None and not torch.distributed.is_initialized()
@pytest.mark.slow  # processes: the module's engine starts ~10-30 s on 2 shared cores
def test_partition_override_reaches_every_stage(pp_engine, tiny3, one_process, monkeypatch):
    pp_engine.shutdown()  # one parallel engine per process
    monkeypatch.setenv(PARTITION_ENV, "1,2")  # the workers inherit it
    engine = LLMEngine(_config(tiny3, pipeline_parallel_size=2))
    try:
        assert (engine.runner.pp.start, engine.runner.pp.end) == (0, 1)
        assert [k.numel() > 0 for k, _ in engine.runner.kv_caches] == [True, False, False]
        assert _greedy(engine) == one_process
    finally:
        engine.shutdown()
