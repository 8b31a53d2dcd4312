"""LoRA adapters over HTTP (issue 17), one ``kvfleet serve`` with the official openai client:
/v1/models lists adapters with their parent; the request's model picks the adapter; base and
two adapters concurrently give the texts each gives alone; runtime load -> serve -> unload -> 404;
bad paths and ranks are 400s naming why; the lora_requests_info gauge and per-adapter counts."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.lora import double_rank, random_adapter, scaled_b
from support.serve import start_serve, stop_serve

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-server")
    random_adapter(root / "a1", 11)
    scaled_b(root / "a1", root / "a2", -2.0)
    double_rank(root / "a1", root / "r16")
    args = ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "8", "--lora-modules", f"a1={root / 'a1'}",
            "--kv-cache-memory", "64MiB", "--metrics-compat", "vllm", "--log-level", "warning"]
    proc, base = start_serve(args, root / "server.log", env={"KVFLEET_ALLOW_RUNTIME_LORA_UPDATING": "true"})
    try:
        yield base, root
    finally:
        stop_serve(proc)


def client(base: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120)


async def complete(c: openai.AsyncOpenAI, model: str) -> str:
    out = await c.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0)
    assert out.model == model  # a response names the adapter it was asked for, as vLLM's
    return out.choices[0].text


def test_adapters_listed_served_loaded_and_unloaded(server):
    base, root = server
    http = httpx.Client(base_url=base, timeout=60)
    cards = {m["id"]: m for m in http.get("/v1/models").json()["data"]}
    assert cards["a1"]["parent"] == MODEL and cards["a1"]["root"] == str(root / "a1") and cards[MODEL]["parent"] is None

    # Runtime load of a second adapter, as vLLM answers it.
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "a2", "lora_path": str(root / "a2")})
    assert r.status_code == 200 and "added successfully" in r.text
    assert "a2" in {m["id"] for m in http.get("/v1/models").json()["data"]}

    async def scenario():
        c = client(base)
        together = await asyncio.gather(*(complete(c, m) for m in (MODEL, "a1", "a2", MODEL, "a1", "a2")))
        alone = [await complete(c, m) for m in (MODEL, "a1", "a2")]
        await c.close()
        return together, alone

    together, alone = asyncio.run(scenario())
    assert together == alone * 2
    assert len(set(alone)) == 3  # the adapters change the text

    r = http.post("/v1/unload_lora_adapter", json={"lora_name": "a2"})
    assert r.status_code == 200 and "removed successfully" in r.text
    with pytest.raises(openai.NotFoundError) as err:
        asyncio.run(complete(client(base), "a2"))
    assert err.value.code == "model_not_found" and "`a1`" in err.value.message  # the 404 lists the adapters
    r = http.post("/v1/unload_lora_adapter", json={"lora_name": "a2"})
    assert r.status_code == 404 and "cannot be found" in r.json()["error"]["message"]

    # Bad adapters: 400 naming why; nothing is loaded.
    for path, why in ((root / "missing", "no such directory"), (root / "r16", "over --max-lora-rank")):
        r = http.post("/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(path)})
        assert r.status_code == 400 and why in r.json()["error"]["message"], r.text
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "a1", "lora_path": str(root / "a1")})
    assert r.status_code == 400 and "already been loaded" in r.json()["error"]["message"]
    assert {m["id"] for m in http.get("/v1/models").json()["data"]} == {MODEL, "a1"}

    # Metrics: vLLM's lora_requests_info gauge and per-adapter request counts.
    families = {f.name: f for f in text_string_to_metric_families(http.get("/metrics").text)}
    info = families["vllm:lora_requests_info"].samples
    assert len(info) == 1 and info[0].labels["max_lora"] == "2" and info[0].value > 1e9
    assert set(info[0].labels) == {"max_lora", "running_lora_adapters", "waiting_lora_adapters"}
    counts = {s.labels["lora_name"]: s.value for s in families["kvfleet:lora_requests"].samples
              if s.name.endswith("_total")}  # fmt: skip
    assert counts == {"a1": 3.0, "a2": 3.0}


def test_embeddings_refuse_an_adapter_and_serve_the_base_model(server):
    # The pooled forward runs the base weights only: an adapter's name is a 400, not base vectors.
    base, _ = server
    c = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120)
    with pytest.raises(openai.BadRequestError) as err:
        c.embeddings.create(model="a1", input="hello")
    assert err.value.code == "unsupported" and "LoRA adapter" in err.value.message
    assert len(c.embeddings.create(model=MODEL, input="hello").data[0].embedding) == 576
