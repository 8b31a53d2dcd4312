"""``/kv_blocks``' hash list: a comma-separated query or a JSON list of 16-byte hex hashes; anything
else is a 400 in OpenAI's error shape naming ``block_hashes`` (issue 29). The fleet only (issue 42):
``/kv_blocks`` answers the fleet's pulls only, sealed; a peer hint not signed by this fleet's
router is ignored and counted, and frames from an address that is not a replica are refused."""

from __future__ import annotations

import http.server
import os
import threading
import time

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from kvfleet.runtime.config import EngineConfig
from kvfleet.runtime.engine.async_llm import AsyncLLMEngine
from kvfleet.runtime.entrypoints.openai.api_server import create_app
from kvfleet.runtime.entrypoints.openai.errors import APIError
from kvfleet.runtime.entrypoints.openai.serve_args import ServerSettings
from kvfleet.runtime.entrypoints.openai.serving_kv_blocks import MAX_BLOCKS, parse_hashes
from kvfleet.runtime.kv_events.hashing import prompt_block_hashes
from kvfleet.runtime.kv_transfer.fleet_auth import FLEET_AUTH_HEADER, HINT_SIGNATURE_HEADER, SECRET_ENV, FleetKeys
from kvfleet.runtime.kv_transfer.peer_pull import PEER_HEADER
from kvfleet.runtime.kv_transfer.wire import FrameReader, encode_frame

A, B = "ab" * 16, "01" * 16


def test_query_and_list_forms():
    assert parse_hashes(f"{A},{B}") == [bytes.fromhex(A), bytes.fromhex(B)]
    assert parse_hashes([A]) == [bytes.fromhex(A)]
    assert parse_hashes("") == [] and parse_hashes([]) == []


@pytest.mark.parametrize("value", ["zz", [A[:-2]], [1], None, {"a": A}, [A] * (MAX_BLOCKS + 1)])
def test_bad_hash_lists_are_a_400(value):
    with pytest.raises(APIError) as exc:
        parse_hashes(value)
    assert exc.value.status == 400 and exc.value.body.error.param == "block_hashes"


# ----------------------------------------------------------------------------- the fleet only (issue 42)
# A real server on the default model, with peer KV pull on and this test's fleet secret: a
# listening "peer" records every connection a replica makes to it.

FLEET = FleetKeys(b"the-fleet-secret-of-this-test")


class Listener:
    """An HTTP server on 127.0.0.1 answering every POST 200 with ``body``; ``requests`` records them."""

    def __init__(self, body: bytes = b"") -> None:
        outer = self
        self.requests: list[str] = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                self.rfile.read(int(self.headers.get("content-length", 0)))
                outer.requests.append(self.path)
                self.send_response(200)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def fleet_server(smollm2):
    os.environ[SECRET_ENV] = "the-fleet-secret-of-this-test"
    try:
        config = EngineConfig(kv_cache_memory=32 * 2**20, max_model_len=512,
                              kv_transfer_config={"kv_connector": "PeerPullConnector", "min_pull_blocks": 2})
        app = create_app(config, ServerSettings(api_key="k"),
                         engine_factory=lambda cfg, loggers: AsyncLLMEngine(cfg, loggers, loaded=smollm2))
        with TestClient(app) as c:
            deadline = time.monotonic() + 120
            while c.get("/ready").status_code != 200:
                assert time.monotonic() < deadline, "the engine did not load"
                time.sleep(0.2)
            yield c
    finally:
        del os.environ[SECRET_ENV]


def metric(c: TestClient, family: str, reason: str | None = None) -> float:
    """``family``'s counter (``reason``: that label's series only); 0 before its first count."""
    for fam in text_string_to_metric_families(c.get("/metrics").text):
        if fam.name == family:
            return sum(s.value for s in fam.samples
                       if s.name.endswith("_total") and reason in (None, s.labels.get("reason")))
    return 0.0


PROMPT = "The fleet shares one long system prompt. " * 12 + "Question:"


