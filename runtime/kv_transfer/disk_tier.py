"""The disk tier of the KV cache: one file per block, ``<dir>/<block hash hex>.kv``, holding one
frame of :mod:`kvfleet.runtime.kv_transfer.wire` (the same checked header as on the wire).

Contract: :meth:`DiskTier.put` writes a block (to a temporary name, then renamed: a crash never
leaves a partial file under a block's name) and drops the least recently used files while the
tier holds more than ``max_bytes``; :meth:`DiskTier.get` reads one back and checks it against the
reader's layout and the hash asked for (a bad file raises
:class:`~kvfleet.runtime.kv_transfer.wire.TransferError` and is deleted). The index is built at
start from the files already there (oldest modification time first), so a restarted replica
finds what it wrote before; a file another replica wrote to a shared folder later is found by
:meth:`DiskTier.leading_run` when asked for. Thread-safe (one lock around the index). Torch-free.
"""

from __future__ import annotations

import collections
import os
import threading
from pathlib import Path

from kvfleet.runtime.kv_transfer.wire import BlockLayout, FrameReader, TransferError, encode_frame

SUFFIX = ".kv"


class DiskTier:
    """Args: path (created if missing), max_bytes (the bound), layout (this replica's)."""

    def __init__(self, path: str | os.PathLike, max_bytes: int, layout: BlockLayout) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.layout = layout
        self._lock = threading.Lock()
        self._index: collections.OrderedDict[bytes, int] = collections.OrderedDict()
        self.num_bytes = 0
        found = []
        for f in self.path.glob("*" + SUFFIX):
            try:
                found.append((f.stat().st_mtime, bytes.fromhex(f.stem), f.stat().st_size))
            except (OSError, ValueError):
                continue  # not one of ours, or gone meanwhile
        for _, block_hash, size in sorted(found):
            self._index[block_hash] = size
            self.num_bytes += size
        self._evict()

    def _file(self, block_hash: bytes) -> Path:
        return self.path / (block_hash.hex() + SUFFIX)

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._index

    def leading_run(self, hashes: list[bytes]) -> int:
        """How many of ``hashes``, from the first, the tier holds (a file another process wrote
        to a shared folder since the index was built is found and indexed too)."""
        n = 0
        for h in hashes:
            with self._lock:
                held = h in self._index
            if not held and not self._adopt(h):
                break
            n += 1
        return n

    def _adopt(self, block_hash: bytes) -> bool:
        try:
            size = self._file(block_hash).stat().st_size
        except OSError:
            return False
        with self._lock:
            if block_hash not in self._index:
                self._index[block_hash] = size
                self.num_bytes += size
        return True

    def put(self, block_hash: bytes, payload: bytes) -> None:
        """Store one block (a block already held only becomes the most recently used)."""
        with self._lock:
            if block_hash in self._index:
                self._index.move_to_end(block_hash)
                return
        data = encode_frame(self.layout, block_hash, payload)
        target = self._file(block_hash)
        tmp = target.with_suffix(f".tmp{threading.get_ident()}")
        tmp.write_bytes(data)
        os.replace(tmp, target)
        with self._lock:
            if block_hash not in self._index:
                self._index[block_hash] = len(data)
                self.num_bytes += len(data)
            self._evict()

    def get(self, block_hash: bytes) -> bytes:
        """One block's payload, checked; TransferError (the file deleted) when it is bad or gone."""
        try:
            data = self._file(block_hash).read_bytes()
        except OSError as exc:
            self._drop(block_hash)
            raise TransferError("truncated", f"disk tier: {exc}") from None
        reader = FrameReader(self.layout, [block_hash])
        try:
            reader.feed(data)
            blocks = reader.finish()
            if not blocks:
                raise TransferError("truncated", "disk tier: an empty file")
        except TransferError:
            self._drop(block_hash)
            raise
        with self._lock:
            if block_hash in self._index:
                self._index.move_to_end(block_hash)
        return blocks[0][1]

    def _drop(self, block_hash: bytes) -> None:
        with self._lock:
            size = self._index.pop(block_hash, None)
            if size is not None:
                self.num_bytes -= size
        self._file(block_hash).unlink(missing_ok=True)

    def _evict(self) -> None:  # under the lock
        while self.num_bytes > self.max_bytes and self._index:
            block_hash, size = self._index.popitem(last=False)
            self.num_bytes -= size
            self._file(block_hash).unlink(missing_ok=True)
