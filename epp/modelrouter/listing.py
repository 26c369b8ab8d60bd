"""One ``GET /v1/models`` for the whole gateway: the pools' servers' lists, merged.

A supervised loop asks every server of every pool for ``GET /v1/models`` each
``refresh_s`` (a DNS name stands for all its addresses, as in Envoy's pool cluster), each
answer bounded (``max_bytes``, ``timeout_s``, ``max_entries`` models), and keeps per pool the
union of what its servers listed; a pool whose servers all failed keeps its last list. The
answer clients get is rebuilt only when that changes, and served from memory, so a client
polling ``/v1/models`` costs the servers nothing.

The list holds every model the gateway routes, each once: the pools' base models and their
adapters (the catalog), with the card a server gave for it (``id``, ``object``, ``created``,
``owned_by``, ``root``, ``parent``, ``max_model_len``...) or, for a configured model no
server listed (yet), a card of its own (``owned_by: epp``, ``parent``: an adapter's base
model). A model a server lists that the gateway does not route is left out.

With ``learn_adapters`` the adapters a pool's servers list (vLLM's ``--lora-modules``, or
adapters loaded at run time, with ``parent`` one of the pool's base models) become routable
(source ``learned:POOL`` of the catalog).

The list's format: OpenAI's ``GET /v1/models`` (``{"object": "list", "data": [...]}``),
as vLLM serves it (vllm/entrypoints/openai/protocol.py ``ModelList``, ``ModelCard``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from epp.envoyconfig import PoolRoute, split_host_port
from epp.modelrouter.catalog import ModelCatalog

log = logging.getLogger(__name__)


@dataclass(slots=True, frozen=True)
class ListingOptions:
    refresh_s: float = 10.0
    """Seconds between two rounds of ``GET /v1/models`` over every server."""
    timeout_s: float = 2.0
    """One server's answer, whole."""
    max_bytes: int = 1 << 20
    """The largest answer read from one server; a larger one is an error."""
    max_entries: int = 2_000
    """Models kept from one server's answer."""
    max_servers: int = 256
    """Servers asked per pool per round (a DNS name may stand for many)."""
    learn_adapters: bool = True


class ListError(Exception):
    """One server's list could not be read (the message names why; bounded text)."""


def _card_id(card: Any) -> str | None:
    if isinstance(card, dict):
        ident = card.get("id")
        if isinstance(ident, str) and 0 < len(ident) <= 256:
            return ident
    return None


def parse_model_list(body: bytes, max_entries: int) -> dict[str, dict[str, Any]]:
    """A ``/v1/models`` answer -> its cards by id (the first of a repeated id kept)."""
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError):
        raise ListError("not JSON") from None
    data = doc.get("data") if isinstance(doc, dict) else None
    if not isinstance(data, list):
        raise ListError("no 'data' list")
    out: dict[str, dict[str, Any]] = {}
    for card in data[:max_entries]:
        ident = _card_id(card)
        if ident is not None:
            out.setdefault(ident, card)
    return out


