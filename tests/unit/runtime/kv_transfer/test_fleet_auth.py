"""The fleet secret (issue 42): the router's hint signature, the pull's auth and the answer's
seal, each refused when forged, stale, for another URL or another pull; the secret's sources."""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
import stat

import pytest

from kvfleet.runtime.kv_transfer import fleet_auth
from kvfleet.runtime.kv_transfer.fleet_auth import MAX_AGE, FleetKeys, Sealer, load_fleet_keys
from kvfleet.runtime.kv_transfer.wire import BlockLayout, FrameReader, TransferError, encode_frame

KEYS = FleetKeys(b"s" * 32)
OTHER = FleetKeys(b"t" * 32)
PEER = "http://10.0.0.7:8000"
LAYOUT = BlockLayout(model="m", dtype="float32", quantization="none", num_layers=1, num_kv_heads=1, head_size=2,
                     block_size=2, elem_size=4)
H = [hashlib.blake2b(bytes([i]), digest_size=16).digest() for i in range(3)]


def test_a_hint_verifies_only_for_its_url_its_fleet_and_while_fresh():
    sig = KEYS.sign_hint(PEER, now=1000)
    assert KEYS.check_hint(PEER, sig, now=1000 + MAX_AGE - 1) is None
    assert KEYS.check_hint("http://10.0.0.8:8000", sig, now=1000) == "signature"  # another URL
    assert OTHER.check_hint(PEER, sig, now=1000) == "signature"  # another fleet's router
    assert KEYS.check_hint(PEER, sig, now=1000 + MAX_AGE + 1) == "expired"
    assert KEYS.check_hint(PEER, None) == "unsigned" and KEYS.check_hint(PEER, "") == "unsigned"
    for bad in ("v1=00", "t=x,v1=00", "garbage", "t=1,,v1=2"):
        assert KEYS.check_hint(PEER, bad) == "malformed"


def test_a_pull_auth_is_the_fleets_fresh_and_yields_its_nonce():
    auth, nonce = KEYS.pull_auth(now=50)
    assert KEYS.check_pull_auth(auth, now=50) == nonce
    assert OTHER.check_pull_auth(auth, now=50) is None
    assert KEYS.check_pull_auth(auth, now=50 + MAX_AGE + 1) is None
    assert KEYS.check_pull_auth(auth.replace(nonce.decode(), "0" * 32), now=50) is None  # nonce swapped
    assert KEYS.check_pull_auth(None) is None and KEYS.check_pull_auth("Bearer x") is None
    assert KEYS.pull_auth()[1] != KEYS.pull_auth()[1]


def sealed(keys: FleetKeys, nonce: bytes, frames: bytes) -> bytes:
    sealer = Sealer(keys.seal_key(nonce))
    return sealer.add(frames) + sealer.seal()


def read(data: bytes, seal_key: bytes, step: int = 7) -> list:
    reader = FrameReader(LAYOUT, H, seal_key=seal_key)
    for i in range(0, len(data), step):  # as it arrives, in pieces that cut frames and the seal
        reader.feed(data[i:i + step])
    return reader.finish()


def test_only_a_replicas_seal_for_this_pull_lets_frames_through():
    payload = b"\1" * LAYOUT.block_bytes
    frames = encode_frame(LAYOUT, H[0], payload) + encode_frame(LAYOUT, H[1], payload)
    nonce = b"n1"
    assert read(sealed(KEYS, nonce, frames), KEYS.seal_key(nonce)) == [(H[0], payload), (H[1], payload)]
    assert read(sealed(KEYS, nonce, b""), KEYS.seal_key(nonce)) == []  # an empty run, sealed
    refused = {
        "unsealed": frames,
        "another fleet": sealed(OTHER, nonce, frames),
        "another pull (replayed)": sealed(KEYS, b"n0", frames),
        "frames changed under the seal": sealed(KEYS, nonce, frames)[:-40] + b"\2" + sealed(KEYS, nonce, frames)[-39:],
        "bytes after the seal": sealed(KEYS, nonce, frames) + encode_frame(LAYOUT, H[2], payload),
    }
    for what, data in refused.items():
        with pytest.raises(TransferError) as exc:
            read(data, KEYS.seal_key(nonce))
        assert exc.value.reason in ("not_replica", "digest"), what
    # the disk tier's reader (no seal key) is unchanged
    plain = FrameReader(LAYOUT)
    plain.feed(frames)
    assert len(plain.finish()) == 2


def test_the_secret_from_the_environment_a_file_or_created_once_for_the_user(tmp_path, monkeypatch):
    env = {fleet_auth.SECRET_ENV: "e" * 20}
    assert load_fleet_keys(environ=env).hint_key == FleetKeys(b"e" * 20).hint_key
    with pytest.raises(ValueError, match="at least 16"):
        load_fleet_keys(environ={fleet_auth.SECRET_ENV: "short"})
    (tmp_path / "given").write_text("f" * 24 + "\n")
    assert load_fleet_keys(str(tmp_path / "given"), environ={}).hint_key == FleetKeys(b"f" * 24).hint_key
    with pytest.raises(ValueError, match="fleet_secret_file"):
        load_fleet_keys(str(tmp_path / "missing"), environ={})
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))
    with concurrent.futures.ThreadPoolExecutor(8) as pool:  # processes of one user racing to create it
        keys = list(pool.map(lambda _: load_fleet_keys(environ={}), range(16)))
    path = tmp_path / "cfg" / "kvfleet" / "fleet-secret"
    assert len({k.hint_key for k in keys}) == 1 and len(path.read_bytes().strip()) >= 32
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert sorted(p.name for p in path.parent.iterdir()) == ["fleet-secret"]  # no temporary file left
    assert load_fleet_keys(environ={}).replica_key == keys[0].replica_key  # a later process: the same fleet
    monkeypatch.setenv("XDG_CONFIG_HOME", "/proc/no-such-dir")  # nowhere to keep one: off, not fatal
    assert load_fleet_keys(environ={}) is None
