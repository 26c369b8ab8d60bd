"""``epp model-router``'s process: the ext_proc gRPC service, health, metrics, the model list.

``start_router`` builds and starts everything (ports may be 0; the handle reports the bound
ones) and returns once the first round of ``GET /v1/models`` over the pools' servers is done
(bounded by its timeout) and the adapter sources have listed once, so the first request
already knows every adapter. ``stop`` reports NOT_SERVING, lets open streams finish within
the grace period, then closes everything.

Open streams are bounded (``max_open_streams``): a stream past it gets its first message
answered 503 and ends.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from epp.errors import Unavailable
from epp.extproc import convert
from epp.extproc.errors import immediate_response
from epp.extproc.service import DEFAULT_MAX_OPEN_STREAMS, REFUSE_READ_S
from epp.extproc.stream import DEFAULT_MAX_BUFFERED_BYTES, ProtocolError
from epp.modelrouter.catalog import CONFIG, DEFAULT_MAX_MODELS, ModelCatalog
from epp.modelrouter.listing import ListingOptions, ModelLister
from epp.modelrouter.metrics import RouterMetrics
from epp.modelrouter.pools import Pools, describe
from epp.modelrouter.stream import ModelRouter, RouterStream
from epp.request.parse import RequestParser
from epp.request.settings import DEFAULT_MAX_BODY_BYTES, RequestControlConfig
from epp.requestcontrol.response import BodyBudget
from epp.server.runner import HEALTH_MAX_CALLS, LIVENESS, READY_SERVICES, ServerOptions
from epp.server.runner import _bind as bind_grpc
from epp.server.runner import _listen as listen
from epp.server.runner import _start_metrics_http as start_metrics_http
from epp.supervise import spawn

log = logging.getLogger(__name__)

DEFAULT_GRPC_PORT = 9005
DEFAULT_METRICS_PORT = 9091


@dataclass(slots=True, frozen=True)
class RouterOptions:
    host: str = "0.0.0.0"
    grpc_port: int = DEFAULT_GRPC_PORT
    health_port: int = -1
    """A second port answering only grpc.health.v1 (-1: health on the ext_proc port alone)."""
    metrics_port: int = DEFAULT_METRICS_PORT
    """-1 disables the metrics HTTP server."""
    cert_file: str = ""
    key_file: str = ""
    processing_mode: int = convert.BUFFERED
    """Body mode assumed when Envoy sends no ``protocol_config``."""
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_buffered_bytes: int = DEFAULT_MAX_BUFFERED_BYTES
    max_open_streams: int = DEFAULT_MAX_OPEN_STREAMS
    trust_control_headers: bool = False
    default_model: str = ""
    max_models: int = DEFAULT_MAX_MODELS
    listing: ListingOptions = field(default_factory=ListingOptions)
    grace_s: float = 30.0
    shutdown_delay_s: float = 0.0


AdapterSource = Callable[[ModelCatalog], Awaitable[Any]]
"""Starts a source of adapters feeding the catalog (Kubernetes ConfigMaps) once it listed;
returns an object with an async ``stop()``."""


class RouterService(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    def __init__(self, router: ModelRouter, default_mode: int, max_open_streams: int) -> None:
        self._router = router
        self._mode = default_mode
        self.max_open_streams = max_open_streams
        self.open_streams = 0

    async def Process(self, request_iterator: Any, context: Any) -> None:
        read, write, eof = context.read, context.write, grpc.aio.EOF
        if self.open_streams >= self.max_open_streams:
            self._router.metrics.request(None, "503")
            try:
                async with asyncio.timeout(REFUSE_READ_S):
                    first = await read()
            except TimeoutError:
                return
            if first is not eof:
                await write(immediate_response(Unavailable(
                    f"the model router has {self.open_streams} requests open, the most it "
                    "holds; retry shortly")))  # fmt: skip
            return
        stream = RouterStream(self._router, self._mode)
        self.open_streams += 1
        try:
            try:
                while (msg := await read()) is not eof:
                    for reply in stream.handle(msg):
                        await write(reply)
                stream.check_complete()
            except ProtocolError as exc:
                log.info("model router stream ended for a protocol error: %s", exc)
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        finally:
            self.open_streams -= 1
            stream.close()


@dataclass
class RouterHandle:
    grpc_port: int
    health_port: int
    metrics_port: int
    router: ModelRouter
    service: RouterService
    health: Any
    registry: CollectorRegistry
    options: RouterOptions
    _servers: list[Any] = field(default_factory=list)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _sources: list[Any] = field(default_factory=list)
    _web: Any = None
    stopped: asyncio.Event = field(default_factory=asyncio.Event)

    async def stop(self, grace_s: float | None = None) -> None:
        if self.stopped.is_set():
            return
        grace = self.options.grace_s if grace_s is None else grace_s
        await self.health.enter_graceful_shutdown()
        log.info("model router shutting down: NOT_SERVING, draining %d open streams (grace %.1fs)",
                 self.service.open_streams, grace)  # fmt: skip
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.options.shutdown_delay_s > 0:
            await asyncio.sleep(self.options.shutdown_delay_s)
        first, *others = self._servers
        await first.stop(grace)
        for server in others:
            await server.stop(0)
        for source in self._sources:
            await source.stop()
        if self._web is not None:
            await self._web.cleanup()
        self.stopped.set()
        log.info("model router stopped")


async def start_router(
    pools: Pools,
    options: RouterOptions | None = None,
    *,
    registry: CollectorRegistry | None = None,
    sources: Sequence[AdapterSource] = (),
) -> RouterHandle:
    """Build and start the model router for ``pools``."""
    opts = options or RouterOptions()
    registry = registry if registry is not None else CollectorRegistry()
    metrics = RouterMetrics(registry)
    catalog = ModelCatalog(pools.pools, opts.max_models)
    catalog.set_adapters(CONFIG, pools.adapter_map())
    lister = ModelLister(pools.pools, catalog, opts.listing, on_result=metrics.list_refreshed)
    parser = RequestParser(RequestControlConfig(max_body_bytes=opts.max_body_bytes),
                           trust_control_headers=opts.trust_control_headers)  # fmt: skip
    router = ModelRouter(parser, catalog, lister, metrics, default_model=opts.default_model,
                         budget=BodyBudget(opts.max_buffered_bytes))  # fmt: skip
    if opts.default_model:
        router.route_model(opts.default_model)  # NotFound: not a model the pools serve
    service = RouterService(router, opts.processing_mode, opts.max_open_streams)
    health_service = health.aio.HealthServicer()
    cap = max(16 << 20, 2 * opts.max_body_bytes + (1 << 20))
    server = grpc.aio.server(
        options=[("grpc.max_receive_message_length", cap), ("grpc.max_send_message_length", cap),
                 ("grpc.so_reuseport", 0)],
        maximum_concurrent_rpcs=opts.max_open_streams + HEALTH_MAX_CALLS,
    )  # fmt: skip
    pb_grpc.add_ExternalProcessorServicer_to_server(service, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_service, server)
    tls = ServerOptions(cert_file=opts.cert_file, key_file=opts.key_file)
    grpc_port = bind_grpc(server, f"{opts.host}:{opts.grpc_port}", tls)
    servers: list[Any] = [server]
    health_port = -1
    if opts.health_port >= 0:
        hserver = grpc.aio.server(options=[("grpc.so_reuseport", 0)],
                                  maximum_concurrent_rpcs=HEALTH_MAX_CALLS)  # fmt: skip
        health_pb2_grpc.add_HealthServicer_to_server(health_service, hserver)
        haddr = f"{opts.host}:{opts.health_port}"
        health_port = listen(lambda: hserver.add_insecure_port(haddr), haddr, "--health-port")
        servers.append(hserver)
    handle = RouterHandle(grpc_port, health_port, -1, router, service, health_service, registry,
                          opts, servers)  # fmt: skip
    for name in READY_SERVICES:
        await health_service.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    await health_service.set(LIVENESS, health_pb2.HealthCheckResponse.SERVING)
    for s in servers:
        await s.start()
    try:
        await _start_rest(handle, pools, sources)
    except BaseException:
        await handle.stop(0)
        raise
    return handle


async def _start_rest(handle: RouterHandle, pools: Pools, sources: Sequence[AdapterSource]) -> None:
    opts, router, metrics = handle.options, handle.router, handle.router.metrics
    if opts.metrics_port >= 0:
        try:
            handle._web, handle.metrics_port = await start_metrics_http(
                handle.registry, opts.host, opts.metrics_port
            )
        except OSError as exc:
            raise OSError(f"cannot listen on {opts.host}:{opts.metrics_port} (--metrics-port): "
                          f"{exc.strerror or exc}") from None  # fmt: skip
    for start in sources:
        handle._sources.append(await start(router.catalog))
    timeout = aiohttp.ClientTimeout(total=opts.listing.timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await router.lister.refresh(session)
    names = tuple(p.name for p in pools.pools)
    handle._tasks.append(spawn("model-list", router.lister.run, on_failure=metrics.task_failed))
    handle._tasks.append(spawn("model-router-housekeeping",
                               functools.partial(_housekeeping, handle, names),
                               on_failure=metrics.task_failed))  # fmt: skip
    metrics.refresh_models(router.catalog, names)
    for name in READY_SERVICES:
        await handle.health.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("model router serving: grpc=%d metrics=%d pools: %s; %d models", handle.grpc_port,
             handle.metrics_port, describe(pools.pools), len(router.catalog.routes))  # fmt: skip


async def _housekeeping(handle: RouterHandle, pools: tuple[str, ...]) -> None:
    """The model gauges, every second."""
    import time

    lister, metrics = handle.router.lister, handle.router.metrics
    while True:
        metrics.refresh_models(handle.router.catalog, pools)
        now = time.time()
        for pool, at in lister.refreshed_s.items():
            metrics.list_age.labels(pool).set(now - at)
        await asyncio.sleep(1.0)
