"""Who the peers are: a static list (``--peers``) or a headless Service name resolved every
few seconds (``--peer-dns``), and one follower task per peer, started and cancelled as the
set changes."""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass
from typing import Any

from epp.errors import ConfigError
from epp.supervise import FailureHook, spawn

log = logging.getLogger(__name__)

Follower = Callable[[str], Coroutine[Any, Any, None]]
"""Follows one peer (``host:port``) until cancelled."""


@dataclass(slots=True, frozen=True)
class HostPort:
    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def parse_host_port(text: str, flag: str) -> HostPort:
    host, sep, port = text.strip().rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not (port.isascii() and port.isdigit()) or len(port) > 5 \
            or not 0 < int(port) < 65536:
        raise ConfigError(flag, f"{text!r} is not host:port")
    return HostPort(host, int(port))


def parse_peers(text: str, flag: str = "--peers") -> list[HostPort]:
    return [parse_host_port(p, flag) for p in text.split(",") if p.strip()]


class PeerSet:
    """The followed peers. ``update`` starts a follower for each new address and cancels
    the followers of addresses that left; a follower never blocks the caller."""

    def __init__(self, follow: Follower, on_failure: FailureHook | None = None) -> None:
        self._follow = follow
        self._on_failure = on_failure
        self._tasks: dict[str, asyncio.Task[None]] = {}

    @property
    def addresses(self) -> frozenset[str]:
        return frozenset(self._tasks)

    @property
    def followed(self) -> int:
        """Peers still followed (a follower that found this replica itself has ended)."""
        return sum(not t.done() for t in self._tasks.values())

    def update(self, addresses: Iterable[str]) -> None:
        wanted = set(addresses)
        for gone in self._tasks.keys() - wanted:
            log.info("sync peer left: %s", gone)
            self._tasks.pop(gone).cancel()
        for new in sorted(wanted - self._tasks.keys()):
            log.info("sync peer joined: %s", new)
            self._tasks[new] = spawn(
                "sync-follower", functools.partial(self._follow, new), name=f"sync-{new}",
                on_failure=self._on_failure,
            )

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


Resolver = Callable[[str, int], Coroutine[Any, Any, list[str]]]


async def resolve_ips(host: str, port: int) -> list[str]:
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


async def watch_dns(
    name: HostPort,
    peers: PeerSet,
    own_ips: frozenset[str],
    interval_s: float,
    resolve: Resolver = resolve_ips,
) -> None:
    """Resolve ``name`` every ``interval_s`` (a headless Service: one A record per ready pod)
    and follow every address but our own. A failed lookup keeps the current peers."""
    failing = False
    while True:
        try:
            ips = await resolve(name.host, name.port)
        except (OSError, UnicodeError) as exc:
            if not failing:
                log.warning("sync peer lookup of %s failed (keeping %d peers): %s",
                            name.host, len(peers.addresses), exc)
            failing = True
        else:
            if failing:
                log.info("sync peer lookup of %s recovered", name.host)
            failing = False
            peers.update(str(HostPort(ip, name.port)) for ip in ips if ip not in own_ips)
        await asyncio.sleep(interval_s)
