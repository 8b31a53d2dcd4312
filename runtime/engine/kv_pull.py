"""Peer KV pull in the engine (issue 29; ``--kv-transfer-config``, docs/routing.md "Peer KV pull").

Serving side: :func:`export_blocks` (engine thread) reads the leading run of the asked hashes
that the block pool caches (or holds for a decode leg). Pulling side: :class:`KVPuller` (event loop) decides from the
prompt's hash chain whether a pull is worth it (at least ``min_pull_blocks`` leading blocks
missing locally; never for a LoRA adapter, a ``cache_salt`` or prompt logprobs, whose blocks hash
differently or must be computed), fetches them from the peer
(:class:`~kvfleet.runtime.kv_transfer.peer_pull.PeerFetcher`: every frame checked, the answer
sealed by a replica of the fleet) and
:func:`install_blocks` (engine thread) writes them into fresh blocks and registers them in the
prefix cache as if computed, before the request is queued: the scheduler then sees prefix hits.
A refused or failed transfer installs nothing (the prompt is computed as without a peer).
With a disk tier (``disk_path``, :mod:`kvfleet.runtime.engine.kv_disk`) the prompt's leading
blocks found on disk are loaded the same way first, with or without a peer. Both reach the cache
only through the engine's KV connector (:mod:`kvfleet.runtime.kv_transfer.connector`).
A prefill/decode *decode leg* (:meth:`KVPuller.fetch_remote_prefill`) fetches its whole prompt's
blocks from the prefill replica and hands them to the connector, which loads them at admission.
"""

from __future__ import annotations

import asyncio
import logging

from kvfleet.runtime.engine.kv_disk import DiskWriter
from kvfleet.runtime.engine.stats import IterationStats
from kvfleet.runtime.kv_events.hashing import prompt_block_hashes
from kvfleet.runtime.kv_transfer.connector import transfer_hashes, transfer_params, transferable
from kvfleet.runtime.kv_transfer.fleet_auth import FleetKeys
from kvfleet.runtime.kv_transfer.peer_pull import PeerFetcher
from kvfleet.runtime.kv_transfer.wire import TransferError
from kvfleet.runtime.worker.kv_blocks import block_layout

logger = logging.getLogger(__name__)


def export_blocks(engine, hashes: list[bytes]) -> list[tuple[bytes, bytes]]:
    """``(hash, payload)`` of the leading run of ``hashes`` this engine caches or holds for a
    decode leg (engine thread; :meth:`PeerPullConnector.export`)."""
    return engine.kv_connector.export(hashes)


def install_blocks(engine, hashes: list[bytes], token_ids: list[int], start: int,
                   pulled: list[tuple[bytes, bytes]]) -> int:
    """Register ``pulled`` in the prefix cache as blocks ``start, ...`` of ``hashes`` (engine thread;
    :meth:`PeerPullConnector.install`); the tokens installed. The KV events of the new blocks go out."""
    installed = engine.kv_connector.install(hashes, token_ids, start, pulled)
    engine._publish_kv_events()
    return installed


