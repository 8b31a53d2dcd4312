"""The disk tier's files: round trip, the index rebuilt at start, the LRU bound, bad files refused
and deleted (issue 29)."""

from __future__ import annotations

import dataclasses
import hashlib
import os

import pytest

from kvfleet.runtime.kv_transfer.disk_tier import DiskTier
from kvfleet.runtime.kv_transfer.wire import BlockLayout, TransferError

LAYOUT = BlockLayout(model="m", dtype="float32", quantization="none", num_layers=1, num_kv_heads=1, head_size=4,
                     block_size=2, elem_size=4)
H = [hashlib.blake2b(bytes([i]), digest_size=16).digest() for i in range(5)]


def payload(i: int) -> bytes:
    return bytes([i]) * LAYOUT.block_bytes


def test_round_trip_and_the_index_survives_a_restart(tmp_path):
    tier = DiskTier(tmp_path, 10**6, LAYOUT)
    for i in range(3):
        tier.put(H[i], payload(i))
    assert tier.get(H[1]) == payload(1) and tier.leading_run(H) == 3 and len(tier) == 3
    again = DiskTier(tmp_path, 10**6, LAYOUT)  # a restarted replica
    assert again.leading_run(H) == 3 and again.num_bytes == tier.num_bytes
    assert again.get(H[2]) == payload(2)
    assert not list(tmp_path.glob("*.tmp*"))


def test_least_recently_used_files_go_past_the_bound(tmp_path):
    one = DiskTier(tmp_path, 10**6, LAYOUT)
    one.put(H[0], payload(0))
    size = one.num_bytes
    tier = DiskTier(tmp_path, 3 * size, LAYOUT)
    for i in range(1, 3):
        tier.put(H[i], payload(i))
    tier.get(H[0])  # used: the newest now
    tier.put(H[3], payload(3))
    assert sorted(h for h in H if h in tier) == sorted([H[0], H[2], H[3]])
    assert not (tmp_path / (H[1].hex() + ".kv")).exists() and tier.num_bytes == 3 * size
    for i, f in enumerate(sorted(tmp_path.glob("*.kv"))):
        os.utime(f, (1000 + i, 1000 + i))
    assert len(DiskTier(tmp_path, 2 * size, LAYOUT)) == 2  # the bound applies to what is found at start


def test_a_bad_file_is_refused_and_deleted(tmp_path):
    tier = DiskTier(tmp_path, 10**6, LAYOUT)
    tier.put(H[0], payload(0))
    tier.put(H[1], payload(1))
    f = tmp_path / (H[0].hex() + ".kv")
    f.write_bytes(f.read_bytes()[:-1] + b"\x7f")
    with pytest.raises(TransferError) as exc:
        tier.get(H[0])
    assert exc.value.reason == "digest" and not f.exists() and H[0] not in tier
    other = DiskTier(tmp_path, 10**6, dataclasses.replace(LAYOUT, dtype="bfloat16"))  # another model's files
    with pytest.raises(TransferError) as exc:
        other.get(H[1])
    assert exc.value.reason == "layout"
    (tmp_path / (H[2].hex() + ".kv")).write_bytes(b"")
    with pytest.raises(TransferError):
        DiskTier(tmp_path, 10**6, LAYOUT).get(H[2])


def test_a_shared_folder_finds_what_another_replica_wrote_later(tmp_path):
    mine, theirs = DiskTier(tmp_path, 10**6, LAYOUT), DiskTier(tmp_path, 10**6, LAYOUT)
    theirs.put(H[0], payload(0))
    theirs.put(H[1], payload(1))
    assert mine.leading_run(H) == 2 and mine.get(H[1]) == payload(1)
    assert mine.num_bytes == theirs.num_bytes
