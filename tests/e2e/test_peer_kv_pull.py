"""End to end, issue 29 "Peer KV pull": three real `kvfleet serve` replicas with
`--kv-events-config` and `--kv-transfer-config` behind `kvfleet router --routing-algorithm
round-robin --kv-peer-hint`, driven by the official `openai` client.

Nine requests share a ~1,500-token system prompt; round robin spreads them over the three
replicas, so without a pull each replica would prefill the prefix once (three prefixes). With the
router's hint each replica that lacks the prefix pulls it from one that has it: the fleet computes
about one prefix plus the nine suffixes (the replicas' own `prompt_tokens_total`), counts the
pulled tokens in `kv_pull_tokens_total` and as prefix-cache hits, and answers the same greedy
text as the replica that computed the whole prompt itself. Every replica also has a disk tier: one restarted from it serves the
prefix with hits (`kv_disk_load_tokens_total`) and the same greedy text.
"""

from __future__ import annotations

import concurrent.futures
import json

import httpx
import pytest
from support.serve import start_serve, stop_serve

from e2e.test_router import API_KEY, MODEL, WORDS, client, scrape, start_router, value, wait_for_router_index
from kvfleet.runtime.kv_transfer.fleet_auth import FLEET_AUTH_HEADER, Sealer, load_fleet_keys

pytestmark = pytest.mark.slow

EVENTS = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:0"})
SERVE_ARGS = ["--max-model-len", "2048", "--kv-cache-memory", "160MiB", "--api-key", API_KEY,
              "--max-num-batched-tokens", "2048", "--kv-events-config", EVENTS]


def serve_args(disk) -> list[str]:
    """SERVE_ARGS and the replica's --kv-transfer-config: peer pull, and a disk tier in ``disk``."""
    transfer = {"kv_connector": "PeerPullConnector", "kv_role": "kv_both", "min_pull_blocks": 4,
                "disk_path": str(disk), "disk_max_bytes": 256 * 2**20}
    return [*SERVE_ARGS, "--kv-transfer-config", json.dumps(transfer)]

PREFIX = "You answer for the support desk. " + " ".join(WORDS[i % len(WORDS)] for i in range(1480)) + "\n"
QUESTIONS = [f"Question {i}: which {WORDS[i]} do you mean?" for i in range(9)]
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pull")
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        replicas = [f.result() for f in [pool.submit(start_serve, serve_args(tmp / f"disk{i}"), tmp / f"replica{i}.log")
                                         for i in range(3)]]
    urls = [base for _, base in replicas]
    router = start_router(["--endpoints", ",".join(urls), "--routing-algorithm", "round-robin", "--kv-peer-hint",
                           "--api-key", API_KEY], tmp / "router.log", 3)
    yield {"replicas": urls, "router": router[1], "procs": replicas, "tmp": tmp}
    router[0].kill()
    router[0].wait()
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        list(pool.map(stop_serve, [proc for proc, _ in replicas]))  # (a restarted one replaces its entry)


def complete(base: str, question: str) -> tuple[str, str, int]:
    """(greedy text, the replica that answered, prompt tokens) of PREFIX + question."""
    raw = client(base).completions.with_raw_response.create(model=MODEL, prompt=PREFIX + question, max_tokens=8,
                                                            temperature=0)
    out = raw.parse()
    return out.choices[0].text, raw.headers.get("x-kvfleet-replica", base), out.usage.prompt_tokens


def totals(replicas: list[str], name: str) -> float:
    return sum(value(scrape(r), name) for r in replicas)


