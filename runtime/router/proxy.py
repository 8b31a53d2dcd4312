"""Forwarding one request: pick a replica, fail over before the first byte, stream the answer.

:meth:`Forwarder.forward` takes the method, path, query, headers and body of a ``/v1/*``
request and returns an ASGI response. The steps:

1. Prefix key (:mod:`.prefix_key`) of the JSON body; a body that is not JSON is forwarded as is
   (the replica answers its 400) and routed by least load.
2. While no replica is available, hold (:mod:`.hold`): 429 when the hold queue is full, 503 past
   ``--pending-timeout`` (OpenAI error bodies).
3. Pick (:mod:`.picker`) among the available replicas this request has not tried; send.
   A connect error, or a connection closed before any response, or an HTTP 503 answer, is a
   failure *before the first byte*: the replica is ejected (back-off, :mod:`.endpoints`) and the
   request goes to the next replica. Nothing reached the client yet, so this can never show the
   client a second generation. When every replica failed with 503, the last 503 is passed on;
   when they failed to connect, the request is held again (same deadline) until one is back.
4. Any other answer is passed through, status and headers as the replica sent them (minus
   hop-by-hop headers, plus ``x-kvfleet-replica``), the body chunk by chunk as it arrives
   (:class:`UpstreamResponse`). A streamed completion / chat completion is sent asking for its
   token ids and answered by a :class:`MigratingResponse`: when its replica fails or drains
   mid-stream, the stream moves to another replica (:mod:`.migration`, at most
   ``--max-migrations`` times) or ends with an error event naming why. Any other answer whose
   replica fails after the first byte is cut (the connection closes without the final chunk),
   never retried.
5. A client that disconnects closes the upstream stream at once, so the replica aborts the
   request (``kvfleet serve`` frees its KV blocks on disconnect).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

import httpx
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from kvfleet.runtime.http.errors import error_response
from kvfleet.runtime.router.endpoints import Endpoint, EndpointPool
from kvfleet.runtime.router.hold import PendingQueue, PendingTimeout, QueueClosed, QueueFull
from kvfleet.runtime.router.metrics import RouterMetrics
from kvfleet.runtime.router.migration import MigratingStream, upstream_body, wants_migration
from kvfleet.runtime.router.picker import Picker
from kvfleet.runtime.router.prefix_key import prefix_key
from kvfleet.runtime.router.response_affinity import RESPONSE_ID_HEADER, ResponseAffinity, wanted_response_id

logger = logging.getLogger("kvfleet.router")

HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
        b"host",
        b"content-length",
    }
)
"""Request/response headers never forwarded (RFC 9110 7.6.1; host and content-length are re-derived)."""
REPLICA_HEADER = "x-kvfleet-replica"
KV_PEER_HEADER = b"x-kvfleet-kv-peer"
"""The router's pull hint to a replica (docs/routing.md, "Peer KV pull"); never taken from a client."""
KV_PEER_SIGNATURE_HEADER = b"x-kvfleet-kv-peer-signature"
"""The router's signature of its hint (:mod:`kvfleet.runtime.kv_transfer.fleet_auth`); never a client's."""


def shutting_down_response() -> JSONResponse:
    """The retryable 503 of a draining router (a new request, or one it held)."""
    return error_response(503, "this router is shutting down; retry (another router takes it)",
                          "service_unavailable", "shutting_down", headers={"Retry-After": "1"})


