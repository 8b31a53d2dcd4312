"""End to end, issue 43 "Prefill/decode disaggregation": a prefill and a decode replica (real
`kvfleet serve` processes, the default model cut to 2 layers) behind `kvfleet router
--prefill-endpoints P --endpoints D`. Each request's prompt is computed on the prefill replica, its
blocks pulled by the decode replica over `/kv_blocks` (fleet auth, sealed frames), which computes
one prompt token per request (its `prompt_tokens_total`) and answers, streamed or not, the same
greedy text as a replica asked directly (colocated), completions and chat completions alike. A
prefill replica killed mid-request (stopped, then SIGKILLed while the router waits on it) fails
over: the decode replica computes the prompt itself and the client still gets the same text. A
`remote_url` the router did not sign is never fetched from (the replica would send its fleet auth
there).
"""

from __future__ import annotations

import concurrent.futures
import json
import signal
import time

import pytest
from support.serve import start_serve, stop_serve

from e2e.test_router import API_KEY, WORDS, client, scrape, start_router, value

pytestmark = pytest.mark.slow

ARGS = ["--device", "cpu", "--dtype", "float32", "--kv-cache-memory", "48MiB", "--served-model-name", "tiny",
        "--max-model-len", "1024", "--api-key", API_KEY, "--kv-transfer-config",
        json.dumps({"kv_connector": "PeerPullConnector", "kv_role": "kv_both", "hold_timeout": 30})]
PROMPTS = [f"Ticket {i}: " + " ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(120 + 13 * i)) for i in range(3)]


@pytest.fixture(scope="module")
def two_layers(smollm2, tmp_path_factory):
    """The default model's first 2 layers, saved (real weights: greedy text worth comparing)."""
    import torch
    from transformers import AutoModelForCausalLM

    path = tmp_path_factory.mktemp("smollm2-2l")
    AutoModelForCausalLM.from_pretrained(smollm2.source, num_hidden_layers=2, dtype=torch.float32).save_pretrained(path)
    smollm2.tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def pd(two_layers, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pd")
    args = ["--model", str(two_layers), *ARGS]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        (p, p_url), (d, d_url) = pool.map(lambda r: start_serve(args, tmp / f"{r}.log"), ["prefill", "decode"])
    router = start_router(["--prefill-endpoints", p_url, "--endpoints", d_url, "--api-key", API_KEY,
                           "--routing-algorithm", "least-load", "--no-kv-peer-hint"], tmp / "router.log", 1)
    yield {"prefill": (p, p_url), "decode": d_url, "router": router[1], "tmp": tmp}
    router[0].kill()
    router[0].wait()
    for proc in (p, d):
        stop_serve(proc)


def greedy(base: str, prompt: str, stream: bool = False) -> str:
    out = client(base).completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0, stream=stream)
    return "".join(c.choices[0].text for c in out) if stream else out.choices[0].text


def test_two_legs_give_the_colocated_text_with_one_prompt_token_on_the_decode_replica(pd):
    decode, router, prefill = pd["decode"], pd["router"], pd["prefill"][1]
    # asked directly, a replica computes the whole prompt (the prefill one: the decode one must not cache them)
    colocated = [greedy(prefill, p) for p in PROMPTS]
    before = scrape(decode)
    answers = [greedy(router, p, stream=i % 2 == 1) for i, p in enumerate(PROMPTS)]
    after, p_metrics, r_metrics = scrape(decode), scrape(prefill), scrape(router)
    assert answers == colocated
    computed = value(after, "kvfleet:prompt_tokens_total") - value(before, "kvfleet:prompt_tokens_total")
    assert computed == len(PROMPTS)  # one prompt token per request: the rest was pulled
    assert value(after, "kvfleet:prefix_cache_hits_total") == value(before, "kvfleet:prefix_cache_hits_total")
    pulled = value(after, "kvfleet:kv_pull_tokens_total") - value(before, "kvfleet:kv_pull_tokens_total")
    assert pulled >= sum(len(p.split()) for p in PROMPTS)  # every prompt's blocks (>= one token per word)
    assert value(p_metrics, "kvfleet:prompt_tokens_total") >= pulled  # the prefill replica computed them
    assert value(p_metrics, "kvfleet:kv_pull_tokens_total") == 0
    assert value(r_metrics, "kvfleet:router_prefill_legs_total", outcome="success") == len(PROMPTS)
    assert value(after, "kvfleet:kv_pull_failures_total") == 0


def test_a_chat_completion_runs_as_two_legs_too(pd):
    decode, router, prefill = pd["decode"], pd["router"], pd["prefill"][1]
    messages = [{"role": "user", "content": "Summarise: " + PROMPTS[2]}]

    def chat(base: str) -> str:
        out = client(base).chat.completions.create(model="tiny", messages=messages, max_completion_tokens=12,
                                                   temperature=0)
        return out.choices[0].message.content

    colocated = chat(prefill)
    before = scrape(decode)
    assert chat(router) == colocated
    after = scrape(decode)
    assert value(after, "kvfleet:prompt_tokens_total") - value(before, "kvfleet:prompt_tokens_total") == 1


def test_a_remote_url_the_router_did_not_sign_is_never_fetched(pd):
    decode, prefill = pd["decode"], pd["prefill"][1]
    prompt = "Unsigned. " + PROMPTS[1]  # no prefix the decode replica caches
    before = scrape(decode)
    params = {"do_remote_prefill": True, "remote_url": prefill}  # a client's, without remote_signature
    out = client(decode).completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0,
                                            extra_body={"kv_transfer_params": params})
    after = scrape(decode)
    computed = value(after, "kvfleet:prompt_tokens_total") - value(before, "kvfleet:prompt_tokens_total")
    assert computed == out.usage.prompt_tokens  # the whole prompt computed here, nothing pulled
    assert value(after, "kvfleet:kv_pull_failures_total", reason="remote_unsigned") == 1


def test_a_prefill_replica_killed_mid_request_fails_over_to_colocated(pd):
    proc, _ = pd["prefill"]
    decode, router = pd["decode"], pd["router"]
    prompt = PROMPTS[0] + " and once more"
    colocated = greedy(decode, prompt)
    proc.send_signal(signal.SIGSTOP)  # the prefill leg reaches it and waits...
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        answer = pool.submit(greedy, router, prompt)
        time.sleep(1.5)
        assert not answer.done()
        proc.kill()  # ...and the replica dies with the request in flight
        proc.wait()
        assert answer.result(timeout=120) == colocated
    m = scrape(router)
    assert value(m, "kvfleet:router_prefill_legs_total", outcome="retried") >= 1
    assert value(m, "kvfleet:router_prefill_legs_total", outcome="colocated") >= 1
