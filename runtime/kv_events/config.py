"""``--kv-events-config``: whether the engine records KV cache events and how it publishes
them (vLLM's ``KVEventsConfig`` field names: ``vllm/config/kv_events.py``).

kvfleet differs from vLLM in two places: there is no ZMQ ``replay_endpoint``; a late reader
instead reads ``GET /kv_events/snapshot`` (every hash cached after batch ``seq``) and then
applies the batches with a larger ``seq`` (docs/routing.md, "Precise prefix routing"). And
``include_token_ids`` (kvfleet's): ``false`` sends ``BlockStored`` with empty ``token_ids``, so the
events carry no prompt text (``kvfleet serve``'s default events, which a router reads for hashes only).
And ``auth`` (kvfleet's): by default the socket is authenticated and encrypted with keys of the
fleet secret (:mod:`~kvfleet.runtime.kv_events.auth`); ``"none"`` publishes in plaintext as vLLM does.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from kvfleet.runtime.json_option import parse_json_option


class KVEventsConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    enable_kv_cache_events: bool = False
    """Record an event each time a block hash enters or leaves the prefix cache."""
    publisher: Literal["null", "zmq"] = "zmq"
    """``zmq``: a ZMQ PUB socket on ``endpoint``; ``null``: record (the snapshot endpoint still
    answers) but send nothing. vLLM's default is ``null`` unless events are enabled."""
    endpoint: str = "tcp://*:5557"
    """The ZMQ endpoint the PUB socket binds (``tcp://*:PORT``; port 0: any free port)."""
    topic: str = ""
    """First frame of every message (subscribers filter on it)."""
    hwm: int = Field(100_000, ge=1)
    """ZMQ send high-water mark: messages queued for a slow subscriber before ZMQ drops them."""
    max_queue_size: int = Field(100_000, ge=1)
    """Accepted for vLLM compatibility; kvfleet sends from the engine thread without a queue."""
    include_token_ids: bool = True
    """``BlockStored.token_ids`` as vLLM sends them; false: empty (block hashes only)."""
    buffer_steps: int = Field(10_000, ge=1)
    """Accepted for vLLM compatibility (its replay buffer); kvfleet replays from the snapshot."""
    auth: Literal["fleet", "none"] = "fleet"
    """kvfleet's. ``fleet``: the socket is a ZMQ CURVE server keyed by the fleet secret, which only
    the fleet's routers can subscribe to and whose batches a router knows are the replica's
    (:mod:`~kvfleet.runtime.kv_events.auth`; no secret to be had: nothing is published).
    ``none``: plaintext, as vLLM publishes (any reader that reaches the port, e.g. an llm-d indexer)."""

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events

    @classmethod
    def parse(cls, value) -> KVEventsConfig | None:
        """A JSON object string (the CLI, the environment), a mapping, a config, or None.

        Raises:
            ValueError: not JSON, not an object, or a field pydantic refuses."""
        return parse_json_option(cls, value, "kv_events_config")
