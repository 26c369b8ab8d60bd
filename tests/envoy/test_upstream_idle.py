"""Envoy, not the model server, closes an idle connection to a server.

vLLM's and SGLang's HTTP servers (uvicorn) close a kept-alive connection after 5 s idle; Envoy
keeps its upstream connections for an hour unless told otherwise. A request Envoy writes onto
a connection the server is closing then fails with a 503 ("upstream connect error or
disconnect/reset before headers. reset reason: connection termination"; seen once in 1,152
requests on two real vLLM servers behind Envoy), and no retry covers a request already sent.
The generator's ``upstream_idle_timeout_s`` (4 s) closes idle connections on Envoy's side
first. Here a server with a 1.5 s keep-alive stands in for uvicorn's 5 s, and Envoy's own
counters tell who closed the idle connection.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
from aiohttp import web

from epp.envoyconfig import EnvoyOptions
from simulator.envoy import start_envoy, with_ports
from tests.http_app import serve_app

SERVER_KEEPALIVE_S = 1.5


@asynccontextmanager
async def keepalive_server(keepalive_s: float) -> AsyncIterator[str]:
    """An HTTP server answering every POST, closing connections idle ``keepalive_s``."""

    async def answer(_: web.Request) -> web.Response:
        return web.json_response({"choices": [{"message": {"content": "ok"}}]})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", answer)
    runner, port = await serve_app(app, access_log=None, keepalive_timeout=keepalive_s)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def _closes_after_idle(tmp_path: Path, envoy_idle_s: float) -> dict[str, int]:
    """One request through Envoy, then the connection left idle past the shorter timeout: Envoy's
    counters of idle-timeout closes and of closes by the server."""
    async with keepalive_server(SERVER_KEEPALIVE_S) as server:
        options = EnvoyOptions(routing="round-robin", pool=(server,),
                               upstream_idle_timeout_s=envoy_idle_s)  # fmt: skip
        envoy = await start_envoy(with_ports(options), tmp_path)
        try:
            async with aiohttp.ClientSession() as http, http.post(
                envoy.url + "/v1/chat/completions", json={"messages": []}
            ) as r:
                assert r.status == 200
            await asyncio.sleep(min(envoy_idle_s, SERVER_KEEPALIVE_S) + 1.5)  # the first to close
            counters = await envoy.counters("cluster.pool.upstream_cx_")
            return {k.removeprefix("cluster.pool."): v for k, v in counters.items()}
        finally:
            await envoy.stop()


async def test_with_its_idle_timeout_below_the_servers_keepalive_envoy_closes_first(
    tmp_path: Path,
) -> None:
    c = await _closes_after_idle(tmp_path, envoy_idle_s=0.5)
    assert c["upstream_cx_total"] == 1
    assert c["upstream_cx_idle_timeout"] == 1 and c["upstream_cx_destroy_remote"] == 0, c


async def test_above_it_the_server_closes_the_idle_connection_under_envoy(tmp_path: Path) -> None:
    """What the timeout avoids: Envoy's default (an hour) against a server's short keep-alive."""
    c = await _closes_after_idle(tmp_path, envoy_idle_s=3600.0)
    assert c["upstream_cx_total"] == 1
    assert c["upstream_cx_idle_timeout"] == 0 and c["upstream_cx_destroy_remote"] == 1, c


def test_the_shipped_default_is_below_uvicorns_five_seconds() -> None:
    assert 0 < EnvoyOptions().upstream_idle_timeout_s < 5.0