def complete(c: TestClient, headers: dict) -> None:
    r = c.post("/v1/completions", json={"model": "SmolLM2-135M-Instruct", "prompt": PROMPT, "max_tokens": 2,
                                        "temperature": 0}, headers={"authorization": "Bearer k", **headers})
    assert r.status_code == 200, r.text  # a refused hint never fails the request: it is computed


def test_a_hint_not_signed_by_the_router_is_ignored_and_counted(fleet_server):
    peer = Listener()
    try:
        complete(fleet_server, {PEER_HEADER: peer.url})  # a client naming a "peer" to a replica directly
        complete(fleet_server, {PEER_HEADER: peer.url,  # signed, but by another fleet's router
                                HINT_SIGNATURE_HEADER: FleetKeys(b"another-fleet-secret").sign_hint(peer.url)})
        complete(fleet_server, {PEER_HEADER: "http://169.254.169.254",  # this fleet's, but for another address
                                HINT_SIGNATURE_HEADER: FLEET.sign_hint(peer.url)})
        assert peer.requests == []  # the replica made no request anywhere
        assert metric(fleet_server, "kvfleet:kv_peer_hints_refused", "unsigned") == 1
        assert metric(fleet_server, "kvfleet:kv_peer_hints_refused", "signature") == 2
    finally:
        peer.close()


def test_frames_from_a_fleet_address_that_is_not_a_replica_are_refused_and_counted(fleet_server, smollm2):
    # the router signs a hint naming an address of the fleet where no replica answers any more (a
    # recycled pod IP): what answers there sends well-formed frames of the prompt's block hashes
    # with garbage K/V, but cannot seal them
    tokens = smollm2.tokenizer(PROMPT)["input_ids"]
    engine = fleet_server.app.state.kvfleet.engine
    layout = engine.kv_block_layout()
    hashes = prompt_block_hashes(tokens[:((len(tokens) - 1) // 16) * 16], 16)
    forged = b"".join(encode_frame(layout, h, b"\0" * layout.block_bytes) for h in hashes)
    peer = Listener(forged)
    fleet_server.post("/reset_prefix_cache", headers={"authorization": "Bearer k"})
    try:
        before = metric(fleet_server, "kvfleet:kv_pull_failures", "not_replica")
        complete(fleet_server, {PEER_HEADER: peer.url, HINT_SIGNATURE_HEADER: FLEET.sign_hint(peer.url)})
        assert peer.requests == ["/kv_blocks"]  # the router's hint is taken
        assert metric(fleet_server, "kvfleet:kv_pull_failures", "not_replica") == before + 1
        assert metric(fleet_server, "kvfleet:kv_pull_tokens") == 0  # nothing installed
    finally:
        peer.close()


def test_kv_blocks_are_served_to_the_fleet_only_and_sealed(fleet_server):
    body = {"block_hashes": ["00" * 16]}
    for headers in ({}, {"authorization": "Bearer k"}, {FLEET_AUTH_HEADER: FleetKeys(b"another-fleet-secret")
                                                         .pull_auth()[0]}):
        r = fleet_server.post("/kv_blocks", json=body, headers=headers)  # the API key is not the fleet's auth
        assert r.status_code == 403, headers
        assert fleet_server.get("/kv_blocks", params={"hashes": "zz"}, headers=headers).status_code == 403
    auth, nonce = FLEET.pull_auth()
    r = fleet_server.post("/kv_blocks", json=body, headers={FLEET_AUTH_HEADER: auth})
    assert r.status_code == 200
    reader = FrameReader(fleet_server.app.state.kvfleet.engine.kv_block_layout(), [bytes(16)],
                         seal_key=FLEET.seal_key(nonce))
    reader.feed(r.content)
    assert reader.finish() == []  # nothing cached under that hash: an empty run, sealed
    assert fleet_server.get("/kv_blocks", params={"hashes": "zz"}, headers={FLEET_AUTH_HEADER: auth}).status_code == 400
