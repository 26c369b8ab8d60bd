"""Gateway lifecycle: ``start_gateway`` binds (port 0 allowed) and returns a handle."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import grpc
from aiohttp import web

from simulator.gateway.extproc import MODE_NAMES
from simulator.gateway.proxy import (
    BaselineExchange,
    EppExchange,
    Exchange,
    GatewayOptions,
    baseline_picker,
)
from simulator.gateway.upstream import GatewayStats, Upstreams

log = logging.getLogger(__name__)

_GRPC_OPTIONS = [
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
]


@dataclass
class GatewayHandle:
    host: str
    port: int
    options: GatewayOptions
    stats: GatewayStats
    _runner: web.AppRunner
    _upstreams: Upstreams
    _channels: list[grpc.aio.Channel]

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def extproc_streams(self) -> dict[str, int]:
        """ext_proc streams opened to each target (as ``EnvoyGateway.extproc_streams``)."""
        return dict(self.stats.by_extproc)

    async def stop(self) -> None:
        await self._runner.cleanup()
        await self._upstreams.close()
        for channel in self._channels:
            await channel.close()


async def start_gateway(options: GatewayOptions) -> GatewayHandle:
    if options.policy not in ("epp", "random", "round-robin"):
        raise ValueError(f"unknown policy {options.policy!r}")
    stats = GatewayStats()
    upstreams = Upstreams(stats, options.connect_timeout_s, options.route_timeout_s)
    channels: list[grpc.aio.Channel] = []
    exchange: Exchange
    if options.policy == "epp":
        targets = options.extproc_targets
        if not targets:
            raise ValueError("policy epp needs the ext_proc address (--epp host:port)")
        channels = [grpc.aio.insecure_channel(t, options=_GRPC_OPTIONS) for t in targets]
        exchange = EppExchange(list(zip(targets, channels, strict=True)), upstreams, options, stats)
    else:
        pick = baseline_picker(options.policy, max(1, len(options.endpoints)), options.seed)
        exchange = BaselineExchange(pick, options.endpoints, upstreams, options.buffer_limit_bytes)

    async def handle(request: web.Request) -> web.StreamResponse:
        stats.requests += 1
        return await exchange.serve(request)

    app = web.Application(client_max_size=0)
    app.router.add_route("*", "/{tail:.*}", handle)
    # bodies pass through as the client sent them (Envoy decodes no content-encoding unless a
    # decompressor filter is configured): epp sees the header and the bytes it would see
    runner = web.AppRunner(app, access_log=None, handle_signals=False, auto_decompress=False)
    await runner.setup()
    site = web.TCPSite(runner, options.host, options.port)
    await site.start()
    port = int(runner.addresses[0][1])
    names = {v: k for k, v in MODE_NAMES.items()}
    log.info(
        "gateway on %s:%d policy=%s ext_proc=%s request=%s response=%s",
        options.host,
        port,
        options.policy,
        options.extproc or "-",
        names.get(options.request_mode),
        names.get(options.response_mode),
    )
    return GatewayHandle(options.host, port, options, stats, runner, upstreams, channels)
