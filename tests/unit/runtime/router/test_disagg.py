"""The router's prefill legs (runtime/router/disagg.py) against mock replicas: which requests run
as two legs, the prefill leg's body, the decode leg's ``kv_transfer_params`` (with ``remote_url``
and the router's signature of it),
failover to the next prefill replica on a transport error or a 5xx, and colocated when none is left
or the answer holds no blocks."""

from __future__ import annotations

import asyncio
import json

import httpx

from kvfleet.runtime.kv_transfer.fleet_auth import FleetKeys
from kvfleet.runtime.router.disagg import Disaggregator, prefill_body, prompt_chars, two_leg
from kvfleet.runtime.router.endpoints import EndpointPool
from kvfleet.runtime.router.metrics import RouterMetrics

BODY = {"model": "m", "prompt": "hello", "max_tokens": 50, "stream": True, "stream_options": {"include_usage": True}}
PARAMS = {"do_remote_prefill": True, "remote_block_ids": [3, 4], "remote_engine_id": "e"}


def test_which_requests_run_two_legs_and_the_prefill_body():
    assert two_leg("POST", "/v1/completions", BODY) and two_leg("POST", "/v1/chat/completions", {"messages": []})
    assert not two_leg("GET", "/v1/completions", BODY) and not two_leg("POST", "/v1/embeddings", BODY)
    assert not two_leg("POST", "/v1/completions", {**BODY, "n": 2})
    assert not two_leg("POST", "/v1/completions", {**BODY, "kv_transfer_params": PARAMS})
    assert not two_leg("POST", "/v1/completions", None)
    assert two_leg("POST", "/v1/completions", BODY, 5) and not two_leg("POST", "/v1/completions", BODY, 6)
    chat = {"messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": [{"text": "abc"}]}]}
    assert prompt_chars(chat) == 5 and prompt_chars({"prompt": [1, 2]}) == 8
    leg = prefill_body({**BODY, "max_completion_tokens": 9, "min_tokens": 3})
    assert leg == {"model": "m", "prompt": "hello", "max_tokens": 1, "stream": False,
                   "kv_transfer_params": {"do_remote_decode": True}}
    assert BODY["max_tokens"] == 50  # the client's body is left as it was


KEYS = FleetKeys(b"fleet-secret-of-this-test")


def run(handlers: dict, body=BODY):
    """``prepare`` over prefill replicas answering through ``handlers`` (url -> request -> response)."""
    seen = []

    def transport(request: httpx.Request) -> httpx.Response:
        url = f"{request.url.scheme}://{request.url.netloc.decode()}"
        seen.append((url, json.loads(request.content)))
        return handlers[url](request)

    async def go():
        pool = EndpointPool()
        pool.set_urls(list(handlers))
        for url in handlers:
            pool.set_probe(url, True)
        metrics = RouterMetrics()
        async with httpx.AsyncClient(transport=httpx.MockTransport(transport)) as client:
            out = await Disaggregator(pool, client, metrics, fleet_keys=KEYS).prepare("POST", "/v1/completions", [],
                                                                                      body)
        legs = {s.labels["outcome"]: s.value for m in metrics.prefill_legs.collect() for s in m.samples
                if s.name.endswith("_total")}
        return out, seen, legs, pool

    return asyncio.run(go())


def answer(params):
    return lambda request: httpx.Response(200, json={"choices": [], "kv_transfer_params": params})


def refuse(request):
    raise httpx.ConnectError("gone", request=request)


def test_the_decode_leg_carries_the_prefill_replicas_params_and_url():
    out, seen, legs, _ = run({"http://p1": answer(PARAMS)})
    signature = out["kv_transfer_params"].pop("remote_signature")
    assert out == {**BODY, "kv_transfer_params": {**PARAMS, "remote_url": "http://p1"}}
    assert KEYS.check_hint("http://p1", signature) is None  # the replica fetches from no URL the router did not sign
    assert KEYS.check_hint("http://evil", signature) == "signature"
    assert seen[0][1]["kv_transfer_params"] == {"do_remote_decode": True} and not seen[0][1]["stream"]
    assert legs == {"success": 1.0}


def test_a_failed_prefill_replica_fails_over_then_colocated():
    out, seen, legs, pool = run({"http://p1": refuse, "http://p2": lambda r: httpx.Response(503)})
    assert out is BODY  # no prefill replica could: the decode replica computes the prompt
    assert sorted(u for u, _ in seen) == ["http://p1", "http://p2"]
    assert legs == {"retried": 2.0, "colocated": 1.0} and not pool.available()  # both ejected
    out, seen, legs, _ = run({"http://p1": answer(PARAMS), "http://p2": refuse})
    assert out["kv_transfer_params"]["remote_url"] == "http://p1"
    assert legs["success"] == 1.0 and legs.get("retried", 0.0) == len(seen) - 1


def test_an_answer_without_held_blocks_runs_colocated():
    for handler in (answer(None), lambda r: httpx.Response(400, json={"error": {}}), answer({"x": 1})):
        out, _, legs, _ = run({"http://p1": handler})
        assert out is BODY and legs == {"colocated": 1.0}
