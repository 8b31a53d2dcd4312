"""The KV connector seam (vLLM's KV connector API, ``vllm/distributed/kv_transfer/kv_connector/v1``):
how KV blocks move between this replica's paged cache and anything outside it, so that a new
transport (NIXL, Mooncake, TCP) is one class.

Contract. A connector has two sides, called at one site each:

- **scheduler side** (engine thread, :mod:`kvfleet.runtime.core.sched.scheduler`):
  :meth:`KVConnectorBase.get_num_new_matched_tokens` (when a waiting request is admitted: how many
  tokens past its local prefix-cache hits the connector can load instead of computing),
  :meth:`~KVConnectorBase.update_state_after_alloc` (the blocks allocated for them: where to load),
  :meth:`~KVConnectorBase.request_finished` (a finished request: whether the connector keeps its
  blocks for a reader, and the ``kv_transfer_params`` its response carries);
- **worker side** (the model runner, before the step's forward): :meth:`~KVConnectorBase.start_load_kv`
  writes the loads planned for the step into the cache tensors. :meth:`~KVConnectorBase.wait_for_layer_load`
  and :meth:`~KVConnectorBase.save_kv_layer` are the layer-wise hooks of vLLM's API; kvfleet's
  transports load whole blocks before the step and serve them on demand after it, so both are no-ops
  here and the runner does not call them (a layer-wise transport would call them from ``worker/attention``).

The connector never imports the engine, the scheduler or torch: the engine hands it a
:class:`KVCacheAccess` (the block pool, and block reads/writes of the runner's cache as bytes).

:class:`PeerPullConnector` (``--kv-transfer-config``) moves blocks as :mod:`.wire` frames over
``/kv_blocks`` (:mod:`.peer_pull`): the prefix-cache side (:meth:`~PeerPullConnector.export`,
:meth:`~PeerPullConnector.install`, used by the engine's peer pull and disk tier) and prefill/decode
disaggregation (docs/routing.md, "Prefill/decode disaggregation"):

- a request whose ``kv_transfer_params`` say ``do_remote_decode`` is a *prefill leg*: when it
  finishes (its one token), its prompt's blocks are held (one reference each, partial last block
  included) under :func:`transfer_hashes` until a peer has read them all or ``hold_timeout`` s pass,
  and its response carries ``{"do_remote_prefill": true, "remote_block_ids", "remote_engine_id",
  "remote_request_id", "num_prompt_tokens", "expires_at"}`` (the router adds ``remote_url`` and its
  signature of it, ``remote_signature``);
- a request whose ``kv_transfer_params`` say ``do_remote_prefill`` (with ``remote_url``) is a
  *decode leg*: before it is queued its prompt's blocks are fetched from ``remote_url`` when the
  router signed it (fleet auth, sealed answer, every frame checked: ``engine/kv_pull.py``), and at
  admission they are loaded into its blocks up to the last prompt token, which it computes itself
  (its logits give the first token): one prompt token computed per request. A failed or partial
  fetch loads what arrived; the rest is computed.

Prefill/decode transfers are refused (computed locally, nothing held) for LoRA adapters, cache salts
and prompt logprobs, as peer pull is.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvfleet.runtime.kv_events.hashing import hash_block_tokens, prompt_block_hashes

logger = logging.getLogger(__name__)

DEFAULT_HOLD_TIMEOUT = 30.0
"""Seconds a prefill leg's blocks stay held for the decode replica to read them."""

MAX_FINISHED_PARAMS = 4096
"""Finished prefill legs' ``kv_transfer_params`` kept for the output side, and decode legs' fetched
blocks kept for the scheduler, at most (entries nobody took: a client gone)."""


