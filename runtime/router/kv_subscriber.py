"""Feeds the router's :class:`~.kv_index.KVIndex` from the replicas' KV cache events.

Contract: for every endpoint URL in the pool, one task reads ``GET <url>/kv_events/snapshot``
to learn the port of the replica's events socket (its ``endpoint``), connects a ZMQ SUB socket
to ``tcp://<replica host>:<that port>``, waits ``join_s`` (the time a ZMQ subscription takes to
reach the publisher), *then* loads the snapshot again (so no batch falls between the two), and
applies each received batch. A ``seq`` gap or a restart of the replica (its ``seq`` goes back)
makes the index stale for that endpoint; the task re-reads the snapshot. A replica answering 404
(events off) or not at all is retried every ``retry_s`` seconds; meanwhile it scores 0 and
requests are placed by the char-prefix ring. Endpoints that leave the pool are forgotten.
Known gap: a batch lost with no later batch is only noticed at the next one.

Authentication (:mod:`kvfleet.runtime.kv_events.auth`): with ``auth="fleet"`` (the default) the SUB
socket is a CURVE client with the fleet's reader key, so only a publisher holding the fleet's
publisher key delivers anything; each refused handshake (``not_fleet``: the publisher speaks no
CURVE or has another key) and each malformed message (``malformed``) is passed to
``on_refused(url, reason)`` (the router counts them), and no batch of it reaches the index.
Without fleet keys nothing is followed (logged).
``auth="none"`` reads plaintext publishers (replicas with ``{"auth": "none"}``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from urllib.parse import urlsplit

import httpx
import msgspec
import zmq
import zmq.asyncio

from kvfleet.runtime.kv_events import wire
from kvfleet.runtime.kv_events.auth import HANDSHAKE_FAILED, EventsKeys, refusal_reason, secure_reader
from kvfleet.runtime.router.kv_index import KVIndex

logger = logging.getLogger("kvfleet.router")


class KVSubscriber:
    def __init__(self, index: KVIndex, client: httpx.AsyncClient, *, topic: str = "",
                 api_key: str | None = None, retry_s: float = 5.0, auth: str = "fleet",
                 keys: EventsKeys | None = None,
                 on_refused: Callable[[str, str], None] = lambda url, reason: None) -> None:
        self.index = index
        self.auth = auth
        self.keys = keys
        self.on_refused = on_refused
        self._warned: set[tuple[str, str]] = set()
        if auth == "fleet" and keys is None:
            logger.warning("KV events: no fleet secret, so no replica's events are read (precise routing "
                           "routes by characters); --kv-events-auth none reads plaintext publishers")
        self.client = client
        self.topic = topic.encode()
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.retry_s = retry_s
        self.join_s = 0.5
        """Wait after connecting before reading the snapshot, so the subscription is in place."""
        self.ctx = zmq.asyncio.Context()
        self.tasks: dict[str, asyncio.Task] = {}

    def sync(self, urls) -> None:
        """Follow exactly ``urls`` (start new tasks, cancel and forget the others)."""
        wanted = set(urls)
        for url in list(self.tasks):
            if url not in wanted:
                self.tasks.pop(url).cancel()
                self.index.forget(url)
        for url in wanted - set(self.tasks):
            self.tasks[url] = asyncio.create_task(self._follow(url))

    async def run(self, urls_fn, interval: float = 1.0) -> None:
        """Keep following ``urls_fn()`` until cancelled."""
        try:
            while True:
                self.sync(urls_fn())
                await asyncio.sleep(interval)
        finally:
            for t in self.tasks.values():
                t.cancel()
            for t in self.tasks.values():
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t
            self.ctx.destroy(linger=0)

    async def _get_snapshot(self, url: str) -> dict | None:
        try:
            resp = await self.client.get(url + "/kv_events/snapshot", headers=self.headers)
            return resp.json() if resp.status_code == 200 else None
        except (httpx.HTTPError, ValueError) as exc:
            logger.debug("KV events snapshot of %s: %s", url, exc)
            return None

    async def _snapshot(self, url: str) -> bool:
        snap = await self._get_snapshot(url)
        try:
            if snap is not None:
                self.index.load_snapshot(url, snap)
                return True
        except (ValueError, KeyError, TypeError) as exc:
            logger.warning("malformed KV events snapshot from %s: %s", url, exc)
        return False

    async def _events_port(self, url: str) -> int:
        """The port of ``url``'s events socket, from its snapshot (retried until it has one)."""
        while True:
            snap = await self._get_snapshot(url)
            endpoint = snap.get("endpoint") if isinstance(snap, dict) else None
            if isinstance(endpoint, str) and endpoint.rsplit(":", 1)[-1].isdigit():
                return int(endpoint.rsplit(":", 1)[-1])
            await asyncio.sleep(self.retry_s)

    async def _watch(self, url: str, monitor) -> None:
        """Count each refused handshake of ``url``'s publisher (the first per reason is logged)."""
        from zmq.utils.monitor import parse_monitor_message

        while True:
            msg = parse_monitor_message(await monitor.recv_multipart())
            reason = refusal_reason(msg["event"], msg["value"])
            if reason is None:
                continue
            self.on_refused(url, reason)
            if (url, reason) not in self._warned:
                self._warned.add((url, reason))
                logger.warning("KV events of %s refused: the publisher failed the fleet's CURVE handshake (it does "
                               "not hold this fleet's secret, or publishes in plaintext: kv_events_config auth "
                               "none, read with --kv-events-auth none)", url)

    async def _follow(self, url: str) -> None:
        if self.auth == "fleet" and self.keys is None:
            return
        host = urlsplit(url).hostname or "127.0.0.1"
        port = await self._events_port(url)
        sock = self.ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, self.topic)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 5000)  # a refusing publisher is retried ever more slowly
        if self.auth == "fleet":
            secure_reader(sock, self.keys)
        monitor = sock.get_monitor_socket(HANDSHAKE_FAILED)
        watcher = asyncio.create_task(self._watch(url, monitor))
        sock.connect(f"tcp://{host}:{port}")
        await asyncio.sleep(self.join_s)  # ZMQ's slow joiner: batches sent before the subscription lands are lost
        try:
            while not await self._snapshot(url):
                await asyncio.sleep(self.retry_s)
            while True:
                parts = await sock.recv_multipart()
                try:
                    seq, batch = wire.parse_frames(parts)
                except (ValueError, msgspec.DecodeError):
                    logger.warning("malformed KV event message from %s", url)
                    self.on_refused(url, "malformed")
                    continue
                rep = self.index.replicas.get(url)
                if rep is not None and not rep.stale and seq < rep.seq - 1:  # the replica restarted
                    rep.stale = True
                if not self.index.apply(url, seq, batch):
                    while not await self._snapshot(url):
                        await asyncio.sleep(self.retry_s)
        finally:
            watcher.cancel()
            with contextlib.suppress(zmq.ZMQError):
                sock.disable_monitor()
            monitor.close(0)
            sock.close(0)
