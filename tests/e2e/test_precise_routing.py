"""End to end, issue 29: two real `kvfleet serve` replicas with `--kv-events-config` behind
`kvfleet router --routing-algorithm precise-prefix-cache`, driven by the official `openai` client.

- the router's hash chain of a chat prompt (via the replica's /tokenize) is what the replica's
  snapshot holds after serving it;
- a long prefix first served by one replica directly (not through the router, so the char-prefix
  ring knows nothing of it) is routed back there, for each replica: requests land where the
  prefix is cached, and the replica's prefix-cache hit counter grows by the prefix's blocks;
- a prompt no replica caches is placed as the char-prefix (prefix-hash) router places it.
"""

from __future__ import annotations

import concurrent.futures
import json

import httpx
import pytest
from support.serve import start_serve, stop_serve

from e2e.test_router import API_KEY, MODEL, client, scrape, start_router, system_prompt, value, wait_for_router_index
from kvfleet.runtime.kv_events.hashing import prompt_block_hashes
from kvfleet.runtime.router.picker import HashRing, hash64
from kvfleet.runtime.router.prefix_key import prefix_key

pytestmark = pytest.mark.slow

EVENTS = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:0"})
SERVE_ARGS = ["--max-model-len", "512", "--kv-cache-memory", "64MiB", "--api-key", API_KEY,
              "--kv-events-config", EVENTS]
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("precise")
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        replicas = [f.result() for f in [pool.submit(start_serve, SERVE_ARGS, tmp / f"replica{i}.log")
                                         for i in range(2)]]
    urls = ",".join(base for _, base in replicas)
    routers = {
        # the router's --api-key also authorizes its own /kv_events/snapshot reads
        "precise": start_router(["--endpoints", urls, "--routing-algorithm", "precise-prefix-cache", "--api-key", API_KEY],
                                tmp / "router-precise.log", 2),
        "prefix": start_router(["--endpoints", urls], tmp / "router-prefix.log", 2),
    }
    yield {"replicas": [b for _, b in replicas], "routers": {k: b for k, (_, b) in routers.items()}}
    for proc, _ in routers.values():
        proc.kill()
        proc.wait()
    for proc, _ in replicas:
        stop_serve(proc)


def messages(tag: str, question: str) -> list[dict]:
    return [{"role": "system", "content": system_prompt(tag)}, {"role": "user", "content": question}]


def chat(base: str, tag: str, question: str) -> str | None:
    """One greedy chat request; returns the replica that answered (x-kvfleet-replica, or base)."""
    raw = client(base).chat.completions.with_raw_response.create(
        model=MODEL, max_tokens=1, temperature=0, messages=messages(tag, question))
    raw.parse()
    return raw.headers.get("x-kvfleet-replica", base)


def cached_blocks(replica: str, tag: str, question: str) -> int:
    """Leading blocks of the prompt's hash chain that ``replica``'s snapshot holds."""
    snap = httpx.get(replica + "/kv_events/snapshot", headers=AUTH, timeout=10).json()
    tokens = httpx.post(replica + "/tokenize", json={"model": MODEL, "messages": messages(tag, question)},
                        headers=AUTH, timeout=10).json()["tokens"]
    held = set(snap["block_hashes"])
    n = 0
    for h in prompt_block_hashes(tokens, snap["block_size"]):
        if h.hex() not in held:
            break
        n += 1
    return n


def test_router_hash_chain_equals_the_replica_snapshot(fleet):
    replica = fleet["replicas"][0]
    chat(replica, "chain", "Hello?")
    snap = httpx.get(replica + "/kv_events/snapshot", headers=AUTH, timeout=10).json()
    tokens = httpx.post(replica + "/tokenize", json={"model": MODEL, "messages": messages("chain", "Hello?")},
                        headers=AUTH, timeout=10).json()["tokens"]
    hashes = prompt_block_hashes(tokens, snap["block_size"])
    assert len(hashes) >= 8 and snap["endpoint"].startswith("tcp://")
    assert {h.hex() for h in hashes} <= set(snap["block_hashes"])


def ring_owner(replicas: list[str], tag: str) -> str:
    """The replica the char-prefix ring (prefix-hash) owns this prompt's key on."""
    ring = HashRing(100)
    ring.update(replicas)
    body = {"model": MODEL, "messages": messages(tag, "Question 0?")}
    return next(ring.walk(hash64(prefix_key("/v1/chat/completions", body))))


def test_requests_land_where_their_prefix_is_cached(fleet):
    router, replicas = fleet["routers"]["precise"], fleet["replicas"]
    # two prefixes the char-prefix ring puts on the same replica, cached one on each replica:
    # CHWBL would send one of them to the replica that lacks it; precise routing must not
    tags = [t for t in (f"warm{i}" for i in range(40)) if ring_owner(replicas, t) == replicas[0]][:2]
    for tag, replica in zip(tags, replicas):
        chat(replica, tag, "First question?")  # cached on this replica only, outside the router
        wait_for_router_index(router, replica, AUTH)  # the events reach the router asynchronously
        cached = cached_blocks(replica, tag, "Question 0?")  # leading blocks the replica holds
        assert cached >= 6
        before = value(scrape(replica), "kvfleet:prefix_cache_hits_total")
        landed = [chat(router, tag, f"Question {q}?") for q in range(3)]
        assert landed == [replica] * 3, landed
        gained = value(scrape(replica), "kvfleet:prefix_cache_hits_total") - before
        assert gained >= 3 * cached * 16  # every request hit the cached system prompt


def test_a_prompt_nobody_caches_is_placed_by_the_char_prefix_ring(fleet):
    # sent to the precise router first, while no replica holds it: the CHWBL ring decides, and
    # the prefix-hash router (same endpoints, same ring) places the same prompt on the same replica
    # three prompts the ring puts on each replica (chosen by ring_owner: six arbitrary prompts all
    # landed on one replica for some pairs of random ports)
    replicas = fleet["replicas"]
    cold = [f"cold{i}" for i in range(40)]
    tags = [t for r in replicas for t in [t for t in cold if ring_owner(replicas, t) == r][:3]]
    placed = [(chat(fleet["routers"]["precise"], t, "Question 0?"), chat(fleet["routers"]["prefix"], t, "Question 0?"))
              for t in tags]
    assert all(a == b for a, b in placed), placed
    assert len({a for a, _ in placed}) == 2  # and the ring spreads new prefixes over both
