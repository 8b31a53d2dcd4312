"""Peer KV pull in the engine (issue 29): blocks read from one engine's cache and installed in
another's are prefix-cache hits there and give the same greedy tokens and log-probabilities as
computing them; a refused transfer (bad header, bad hash, corrupted or truncated bytes, an HTTP
error) installs nothing, is counted, and the prompt is computed as without a peer.

On the default model's first two decoder layers (conftest's ``smollm2_two_layers``), with
log-probabilities compared too (see tests/unit/runtime/engine/test_prefix_caching.py)."""

from __future__ import annotations

import asyncio
import dataclasses

import httpx
import pytest

from kvfleet.runtime.config import EngineConfig
from kvfleet.runtime.engine.kv_pull import KVPuller, export_blocks, install_blocks
from kvfleet.runtime.engine.llm_engine import LLMEngine
from kvfleet.runtime.kv_events.hashing import prompt_block_hashes
from kvfleet.runtime.kv_transfer.fleet_auth import FLEET_AUTH_HEADER, FleetKeys, Sealer
from kvfleet.runtime.kv_transfer.wire import encode_frame
from kvfleet.runtime.sampling_params import SamplingParams
from kvfleet.runtime.worker.kv_blocks import block_layout

from .test_prefix_caching import Seq, system_prompt

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
TRANSFER = {"kv_connector": "PeerPullConnector", "min_pull_blocks": 4}
KEYS = FleetKeys(b"fleet-secret-of-this-test")


class Recorder:
    def __init__(self) -> None:
        self.scheduler, self.iterations = [], []

    def record(self, scheduler_stats, iteration_stats) -> None:
        if scheduler_stats is not None:
            self.scheduler.append(scheduler_stats)
        if iteration_stats is not None:
            self.iterations.append(iteration_stats)

    def hits(self) -> int:
        return sum(s.prefix_cache_hits for s in self.scheduler)

    def computed(self) -> int:
        return sum(i.num_prompt_tokens for i in self.iterations)


def make_engine(loaded, **kw):
    recorder = Recorder()
    config = EngineConfig(kv_cache_memory=32 * 2**20, max_num_batched_tokens=512, kv_transfer_config=TRANSFER, **kw)
    return LLMEngine(config, [recorder], loaded=loaded), recorder


def run(engine, prompt: list[int], rid: str) -> Seq:
    engine.add_request(rid, prompt, GREEDY)
    return Seq(engine.run_until_done()[rid].outputs[0])


@pytest.fixture(scope="module")
def prompt(smollm2_two_layers) -> list[int]:
    tok = smollm2_two_layers.tokenizer
    return system_prompt(tok, 300) + tok("What is the capital of France?", add_special_tokens=False)["input_ids"]


@pytest.fixture(scope="module")
def source(smollm2_two_layers, prompt):
    """An engine that computed ``prompt`` (the peer), and its greedy output."""
    engine, _ = make_engine(smollm2_two_layers)
    return engine, run(engine, prompt, "src")


def test_pulled_blocks_are_prefix_hits_with_the_same_greedy_output(smollm2_two_layers, prompt, source):
    peer, computed = source
    hashes = prompt_block_hashes(prompt[:len(prompt) - 1], 16)
    blocks = export_blocks(peer, hashes)
    assert [h for h, _ in blocks] == hashes  # the peer holds the whole chain
    engine, recorder = make_engine(smollm2_two_layers)
    installed = install_blocks(engine, hashes, prompt, 0, blocks)
    assert installed == len(hashes) * 16
    assert engine.scheduler.kv_cache_manager.usage == 0  # cached, evictable, held by nobody
    assert run(engine, prompt, "pulled") == computed
    assert recorder.hits() == installed  # every pulled token is a prefix-cache hit
    assert recorder.computed() == len(prompt) - installed
    # installing again adds nothing: the blocks are cached already
    assert install_blocks(engine, hashes, prompt, 0, blocks) == 0
    assert len(engine.scheduler.kv_cache_manager.block_pool.cached_blocks) >= len(hashes)


class FakePeer:
    """An httpx transport serving ``/kv_blocks`` from a real engine's blocks, ``spoil`` applied,
    sealed with ``keys`` (None: not sealed) as a replica of that fleet seals them."""

    def __init__(self, engine, spoil=None, keys: FleetKeys | None = KEYS, cut: int = 0) -> None:
        self.engine, self.spoil, self.calls, self.keys, self.cut = engine, spoil, 0, keys, cut

    def __call__(self, request: httpx.Request) -> httpx.Response:
        import json

        self.calls += 1
        hashes = [bytes.fromhex(h) for h in json.loads(request.content)["block_hashes"]]
        layout = block_layout(self.engine.runner, self.engine.model_name, None)
        blocks = export_blocks(self.engine, hashes)
        data = b"".join(encode_frame(layout, h, p) for h, p in blocks)
        data = self.spoil(data, layout, blocks) if self.spoil else data
        if self.keys is None:
            return httpx.Response(200, content=data)
        nonce = KEYS.check_pull_auth(request.headers.get(FLEET_AUTH_HEADER))  # the pull is this fleet's
        assert nonce is not None
        sealer = Sealer(self.keys.seal_key(nonce))
        data = sealer.add(data) + sealer.seal()
        return httpx.Response(200, content=data[:len(data) - self.cut])  # cut: the connection lost