def test_nine_requests_over_three_replicas_compute_the_prefix_once(fleet):
    replicas, router = fleet["replicas"], fleet["router"]
    answers = []
    for q in QUESTIONS:
        answers.append(complete(router, q))
        wait_for_router_index(router, answers[-1][1], AUTH)  # the replica's KV events reach the router
    assert sorted(r for _, r, _ in answers) == sorted(replicas * 3)  # round robin: three each
    prompt_len = answers[0][2]
    assert prompt_len >= 1480
    computed = totals(replicas, "kvfleet:prompt_tokens_total")
    pulled = totals(replicas, "kvfleet:kv_pull_tokens_total")
    # one prefix, then per request at most its suffix and the partial blocks either side of it
    assert computed <= prompt_len + 9 * (2 * 16 + 24), (computed, pulled)
    assert pulled >= 2 * (prompt_len - 3 * 16)  # the two replicas that lacked it pulled the prefix
    hits = totals(replicas, "kvfleet:prefix_cache_hits_total")
    assert hits >= 8 * (prompt_len - 3 * 16)  # pulled tokens are prefix-cache hits as well
    assert totals(replicas, "kvfleet:kv_pull_failures_total") == 0
    print(f"prompt {prompt_len} tokens; computed {computed:.0f}, pulled {pulled:.0f}, hits {hits:.0f}")
    router_hints = value(scrape(router), "kvfleet:router_kv_peer_hints_total")
    assert router_hints >= 2

    # the same greedy text as computing the whole prompt: the first request was computed from scratch;
    # the two replicas that pulled the prefix answer its prompt (asked directly: no hint) from the
    # pulled blocks
    assert answers[0][1] not in [r for _, r, _ in answers[1:3]]
    before = totals(replicas, "kvfleet:kv_pull_tokens_total")
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        again = list(pool.map(complete, [r for _, r, _ in answers[1:3]], QUESTIONS[:1] * 2))
    assert totals(replicas, "kvfleet:kv_pull_tokens_total") == before  # nothing new pulled
    assert [t for t, _, _ in again] == [answers[0][0]] * 2


def test_kv_blocks_endpoint_is_the_fleets_and_refuses_bad_hashes(fleet):
    base = fleet["replicas"][0]
    keys = load_fleet_keys()  # the suite's fleet secret, the one every replica and the router read
    auth = {FLEET_AUTH_HEADER: keys.pull_auth()[0]}
    r = httpx.get(base + "/kv_blocks", params={"hashes": "zz"}, headers=auth, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "block_hashes"
    auth, nonce = keys.pull_auth()
    r = httpx.post(base + "/kv_blocks", json={"block_hashes": ["00" * 16]}, headers={FLEET_AUTH_HEADER: auth},
                   timeout=10)
    assert r.status_code == 200
    assert r.content == Sealer(keys.seal_key(nonce)).seal()  # nothing cached under that hash: an empty run, sealed
    for headers in ({}, AUTH):  # a client, with or without the API key, reads no blocks
        assert httpx.get(base + "/kv_blocks", headers=headers, timeout=10).status_code == 403


def test_a_replica_restarted_from_its_disk_tier_serves_the_prefix_with_hits(fleet):
    # runs after the nine requests: every replica wrote the prefix's blocks to its disk tier
    replica, tmp = fleet["replicas"][0], fleet["tmp"]
    before_restart = complete(replica, QUESTIONS[0])[0]
    proc, _ = fleet["procs"][0]
    stop_serve(proc)  # SIGTERM: the queued disk writes finish first
    assert len(list((tmp / "disk0").glob("*.kv"))) >= 1480 // 16
    port = int(replica.rsplit(":", 1)[1])
    fleet["procs"][0] = start_serve(serve_args(tmp / "disk0"), tmp / "replica0-restarted.log", port=port)
    text, _, prompt_len = complete(replica, QUESTIONS[0])  # directly: no router, no peer hint
    m = scrape(replica)
    loaded = value(m, "kvfleet:kv_disk_load_tokens_total")
    assert loaded >= prompt_len - 2 * 16
    assert value(m, "kvfleet:prefix_cache_hits_total") >= loaded  # loaded tokens are prefix-cache hits
    assert value(m, "kvfleet:prompt_tokens_total") <= prompt_len - loaded + 16
    assert value(m, "kvfleet:kv_pull_tokens_total") == 0
    assert value(m, "kvfleet:kv_disk_usage_bytes") >= 1480 // 16 * 16 * 22 * 1024  # >= 22 KiB a token (bf16)
    assert text == before_restart
