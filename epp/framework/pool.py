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
  then KV-cache use, then requests running;
* ``kv``: KV-cache use (0.5 while never scraped: unknown, as the KV scorer reads it), then the
  queue, then requests running;
* ``busy``: requests running and waiting (the queue), then KV-cache use, then the queue.
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


def load_key(load: Load) -> Callable[[Endpoint], tuple[float, float, float]]:
    """The sort key of a ``Load``: smaller is less loaded (KV use in 1,023 steps and the
    tie-breaks up to 1,023, as the datastore's index keeps them)."""
    if load == "queue":
        return lambda e: (e.queue, int(kv_use(e) * 1023), min(e.metrics.running, 1023))
    if load == "kv":
        return lambda e: (kv_use(e), min(e.queue, 1023), min(e.metrics.running, 1023))
    return lambda e: (busy(e), int(kv_use(e) * 1023), min(e.queue, 1023))


class Pool(Sequence[Endpoint]):
    """The endpoints one cycle may pick from, in a stable order, with look-ups that need no
    pass over them where the implementation keeps an index. Read during the cycle only: the
    datastore's pool is a view of its live index."""

    __slots__ = ("_endpoints",)

    def __init__(self, endpoints: Sequence[Endpoint]) -> None:
        self._endpoints = endpoints

    @property
    def endpoints(self) -> Sequence[Endpoint]:
        """The endpoints as the caller gave them (the datastore's snapshot tuple)."""
        return self._endpoints

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
    def staircase(self, load: Literal["queue", "busy"], k: int,
                  against: Literal["kv", "running"] = "kv") -> list[Endpoint]:  # fmt: skip
        """The endpoints no other beats on both ``load`` and ``against`` (KV-cache use, or
        requests running; the pairs queue/KV, busy/KV and queue/running), from the least
        loaded: for each value of the load, its endpoint lowest on ``against`` (and those
        level with it on both) while that is lower than every one before, so that whatever
        weights a score gives the two, its best is among them; at most about ``k``, found in
        at most 16 steps."""

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

    __slots__ = ("_ids", "_ring")

    def __init__(self, endpoints: Sequence[Endpoint]) -> None:
        super().__init__(endpoints)
        self._ids: dict[EndpointId, Endpoint] | None = None
        self._ring: list[tuple[int, Endpoint]] | None = None

    def _by_id(self) -> dict[EndpointId, Endpoint]:
        if self._ids is None:
            self._ids = {e.id: e for e in self._endpoints}
        return self._ids

    @property
    def ids(self) -> Container[EndpointId]:
        return self._by_id()

    def get(self, endpoint_id: EndpointId) -> Endpoint | None:
        return self._by_id().get(endpoint_id)

    def least(self, load: Load, k: int) -> list[Endpoint]:
        return heapq.nsmallest(k, self._endpoints, key=load_key(load))

    def staircase(self, load: Literal["queue", "busy"], k: int,
                  against: Literal["kv", "running"] = "kv") -> list[Endpoint]:  # fmt: skip
        return _staircase(self._endpoints, load, k, against)

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


def _staircase(endpoints: Sequence[Endpoint], load: Literal["queue", "busy"], k: int,
               against: Literal["kv", "running"]) -> list[Endpoint]:  # fmt: skip
    def measure(e: Endpoint) -> int:
        return e.queue if load == "queue" else busy(e)

    def kvq(e: Endpoint) -> int:
        return int(kv_use(e) * 1023)

    def other(e: Endpoint) -> float:
        # as the index keeps them: KV use in 1,023 steps, running up to 1,023
        return kvq(e) if against == "kv" else min(e.metrics.running, 1023)

    def then(e: Endpoint) -> int:  # the index's second tie-break
        if against == "running":
            return kvq(e)
        return min(e.queue, 1023) if load == "busy" else min(e.metrics.running, 1023)

    ordered = sorted(endpoints, key=lambda e: (measure(e), other(e), then(e)))
    out: list[Endpoint] = []
    best = float("inf")
    last, step, steps = None, None, 0
    for e in ordered:
        value, o = measure(e), other(e)
        if value == last:
            if o == step and len(out) < k:
                out.append(e)  # level with the step on both
            continue  # else the lowest on ``against`` of this load value came first
        steps += 1
        if steps > 16:
            break
        last, step = value, None
        if o < best:
            out.append(e)
            best = step = o
            if len(out) >= k or best == 0:
                break
    return out


def as_pool(endpoints: Sequence[Endpoint]) -> Pool:
    """``endpoints`` itself when it is a ``Pool``, else a ``ScanPool`` over it."""
    return endpoints if isinstance(endpoints, Pool) else ScanPool(endpoints)