def pull_through(engine, peer: FakePeer, prompt) -> int:
    puller = KVPuller(engine, lambda fn, *a: asyncio.sleep(0, fn(*a)), KEYS)
    puller.fetcher._client = httpx.AsyncClient(transport=httpx.MockTransport(peer))
    request = engine.input_processor.process("p", prompt, GREEDY).requests[0]
    return asyncio.run(puller.pull(request, "http://peer:8000"))


def flip_last_byte(data, layout, blocks):
    return data[:-1] + bytes([data[-1] ^ 1])


def wrong_dtype(data, layout, blocks):
    other = dataclasses.replace(layout, dtype="bfloat16")
    return b"".join(encode_frame(other, h, p) for h, p in blocks)


def swapped_hashes(data, layout, blocks):
    (h0, p0), (h1, p1) = blocks[:2]
    return encode_frame(layout, h1, p0) + encode_frame(layout, h0, p1)


@pytest.mark.parametrize(("fake_kw", "reason"), [
    ({"spoil": flip_last_byte}, "digest"), ({"spoil": wrong_dtype}, "layout"), ({"spoil": swapped_hashes}, "hash"),
    ({"cut": 3 + 36}, "truncated"),
    # well-formed frames of the prompt's real blocks from an address that is not a replica of this
    # fleet (a forged peer: no seal, or another fleet's): nothing of them enters the prefix cache
    ({"keys": None}, "not_replica"), ({"keys": FleetKeys(b"another-fleet-secret")}, "not_replica"),
])
def test_a_bad_transfer_is_refused_counted_and_recomputed(smollm2_two_layers, prompt, source, fake_kw, reason):
    peer, computed = source
    engine, recorder = make_engine(smollm2_two_layers)
    fake = FakePeer(peer, **fake_kw)
    assert pull_through(engine, fake, prompt) == 0
    assert fake.calls == 1
    assert not engine.scheduler.kv_cache_manager.block_pool.cached_blocks  # nothing of it was used
    assert [r for i in recorder.iterations for r in i.kv_pull_failures] == [reason]
    assert run(engine, prompt, "recomputed") == computed
    assert recorder.hits() == 0 and recorder.computed() == len(prompt)


def test_a_good_pull_through_http_and_when_a_pull_is_not_tried(smollm2_two_layers, prompt, source):
    peer, computed = source
    engine, recorder = make_engine(smollm2_two_layers)
    fake = FakePeer(peer)
    pulled = pull_through(engine, fake, prompt)
    assert pulled == (len(prompt) - 1) // 16 * 16
    assert sum(i.num_pulled_tokens for i in recorder.iterations) == pulled
    assert pull_through(engine, fake, prompt) == 0 and fake.calls == 1  # all cached now: no second pull
    assert pull_through(engine, fake, prompt[:16 * 4]) == 0 and fake.calls == 1  # < min_pull_blocks to gain
    salted = engine.input_processor.process("s", prompt, GREEDY).requests[0]
    salted.cache_salt = "tenant-a"
    assert not KVPuller(engine, None).eligible(salted)  # salted (and adapter) prompts never pull
    assert run(engine, prompt, "pulled") == computed


def test_a_burst_sharing_a_new_prefix_fetches_it_once(smollm2_two_layers, prompt, source):
    peer, computed = source
    engine, recorder = make_engine(smollm2_two_layers)
    fake = FakePeer(peer)
    puller = KVPuller(engine, lambda fn, *a: asyncio.sleep(0, fn(*a)), KEYS)
    puller.fetcher._client = httpx.AsyncClient(transport=httpx.MockTransport(fake))
    tok = smollm2_two_layers.tokenizer
    prompts = [prompt[:-8] + tok(f" Question {i}?", add_special_tokens=False)["input_ids"] for i in range(3)]
    requests = [engine.input_processor.process(f"b{i}", p, GREEDY).requests[0] for i, p in enumerate(prompts)]

    async def burst():
        return await asyncio.gather(*(puller.pull(r, "http://peer:8000") for r in requests))

    pulled = asyncio.run(burst())
    assert fake.calls == 1 and pulled[0] > 0 and pulled[1:] == [0, 0]  # the others found it installed
    assert not puller._inflight
    assert run(engine, prompt, "after") == computed


def test_a_failed_install_leaks_no_block_and_never_fails_the_request(smollm2_two_layers, prompt, source,
                                                                     monkeypatch):
    peer, computed = source
    engine, recorder = make_engine(smollm2_two_layers)
    pool = engine.scheduler.kv_cache_manager.block_pool

    def broken(*_):
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine.kv_connector.access, "write", broken)  # the connector's cache writes
    hashes = prompt_block_hashes(prompt[:len(prompt) - 1], 16)
    with pytest.raises(RuntimeError):
        install_blocks(engine, hashes, prompt, 0, export_blocks(peer, hashes))
    assert pool.num_free_blocks == pool.num_usable_blocks and not pool.cached_blocks
    assert pull_through(engine, FakePeer(peer), prompt) == 0  # the request goes on, recomputing
    assert [r for i in recorder.iterations for r in i.kv_pull_failures] == ["error"]
    monkeypatch.undo()
    assert run(engine, prompt, "recomputed") == computed
