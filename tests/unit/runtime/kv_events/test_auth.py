"""The fleet's CURVE keys for KV events (kvfleet.runtime.kv_events.auth), on real ZMQ sockets: a
replica's default publisher lets in only a reader holding the fleet secret (a plaintext
subscriber and one with another key read nothing, the latter counted), and the monitor events a
router sees from a refused publisher map to ``not_fleet``."""

from __future__ import annotations

import time

import pytest
import zmq

from kvfleet.runtime.core import kv_events as ev
from kvfleet.runtime.engine.kv_event_publisher import KVEventPublisher
from kvfleet.runtime.kv_events import auth, wire
from kvfleet.runtime.kv_events.config import KVEventsConfig
from kvfleet.runtime.kv_transfer.fleet_auth import FleetKeys

SECRET = "a fleet secret of this test, 32+ bytes"
FLEET = auth.events_keys(FleetKeys(SECRET.encode()))
OTHER = auth.events_keys(FleetKeys(b"another fleet's secret, as long"))


def test_every_holder_of_the_secret_derives_the_same_keys_and_another_secret_others():
    again = auth.events_keys(FleetKeys(SECRET.encode()))
    assert again == FLEET and len(FLEET.publisher_public) == 40
    assert zmq.curve_public(FLEET.reader_secret) == FLEET.reader_public
    assert len({FLEET.publisher_public, FLEET.reader_public, OTHER.publisher_public, OTHER.reader_public}) == 4


@pytest.fixture
def publisher(monkeypatch):
    monkeypatch.setenv("KVFLEET_FLEET_SECRET", SECRET)
    pub = KVEventPublisher(KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://127.0.0.1:0"), 4)
    yield pub
    pub.close()


def _reader(ctx: zmq.Context, endpoint: str, keys: auth.EventsKeys | None, as_reader: bool = True) -> zmq.Socket:
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.setsockopt(zmq.LINGER, 0)
    if keys is not None:
        sock.curve_serverkey = FLEET.publisher_public
        sock.curve_publickey, sock.curve_secretkey = ((keys.reader_public, keys.reader_secret) if as_reader
                                                      else (keys.publisher_public, keys.publisher_secret))
    sock.connect(endpoint)
    return sock


def _received(pub: KVEventPublisher, sock: zmq.Socket, seconds: float = 3.0) -> list[bytes] | None:
    """Publish until ``sock`` gets a message (ZMQ's slow joiner) or ``seconds`` pass."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        pub.publish([ev.BlockStored([b"h" * 16], None, [], 4)])
        if sock.poll(50):
            return sock.recv_multipart()
    return None


def test_the_default_publisher_is_read_by_the_fleet_only(publisher):
    snap = publisher.snapshot_json()
    assert snap["auth"] == "fleet" and snap["endpoint"].startswith("tcp://127.0.0.1:")
    ctx = zmq.Context()
    try:
        fleet = _reader(ctx, snap["endpoint"], FLEET)
        parts = _received(publisher, fleet)
        assert parts is not None, "the fleet's reader got nothing"
        seq, batch = wire.parse_frames(parts)
        assert seq >= 1 and batch.events[0].block_hashes == [b"h" * 16]
        # Outsiders: plaintext, and a CURVE client with keys not the fleet's reader key (the other
        # fleet's, and this fleet's publisher pair: a key pair is not a pass).
        plain = _reader(ctx, snap["endpoint"], None)
        other = _reader(ctx, snap["endpoint"], OTHER)
        wrong_pair = _reader(ctx, snap["endpoint"], FLEET, as_reader=False)
        for sock in (plain, other, wrong_pair):
            assert _received(publisher, sock, 1.5) is None
        assert publisher.refused_subscribers >= 2
        assert _received(publisher, fleet) is not None  # the fleet's reader still reads
    finally:
        ctx.destroy(linger=0)


def test_no_secret_means_nothing_published_and_auth_none_is_plaintext(monkeypatch, tmp_path):
    monkeypatch.delenv("KVFLEET_FLEET_SECRET", raising=False)
    monkeypatch.setattr("kvfleet.runtime.kv_transfer.fleet_auth.default_secret_file", lambda: None)
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://127.0.0.1:0")
    silent = KVEventPublisher(config, 4)
    silent.publish([ev.BlockStored([b"x" * 16], None, [], 4)])  # recorded for the snapshot, sent nowhere
    assert silent.bound_endpoint is None and silent.snapshot_json()["block_hashes"] == ["78" * 16]
    silent.close()
    plain = KVEventPublisher(config.model_copy(update={"auth": "none"}), 4)
    ctx = zmq.Context()
    try:
        assert plain.snapshot_json()["auth"] == "none"
        assert _received(plain, _reader(ctx, plain.bound_endpoint, None)) is not None
    finally:
        plain.close()
        ctx.destroy(linger=0)


def test_an_unknown_auth_mode_is_refused():
    with pytest.raises(ValueError, match="auth"):
        KVEventsConfig.parse('{"enable_kv_cache_events": true, "auth": "hmac"}')


@pytest.mark.parametrize(("event", "value", "reason"), [
    (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH, "not_fleet"),
    (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, 0, "not_fleet"),
    (zmq.EVENT_HANDSHAKE_FAILED_AUTH, 400, "not_fleet"),
    (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC, "not_fleet"),
    (zmq.EVENT_CONNECTED, 12, None),
    (zmq.EVENT_HANDSHAKE_SUCCEEDED, 0, None),
])
def test_refusal_reasons_of_monitor_events(event, value, reason):
    assert auth.refusal_reason(event, value) == reason
