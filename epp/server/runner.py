"""Process lifecycle: build the request path, serve gRPC, health and metrics, drain on stop.

``start_server`` is the programmatic entry point (the CLI, the dev gateway and e2e tests use
it). Ports may be 0; the handle reports the bound ones. ``stop`` reports NOT_SERVING, lets
open ext_proc streams finish within the grace period, then closes everything.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import os
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from aiohttp import web
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from epp import package_version
from epp.config.loader import EppConfig, default_config
from epp.datastore.scraper import MetricsScraper, ScrapeOptions
from epp.datastore.snapshot import snapshot_json
from epp.datastore.store import Datastore
from epp.errors import ConfigError
from epp.extproc import convert
from epp.extproc.observer import DEFAULT_WAIT_S, ResponseHandoff
from epp.extproc.service import DEFAULT_MAX_OPEN_STREAMS, ExtProcService, add_to_server
from epp.extproc.stream import DEFAULT_MAX_BUFFERED_BYTES
from epp.extproc.summary import AccessLogReceiver
from epp.extproc.summary import add_to_server as add_summary_to_server
from epp.framework.endpoint import Endpoint
from epp.framework.interfaces import Lifecycle, PluginContext
from epp.observability.looplag import watch_loop
from epp.observability.metrics import EppMetrics
from epp.observability.tracing import Tracing
from epp.prefix.index import PrefixIndex
from epp.request.parse import ObjectiveLookup, RequestParser
from epp.request.settings import RequestControlConfig
from epp.requestcontrol.director import DEFAULT_MAX_LEARNING_BYTES, Director
from epp.requestcontrol.response import BodyBudget, ResponseLimits
from epp.scheduling.scheduler import Scheduler
from epp.supervise import spawn
from epp.sync.load import SharedPrefill
from epp.sync.node import SharedIndex, SyncNode, SyncOptions, WarmStart
from epp.sync.stored import SharedStored
from epp.wiring import build_scheduler

log = logging.getLogger(__name__)

LIVENESS = "liveness"
READY_SERVICES = ("", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor")
"""gRPC health service names answered on both gRPC ports (ext_proc and health)."""

SourceStarter = Callable[[Datastore], Any]
"""Starts an endpoint source (static list, Kubernetes) feeding the datastore. May return an
object with an async or sync ``stop()``."""


@dataclass(slots=True)
class ServerOptions:
    host: str = "0.0.0.0"
    grpc_port: int = 9002
    health_port: int = 9003
    metrics_port: int = 9090
    """-1 disables the metrics HTTP server."""
    cert_file: str = ""
    key_file: str = ""
    processing_mode: int = convert.FULL_DUPLEX_STREAMED
    """Body mode assumed when Envoy sends no ``protocol_config``."""
    scrape: bool = True
    scraping: ScrapeOptions = field(default_factory=ScrapeOptions)
    fallbacks: int | None = None
    max_body_bytes: int | None = None
    max_buffered_bytes: int = DEFAULT_MAX_BUFFERED_BYTES
    """Request-body bytes all open streams may hold together (503 past it)."""
    max_learning_bytes: int = DEFAULT_MAX_LEARNING_BYTES
    """Prompt text and chain hashes all requests in flight keep to learn from their replies."""
    max_open_streams: int = DEFAULT_MAX_OPEN_STREAMS
    """ext_proc streams open at once; a new one past it is answered 503."""
    response_observer_wait_s: float = 0.0
    """> 0: responses come on a second ext_proc filter's stream in observability mode
    (``epp.extproc.observer``); a routed request waits this long for it."""
    response_limits: ResponseLimits = field(default_factory=ResponseLimits)
    """What a model server's response may make epp hold while it reads usage from it."""
    pool_name: str = "static"
    """The ``name`` label of the inference_pool_* metrics (the InferencePool's name)."""
    trust_control_headers: bool = False
    """Honour x-gateway-model-name-rewrite / x-gateway-inference-objective from requests
    (only when a proxy in front sets or strips them); else they are ignored and removed."""
    grace_s: float = 30.0
    shutdown_delay_s: float = 0.0
    """Keep serving this long after reporting NOT_SERVING (lets load balancers notice)."""
    housekeeping_interval_s: float = 1.0
    max_message_bytes: int = 0
    """gRPC message cap; 0 derives it from the body cap."""
    sync: SyncOptions | None = None
    """Index sync with peer replicas (docs/sync.md); None: this replica learns alone."""
    tracing: Tracing | None = None
    """OpenTelemetry tracing (``tracing_from_env``: the ``OTEL_*`` variables); None: off."""


