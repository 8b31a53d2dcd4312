"""Prefill/decode disaggregation through the KV connector seam, in two real engines (issue 43):
a prefill leg (``do_remote_decode``) holds its prompt's blocks, partial last block included, and
answers ``kv_transfer_params``; a decode leg given those blocks computes one prompt token and
decodes the same greedy tokens and log-probabilities as an engine that computed the prompt; a hold
is released once read, or at its timeout; an aborted prefill leg holds nothing.

On the default model's first two decoder layers (conftest's ``smollm2_two_layers``)."""

from __future__ import annotations

import dataclasses

import pytest

from kvfleet.runtime.engine.kv_pull import export_blocks
from kvfleet.runtime.kv_transfer.connector import transfer_hashes
from kvfleet.runtime.sampling_params import SamplingParams

from .test_kv_pull import GREEDY, make_engine, run
from .test_prefix_caching import Seq, system_prompt

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def prompt(smollm2_two_layers) -> list[int]:
    tok = smollm2_two_layers.tokenizer
    out = system_prompt(tok, 200) + tok("Where is Paris?", add_special_tokens=False)["input_ids"]
    return out if len(out) % 16 else out[:-1]  # a partial last block


@pytest.fixture(scope="module")
def colocated(smollm2_two_layers, prompt) -> Seq:
    engine, _ = make_engine(smollm2_two_layers)
    return run(engine, prompt, "colocated")


def prefill(engine, prompt, rid="p") -> dict:
    params = dataclasses.replace(GREEDY, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    engine.add_request(rid, prompt, params)
    engine.run_until_done()
    return engine.kv_connector.finished_params.pop(rid)


def test_decode_leg_computes_one_prompt_token_and_matches_colocated(smollm2_two_layers, prompt, colocated):
    p_engine, _ = make_engine(smollm2_two_layers)
    pool = p_engine.scheduler.kv_cache_manager.block_pool
    params = prefill(p_engine, prompt)
    hashes = transfer_hashes(prompt, 16)
    assert params["do_remote_prefill"] and len(params["remote_block_ids"]) == len(hashes) == len(prompt) // 16 + 1
    assert p_engine.kv_connector.num_held_blocks == len(hashes)
    assert pool.usage > 0  # held: no request may evict them
    blocks = export_blocks(p_engine, hashes)
    assert [h for h, _ in blocks] == hashes
    assert p_engine.kv_connector.num_held_blocks == 0 and pool.usage == 0  # read whole: released
    assert export_blocks(p_engine, hashes[-1:]) == []  # the partial block is gone with its hold

    d_engine, recorder = make_engine(smollm2_two_layers)
    d_engine.kv_connector.set_fetched("d", [p for _, p in blocks])
    decode = dataclasses.replace(GREEDY, kv_transfer_params={**params, "remote_url": "http://p"})
    d_engine.add_request("d", prompt, decode)
    assert Seq(d_engine.run_until_done()["d"].outputs[0]) == colocated
    assert recorder.computed() == 1  # only the last prompt token, for its logits
    assert recorder.hits() == 0  # loaded blocks are not counted as prefix-cache hits


def test_an_unread_hold_expires_and_an_aborted_prefill_holds_nothing(smollm2_two_layers, prompt):
    engine, _ = make_engine(smollm2_two_layers)
    connector, pool = engine.kv_connector, engine.scheduler.kv_cache_manager.block_pool
    now = [1000.0]
    connector.clock = lambda: now[0]
    params = prefill(engine, prompt)
    assert params["expires_at"] == 1000.0 + connector.hold_timeout and connector.num_held_blocks > 0
    now[0] += connector.hold_timeout
    assert export_blocks(engine, transfer_hashes(prompt, 16)[-1:]) == []  # expired: released first
    assert connector.num_held_blocks == 0 and pool.usage == 0
    engine.add_request("a", prompt, dataclasses.replace(GREEDY, max_tokens=4,
                                                        kv_transfer_params={"do_remote_decode": True}))
    engine.step()
    engine.abort_request(["a"])
    assert connector.num_held_blocks == 0 and "a" not in connector.finished_params and pool.usage == 0


def test_a_decode_leg_without_blocks_computes_its_prompt(smollm2_two_layers, prompt, colocated):
    engine, recorder = make_engine(smollm2_two_layers)
    engine.add_request("d", prompt, dataclasses.replace(GREEDY, kv_transfer_params={"do_remote_prefill": True}))
    assert Seq(engine.run_until_done()["d"].outputs[0]) == colocated
    assert recorder.computed() == len(prompt)


def test_kv_transfer_params_must_be_an_object_with_one_sequence():
    with pytest.raises(ValueError, match="kv_transfer_params"):
        SamplingParams(kv_transfer_params=["do_remote_decode"])
    with pytest.raises(ValueError, match="kv_transfer_params"):
        SamplingParams(n=2, kv_transfer_params={"do_remote_decode": True})
