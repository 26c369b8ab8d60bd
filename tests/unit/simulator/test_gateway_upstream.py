"""The gateway's upstream client: a server that resets the connection before answering is a
failed destination (the next one is tried; none left is Envoy's 503), not a crash."""

from __future__ import annotations

import asyncio
import socket
import struct

import pytest
from aiohttp import web

from simulator.gateway.headers import HeaderList
from simulator.gateway.upstream import GatewayStats, NoUpstream, Upstreams
from tests.http_app import serve_app


async def _resetting_server() -> tuple[asyncio.AbstractServer, str]:
    """Reads the request, then closes with SO_LINGER 0: the client sees a reset."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, f"127.0.0.1:{server.sockets[0].getsockname()[1]}"


async def _ok_server() -> tuple[web.AppRunner, str]:
    async def models(_: web.Request) -> web.Response:
        return web.json_response({"data": []})

    app = web.Application()
    app.router.add_get("/v1/models", models)
    runner, port = await serve_app(app)
    return runner, f"127.0.0.1:{port}"


async def test_a_reset_before_headers_falls_back_to_the_next_destination() -> None:
    bad, bad_addr = await _resetting_server()
    runner, ok_addr = await _ok_server()
    stats = GatewayStats()
    ups = Upstreams(stats, connect_timeout_s=2.0, route_timeout_s=5.0)
    headers = HeaderList([(":path", "/v1/models"), (":method", "GET")])
    try:
        up = await ups.open("GET", [bad_addr, ok_addr], headers, None)
        async with up.response:
            assert up.address == ok_addr and up.response.status == 200
        assert stats.connect_failures == 1 and stats.fallbacks == 1
        with pytest.raises(NoUpstream, match="reset before headers"):
            await ups.open("GET", [bad_addr], headers, None)
    finally:
        await ups.close()
        bad.close()
        await runner.cleanup()
