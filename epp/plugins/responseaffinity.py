"""``response-affinity-filter``: a request that names an object a model server stored (a
stored Responses-API response, a conversation) goes to the endpoint that holds it.

With ``store`` (OpenAI's default; vLLM with ``VLLM_ENABLE_RESPONSES_API_STORE=1``, SGLang
likewise) a response lives in the memory of the server that produced it: a follow-up with
``previous_response_id``, ``GET /v1/responses/{id}`` and ``POST /v1/responses/{id}/cancel``
succeed there and get 404 from any other server. epp learns each stored object's id from the
response that created it (the JSON body, or a stream's first ``response.created`` event:
``ResponseReader.stored_ids``, through the ``PostStored`` hook), remembers the endpoint that
answered, and keeps only that endpoint for a request that names the id:

* a Responses request's ``previous_response_id``, else its ``conversation`` (an id, or an
  object with an ``id``);
* the path of ``/v1/responses/{id}`` (``GET``, ``DELETE``), ``.../cancel``,
  ``.../input_items`` and ``/v1/conversations/{id}[/items...]``.

When the home endpoint is not among the candidates (it left the pool, or is not ready), the
request is routed as if it named nothing and counted (``home_unavailable``): the server it
reaches answers 404, as the lost home would have. An id epp never learnt (another gateway's,
or forgotten) is routed by load (``unknown``). A request with ``"store": false`` teaches
nothing, nor does a server that says so in its reply.

The table is bounded: at most ``maxEntries`` ids and ``maxBytes`` of them (estimated: the
id's characters plus ``ENTRY_OVERHEAD_BYTES``), the least recently used forgotten first; an
id neither learnt nor named for ``ttlSeconds`` is forgotten (on lookup, and by a supervised
task every ``sweepSeconds``). With index sync (docs/sync.md) every replica sends the ids it
learns to its peers and fetches a peer's table when it starts (``SharedStored``), so a
follow-up through any replica finds the home.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import ClassVar

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from epp.framework.endpoint import Endpoint, EndpointId
from epp.framework.interfaces import PluginContext
from epp.framework.request import (
    MAX_STORED_ID_CHARS,
    STORED_OBJECT_PREFIXES,
    ApiKind,
    InferenceRequest,
    stored_object_id,
)
from epp.framework.types import CycleState, PickResult

log = logging.getLogger(__name__)

ENTRY_OVERHEAD_BYTES = 176
"""Memory one entry takes besides its id's characters (the id's string header, the ordered
dict's slot and links, the (endpoint, time) pair; measured with tracemalloc on CPython 3.11:
~257 bytes for a 37-character vLLM id)."""
_EXPIRE_SLICE = 4096
"""Entries the background expiry removes before it lets other work run."""
OUTCOMES = ("home", "home_unavailable", "unknown")
_RESPONSES = ApiKind.RESPONSES
_NOT_STORED = "store: false"
"""Kept on the cycle state of a request that asked not to be stored."""
"""Bound once: an enum member read from its class costs ~0.2 us, on every request."""

StoredSink = Callable[[str, EndpointId, float], None]
"""Told of each object this replica learnt from a response: id, endpoint, time (index sync)."""


@dataclass(slots=True, frozen=True)
class ResponseAffinityParams:
    ttl_seconds: float = 86_400.0
    """An id neither learnt nor named by a request for this long is forgotten (vLLM keeps
    stored responses until it restarts; a day lets a conversation resume the next morning)."""
    max_entries: int = 200_000
    """Ids remembered at most, the least recently used forgotten first (size it: stored
    responses per second x how long clients come back to them)."""
    max_bytes: int = 64 << 20
    """Estimated memory of the table at most (each id's characters plus ~176 bytes)."""
    sweep_seconds: float = 60.0
    """How often a background task forgets the ids past their TTL."""
    __config_min__: ClassVar[dict[str, float]] = {
        "ttl_seconds": 1, "max_entries": 1, "max_bytes": 4096, "sweep_seconds": 0.1,
    }


def entry_bytes(object_id: str) -> int:
    """The estimated memory of one entry for ``object_id``."""
    return ENTRY_OVERHEAD_BYTES + len(object_id) * (1 if object_id.isascii() else 4)


def stored_reference(request: InferenceRequest) -> str:
    """The id of the stored object ``request`` names: in its path (``/v1/responses/{id}``,
    ``/v1/conversations/{id}...``), else a Responses request's ``previous_response_id``, else
    its ``conversation``; '' when it names none (or one longer than MAX_STORED_ID_CHARS)."""
    oid: object = None
    if request.api is _RESPONSES:
        body = request.body
        if body is not None:
            oid = body.get("previous_response_id")
            if not oid:
                oid = body.get("conversation")
                if isinstance(oid, dict):
                    oid = oid.get("id")
    else:  # whatever kind the parser gives the stored-object paths
        path = request.headers.get(":path", "")
        if path.startswith(STORED_OBJECT_PREFIXES):
            oid = stored_object_id(path)
    if isinstance(oid, str) and len(oid) <= MAX_STORED_ID_CHARS:
        return oid
    return ""


class StoredHomes:
    """Stored objects' ids -> the endpoint holding each, least recently used first.

    Bounded by ``max_entries`` and ``max_bytes`` (``entry_bytes``); an entry unused for
    ``ttl_s`` is forgotten on lookup or by ``expire``. Loop-only: no lock."""

    __slots__ = ("_entries", "bytes", "evicted", "expired", "max_bytes", "max_entries", "ttl_s")

    def __init__(self, ttl_s: float, max_entries: int, max_bytes: int) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, tuple[EndpointId, float]] = OrderedDict()
        self.bytes = 0
        self.expired = 0
        """Entries forgotten past their TTL, in all."""
        self.evicted = 0
        """Entries forgotten to stay within the bounds, in all."""

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, object_id: str, now_s: float) -> EndpointId | None:
        """The endpoint holding ``object_id``, or None (unknown, or past its TTL: then it is
        forgotten). A hit counts as a use."""
        entry = self._entries.get(object_id)
        if entry is None:
            return None
        if now_s - entry[1] > self.ttl_s:
            self._drop(object_id)
            self.expired += 1
            return None
        self._entries[object_id] = (entry[0], now_s)
        self._entries.move_to_end(object_id)
        return entry[0]

    def put(self, object_id: str, endpoint_id: EndpointId, stamp_s: float) -> None:
        """``object_id`` lives on ``endpoint_id``, last used at ``stamp_s``."""
        if object_id in self._entries:
            self._drop(object_id)
        self._entries[object_id] = (endpoint_id, stamp_s)
        self.bytes += entry_bytes(object_id)
        entries = self._entries
        while len(entries) > self.max_entries or (self.bytes > self.max_bytes and entries):
            self._drop(next(iter(entries)))
            self.evicted += 1

    def expire(self, now_s: float, most: int) -> int:
        """Forget, least recently used first, at most ``most`` entries past their TTL;
        returns how many."""
        entries = self._entries
        limit = now_s - self.ttl_s
        removed = 0
        while entries and removed < most:
            oid, (_, seen_s) = next(iter(entries.items()))
            if seen_s >= limit:
                break
            self._drop(oid)
            removed += 1
        self.expired += removed
        return removed

    def items(self) -> list[tuple[str, EndpointId, float]]:
        """Every entry, least recently used first: (id, endpoint, last use)."""
        return [(oid, eid, seen) for oid, (eid, seen) in self._entries.items()]

    def _drop(self, object_id: str) -> None:
        del self._entries[object_id]
        self.bytes -= entry_bytes(object_id)


