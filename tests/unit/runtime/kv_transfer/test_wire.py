"""The KV block frame format: round trip, and every kind of bad transfer refused (issue 29)."""

from __future__ import annotations

import dataclasses
import hashlib

import pytest

from kvfleet.runtime.kv_transfer.wire import BlockLayout, FrameReader, TransferError, encode_frame

LAYOUT = BlockLayout(model="m", dtype="float32", quantization="none", num_layers=2, num_kv_heads=1, head_size=4,
                     block_size=2, elem_size=4)
HASHES = [hashlib.blake2b(bytes([i]), digest_size=16).digest() for i in range(3)]
PAYLOADS = [bytes([i]) * LAYOUT.block_bytes for i in range(3)]


def stream(layout=LAYOUT, hashes=HASHES, payloads=PAYLOADS) -> bytes:
    return b"".join(encode_frame(layout, h, p) for h, p in zip(hashes, payloads))


def read(data: bytes, expected=HASHES, chunk: int = 7):
    reader = FrameReader(LAYOUT, expected)
    for i in range(0, len(data), chunk):
        reader.feed(data[i:i + chunk])
    return reader.finish()


def test_frames_round_trip_whatever_the_chunking():
    assert LAYOUT.block_bytes == 2 * 2 * 2 * 1 * 4 * 4
    for chunk in (1, 7, 10_000):
        assert read(stream(), chunk=chunk) == list(zip(HASHES, PAYLOADS))


def test_a_shorter_run_than_asked_is_fine():
    assert read(stream(hashes=HASHES[:2], payloads=PAYLOADS[:2])) == list(zip(HASHES[:2], PAYLOADS[:2]))
    assert read(b"") == []


@pytest.mark.parametrize("field", ["model", "dtype", "quantization", "num_layers", "num_kv_heads", "head_size",
                                   "block_size"])
def test_a_different_layout_is_refused(field):
    other = dataclasses.replace(LAYOUT, **{field: 99 if isinstance(getattr(LAYOUT, field), int) else "x"})
    with pytest.raises(TransferError) as exc:
        read(stream(layout=other))
    assert exc.value.reason == "layout"


def test_a_block_that_is_not_the_next_of_the_chain_is_refused():
    with pytest.raises(TransferError) as exc:
        read(stream(hashes=[HASHES[0], HASHES[2], HASHES[1]]))
    assert exc.value.reason == "hash"
    with pytest.raises(TransferError) as exc:  # more blocks than asked for
        read(stream(), expected=HASHES[:2])
    assert exc.value.reason == "hash"


def test_a_corrupted_payload_is_refused():
    data = bytearray(stream())
    data[-5] ^= 0x40
    with pytest.raises(TransferError) as exc:
        read(bytes(data))
    assert exc.value.reason == "digest"


def test_a_truncated_stream_is_refused():
    with pytest.raises(TransferError) as exc:
        read(stream()[:-1])
    assert exc.value.reason == "truncated"


def test_garbage_is_refused():
    with pytest.raises(TransferError) as exc:
        read(b"HTTP/1.1 200 OK\r\n\r\n")
    assert exc.value.reason == "malformed"