class ModelLister:
    """The gateway's model list (see the module's docstring)."""

    def __init__(
        self,
        pools: tuple[PoolRoute, ...],
        catalog: ModelCatalog,
        options: ListingOptions = ListingOptions(),
        on_result: Callable[[str, str], None] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._pools = pools
        self._catalog = catalog
        self.options = options
        self._on_result = on_result or (lambda pool, result: None)
        self._seen: dict[str, dict[str, dict[str, Any]]] = {p.name: {} for p in pools}
        self.refreshed_s: dict[str, float] = {}
        """Per pool, the wall-clock time of its last list from at least one server."""
        self._created = int(clock())
        self._built: tuple[int, int] = (-1, -1)
        self._body = b""
        self._cards: dict[str, bytes] = {}
        self._changes = 0

    # --- what clients get --------------------------------------------------------------

    def body(self) -> bytes:
        """``GET /v1/models``: the gateway's list (JSON bytes)."""
        self._build()
        return self._body

    def card(self, model: str) -> bytes | None:
        """``GET /v1/models/MODEL``: its card, or None when the gateway does not route it."""
        self._build()
        return self._cards.get(model)

    def _build(self) -> None:
        key = (self._catalog.version, self._changes)
        if key == self._built:
            return
        seen: dict[str, dict[str, Any]] = {}
        for cards in self._seen.values():
            for ident, card in cards.items():
                seen.setdefault(ident, card)
        data = []
        self._cards = {}
        for model, route in self._catalog.routes.items():
            card = seen.get(model) or {
                "id": model, "object": "model", "created": self._created, "owned_by": "epp",
                "root": model, "parent": route.base_model if route.adapter else None,
            }  # fmt: skip
            data.append(card)
            self._cards[model] = json.dumps(card, separators=(",", ":")).encode()
        self._body = json.dumps({"object": "list", "data": data}, separators=(",", ":")).encode()
        self._built = key

    # --- asking the servers ------------------------------------------------------------

    async def run(self) -> None:
        """Refresh every ``refresh_s`` until cancelled (run it supervised)."""
        timeout = aiohttp.ClientTimeout(total=self.options.timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                await self.refresh(session)
                await asyncio.sleep(self.options.refresh_s)

    async def refresh(self, session: aiohttp.ClientSession) -> None:
        """One round over every pool (concurrently)."""
        await asyncio.gather(*(self._refresh_pool(session, p) for p in self._pools))

    async def _refresh_pool(self, session: aiohttp.ClientSession, pool: PoolRoute) -> None:
        servers = await _resolve(pool.servers, self.options.max_servers)
        answers = await asyncio.gather(*(self._ask(session, s) for s in servers),
                                       return_exceptions=True)  # fmt: skip
        merged: dict[str, dict[str, Any]] = {}
        failed = []
        for server, answer in zip(servers, answers, strict=True):
            if isinstance(answer, ListError):
                failed.append(f"{server}: {answer}")
                continue
            if isinstance(answer, BaseException):
                raise answer  # a bug: the supervisor logs it
            for ident, card in answer.items():
                if len(merged) < self.options.max_entries:
                    merged.setdefault(ident, card)
        if failed:
            log.debug("model list of pool %s: %d of %d servers failed: %s", pool.name,
                      len(failed), len(servers), "; ".join(failed[:3]))  # fmt: skip
        if servers and len(failed) == len(servers):
            self._on_result(pool.name, "error")
            return  # keep the last list
        self._on_result(pool.name, "ok" if servers else "no_servers")
        if not servers:
            return
        self.refreshed_s[pool.name] = time.time()
        if merged != self._seen[pool.name]:
            self._seen[pool.name] = merged
            self._changes += 1
        if self.options.learn_adapters:
            bases = set(pool.models)
            learned = {ident: card["parent"] for ident, card in merged.items()
                       if isinstance(card.get("parent"), str) and card["parent"] in bases
                       and ident not in bases}  # fmt: skip
            self._catalog.set_adapters(f"learned:{pool.name}", learned)

    async def _ask(self, session: aiohttp.ClientSession, server: str) -> dict[str, dict[str, Any]]:
        url = f"http://{server}/v1/models"
        try:
            async with session.get(url) as r:
                if r.status != 200:
                    raise ListError(f"HTTP {r.status}")
                body = bytearray()
                async for chunk in r.content.iter_chunked(1 << 16):
                    body += chunk
                    if len(body) > self.options.max_bytes:
                        raise ListError(f"answer over {self.options.max_bytes} bytes")
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise ListError(type(exc).__name__) from None
        return parse_model_list(bytes(body), self.options.max_entries)


async def _resolve(addresses: tuple[str, ...], limit: int) -> list[str]:
    """``host:port`` of every server: an IP as it is, a DNS name as all its addresses (at
    most ``limit`` in all); a name that does not resolve is skipped (logged at debug)."""
    loop = asyncio.get_running_loop()
    out: list[str] = []
    for address in addresses:
        host, port = split_host_port(address)
        try:
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as exc:
            log.debug("model list: %s does not resolve: %s", host, exc)
            continue
        for info in infos:
            ip = str(info[4][0])
            entry = f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"
            if entry not in out:
                out.append(entry)
            if len(out) >= limit:
                return out
    return out