HEALTH_MAX_CALLS = 256
"""Health calls (probes' ``Check``, watchers' ``Watch``) open at once on the health port."""


@dataclass
class ServerHandle:
    grpc_port: int
    health_port: int
    metrics_port: int
    datastore: Datastore
    scheduler: Scheduler
    parser: RequestParser
    director: Director
    metrics: EppMetrics
    registry: CollectorRegistry
    service: ExtProcService
    health: Any
    _servers: list[Any] = field(default_factory=list)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _scraper: MetricsScraper | None = None
    _web: web.AppRunner | None = None
    _sources: list[Any] = field(default_factory=list)
    _options: ServerOptions = field(default_factory=ServerOptions)
    sync: SyncNode | None = None
    sync_port: int = -1
    _started: list[Lifecycle] = field(default_factory=list)
    """Plugins whose ``start`` ran (stopped in reverse order)."""
    warm: WarmStart | None = None
    """What this replica fetched from a peer at start (index sync)."""
    stopped: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def index(self) -> PrefixIndex:
        """The shared prefix index (the approximate producer's; raises when the config has
        no plugin that owns one)."""
        owner = self.scheduler.plugin(SharedIndex)  # type: ignore[type-abstract]
        if owner is None:
            raise LookupError("the config has no plugin owning a shared prefix index")
        return owner.index

    async def update_health(self) -> None:
        """``liveness``: serving (the process runs its loop); ``readiness``, ``""`` and the
        ext_proc service: serving once the pool is known (a source delivered its first full
        list of endpoints). The names are the Inference Extension's endpoint-picker protocol."""
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if self.datastore.synced
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        await self.health.set(LIVENESS, health_pb2.HealthCheckResponse.SERVING)
        for service in READY_SERVICES:
            await self.health.set(service, status)

    async def stop(self, grace_s: float | None = None) -> None:
        if self.stopped.is_set():
            return
        grace = self._options.grace_s if grace_s is None else grace_s
        await self.health.enter_graceful_shutdown()
        log.info(
            "shutting down: NOT_SERVING, draining %d open streams (grace %.1fs)",
            self.service.open_streams, grace,
        )
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.director.admission is not None:  # queued requests get a clear 503 now
            drained = self.director.admission.drain()
            if drained:
                log.info("shutting down: %d queued requests answered 503 shutting-down", drained)
        if self._options.shutdown_delay_s > 0:
            await asyncio.sleep(self._options.shutdown_delay_s)
        ext_proc_server, *others = self._servers
        await ext_proc_server.stop(grace)
        if self.sync is not None:  # after the drain: peers still learn the drained replies
            await self.sync.stop()
        for server in others:
            await server.stop(0)
        if self._scraper is not None:
            await self._scraper.stop()
        for plugin in reversed(self._started):
            try:
                await plugin.stop()
            except Exception:  # one plugin's failed stop must not keep the others running
                log.exception("plugin %s: stop failed", plugin.name)
        self._started.clear()
        for source in self._sources:
            stop = getattr(source, "stop", None)
            if stop is not None:
                res = stop()
                if asyncio.iscoroutine(res):
                    await res
        if self._web is not None:
            await self._web.cleanup()
        await _flush_traces(self._options.tracing)
        self.stopped.set()
        log.info("stopped")


