"""The messages on the KV events socket, as vLLM sends them (``vllm/distributed/kv_events.py``):
three ZMQ frames ``(topic, seq as 8 big-endian bytes, payload)``, the payload a msgpack array
``[ts, [event, ...], data_parallel_rank]``, each event an array whose first element is its tag
(``"BlockStored"``, ``"BlockRemoved"``, ``"AllBlocksCleared"``). msgspec structs with
``array_like=True, tag=True`` are that encoding.

kvfleet's block hashes are 16-byte strings (msgpack ``bin``), where vLLM's are integers or
bytes depending on its hash function; a reader must treat them as opaque keys.
"""

from __future__ import annotations

import msgspec


class _Event(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(_Event):
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None


class BlockRemoved(_Event):
    block_hashes: list[bytes]
    medium: str | None = None


class AllBlocksCleared(_Event):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(batch: KVEventBatch) -> bytes:
    return _ENCODER.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """Raises msgspec.DecodeError on a malformed payload."""
    return _DECODER.decode(payload)


def frames(topic: str, seq: int, batch: KVEventBatch) -> tuple[bytes, bytes, bytes]:
    return topic.encode(), seq.to_bytes(8, "big"), encode_batch(batch)


def parse_frames(parts: list[bytes]) -> tuple[int, KVEventBatch]:
    """``(seq, batch)`` of a received multipart message. Raises ValueError / DecodeError."""
    if len(parts) != 3 or len(parts[1]) != 8:
        raise ValueError(f"a KV event message has 3 frames (topic, seq, payload), got {len(parts)}")
    return int.from_bytes(parts[1], "big"), decode_batch(parts[2])