class UpstreamResponse(Response):
    """The replica's answer streamed to the client chunk by chunk (``aiter_raw``: bytes as they
    arrive, content encoding untouched), racing a listener for the client's disconnect: whichever
    ends first ends the other, and the upstream response is always closed (which closes its
    connection when the body was not read to the end, so the replica sees the disconnect)."""

    def __init__(self, upstream: httpx.Response, endpoint: Endpoint, on_done):
        self.upstream = upstream
        self.endpoint = endpoint
        self.on_done = on_done  # (endpoint, outcome) -> None
        self.status_code = upstream.status_code
        self.background = None
        skip = (HOP_BY_HOP - {b"content-length"}) | {b"date", b"server"}  # uvicorn writes its own
        raw = [(k.lower(), v) for k, v in upstream.headers.raw if k.lower() not in skip]
        raw.append((REPLICA_HEADER.encode(), endpoint.url.encode()))
        self.raw_headers = raw

    async def _pump(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async for chunk in self.upstream.aiter_raw():
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    @staticmethod
    async def _disconnected(receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        outcome = "success" if self.status_code < 400 else "error_status"
        pump = asyncio.ensure_future(self._pump(send))
        listen = asyncio.ensure_future(self._disconnected(receive))
        try:
            done, _ = await asyncio.wait({pump, listen}, return_when=asyncio.FIRST_COMPLETED)
            if pump in done:
                exc = pump.exception()
                if isinstance(exc, httpx.HTTPError):
                    # Returning with the body unfinished makes the server close the connection:
                    # the client's stream is cut (never a second generation), without a traceback.
                    outcome = "stream_error"
                    logger.warning("replica %s failed mid-stream (%s: %s): the client's stream is cut",
                                   self.endpoint.url, type(exc).__name__, exc)
                if isinstance(exc, OSError):
                    outcome = "client_disconnect"
                elif exc is not None:
                    raise exc
            else:
                outcome = "client_disconnect"
        except asyncio.CancelledError:
            outcome = "client_disconnect"
            raise
        finally:
            for task in (pump, listen):
                task.cancel()
            await asyncio.gather(pump, listen, return_exceptions=True)
            await self.upstream.aclose()
            self.on_done(self.endpoint, outcome)


class MigratingResponse(UpstreamResponse):
    """A migratable stream (:mod:`.migration`): the client's body comes from a
    :class:`MigratingStream`, which moves to another replica when this one's stream breaks."""

    def __init__(self, upstream: httpx.Response, endpoint: Endpoint, forwarder: Forwarder, body: dict,
                 target: str, headers):
        super().__init__(upstream, endpoint, self._finish)
        self.forwarder, self.target, self.upstream_headers = forwarder, target, headers
        self.tried = {endpoint.url}
        self.stream = MigratingStream(body, upstream, self._reopen, forwarder.max_migrations, forwarder.migrated)
        self.upstream = self.stream  # type: ignore[assignment]  # aclose() closes the current replica's

    def _finish(self, ep: Endpoint, outcome: str) -> None:
        # a stream that ended with a migration_failed event passed through whole, but did not succeed
        failed = outcome == "success" and self.stream.failed is not None
        self.forwarder._done(ep, "migration_failed" if failed else outcome)

    async def _reopen(self, body: dict, reason: str) -> httpx.Response | str:
        old = self.endpoint
        if reason != "drain":
            self.forwarder.pool.eject(old)
        answer = await self.forwarder.reopen(self.target, self.upstream_headers, body, self.tried)
        if isinstance(answer, str):
            return answer
        self.forwarder._done(old, "migrated")
        upstream, self.endpoint = answer
        return upstream

    async def _pump(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async for chunk in self.stream.events():
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


class Forwarder:
    """The request path (see the module docstring).

    Args:
        pool, pending, picker, metrics: the router's state.
        client: the proxy's HTTP client (no read timeout: generations are long).
        prefix_chars: characters of the prompt the prefix key covers.
        on_hold: called when a request starts waiting (the prober then probes at once).
    """

    def __init__(self, pool: EndpointPool, pending: PendingQueue, picker: Picker, metrics: RouterMetrics,
                 client: httpx.AsyncClient, *, prefix_chars: int = 256, on_hold=lambda: None,
                 max_migrations: int = 3):
        self.pool = pool
        self.pending = pending
        self.picker = picker
        self.metrics = metrics
        self.client = client
        self.prefix_chars = prefix_chars
        self.on_hold = on_hold
        self.max_migrations = max_migrations
        self.in_flight = 0
        self.affinity = ResponseAffinity()
        self.disagg = None
        """The prefill legs (:class:`~.disagg.Disaggregator`; None: every replica does both)."""

    def _done(self, ep: Endpoint, outcome: str) -> None:
        ep.in_flight -= 1
        self.in_flight -= 1
        self.metrics.requests.labels(ep.url, outcome).inc()

    async def forward(self, method: str, path: str, query: bytes, headers: list[tuple[bytes, bytes]],
                      body: bytes) -> Response:
        key = parsed = None
        if body and method == "POST":
            try:
                parsed = json.loads(body)
                key = prefix_key(path, parsed, self.prefix_chars)
            except ValueError:
                key = None
        if self.disagg is not None:  # prefill/decode disaggregation: the prefill leg first (.disagg)
            decode_body = await self.disagg.prepare(method, path, self._forwarded(headers), parsed)
            if decode_body is not None and decode_body is not parsed:
                parsed, body = decode_body, json.dumps(decode_body).encode()
        migrate = self.max_migrations > 0 and wants_migration(path, parsed)
        if migrate:
            body = json.dumps(upstream_body(parsed)).encode()
        pinned = self.affinity.replica(wanted_response_id(method, path, parsed))
        fwd_headers = self._forwarded(headers)
        target = path + ("?" + query.decode("latin-1") if query else "")
        tried: set[str] = set()
        deadline: float | None = None
        last_503: httpx.Response | None = None
        while True:
            candidates = self.pool.available(exclude=tried)
            if not candidates:
                if last_503 is not None:
                    return self._passthrough_error(last_503)
                try:
                    self.on_hold()
                    deadline = await self.pending.hold(lambda: bool(self.pool.available()), deadline)
                except QueueFull:
                    self.metrics.requests.labels("", "rejected").inc()
                    return error_response(429, f"the router holds {self.pending.max_pending} requests already "
                                          "(--max-pending); retry later", "rate_limit_error", "too_many_pending",
                                          headers={"Retry-After": "5"})
                except QueueClosed:
                    self.metrics.requests.labels("", "shutting_down").inc()
                    return shutting_down_response()
                except PendingTimeout:
                    self.metrics.requests.labels("", "timeout").inc()
                    return error_response(503, f"no replica became ready within {self.pending.pending_timeout:g} s "
                                          "(--pending-timeout)", "service_unavailable", "no_ready_replica",
                                          headers={"Retry-After": "5"})
                tried.clear()
                continue
            ep = next((e for e in candidates if e.url == pinned), None)  # the replica storing the response
            if ep is None:
                decision = self.picker.pick([e.candidate() for e in candidates], key, ring_keys=self.pool.urls())
                self.metrics.decisions.labels(decision.decision).inc()
                ep = self.pool.get(decision.key)
            assert ep is not None
            tried.add(ep.url)
            ep.in_flight += 1
            self.in_flight += 1
            request = self.client.build_request(method, ep.url + target, headers=self.upstream_headers(ep, fwd_headers),
                                                content=body)
            t0 = time.perf_counter()
            try:
                upstream = await self.client.send(request, stream=True)
            except (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError) as exc:
                # nothing was answered: the replica is gone (or restarting); try the next one
                self._failed(ep, f"{type(exc).__name__}: {exc}")
                continue
            except httpx.HTTPError as exc:
                self._done(ep, "upstream_error")
                self.pool.eject(ep)
                return error_response(502, f"replica {ep.url} failed before answering: {type(exc).__name__}",
                                      "server_error", "upstream_error")
            except BaseException:  # cancelled (server shutdown) or a bug: keep the counts true
                self._done(ep, "upstream_error")
                raise
            self.metrics.upstream_latency.labels(ep.url).observe(time.perf_counter() - t0)
            if upstream.status_code == 503:
                await upstream.aread()
                await upstream.aclose()
                last_503 = upstream
                self._failed(ep, "HTTP 503")
                continue
            self.pool.succeeded(ep)
            self.affinity.record(upstream.headers.get(RESPONSE_ID_HEADER), ep.url)
            if migrate and upstream.status_code == 200:
                return MigratingResponse(upstream, ep, self, parsed, target, fwd_headers)
            return UpstreamResponse(upstream, ep, self._done)

    @staticmethod
    def _forwarded(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
        """The client's headers a replica gets (never hop-by-hop ones, never a KV peer hint)."""
        return [(k, v) for k, v in headers if k.lower() not in HOP_BY_HOP
                and k.lower() not in (KV_PEER_HEADER, KV_PEER_SIGNATURE_HEADER)]

    def upstream_headers(self, ep: Endpoint, headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
        """The headers sent to ``ep`` (a subclass may add its own, e.g. the KV peer hint)."""
        return headers

    async def reopen(self, target: str, headers, body: dict, exclude: set[str]
                     ) -> tuple[httpx.Response, Endpoint] | str:
        """Send a resumed stream's body to a ready replica outside ``exclude`` (waiting up to
        ``--pending-timeout`` for one): ``(response, endpoint)``, or why it could not."""
        content = json.dumps(body).encode()
        deadline = time.monotonic() + self.pending.pending_timeout
        while True:
            candidates = self.pool.available(exclude=exclude)
            if not candidates:
                if time.monotonic() > deadline:
                    return f"no other replica became ready within {self.pending.pending_timeout:g} s"
                await asyncio.sleep(0.2)
                continue
            decision = self.picker.pick([e.candidate() for e in candidates], None, ring_keys=self.pool.urls())
            ep = self.pool.get(decision.key)
            assert ep is not None
            exclude.add(ep.url)
            ep.in_flight += 1
            self.in_flight += 1
            try:
                upstream = await self.client.send(
                    self.client.build_request("POST", ep.url + target, headers=headers, content=content), stream=True)
            except httpx.HTTPError as exc:
                self._failed(ep, f"{type(exc).__name__}: {exc}")
                continue
            if upstream.status_code == 200:
                return upstream, ep
            detail = (await upstream.aread()).decode(errors="replace")[:300]
            await upstream.aclose()
            self._done(ep, "error_status")
            if upstream.status_code != 503:
                return f"replica {ep.url} refused the resumed request (HTTP {upstream.status_code}: {detail})"

    def migrated(self, reason: str, tokens: int) -> None:
        self.metrics.migrations.labels(reason).inc()
        self.metrics.migrated_tokens.inc(tokens)

    def _failed(self, ep: Endpoint, why: str) -> None:
        self._done(ep, "retried")
        backoff = self.pool.eject(ep)
        logger.warning("replica %s failed before the first byte (%s): ejected for %.1f s, trying another",
                       ep.url, why, backoff)

    @staticmethod
    def _passthrough_error(upstream: httpx.Response) -> Response:
        headers = {k: v for k, v in upstream.headers.items() if k.lower().encode() not in HOP_BY_HOP}
        return Response(upstream.content, status_code=upstream.status_code, headers=headers)
