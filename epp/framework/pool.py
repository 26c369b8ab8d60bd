"""The pool a scheduling cycle picks from, with the look-ups a shortlist needs.

A profile with many candidates scores only a shortlist of them (``epp.scheduling.profile``):
the endpoints its scorers nominate, each scorer its own best by its own measure, found
without scoring every endpoint. ``Pool`` is what they search: the endpoints as a sequence,
plus the few endpoints that are least loaded by each of three measures (``Load``), the
endpoints reporting a LoRA adapter, and the pool's extremes that scorers normalise over.

Two implementations: ``ScanPool`` answers over any sequence by a pass over it (a filter's
survivors, a proxy's subset, a test's list); the datastore keeps an index up to date as
endpoints change (``epp.datastore.poolindex``), so that its routable pool answers them in
time that does not grow with the pool.
"""

from __future__ import annotations

import hashlib
import heapq
from abc import abstractmethod
from bisect import bisect_left
from collections.abc import Callable, Container, Iterator, Sequence
from typing import Literal, overload

from epp.framework.endpoint import Endpoint, EndpointId

Load = Literal["queue", "kv", "busy"]
"""How loaded an endpoint is, three ways, each with the others as tie-breaks:

* ``queue``: requests waiting (scraped, plus those epp sent since the scrape, in flight),
  then KV-cache use;
* ``kv``: KV-cache use (0.5 while never scraped: unknown, as the KV scorer reads it), then the
  queue;
* ``busy``: requests running and waiting (the queue), then KV-cache use.
"""

LOADS: tuple[Load, ...] = ("queue", "kv", "busy")

UNKNOWN_KV = 0.5
"""KV-cache use of an endpoint never scraped, for ordering (the KV scorer's neutral score)."""


_HASHES: dict[EndpointId, int] = {}
_MAX_HASHES = 65_536


def endpoint_hash(endpoint_id: EndpointId) -> int:
    """A stable 64-bit hash of an endpoint id (BLAKE2b, 8 bytes, little-endian): the same in
    every epp replica and release, for consistent hashing over the pool (``Pool.ring``)."""
    h = _HASHES.get(endpoint_id)
    if h is None:
        if len(_HASHES) >= _MAX_HASHES:
            _HASHES.clear()
        h = _HASHES[endpoint_id] = int.from_bytes(
            hashlib.blake2b(endpoint_id.encode(), digest_size=8).digest(), "little")
    return h


def kv_use(e: Endpoint) -> float:
    m = e.metrics
    return m.kv_usage if m.scraped_at_s else UNKNOWN_KV


def busy(e: Endpoint) -> int:
    """Requests running and waiting there (the queue counts epp's sends since the scrape)."""
    return e.metrics.running + e.queue


def load_key(load: Load) -> Callable[[Endpoint], tuple[float, float]]:
    """The sort key of a ``Load``: smaller is less loaded."""
    if load == "queue":
        return lambda e: (e.queue, kv_use(e))
    if load == "kv":
        return lambda e: (kv_use(e), e.queue)
    return lambda e: (busy(e), kv_use(e))


class Pool(Sequence[Endpoint]):
    """The endpoints one cycle may pick from, in a stable order, with look-ups that need no
    pass over them where the implementation keeps an index. Read during the cycle only: the
    datastore's pool is a view of its live index."""

    __slots__ = ()

    @property
    @abstractmethod
    def ids(self) -> Container[EndpointId]:
        """The pool's endpoint ids, for membership tests."""

    @abstractmethod
    def get(self, endpoint_id: EndpointId) -> Endpoint | None:
        """The pool's endpoint of that id, or None."""

    @abstractmethod
    def least(self, load: Load, k: int) -> list[Endpoint]:
        """The (up to) ``k`` least loaded endpoints by ``load``, least first; ties by the
        other measures, then in a fixed order."""

    @abstractmethod
    def staircase(self, load: Literal["queue", "busy"], k: int) -> list[Endpoint]:
        """The endpoints no other beats on both ``load`` and KV-cache use, from the least
        loaded: for each value of the load, its least KV-used endpoint (and those level with
        it on both) while that uses less KV than every one before (a weighted sum of the two
        is best at one of them); at most about ``k``."""

    @abstractmethod
    def queue_range(self) -> tuple[int, int]:
        """The shortest and the longest queue in the pool."""

    @abstractmethod
    def busy_total(self) -> int:
        """Requests running and waiting, summed over the pool."""

    @abstractmethod
    def holding(self, adapter: str) -> list[Endpoint]:
        """The endpoints whose last scrape reports ``adapter`` running or waiting."""

    @abstractmethod
    def ring(self, key: int, count: int, skip: int = 0) -> list[tuple[int, Endpoint]]:
        """Consistent hashing: ``count`` endpoints with their ``endpoint_hash``, in hash
        order from the first whose hash is at least ``key`` (wrapping round), after skipping
        ``skip`` of them; fewer when the pool is smaller."""