class KVPuller:
    """The pulling side of one engine (``LLMEngine`` ``engine``); ``call(fn, *args)`` awaits
    ``fn`` in the engine thread. Sources, in order: the disk tier (``disk_path``), then the peer
    the router names (``kv_role`` ``kv_both`` / ``kv_consumer``, and the fleet's ``keys``: no
    keys, no peer pulls)."""

    def __init__(self, engine, call, keys: FleetKeys | None = None) -> None:
        self.engine = engine
        self.call = call
        self.config = engine.config.kv_transfer_config
        self.layout = block_layout(engine.runner, engine.model_name, engine.loaded.quantization)
        self.keys = keys
        self.fetcher = (PeerFetcher(self.config, self.layout, keys)
                        if self.config.pulls and keys is not None else None)
        self.disk = next((s.disk for s in engine.kv_event_sinks if isinstance(s, DiskWriter)), None)
        self._inflight: dict[bytes, asyncio.Future] = {}
        """First missing block hash -> the fill in progress from there (event loop only)."""

    def missing_blocks(self, request) -> tuple[list[bytes], int]:
        """The prompt's hash chain (blocks a hit may cover) and how many lead it cached locally
        (read from the event loop: a hint, :func:`install_blocks` checks again)."""
        bs = self.engine.config.block_size
        tokens = request.prompt_token_ids
        hashes = prompt_block_hashes(tokens[:((len(tokens) - 1) // bs) * bs], bs)
        return hashes, len(self.engine.kv_connector.cached_run(hashes))

    def eligible(self, request) -> bool:
        """Base-model prompts without a cache salt or prompt logprobs, with prefix caching on."""
        return self.engine.config.enable_prefix_caching and transferable(request)

    async def aclose(self) -> None:
        if self.fetcher is not None:
            await self.fetcher.aclose()

    async def pull(self, request, peer: str | None = None) -> int:
        """Fill ``request``'s missing prefix blocks from the disk tier, then from ``peer`` when
        worth it; the tokens installed. Requests whose first missing block is the same (a burst
        sharing a new prefix) take turns: each looks again once the one before is done, so a
        prefix is fetched once."""
        if not self.eligible(request):
            return 0
        hashes, local = self.missing_blocks(request)
        while local < len(hashes) and (pending := self._inflight.get(hashes[local])) is not None:
            await asyncio.shield(pending)
            hashes, local = self.missing_blocks(request)
        if local == len(hashes):
            return 0
        done = self._inflight[hashes[local]] = asyncio.get_running_loop().create_future()
        try:
            return await self._fill(request, hashes, local, peer)
        except Exception:  # an optimisation: its failure must never fail the request
            logger.exception("KV fill failed, recomputing")
            self._record(IterationStats(kv_pull_failures=["error"]))
            return 0
        finally:
            del self._inflight[hashes[local]]
            done.set_result(None)

    async def _fill(self, request, hashes: list[bytes], local: int, peer: str | None) -> int:
        tokens = list(request.prompt_token_ids)
        total = 0
        if self.disk is not None and self.disk.leading_run(hashes[local:local + 1]):
            loaded = await asyncio.to_thread(self._read_disk, hashes[local:])
            if loaded:
                total = await self.call(install_blocks, self.engine, hashes, tokens, local, loaded)
                self._record(IterationStats(num_disk_loaded_tokens=total))
                hashes, local = self.missing_blocks(request)
        if peer is None or self.fetcher is None or len(hashes) - local < self.config.min_pull_blocks:
            return total
        try:
            pulled = await self.fetcher.fetch(peer, hashes[local:])
        except TransferError as exc:
            logger.warning("KV pull from %s refused, recomputing: %s", peer, exc)
            self._record(IterationStats(kv_pull_failures=[exc.reason]))
            return total
        if not pulled:
            return total
        installed = await self.call(install_blocks, self.engine, hashes, tokens, local, pulled)
        self._record(IterationStats(num_pulled_tokens=installed))
        return total + installed

    def _read_disk(self, hashes: list[bytes]) -> list[tuple[bytes, bytes]]:
        """The leading run of ``hashes`` the disk tier holds, read and checked (a worker thread)."""
        out = []
        for h in hashes[:self.disk.leading_run(hashes)]:
            try:
                out.append((h, self.disk.get(h)))
            except TransferError as exc:
                logger.warning("KV disk tier: block %s refused: %s", h.hex(), exc)
                self._record(IterationStats(kv_pull_failures=["disk_" + exc.reason]))
                break
        return out

    async def fetch_remote_prefill(self, request) -> int:
        """A decode leg (``kv_transfer_params`` with ``do_remote_prefill``): fetch its prompt's blocks
        from the prefill replica (``remote_url``, taken only with the router's ``remote_signature``:
        :meth:`FleetKeys.check_hint <kvfleet.runtime.kv_transfer.fleet_auth.FleetKeys.check_hint>`) and
        hand them to the connector, which loads them at the request's admission; the blocks fetched
        (0: none; the prompt is then computed here)."""
        params = transfer_params(request) or {}
        url = params.get("remote_url")
        if not params.get("do_remote_prefill") or not transferable(request) or self.fetcher is None:
            return 0
        refused = "no_url" if not isinstance(url, str) else self.keys.check_hint(url, params.get("remote_signature"))
        if refused is not None:  # only the router names where a replica sends its fleet auth
            logger.warning("kv_transfer_params' remote_url %r refused (%s): computing the prompt of %s",
                           url, refused, request.request_id)
            self._record(IterationStats(kv_pull_failures=["remote_" + refused]))
            return 0
        hashes = transfer_hashes(request.prompt_token_ids, self.engine.config.block_size)
        try:
            fetched = await self.fetcher.fetch(url, hashes)
        except TransferError as exc:
            logger.warning("KV of %s from the prefill replica %s refused, computing it: %s",
                           request.request_id, url, exc)
            self._record(IterationStats(kv_pull_failures=[exc.reason]))
            return 0
        except Exception:  # an optimisation: its failure must never fail the request
            logger.exception("KV fetch of %s failed, computing it", request.request_id)
            self._record(IterationStats(kv_pull_failures=["error"]))
            return 0
        await self.call(self.engine.kv_connector.set_fetched, request.request_id, [p for _, p in fetched])
        self._record(IterationStats(num_pulled_tokens=min(len(fetched) * self.engine.config.block_size,
                                                          len(request.prompt_token_ids))))
        return len(fetched)

    def _record(self, iteration: IterationStats) -> None:
        for stat_logger in self.engine.stat_loggers:  # prometheus-client is thread-safe
            try:
                stat_logger.record(None, iteration)
            except Exception:
                logger.exception("stat logger %r failed", stat_logger)
