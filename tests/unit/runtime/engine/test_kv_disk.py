"""The disk tier in the engine (issue 29): every block an engine caches is written through to the
tier; a new engine on the same folder (a restarted replica) loads a prompt's leading blocks from
it as prefix-cache hits, with the same greedy tokens and log-probabilities as computing them.

On the default model's first two decoder layers (see test_prefix_caching.py)."""

from __future__ import annotations

import asyncio

import pytest

from kvfleet.runtime.config import EngineConfig
from kvfleet.runtime.engine.kv_pull import KVPuller
from kvfleet.runtime.engine.llm_engine import LLMEngine

from .test_kv_pull import GREEDY, Recorder, run
from .test_prefix_caching import system_prompt

pytestmark = pytest.mark.slow


def make_engine(loaded, path):
    recorder = Recorder()
    transfer = {"kv_role": "kv_producer", "disk_path": str(path), "disk_max_bytes": 64 * 2**20}
    config = EngineConfig(kv_cache_memory=32 * 2**20, max_num_batched_tokens=512, kv_transfer_config=transfer)
    return LLMEngine(config, [recorder], loaded=loaded), recorder


def test_a_restarted_engine_loads_the_prefix_from_disk(smollm2_two_layers, tmp_path):
    tok = smollm2_two_layers.tokenizer
    prompt = system_prompt(tok, 300) + tok("Where is Paris?", add_special_tokens=False)["input_ids"]
    first, _ = make_engine(smollm2_two_layers, tmp_path)
    computed = run(first, prompt, "first")
    first.shutdown()  # finishes the queued writes
    assert len(list(tmp_path.glob("*.kv"))) >= len(prompt) // 16  # every full block, the output's too

    engine, recorder = make_engine(smollm2_two_layers, tmp_path)
    puller = KVPuller(engine, lambda fn, *a: asyncio.sleep(0, fn(*a)))
    assert puller.fetcher is None and puller.disk is not None and len(puller.disk) >= len(prompt) // 16
    request = engine.input_processor.process("p", prompt, GREEDY).requests[0]
    loaded = asyncio.run(puller.pull(request))
    assert loaded == (len(prompt) - 1) // 16 * 16
    assert sum(i.num_disk_loaded_tokens for i in recorder.iterations) == loaded
    assert run(engine, prompt, "again") == computed
    assert recorder.hits() == loaded and recorder.computed() == len(prompt) - loaded
    engine.shutdown()
