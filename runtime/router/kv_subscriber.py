"""Feeds the router's :class:`~.kv_index.KVIndex` from the replicas' KV cache events.

Contract: for every endpoint URL in the pool, one task connects a ZMQ SUB socket to
``tcp://<replica host>:<kv_events_port>`` (the replicas' ``--kv-events-config`` endpoint port),
*then* reads ``GET <url>/kv_events/snapshot`` (so no batch falls between the two), and applies
each received batch. A ``seq`` gap, a malformed message or a restart of the replica (its ``seq``
goes back) makes the index stale for that endpoint; the task re-reads the snapshot. A replica
answering 404 (events off) or not at all is retried every ``retry_s`` seconds; meanwhile it scores
0 and requests are placed by the char-prefix ring. Endpoints that leave the pool are forgotten.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from urllib.parse import urlsplit

import httpx
import msgspec
import zmq
import zmq.asyncio

from kvfleet.runtime.kv_events import wire
from kvfleet.runtime.router.kv_index import KVIndex

logger = logging.getLogger("kvfleet.router")


class KVSubscriber:
    def __init__(self, index: KVIndex, client: httpx.AsyncClient, *, port: int, topic: str = "",
                 api_key: str | None = None, retry_s: float = 5.0) -> None:
        self.index = index
        self.client = client
        self.port = port
        self.topic = topic.encode()
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.retry_s = retry_s
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

    async def _snapshot(self, url: str) -> bool:
        try:
            resp = await self.client.get(url + "/kv_events/snapshot", headers=self.headers)
            if resp.status_code != 200:
                return False
            self.index.load_snapshot(url, resp.json())
            return True
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            logger.debug("KV events snapshot of %s: %s", url, exc)
            return False

    async def _follow(self, url: str) -> None:
        host = urlsplit(url).hostname or "127.0.0.1"
        sock = self.ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, self.topic)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://{host}:{self.port}")
        try:
            while not await self._snapshot(url):
                await asyncio.sleep(self.retry_s)
            while True:
                parts = await sock.recv_multipart()
                try:
                    seq, batch = wire.parse_frames(parts)
                except (ValueError, msgspec.DecodeError):
                    logger.warning("malformed KV event message from %s", url)
                    continue
                rep = self.index.replicas.get(url)
                if rep is not None and not rep.stale and seq < rep.seq - 1:  # the replica restarted
                    rep.stale = True
                if not self.index.apply(url, seq, batch):
                    while not await self._snapshot(url):
                        await asyncio.sleep(self.retry_s)
        finally:
            sock.close(0)