async def _flush_traces(tracing: Tracing | None, timeout_s: float = 5.0) -> None:
    """Export the drained requests' spans, waiting at most ``timeout_s``."""
    if tracing is None:
        return
    try:
        await asyncio.wait_for(asyncio.to_thread(tracing.shutdown), timeout_s)
    except TimeoutError:
        log.warning("tracing: spans still unexported %g s into shutdown were dropped", timeout_s)


def _bind(server: Any, address: str, options: ServerOptions) -> int:
    if options.cert_file or options.key_file:
        if not (options.cert_file and options.key_file):
            raise ValueError("TLS needs both --cert and --key")
        with open(options.key_file, "rb") as f:
            key = f.read()
        with open(options.cert_file, "rb") as f:
            cert = f.read()
        creds = grpc.ssl_server_credentials([(key, cert)])
        port: int = _listen(
            lambda: server.add_secure_port(address, creds), address,
            "--grpc-port; or --cert/--key are not a PEM certificate and its key",
        )
    else:
        port = _listen(lambda: server.add_insecure_port(address), address, "--grpc-port")
    return port


def _listen(bind: Callable[[], int], address: str, flag: str) -> int:
    """Run a grpc ``add_*_port`` call; a failure becomes an OSError naming the flag (grpc
    raises a bare RuntimeError that only suggests GRPC_VERBOSITY)."""
    try:
        port = bind()
    except RuntimeError:
        port = 0
    if port == 0:
        raise OSError(f"cannot listen on {address} ({flag}): port in use or address not local")
    return port