class ResponseAffinityFilter:
    def __init__(
        self, name: str, params: ResponseAffinityParams, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.name = name
        self.params = params
        self.homes = StoredHomes(params.ttl_seconds, params.max_entries, params.max_bytes)
        self.outcomes = dict.fromkeys(OUTCOMES, 0)
        """Requests that named a stored object, by what became of them."""
        self.learned = {"response": 0, "peer": 0}
        """Ids learnt from this replica's responses, and from its peers' (index sync)."""
        self._sinks: list[StoredSink] = []
        self._clock = clock

    def __len__(self) -> int:
        return len(self.homes)

    def filter(self, state: CycleState, endpoints: Sequence[Endpoint]) -> Sequence[Endpoint]:
        oid = stored_reference(state.request)
        if not oid:
            return endpoints
        home = self.homes.get(oid, state.now_s)
        if home is None:
            self.outcomes["unknown"] += 1
            return endpoints
        for e in endpoints:
            if e.id == home:
                self.outcomes["home"] += 1
                return [e]
        self.outcomes["home_unavailable"] += 1
        log.debug("request %s names stored object %r, whose endpoint %s is not available: "
                  "routed without it", state.request.request_id, oid, home)  # fmt: skip
        return endpoints

    def post_pick(self, state: CycleState, result: PickResult) -> None:
        """Note a ``"store": false`` on the request's cycle state: its parsed body is let go
        once it is picked (the Director keeps what a request holds in flight small)."""
        body = state.request.body
        if body is not None and body.get("store") is False:
            state.write(self.name, _NOT_STORED)

    def post_stored(self, state: CycleState, result: PickResult, ids: Sequence[str]) -> None:
        if state.data.get(self.name) is _NOT_STORED:
            return
        endpoint = result.target.id
        now = state.now_s
        for oid in ids:
            self.homes.put(oid, endpoint, now)
            self.learned["response"] += 1
            for sink in self._sinks:
                sink(oid, endpoint, now)
        self.homes.expire(now, 16)

    # --- index sync (epp.sync.stored.SharedStored) ----------------------------------------

    def subscribe_stored(self, sink: StoredSink) -> Callable[[], None]:
        """Hear of every id this replica learns from its own responses; returns the
        unsubscribe."""
        self._sinks.append(sink)
        return lambda: self._sinks.remove(sink)

    def apply_remote_stored(self, object_id: str, endpoint_id: EndpointId, stamp_s: float) -> None:
        """A peer's id (never republished)."""
        if 0 < len(object_id) <= MAX_STORED_ID_CHARS and endpoint_id:
            self.homes.put(object_id, endpoint_id, stamp_s)
            self.learned["peer"] += 1

    def export_stored(self) -> list[tuple[str, EndpointId, float]]:
        """Every id held, least recently used first (a peer's warm start)."""
        return self.homes.items()

    # --- lifecycle ----------------------------------------------------------------------

    async def start(self, ctx: PluginContext) -> None:
        ctx.register(_Collector(self))
        ctx.spawn("response-affinity-expiry", self._expire_loop)

    async def stop(self) -> None:
        pass

    async def _expire_loop(self) -> None:
        while True:
            await asyncio.sleep(self.params.sweep_seconds)
            await self.expire(self._clock())

    async def expire(self, now_s: float) -> int:
        """Forget every id past its TTL, in slices (requests run between); returns how many."""
        total = 0
        while True:
            removed = self.homes.expire(now_s, _EXPIRE_SLICE)
            total += removed
            if removed < _EXPIRE_SLICE:
                return total
            await asyncio.sleep(0)


def _by_label(name: str, doc: str, label: str, values: dict[str, int]) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=[label])
    for key, n in values.items():
        family.add_metric([key], n)
    return family


class _Collector(Collector):
    def __init__(self, plugin: ResponseAffinityFilter) -> None:
        self._plugin = plugin

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        p = self._plugin
        yield _by_label(
            "epp_response_affinity_requests",
            "Requests naming a stored response or conversation, by outcome: home (routed to "
            "the endpoint holding it), home_unavailable (that endpoint is gone or not ready: "
            "routed normally), unknown (an id epp did not learn: routed by load).",
            "outcome", p.outcomes,
        )
        yield _by_label(
            "epp_response_affinity_learned",
            "Stored objects' homes learnt: from this replica's responses, or from its peers.",
            "source", p.learned,
        )
        yield _by_label(
            "epp_response_affinity_forgotten",
            "Stored objects' homes forgotten: past ttlSeconds (expired), or to stay within "
            "maxEntries / maxBytes (evicted).",
            "reason", {"expired": p.homes.expired, "evicted": p.homes.evicted},
        )
        yield GaugeMetricFamily("epp_response_affinity_entries",
                                "Stored objects whose home epp remembers.", value=len(p.homes))
        yield GaugeMetricFamily("epp_response_affinity_bytes",
                                "Estimated memory of the remembered homes.", value=p.homes.bytes)
