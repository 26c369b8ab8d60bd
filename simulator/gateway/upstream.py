"""Forwarding to the chosen model server, falling back down the list on connection failure."""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field

import aiohttp
from multidict import CIMultiDict

from simulator.gateway.headers import HOP_BY_HOP, HeaderList

log = logging.getLogger(__name__)


class NoUpstream(Exception):
    """Every destination refused the connection (Envoy answers 503)."""


@dataclass(slots=True)
class GatewayStats:
    requests: int = 0
    by_upstream: Counter[str] = field(default_factory=Counter)
    by_extproc: Counter[str] = field(default_factory=Counter)
    """ext_proc streams opened per target (epp replica)."""
    immediate: Counter[int] = field(default_factory=Counter)
    fallbacks: int = 0
    connect_failures: int = 0
    extproc_errors: int = 0


@dataclass(slots=True, frozen=True)
class Upstream:
    address: str
    response: aiohttp.ClientResponse


class Upstreams:
    """One pooled HTTP/1.1 client for all model servers (keep-alive, as Envoy's cluster)."""

    def __init__(self, stats: GatewayStats, connect_timeout_s: float, route_timeout_s: float):
        self._stats = stats
        self._session = aiohttp.ClientSession(
            # idle connections are dropped after 4 s, before uvicorn's (vLLM's) 5 s keep-alive
            # timeout closes them from its side: reusing one the server is closing ends in a
            # reset (Envoy's clusters set an idle_timeout for the same reason)
            connector=aiohttp.TCPConnector(limit=0, force_close=False, keepalive_timeout=4.0),
            timeout=aiohttp.ClientTimeout(
                total=None, sock_connect=connect_timeout_s, sock_read=route_timeout_s
            ),
            auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept-Encoding"),
        )

    async def open(
        self, method: str, destinations: list[str], headers: HeaderList, body: bytes | None
    ) -> Upstream:
        path = headers.get(":path") or "/"
        out: CIMultiDict[str] = CIMultiDict(
            (k, v) for k, v in headers.regular() if k != "content-length" and k not in HOP_BY_HOP
        )
        authority = headers.get(":authority")
        for i, dest in enumerate(destinations):
            out["host"] = authority or dest
            try:
                response = await self._session.request(
                    method,
                    f"http://{dest}{path}",
                    headers=out,
                    data=body,
                    allow_redirects=False,
                )
            except (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError) as exc:
                # refused, reset or closed before the response headers: the next destination
                # (Envoy: "disconnect/reset before headers")
                self._stats.connect_failures += 1
                log.warning(
                    "upstream %s failed (%s); %d more to try",
                    dest,
                    type(exc).__name__,
                    len(destinations) - i - 1,
                )
                continue
            if i:
                self._stats.fallbacks += 1
            self._stats.by_upstream[dest] += 1
            return Upstream(dest, response)
        raise NoUpstream(
            "upstream connect error or disconnect/reset before headers. "
            "reset reason: connection failure"
        )

    async def close(self) -> None:
        await self._session.close()
