"""A small aiohttp application served on a free loopback port, for tests that need a real
HTTP server (a /metrics page, a model server's stand-in)."""

from __future__ import annotations

from typing import Any

from aiohttp import web


async def serve_app(app: web.Application, **options: Any) -> tuple[web.AppRunner, int]:
    """Start ``app`` on 127.0.0.1 and a free port; the caller ends it with ``runner.cleanup()``.
    ``options``: ``web.AppRunner``'s options (e.g. ``keepalive_timeout``)."""
    runner = web.AppRunner(app, **options)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, int(port)