class ScanPool(Pool):
    """A ``Pool`` over any sequence: each look-up is a pass over it (``least`` keeps a heap
    of ``k``), the id set is built on first use."""

    __slots__ = ("_endpoints", "_ids", "_ring")

    def __init__(self, endpoints: Sequence[Endpoint]) -> None:
        self._endpoints = endpoints
        self._ids: dict[EndpointId, Endpoint] | None = None
        self._ring: list[tuple[int, Endpoint]] | None = None

    def _by_id(self) -> dict[EndpointId, Endpoint]:
        if self._ids is None:
            self._ids = {e.id: e for e in self._endpoints}
        return self._ids

    @overload
    def __getitem__(self, i: int) -> Endpoint: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[Endpoint]: ...
    def __getitem__(self, i: int | slice) -> Endpoint | Sequence[Endpoint]:
        return self._endpoints[i]

    def __len__(self) -> int:
        return len(self._endpoints)

    def __iter__(self) -> Iterator[Endpoint]:
        return iter(self._endpoints)

    @property
    def ids(self) -> Container[EndpointId]:
        return self._by_id()

    def get(self, endpoint_id: EndpointId) -> Endpoint | None:
        return self._by_id().get(endpoint_id)

    def least(self, load: Load, k: int) -> list[Endpoint]:
        return heapq.nsmallest(k, self._endpoints, key=load_key(load))

    def staircase(self, load: Literal["queue", "busy"], k: int) -> list[Endpoint]:
        return _staircase(sorted(self._endpoints, key=load_key(load)), load, k)

    def queue_range(self) -> tuple[int, int]:
        queues = [e.queue for e in self._endpoints]
        return (min(queues), max(queues)) if queues else (0, 0)

    def busy_total(self) -> int:
        return sum(e.metrics.running + e.queue for e in self._endpoints)

    def holding(self, adapter: str) -> list[Endpoint]:
        return [e for e in self._endpoints
                if adapter in e.metrics.running_adapters or adapter in e.metrics.waiting_adapters]  # fmt: skip

    def ring(self, key: int, count: int, skip: int = 0) -> list[tuple[int, Endpoint]]:
        if self._ring is None:
            self._ring = sorted(((endpoint_hash(e.id), e) for e in self._endpoints),
                                key=lambda he: he[0])  # fmt: skip
        ring = self._ring
        n = len(ring)
        start = bisect_left(ring, key, key=lambda he: he[0])
        return [ring[(start + skip + i) % n] for i in range(min(count, n - skip))] if n else []


def _staircase(ordered: Sequence[Endpoint], load: Literal["queue", "busy"], k: int) -> list[Endpoint]:
    measure = (lambda e: e.queue) if load == "queue" else busy
    out: list[Endpoint] = []
    best = 2.0
    last, step = None, None
    for e in ordered:
        value, kv = measure(e), kv_use(e)
        if value == last:
            if kv == step and len(out) < k:
                out.append(e)  # level with the step on both
            continue  # else the least KV-used of this load value came first
        last, step = value, None
        if kv < best:
            out.append(e)
            best = step = kv
            if len(out) >= k:
                break
    return out


def as_pool(endpoints: Sequence[Endpoint]) -> Pool:
    """``endpoints`` itself when it is a ``Pool``, else a ``ScanPool`` over it."""
    return endpoints if isinstance(endpoints, Pool) else ScanPool(endpoints)
