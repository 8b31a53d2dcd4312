"""The router's HTTP app (``kvfleet router``) and its ``main``.

Routes: ``/v1/{path}`` (every method; :class:`~.proxy.Forwarder`), ``/health`` (liveness:
the process serves), ``/ready`` (200 once the endpoint source has been read, even with no
replica ready: the router must accept requests to hold them while replicas scale from zero; the
body lists the endpoint counts; 503 while draining), ``/metrics`` (:mod:`.metrics`). The lifespan
owns the HTTP clients, the probe loop and the endpoint source (static list or EndpointSlice
watch). SIGTERM drains (:mod:`.shutdown`). A path or method it does not serve is a 404 / 405 in
OpenAI's error shape, as ``kvfleet serve`` answers it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from contextlib import asynccontextmanager

import httpx
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvfleet.runtime.http.auth import key_matches
from kvfleet.runtime.http.errors import error_response
from kvfleet.runtime.kv_events.auth import events_keys
from kvfleet.runtime.kv_transfer.fleet_auth import load_fleet_keys
from kvfleet.runtime.router.disagg import Disaggregator
from kvfleet.runtime.router.endpoints import EndpointPool
from kvfleet.runtime.router.hold import PendingQueue
from kvfleet.runtime.router.kv_index import KVIndex
from kvfleet.runtime.router.kv_subscriber import KVSubscriber
from kvfleet.runtime.router.metrics import CONTENT_TYPE, RouterMetrics
from kvfleet.runtime.router.picker import Picker
from kvfleet.runtime.router.precise import PreciseForwarder, PrecisePicker
from kvfleet.runtime.router.probe import Prober
from kvfleet.runtime.router.proxy import Forwarder
from kvfleet.runtime.router.routing import reads_kv_events
from kvfleet.runtime.router.settings import RouterSettings, parse_args
from kvfleet.runtime.router.shutdown import Drain, DrainingServer, DrainMiddleware

logger = logging.getLogger("kvfleet.router")

METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE"]


class RouterState:
    """Everything one router app holds (``app.state.router``)."""

    def __init__(self, settings: RouterSettings):
        self.settings = settings
        self.pool = EndpointPool(eject_base=settings.eject_base_seconds, eject_max=settings.eject_max_seconds)
        self.pending = PendingQueue(settings.max_pending, settings.pending_timeout)
        self.pool.on_available(self.pending.notify)
        self.drain = Drain(settings.shutdown_timeout)
        self.drain.on_start(self.pending.close)  # held requests: 503 at once, retried on another router
        picker_kw = {"load_factor": settings.load_factor, "virtual_nodes": settings.virtual_nodes,
                     "min_capacity": settings.min_capacity}
        self.kv_index: KVIndex | None = None
        """The replicas' cached blocks (an algorithm that reads KV events, or ``--kv-peer-hint``)."""
        on_events = reads_kv_events(settings.routing_algorithm)
        if on_events or settings.kv_peer_hint:
            self.kv_index = KVIndex()
        if on_events:
            self.picker: Picker = PrecisePicker(self.kv_index, settings.routing_algorithm, **picker_kw)
        else:
            self.picker = Picker(settings.routing_algorithm, **picker_kw)
        self.metrics = RouterMetrics()
        self.source_ready = asyncio.Event()
        self.forwarder: Forwarder | None = None
        self.prober: Prober | None = None
        self.prefill_pool: EndpointPool | None = None
        """Prefill/decode disaggregation's prefill replicas (None: not disaggregated)."""


def start_prefill_pool(state: RouterState, probe_client: httpx.AsyncClient,
                       proxy_client: httpx.AsyncClient) -> list[asyncio.Task]:
    """The prefill pool of prefill/decode disaggregation (:mod:`.disagg`): its endpoints, its
    prober, the forwarder's :class:`~.disagg.Disaggregator`; the tasks it runs."""
    settings = state.settings
    pool = state.prefill_pool = EndpointPool(eject_base=settings.eject_base_seconds,
                                             eject_max=settings.eject_max_seconds)
    prober = Prober(pool, probe_client, interval=settings.probe_interval)
    assert state.forwarder is not None
    keys = load_fleet_keys(settings.fleet_secret_file)  # signs the decode legs' remote_url
    if keys is None:
        logger.warning("no fleet secret: decode replicas will not pull from the prefill replicas (they compute)")
    state.forwarder.disagg = Disaggregator(pool, proxy_client, state.metrics, fleet_keys=keys,
                                           prefill_timeout=settings.prefill_timeout, prefix_chars=settings.prefix_chars,
                                           min_prompt_chars=settings.prefill_min_prompt_chars)
    tasks = [asyncio.create_task(prober.run())]
    if settings.prefill_endpoints:
        pool.set_urls(settings.prefill_endpoints)
    else:
        from kvfleet.runtime.router.endpointslices import watch_endpoint_slices

        tasks.append(asyncio.create_task(watch_endpoint_slices(
            pool, settings.prefill_kube_service, settings.kube_namespace, settings.kube_port)))
    return tasks