async def start_server(
    config: EppConfig | None = None,
    endpoints: Sequence[Endpoint] = (),
    options: ServerOptions | None = None,
    *,
    registry: CollectorRegistry | None = None,
    datastore: Datastore | None = None,
    scheduler: Scheduler | None = None,
    sources: Sequence[SourceStarter] = (),
    objective_lookup: ObjectiveLookup | None = None,
    rng: random.Random | None = None,
) -> ServerHandle:
    """Build and start epp. ``endpoints`` is a static pool; ``sources`` start other sources."""
    cfg = config or default_config()
    opts = options or ServerOptions()
    rc: RequestControlConfig = cfg.request_control
    if opts.fallbacks is not None:
        rc = dataclasses.replace(rc, fallbacks=opts.fallbacks)
    if opts.max_body_bytes is not None:
        rc = dataclasses.replace(rc, max_body_bytes=opts.max_body_bytes)

    registry = registry if registry is not None else CollectorRegistry()
    metrics = EppMetrics(registry)
    metrics.pool_name = opts.pool_name
    metrics.set_build(os.environ.get("EPP_COMMIT", "unknown"), package_version())
    if opts.tracing is not None:
        opts.tracing.register_metrics(registry)
    ds = datastore or Datastore(stale_after_s=cfg.saturation.metrics_staleness_seconds)
    sched = scheduler or build_scheduler(cfg, rng or random.Random())
    ds.on_removed(sched.remove_endpoint)
    ds.on_metrics(sched.observe_endpoint)
    ds.on_reset(functools.partial(_endpoint_reset, metrics))
    ds.on_serving(functools.partial(_endpoint_serving, metrics))
    parser = RequestParser(rc, objective_lookup, trust_control_headers=opts.trust_control_headers)
    director = Director(ds, sched, cfg.saturation, metrics, fallbacks=rc.fallbacks,
                        flow=cfg.flow_control, max_learning_bytes=opts.max_learning_bytes)  # fmt: skip
    if director.flow is not None:
        admission = director.enable_admission(
            lambda item, wait_s: metrics.flow_left(
                item.flow, item.band, item.outcome, item.request.original_model
                or item.request.model, item.request.model, wait_s,
            )
        )  # fmt: skip
        ds.on_metrics(lambda _endpoint: admission.wake())
        cycle_hist = metrics.flow_dispatch_cycle.labels(metrics.pool_name)
        admission.on_cycle = cycle_hist.observe
    flow = director.flow
    metrics.pool_waiting.labels(metrics.pool_name).set_function(
        lambda: float(flow.count) if flow is not None else 0.0
    )
    observing = opts.response_observer_wait_s > 0
    handoff = ResponseHandoff(
        director, opts.response_observer_wait_s if observing else DEFAULT_WAIT_S,
        observing=observing,
    )  # fmt: skip
    service = ExtProcService(
        parser, director, opts.processing_mode, BodyBudget(opts.max_buffered_bytes),
        opts.response_limits, opts.max_open_streams, handoff, opts.tracing,
    )
    health_service = health.aio.HealthServicer()

    msg_cap = opts.max_message_bytes or max(16 << 20, 2 * rc.max_body_bytes + (1 << 20))
    grpc_options = [
        ("grpc.max_receive_message_length", msg_cap),
        ("grpc.max_send_message_length", msg_cap),
        ("grpc.so_reuseport", 0),
    ]
    # gRPC's own bound on the calls open at once, over ext_proc's (see ExtProcService): room
    # for its refusals and for health checks; a call past it gets RESOURCE_EXHAUSTED
    rpc_cap = opts.max_open_streams + max(64, opts.max_open_streams // 16) + HEALTH_MAX_CALLS
    server = grpc.aio.server(options=grpc_options, maximum_concurrent_rpcs=rpc_cap)
    add_to_server(service, server)
    add_summary_to_server(AccessLogReceiver(handoff), server)
    health_pb2_grpc.add_HealthServicer_to_server(health_service, server)
    grpc_port = _bind(server, f"{opts.host}:{opts.grpc_port}", opts)
    servers: list[Any] = [server]
    health_port = -1
    if opts.health_port >= 0:
        hserver = grpc.aio.server(
            options=[("grpc.so_reuseport", 0)], maximum_concurrent_rpcs=HEALTH_MAX_CALLS
        )
        health_pb2_grpc.add_HealthServicer_to_server(health_service, hserver)
        haddr = f"{opts.host}:{opts.health_port}"
        health_port = _listen(lambda: hserver.add_insecure_port(haddr), haddr, "--health-port")
        servers.append(hserver)

    handle = ServerHandle(
        grpc_port=grpc_port,
        health_port=health_port,
        metrics_port=-1,
        datastore=ds,
        scheduler=sched,
        parser=parser,
        director=director,
        metrics=metrics,
        registry=registry,
        service=service,
        health=health_service,
        _servers=servers,
        _options=opts,
    )
    for name in READY_SERVICES:
        await handle.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    await handle.health.set(LIVENESS, health_pb2.HealthCheckResponse.SERVING)
    for s in servers:
        await s.start()
    try:
        await _start_rest(handle, cfg, opts, endpoints, sources)
    except BaseException:
        await handle.stop(0)  # nothing keeps listening, no task outlives the failed start
        raise
    return handle


async def _start_rest(
    handle: ServerHandle,
    cfg: EppConfig,
    opts: ServerOptions,
    endpoints: Sequence[Endpoint],
    sources: Sequence[SourceStarter],
) -> None:
    ds, sched, metrics = handle.datastore, handle.scheduler, handle.metrics
    if opts.metrics_port >= 0:
        try:
            handle._web, handle.metrics_port = await _start_metrics_http(
                handle.registry, opts.host, opts.metrics_port, ds
            )
        except OSError as exc:
            raise OSError(
                f"cannot listen on {opts.host}:{opts.metrics_port} (--metrics-port): "
                f"{exc.strerror or exc}"
            ) from None

    if endpoints:
        ds.replace_all(endpoints)
    if opts.sync is not None:
        await _start_sync(handle, opts.sync, opts.host)
    await _start_plugins(handle)
    for start in sources:
        result = start(ds)
        if asyncio.iscoroutine(result):
            result = await result
        if result is not None:
            handle._sources.append(result)
    if handle.sync is not None and (opts.sync.peers or opts.sync.peer_dns):  # type: ignore[union-attr]
        # before reporting ready: learn what the pool's other replicas know
        handle.warm = await handle.sync.warm_start(ready=functools.partial(_pool_known, ds))

    if opts.scrape:
        handle._scraper = MetricsScraper(ds, metrics, opts.scraping)
        await handle._scraper.start()
    await handle.update_health()
    handle._tasks.append(spawn(
        "housekeeping", functools.partial(_housekeeping, handle, opts),
        on_failure=metrics.task_failed,
    ))
    if handle.director.admission is not None:
        handle._tasks.append(spawn(
            "flow-dispatch", handle.director.admission.run, on_failure=metrics.task_failed,
        ))
    handle._tasks.append(spawn(
        "index-sweep", functools.partial(_sweeper, sched, sched.sweep_interval_s),
        on_failure=metrics.task_failed,
    ))
    handle._tasks.append(spawn(
        "loop-lag", functools.partial(watch_loop, metrics.loop_lag.observe),
        on_failure=metrics.task_failed,
    ))
    log.info(
        "epp serving on %s%s: grpc=%d health=%d metrics=%d sync=%d endpoints=%d mode=%s",
        opts.host, " (every interface; --host 127.0.0.1 keeps it to this machine)"
        if opts.host in ("0.0.0.0", "::", "") else "",
        handle.grpc_port, handle.health_port, handle.metrics_port, handle.sync_port, len(ds),
        convert.BodySendMode.Name(opts.processing_mode),
    )


async def _start_sync(handle: ServerHandle, options: SyncOptions, host: str) -> None:
    """Index sync with the peers: what the plugins share (the prefix index, the prefill in
    flight, stored responses' homes) and the observations of --response-observer streams."""
    sched = handle.scheduler
    producer = sched.plugin(SharedIndex)  # type: ignore[type-abstract]
    if producer is None:
        raise ConfigError(
            "--peers/--peer-dns",
            "index sync shares the approximate prefix index (a plugin owning a shared "
            "index, such as approx-prefix-cache-producer), and the config has none",
        )
    handle.sync = SyncNode(options, producer, handle.datastore, handle.metrics)
    if options.share_prefill:  # each one's prefill in flight, added to the others' own
        ledger: SharedPrefill = handle.datastore.prefill
        ledger.use_peer_prefill(handle.sync.share_prefill(ledger.prefill_in_flight))
    owner = sched.plugin(SharedStored)  # type: ignore[type-abstract]
    if owner is not None:  # where stored responses live, learnt by any replica
        handle.sync.share_stored(owner)
    handoff = handle.service.handoff
    if handoff is not None:  # observer streams and access logs reaching another replica report here
        handoff.publish = handle.sync.publish_observation
        handle.sync.on_observations = handoff.apply_remote
    try:
        handle.sync_port = await handle.sync.start(host)
    except (RuntimeError, OSError):
        handle.sync = None
        raise OSError(
            f"cannot listen on {host}:{options.port} (--sync-port): port in use "
            "or address not local"
        ) from None


async def _start_plugins(handle: ServerHandle) -> None:
    """Start the plugins with background work (``Lifecycle``), in the profile's order; their
    tasks are supervised and cancelled on stop, their collectors served on /metrics."""
    failed = handle.metrics.task_failed

    def spawn_task(kind: str, run: Callable[[], Awaitable[None]]) -> asyncio.Task[None]:
        task = spawn(kind, run, on_failure=failed)
        handle._tasks.append(task)
        return task

    ctx = PluginContext(spawn=spawn_task, register=handle.registry.register, on_failure=failed)
    for plugin in handle.scheduler.lifecycle:
        await plugin.start(ctx)
        handle._started.append(plugin)
        log.info("plugin %s started", plugin.name)


def _endpoint_reset(metrics: EppMetrics, endpoint_id: str, reason: str) -> None:
    metrics.endpoint_reset(endpoint_id, reason)
    log.warning("endpoint %s: another server is behind it (%s): its prefix-index entries, "
                "metrics and in-flight counts are dropped", endpoint_id, reason)


def _endpoint_serving(metrics: EppMetrics, endpoint_id: str, reason: str) -> None:
    metrics.endpoint_serving(endpoint_id, reason)
    if reason:
        log.warning("endpoint %s reports it cannot serve (%s): out of the candidates, its "
                    "prefix-cache entries forgotten", endpoint_id, reason)
    else:
        log.info("endpoint %s serves again: back among the candidates", endpoint_id)


async def _pool_known(ds: Datastore) -> None:
    """Until a source delivered its first full list of endpoints."""
    listed = asyncio.Event()
    ds.on_synced(listed.set)
    await listed.wait()


async def _housekeeping(handle: ServerHandle, opts: ServerOptions) -> None:
    """Health and pool gauges, every ``housekeeping_interval_s`` (supervised: a failure is
    logged, counted and the loop restarted)."""
    while True:
        await handle.update_health()
        owner = handle.scheduler.plugin(SharedIndex)  # type: ignore[type-abstract]
        stats = None if owner is None else owner.index.stats()
        handle.metrics.refresh_pool(handle.datastore.snapshot(), stats, handle.datastore.in_flight())
        if handle.sync is not None:
            handle.sync.refresh_metrics()
        flow = handle.director.flow
        if flow is not None:
            handle.metrics.flow_refresh(flow.queued_by(), handle.director.saturation_level())
        handoff = handle.service.handoff
        if handoff is not None:  # when no new request comes to expire what waits
            handoff.expire()
            handle.metrics.observer_refresh(handoff.counts())
        held = handle.metrics.held_bytes
        held.labels("request_bodies").set(handle.service.budget.used)
        held.labels("responses").set(handle.service.response_budget.used)
        held.labels("learning").set(handle.director.learning_bytes)
        handle.metrics.learning_dropped.set(handle.director.learning_dropped)
        await asyncio.sleep(opts.housekeeping_interval_s)


async def _sweeper(scheduler: Scheduler, interval_s: float) -> None:
    """Expire old index entries on the loop, one bounded slice (~1k entries) at a time,
    letting requests in between: a 500k-entry pass never holds the loop more than a slice
    (in a worker thread it held the index lock that every request's match waits on)."""
    while True:
        await asyncio.sleep(interval_s)
        removed = 0
        for n in scheduler.sweep_steps(time.monotonic()):
            removed += n
            await asyncio.sleep(0)
        if removed:
            log.debug("prefix index sweep removed %d expired entries", removed)


async def _start_metrics_http(
    registry: CollectorRegistry, host: str, port: int, datastore: Datastore | None = None
) -> tuple[web.AppRunner, int]:
    """``/metrics``, and ``/debug/endpoints``: the pool as epp sees it (JSON,
    ``epp.datastore.snapshot``), what ``epp dry-run --snapshot`` reads."""

    async def metrics_view(_: web.Request) -> web.Response:
        body = await asyncio.get_running_loop().run_in_executor(None, generate_latest, registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def endpoints_view(_: web.Request) -> web.Response:
        assert datastore is not None
        return web.json_response(snapshot_json(datastore, time.monotonic()))

    app = web.Application()
    app.router.add_get("/metrics", metrics_view)
    if datastore is not None:
        app.router.add_get("/debug/endpoints", endpoints_view)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = port
    sockets = getattr(site._server, "sockets", None)
    if sockets:
        bound = int(sockets[0].getsockname()[1])
    return runner, bound