def transfer_hashes(token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """The hashes a prompt's blocks are transferred under: the prefix-cache chain of its full blocks
    and, for a partial last block, a hash of its tokens marked partial (never a prefix-cache hash)."""
    out = prompt_block_hashes(token_ids, block_size)
    tail = token_ids[len(out) * block_size:]
    if tail:
        out.append(hash_block_tokens(out[-1] if out else None, tail, ("partial",)))
    return out


def transfer_params(request) -> dict | None:
    """The ``kv_transfer_params`` of a scheduler request (its SamplingParams'), or None."""
    params = getattr(request.sampling_params, "kv_transfer_params", None)
    return params if isinstance(params, dict) else None


def transferable(request) -> bool:
    """Base-model prompts without a cache salt or prompt logprobs (their blocks hash as computed)."""
    return not (request.lora_int_id or request.cache_salt or request.sampling_params.prompt_logprobs is not None)


class KVCacheAccess(Protocol):
    """What the engine gives a connector: its block pool and the runner's cache as bytes."""

    pool: Any
    """The scheduler's block pool (``get_cached_block``, ``touch``, ``free_blocks``, ``get_new_blocks``,
    ``cache_block``, ``num_free_blocks``, ``enable_caching``)."""
    block_size: int

    def read(self, block_ids: list[int]) -> list[bytes]: ...

    def write(self, block_ids: list[int], payloads: list[bytes]) -> None: ...


class KVConnectorBase:
    """vLLM's connector API, as far as kvfleet's engine calls it (see the module doc). The base
    class loads nothing and holds nothing: a transport overrides what it needs."""

    # -- scheduler side ------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> int:
        """Tokens after the ``num_computed_tokens`` local hits of ``request`` that the connector
        loads (0: none); always fewer than the request's tokens (the last one is computed)."""
        return 0

    def update_state_after_alloc(self, request, block_ids: list[int], num_external_tokens: int) -> None:
        """``request``'s block table after its admission; ``num_external_tokens``: what
        :meth:`get_num_new_matched_tokens` said, to be loaded into those blocks this step."""

    def request_finished(self, request, blocks: list) -> tuple[bool, dict | None]:
        """``request`` finished, ``blocks`` (its block pool blocks) about to be freed: whether the
        connector keeps them (it then holds its own reference), and the response's ``kv_transfer_params``."""
        return False, None

    # -- worker side ---------------------------------------------------------------
    def start_load_kv(self) -> None:
        """Write the loads planned for this step into the cache (before the step's forward)."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Layer-wise transports: block until ``layer_name``'s KV is loaded (no-op: loads are whole)."""

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata) -> None:
        """Layer-wise transports: send ``layer_name``'s KV as computed (no-op: blocks are read on demand)."""


@dataclass
class _Hold:
    hashes: list[bytes]
    blocks: list
    expires_at: float
    unread: set[bytes] = field(default_factory=set)


