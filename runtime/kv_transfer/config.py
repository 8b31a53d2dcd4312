"""``--kv-transfer-config``: pulling prefix KV blocks from a peer replica instead of recomputing
them (vLLM's ``KVTransferConfig`` field names where they fit: ``kv_connector``, ``kv_role``).

kvfleet's one connector is ``PeerPullConnector``: a replica serves its cached blocks on
``GET|POST /kv_blocks`` (``kv_role`` ``kv_producer`` or ``kv_both``) and, for a request that
carries the router's ``x-kvfleet-kv-peer`` hint, pulls the prompt's missing prefix blocks from
that peer (``kv_consumer`` or ``kv_both``). vLLM's connectors (NIXL, LMCache, P2P NCCL) move
blocks between a prefill and a decode instance over RDMA/NCCL; kvfleet's moves them over HTTP
between equal replicas (docs/routing.md, "Peer KV pull"). ``disk_path`` adds a disk tier
(docs/routing.md, "Disk tier"), with or without peers.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from kvfleet.runtime.json_option import parse_json_option

DEFAULT_MIN_PULL_BLOCKS = 4
"""Pull only when at least this many prefix blocks are missing locally: below it (64 tokens at
block size 16) one HTTP round trip costs about what recomputing them costs on a CPU."""


class KVTransferConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kv_connector: Literal["PeerPullConnector"] = "PeerPullConnector"
    kv_role: Literal["kv_both", "kv_producer", "kv_consumer"] = "kv_both"
    """``kv_producer``: serve ``/kv_blocks`` only; ``kv_consumer``: pull only; ``kv_both``: both."""
    min_pull_blocks: int = Field(DEFAULT_MIN_PULL_BLOCKS, ge=1)
    """Pull only when this many leading prompt blocks (or more) are missing locally."""
    max_concurrent_pulls: int = Field(2, ge=1)
    """Pulls in flight at once on this replica (more requests wait for a slot)."""
    pull_timeout: float = Field(30.0, gt=0)
    """Seconds a pull may take in all; past it the request recomputes its prefix."""
    hold_timeout: float = Field(30.0, gt=0)
    """Prefill/decode disaggregation: seconds a prefill leg's blocks stay held for the decode
    replica to read them (then they are freed; an unread decode leg computes its prompt)."""
    disk_path: str | None = None
    """The disk tier's folder (``<disk_path>/<block hash>.kv``); None: no disk tier. Every block
    the replica caches is written there after the step that computed it, and a prompt's leading
    blocks found there are loaded instead of computed (a restarted replica starts warm)."""
    disk_max_bytes: int = Field(2**30, ge=1)
    """The disk tier's bound: least recently used files go past it."""
    fleet_secret_file: str | None = None
    """The fleet secret's file (:mod:`~kvfleet.runtime.kv_transfer.fleet_auth`); None:
    ``$KVFLEET_FLEET_SECRET``, else ``~/.config/kvfleet/fleet-secret`` (created if missing)."""

    @property
    def serves(self) -> bool:
        return self.kv_role in ("kv_both", "kv_producer")

    @property
    def pulls(self) -> bool:
        return self.kv_role in ("kv_both", "kv_consumer")

    @classmethod
    def parse(cls, value) -> KVTransferConfig | None:
        """A JSON object string (the CLI, the environment), a mapping, a config, or None.

        Raises:
            ValueError: not JSON, not an object, or a field pydantic refuses."""
        return parse_json_option(cls, value, "kv_transfer_config")