async def _disconnected(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def create_app(settings: RouterSettings) -> Starlette:
    """Build the router app for ``settings``; endpoints and probes start with its lifespan."""
    state = RouterState(settings)

    @asynccontextmanager
    async def lifespan(app: Starlette):
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=512)
        timeout = httpx.Timeout(connect=settings.connect_timeout, read=None, write=None, pool=None)
        proxy_client = httpx.AsyncClient(limits=limits, timeout=timeout)
        probe_client = httpx.AsyncClient(timeout=httpx.Timeout(2.0))
        prober = Prober(state.pool, probe_client, interval=settings.probe_interval,
                        urgent=lambda: len(state.pending) > 0)
        state.prober = prober
        fwd_args = (state.pool, state.pending, state.picker, state.metrics, proxy_client)
        fwd_kw = {"prefix_chars": settings.prefix_chars, "on_hold": prober.kick,
                  "max_migrations": settings.max_migrations}
        tasks = [asyncio.create_task(prober.run())]
        if state.kv_index is not None:
            keys = (load_fleet_keys(settings.fleet_secret_file)
                    if settings.kv_peer_hint or settings.kv_events_auth == "fleet" else None)
            state.forwarder = PreciseForwarder(*fwd_args, index=state.kv_index, kv_peer_hint=settings.kv_peer_hint,
                                               fleet_keys=keys if settings.kv_peer_hint else None, **fwd_kw)
            subscriber = KVSubscriber(
                state.kv_index, probe_client, topic=settings.kv_events_topic, api_key=settings.api_key,
                auth=settings.kv_events_auth, keys=events_keys(keys) if keys is not None else None,
                on_refused=lambda url, reason: state.metrics.kv_events_refused.labels(reason).inc())
            tasks.append(asyncio.create_task(subscriber.run(state.pool.urls)))
        else:
            state.forwarder = Forwarder(*fwd_args, **fwd_kw)
        if settings.disaggregated:
            tasks.extend(start_prefill_pool(state, probe_client, proxy_client))
        if settings.endpoints:
            state.pool.set_urls(settings.endpoints)
            state.source_ready.set()
        else:
            from kvfleet.runtime.router.endpointslices import watch_endpoint_slices

            tasks.append(asyncio.create_task(watch_endpoint_slices(
                state.pool, settings.kube_service, settings.kube_namespace, settings.kube_port,
                on_synced=state.source_ready.set)))
        try:
            yield
        finally:
            for t in tasks:
                t.cancel()
            for t in tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t
            await proxy_client.aclose()
            await probe_client.aclose()

    async def proxy(request: Request) -> Response:
        if settings.api_key is not None:
            if not key_matches(request.headers, settings.api_key):
                state.metrics.requests.labels("", "unauthorized").inc()
                return error_response(401, "invalid or missing API key (Authorization: Bearer KEY)",
                                      "invalid_request_error", "invalid_api_key")
        body = await request.body()
        assert state.forwarder is not None
        forward = asyncio.ensure_future(state.forwarder.forward(
            request.method, request.url.path, request.scope.get("query_string", b""), request.headers.raw, body))
        # A client that goes away before the answer starts (e.g. while its request is held) gives up
        # its place at once; once forward() returns, UpstreamResponse watches for the disconnect.
        gone = asyncio.ensure_future(_disconnected(request.receive))
        done, _ = await asyncio.wait({forward, gone}, return_when=asyncio.FIRST_COMPLETED)
        if forward in done:
            gone.cancel()
            return forward.result()
        forward.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await forward
        state.metrics.requests.labels("", "client_disconnect").inc()
        return Response(status_code=499)  # nobody reads it

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def ready(request: Request) -> Response:
        eps = list(state.pool)
        body = {"endpoints": len(eps), "available": len(state.pool.available()), "pending": len(state.pending),
                "draining": state.drain.draining}
        if state.prefill_pool is not None:
            body["prefill_endpoints"] = len(state.prefill_pool.urls())
            body["prefill_available"] = len(state.prefill_pool.available())
        ok = state.source_ready.is_set() and not state.drain.draining
        return JSONResponse(body, status_code=200 if ok else 503)

    async def metrics(request: Request) -> Response:
        in_flight = state.forwarder.in_flight if state.forwarder else 0
        blocks = state.kv_index.block_counts() if state.kv_index is not None else None
        return Response(state.metrics.exposition(state.pool, len(state.pending), in_flight, blocks),
                        media_type=CONTENT_TYPE)

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/ready", ready, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/v1/{path:path}", proxy, methods=METHODS),
    ]
    refused = state.metrics.requests.labels("", "shutting_down").inc
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: _http_error},
                    middleware=[Middleware(DrainMiddleware, drain=state.drain, on_refused=refused)])
    app.state.router = state
    return app


async def _http_error(request: Request, exc: Exception) -> Response:
    """Starlette's 404 / 405 (a path or method the router does not serve) in OpenAI's error shape."""
    assert isinstance(exc, HTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    return error_response(exc.status_code, str(exc.detail), code=code, headers=exc.headers)


def main(argv: list[str] | None = None) -> int:
    """``kvfleet router [options]``; returns the exit status."""
    import uvicorn

    settings = parse_args(list(argv or []))
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per proxied request otherwise
    app = create_app(settings)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                            access_log=False)
    DrainingServer(config, app.state.router.drain).run()
    return 0