class PeerPullConnector(KVConnectorBase):
    """Blocks over ``/kv_blocks`` between replicas of a fleet (see the module doc).

    Args:
        access: the engine's :class:`KVCacheAccess`.
        hold_timeout: seconds a prefill leg's blocks are held unread.
        clock: wall-clock seconds (``expires_at`` is a Unix time; tests pass their own).
    """

    def __init__(self, access: KVCacheAccess, hold_timeout: float = DEFAULT_HOLD_TIMEOUT,
                 clock: Callable[[], float] = time.time) -> None:
        self.access = access
        self.hold_timeout = hold_timeout
        self.clock = clock
        self.engine_id = uuid.uuid4().hex
        self._holds: dict[str, _Hold] = {}
        """Prefill legs' held blocks by request id."""
        self._held: dict[bytes, tuple[str, Any]] = {}
        """Transfer hash -> (the hold's request id, its block)."""
        self._fetched: dict[str, list[bytes]] = {}
        """Decode legs: the payloads fetched for a request (blocks 0, 1, ...), until its admission."""
        self._to_load: list[tuple[int, bytes]] = []
        """(block id, payload) to write before the next step's forward."""
        self.finished_params: dict[str, dict] = {}
        """The ``kv_transfer_params`` of finished prefill legs, until the output side takes them."""

    # -- prefix cache (peer pull, disk tier) ------------------------------------------
    def cached_run(self, hashes: Sequence[bytes]) -> list:
        """The pool's blocks of the leading run of ``hashes`` it caches."""
        out = []
        for h in hashes:
            block = self.access.pool.get_cached_block(h)
            if block is None:
                break
            out.append(block)
        return out

    def export(self, hashes: list[bytes]) -> list[tuple[bytes, bytes]]:
        """``(hash, payload)`` of the leading run of ``hashes`` held for a decode leg or in the
        prefix cache (engine thread); a hold whose every block was read is released."""
        self.expire()
        blocks = []
        for h in hashes:
            held = self._held.get(h)
            block = held[1] if held is not None else self.access.pool.get_cached_block(h)
            if block is None:
                break
            blocks.append(block)
        out = list(zip(hashes, self.access.read([b.block_id for b in blocks])))
        for h, _ in out:
            held = self._held.get(h)
            if held is not None and held[0] in self._holds:
                hold = self._holds[held[0]]
                hold.unread.discard(h)
                if not hold.unread:
                    self._release(held[0])
        return out

    def install(self, hashes: list[bytes], token_ids: list[int], start: int,
                pulled: list[tuple[bytes, bytes]]) -> int:
        """Register ``pulled`` (blocks ``start, start + 1, ...`` of the chain ``hashes`` of
        ``token_ids``) in the prefix cache (engine thread). Blocks cached meanwhile are kept as
        they are; the run stops where the pool has no free block left. Returns the tokens installed
        (0 when the cached prefix the pull extends was evicted meanwhile)."""
        pool, bs = self.access.pool, self.access.block_size
        if not pool.enable_caching:
            return 0
        chain = self.cached_run(hashes[:start])
        if len(chain) < start:
            return 0
        pool.touch(chain)  # no allocation below may evict the prefix the pulled blocks extend
        todo = []  # (index in the chain, hash, payload, fresh block)
        try:
            for i, (h, payload) in enumerate(pulled, start):
                block = pool.get_cached_block(h)
                if block is not None:
                    pool.touch([block])
                elif pool.num_free_blocks == 0:
                    break
                else:
                    (block,) = pool.get_new_blocks(1)
                    todo.append((i, h, payload, block))
                chain.append(block)
            self.access.write([t[3].block_id for t in todo], [t[2] for t in todo])
            for i, h, _, block in todo:
                pool.cache_block(block, h, token_ids[i * bs:(i + 1) * bs], hashes[i - 1] if i else None)
        finally:  # whatever happens, every reference taken here is dropped (fresh blocks unwritten: uncached)
            pool.free_blocks(reversed(chain))  # the deepest block is evicted first, as a finished request's
        return len(todo) * bs

    def read_cached(self, block_hashes: Sequence[bytes]) -> list[tuple[bytes, bytes]]:
        """``(hash, payload)`` of each of ``block_hashes`` the prefix cache still holds (the disk
        tier's write-through)."""
        found = [(h, b) for h in block_hashes if (b := self.access.pool.get_cached_block(h)) is not None]
        return list(zip([h for h, _ in found], self.access.read([b.block_id for _, b in found])))

    # -- decode leg: scheduler side ------------------------------------------------------
    def set_fetched(self, request_id: str, payloads: list[bytes]) -> None:
        """A decode leg's fetched blocks (engine thread, before the request is queued)."""
        if payloads:
            self._fetched[request_id] = payloads
        while len(self._fetched) > MAX_FINISHED_PARAMS:  # requests that never reached the scheduler
            self._fetched.pop(next(iter(self._fetched)))

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> int:
        payloads = self._fetched.get(request.request_id)
        if not payloads:
            return 0
        covered = min(len(payloads) * self.access.block_size, request.num_prompt_tokens - 1)
        return max(0, covered - num_computed_tokens)

    def update_state_after_alloc(self, request, block_ids: list[int], num_external_tokens: int) -> None:
        payloads = self._fetched.pop(request.request_id, None)
        if not payloads or num_external_tokens <= 0:
            return
        bs = self.access.block_size
        covered = min(len(payloads) * bs, request.num_prompt_tokens - 1)
        start = (covered - num_external_tokens) // bs  # the local hits before it are whole blocks
        self._to_load.extend((block_ids[i], payloads[i]) for i in range(start, min(len(payloads), len(block_ids))))

    # -- prefill leg: scheduler side -------------------------------------------------------
    def request_finished(self, request, blocks: list) -> tuple[bool, dict | None]:
        self._fetched.pop(request.request_id, None)
        params = transfer_params(request)
        if (params is None or not params.get("do_remote_decode") or request.status.finish_reason == "abort"
                or not transferable(request)):
            return False, None
        self.expire()
        bs = self.access.block_size
        hashes = transfer_hashes(request.prompt_token_ids, bs)
        held = list(blocks[:len(hashes)])
        null = getattr(self.access.pool, "null_block", None)
        if len(held) < len(hashes) or any(b is null for b in held):
            return False, None  # out-of-window blocks already freed: nothing whole to hand over
        self.access.pool.touch(held)
        rid = request.request_id
        expires_at = self.clock() + self.hold_timeout
        self._holds[rid] = _Hold(hashes, held, expires_at, set(hashes))
        for h, b in zip(hashes, held):
            self._held.setdefault(h, (rid, b))
        out = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": self.engine_id,
               "remote_request_id": rid, "remote_block_ids": [b.block_id for b in held],
               "num_prompt_tokens": request.num_prompt_tokens, "expires_at": expires_at}
        self.finished_params[rid] = out
        while len(self.finished_params) > MAX_FINISHED_PARAMS:  # answers nobody took (a client gone)
            self.finished_params.pop(next(iter(self.finished_params)))
        return True, out

    def expire(self) -> None:
        """Release the holds past their time (called whenever the connector is used)."""
        now = self.clock()
        for rid in [r for r, h in self._holds.items() if h.expires_at <= now]:
            logger.info("KV transfer hold of %s expired unread", rid)
            self._release(rid)

    def _release(self, rid: str) -> None:
        hold = self._holds.pop(rid)
        for h in hold.hashes:
            if self._held.get(h, (None,))[0] == rid:
                del self._held[h]
        for other_rid, other in self._holds.items():  # another hold of the same prompt takes its hashes over
            for h, b in zip(other.hashes, other.blocks):
                self._held.setdefault(h, (other_rid, b))
        self.access.pool.free_blocks(reversed(hold.blocks))

    @property
    def num_held_blocks(self) -> int:
        return sum(len(h.blocks) for h in self._holds.values())

    # -- worker side ------------------------------------------------------------------------
    def start_load_kv(self) -> None:
        if self._to_load:
            todo, self._to_load = self._to_load, []
            self.access.write([b for b, _ in todo], [p for _, p in todo])
