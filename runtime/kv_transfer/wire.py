"""The framed format of KV blocks on the wire (``/kv_blocks``) and on disk, and its checks.

One frame per block: ``b"KVB1"``, the header's length (4 bytes, big-endian), the header (a JSON
object), then the payload. The header names the model, the cache dtype, the weight
quantization, the layout (``num_layers``, ``num_kv_heads``, ``head_size``, ``block_size``), the
block's prefix-cache hash (hex), the payload's length and its BLAKE2b-128 digest. The payload is
the block's K and V for every layer, ``[num_layers, 2, block_size, num_kv_heads, head_size]`` in
the cache dtype, C order (:mod:`kvfleet.runtime.worker.kv_blocks`).

:class:`FrameReader` takes the bytes as they arrive and refuses (:class:`TransferError`, with a
``reason``) any frame whose header differs from the reader's own layout, whose hash is not the
next one of the hashes asked for, whose payload length or digest is wrong, and a stream that
ends inside a frame. With a ``seal_key`` (a pull from a peer) the stream must end with the seal
of :mod:`~kvfleet.runtime.kv_transfer.fleet_auth` over every frame before it: no seal, a wrong
one, or bytes after it are refused (``not_replica``), and :meth:`FrameReader.finish` returns
nothing unsealed. Torch-free, no I/O.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import struct
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from kvfleet.runtime.kv_transfer.fleet_auth import SEAL_BYTES, SEAL_MAGIC

MAGIC = b"KVB1"
MAX_HEADER_BYTES = 64 * 1024
CONTENT_TYPE = "application/x-kvfleet-kv-blocks"


class TransferError(ValueError):
    """A refused transfer; ``reason`` is one of ``layout``, ``hash``, ``digest``, ``truncated``,
    ``malformed``, ``not_replica`` (the ``reason`` label of the failure metric)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason


@dataclass(frozen=True)
class BlockLayout:
    """What must be equal on both sides for a block's bytes to mean the same K/V."""

    model: str
    dtype: str
    """The cache dtype, e.g. ``bfloat16``."""
    quantization: str
    """The weights' quantization (``none``, ``int8``, ``int4``): it changes the K/V computed."""
    num_layers: int
    num_kv_heads: int
    head_size: int
    block_size: int
    elem_size: int
    """Bytes per element of ``dtype``."""

    @property
    def block_bytes(self) -> int:
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_size * self.elem_size


def _digest(payload: bytes) -> str:
    return hashlib.blake2b(payload, digest_size=16).hexdigest()


def encode_frame(layout: BlockLayout, block_hash: bytes, payload: bytes) -> bytes:
    """One block's frame."""
    header = {**asdict(layout), "block_hash": block_hash.hex(), "payload_bytes": len(payload),
              "payload_blake2b": _digest(payload)}
    raw = json.dumps(header, separators=(",", ":")).encode()
    return MAGIC + struct.pack(">I", len(raw)) + raw + payload


def check_header(header: dict, layout: BlockLayout, expected_hash: bytes | None) -> None:
    """Raise :class:`TransferError` unless ``header`` describes a block of ``layout`` (and, when
    given, of hash ``expected_hash``)."""
    if not isinstance(header, dict):
        raise TransferError("malformed", "the header is not a JSON object")
    mine = asdict(layout)
    for key, value in mine.items():
        if header.get(key) != value:
            raise TransferError("layout", f"{key} {header.get(key)!r} differs from this replica's {value!r}")
    if expected_hash is not None and header.get("block_hash") != expected_hash.hex():
        raise TransferError("hash", f"block hash {header.get('block_hash')!r} is not the {expected_hash.hex()} "
                                    "this prompt's hash chain asks for")
    if header.get("payload_bytes") != layout.block_bytes:
        raise TransferError("layout", f"payload of {header.get('payload_bytes')!r} bytes, {layout.block_bytes} "
                                      "expected")


class FrameReader:
    """Decodes frames as bytes arrive, checking each against ``layout`` and the next of
    ``expected`` (the hashes asked for, in order; None: any hash, e.g. a disk file's own);
    ``seal_key``: the stream must end with the seal made with it (a peer's answer)."""

    def __init__(self, layout: BlockLayout, expected: Sequence[bytes] | None = None,
                 seal_key: bytes | None = None) -> None:
        self.layout = layout
        self.expected = list(expected) if expected is not None else None
        self.blocks: list[tuple[bytes, bytes]] = []
        self._buf = bytearray()
        self._mac = hmac.new(seal_key, digestmod=hashlib.sha256) if seal_key is not None else None
        self._sealed = False

    def feed(self, data: bytes) -> None:
        """Take more bytes; every complete frame is checked and appended to ``blocks``."""
        self._buf += data
        while self._take_one():
            pass

    def _take_one(self) -> bool:
        buf = self._buf
        if self._sealed and buf:
            raise TransferError("not_replica", "bytes after the seal")
        if len(buf) < 8:
            return False
        if self._mac is not None and bytes(buf[:4]) == SEAL_MAGIC:
            if len(buf) < SEAL_BYTES:
                return False
            if not hmac.compare_digest(bytes(buf[4:SEAL_BYTES]), self._mac.digest()):
                raise TransferError("not_replica", "the answer's seal is not a replica's of this fleet")
            self._sealed = True
            del buf[:SEAL_BYTES]
            return bool(buf)
        if bytes(buf[:4]) != MAGIC:
            raise TransferError("malformed", "a frame does not start with KVB1")
        (hlen,) = struct.unpack(">I", buf[4:8])
        if hlen > MAX_HEADER_BYTES:
            raise TransferError("malformed", f"header of {hlen} bytes")
        if len(buf) < 8 + hlen:
            return False
        try:
            header = json.loads(bytes(buf[8:8 + hlen]))
        except ValueError:
            raise TransferError("malformed", "the header is not JSON") from None
        index = len(self.blocks)
        if self.expected is not None and index >= len(self.expected):
            raise TransferError("hash", f"more blocks than the {len(self.expected)} asked for")
        check_header(header, self.layout, self.expected[index] if self.expected is not None else None)
        end = 8 + hlen + self.layout.block_bytes
        if len(buf) < end:
            return False
        payload = bytes(buf[8 + hlen:end])
        if _digest(payload) != header.get("payload_blake2b"):
            raise TransferError("digest", f"block {header['block_hash']}: the payload's digest differs")
        try:
            block_hash = bytes.fromhex(header["block_hash"])
        except (TypeError, ValueError):
            raise TransferError("malformed", "block_hash is not hex") from None
        self.blocks.append((block_hash, payload))
        if self._mac is not None:
            self._mac.update(bytes(buf[:end]))
        del buf[:end]
        return True

    def finish(self) -> list[tuple[bytes, bytes]]:
        """The blocks read; :class:`TransferError` ``truncated`` when the stream ended inside a frame."""
        if self._buf:
            raise TransferError("truncated", f"the stream ended {len(self._buf)} bytes into a frame")
        if self._mac is not None and not self._sealed:
            raise TransferError("not_replica", "the answer has no seal of a replica of this fleet")
        return self.blocks
