"""The approximate prefix index: which endpoint recently received which prompt chunk.

Layout: per endpoint, a short list of *generations* (plain dicts, chunk hash -> last-use time),
oldest first. Recording a request writes its chunks into the newest generation in one C-level
``dict.update``; when the newest generation reaches ``capacity / GENERATIONS`` entries a new
one starts, and when there are more than ``GENERATIONS`` the oldest is dropped whole. This is a
segmented LRU: an endpoint always keeps at least the ``(GENERATIONS-1)/GENERATIONS`` most
recently used share of its capacity and never more than its capacity, and recording costs no
per-chunk pop and re-insert (that was 60% of a decision's time with an exact LRU).

Every chunk's newest copy lives in the newest generation that saw it, and a record always
writes a prompt's whole chain at once, so a chunk's ancestors are always in the same or a newer
generation and their last-use times are never older. Dropping the oldest generation or expiring
entries older than the TTL therefore keeps each endpoint's chunk set *prefix-closed* along every
chain (if chunk ``i`` of a prompt is present, so are chunks ``1..i-1``). That makes "how many
leading chunks does the endpoint hold" a binary search: a 220 KB prompt costs ~12 probes per
endpoint holding its first chunk, and one probe per endpoint that does not.

Bounds: a per-endpoint capacity in chunks, a global cap on entries (dropping the oldest
generation across endpoints), and a time-to-live applied lazily on every read and eagerly by
``sweep``. All public methods take one lock, so a sweeper thread and the serving loop may call
them at once. ``len(index)`` counts stored entries: a chunk used again after its generation
closed is stored twice until the older copy's generation is dropped.

Memory: an entry costs one dict slot plus its key object (~80-90 bytes in CPython; the
last-use time object is shared by all chunks recorded by one request).
``tests/bench/bench_scheduling.py`` prints the measured figure.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import repeat

from epp.datastore.endpoint import EndpointId

GENERATIONS = 4


@dataclass(slots=True, frozen=True)
class IndexStats:
    entries: int
    endpoints: int
    lookups: int
    lookup_chunks: int
    hit_chunks: int
    evictions: int
    expirations: int
    approx_bytes: int

    @property
    def hit_ratio(self) -> float:
        return self.hit_chunks / self.lookup_chunks if self.lookup_chunks else 0.0


@dataclass(slots=True)
class _Gen:
    chunks: dict[int, float]
    born_s: float
    """When the generation was opened: every entry in it is at least this recent."""
    last_s: float
    """The newest last-use time written into it."""


@dataclass(slots=True)
class _EndpointChunks:
    capacity: int
    gens: list[_Gen] = field(default_factory=list)
    """Oldest first."""

    def size(self) -> int:
        return sum(len(g.chunks) for g in self.gens)


class PrefixIndex:
    def __init__(
        self,
        *,
        capacity_chunks: int = 31_250,
        max_entries: int = 4_000_000,
        ttl_s: float = 600.0,
    ) -> None:
        if capacity_chunks <= 0 or max_entries <= 0 or ttl_s <= 0:
            raise ValueError("capacity_chunks, max_entries and ttl_s must be positive")
        self.default_capacity = capacity_chunks
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self._endpoints: dict[EndpointId, _EndpointChunks] = {}
        self._entries = 0
        self._lock = threading.Lock()
        self._lookups = 0
        self._lookup_chunks = 0
        self._hit_chunks = 0
        self._evictions = 0
        self._expirations = 0

    # --- reads ---------------------------------------------------------------------------

    def match(
        self, hashes: Sequence[int], endpoint_ids: Iterable[EndpointId], now_s: float
    ) -> dict[EndpointId, int]:
        """Per endpoint, how many leading chunks of ``hashes`` it holds (endpoints holding
        none are omitted). Entries older than the TTL count as absent."""
        n = len(hashes)
        result: dict[EndpointId, int] = {}
        if n == 0:
            return result
        cutoff = now_s - self.ttl_s
        first = hashes[0]
        last = hashes[-1]
        best = 0
        with self._lock:
            self._lookups += 1
            self._lookup_chunks += n
            endpoints = self._endpoints
            for eid in endpoint_ids:
                ep = endpoints.get(eid)
                if ep is None:
                    continue
                gens = ep.gens
                get: Callable[[int], float | None]
                if len(gens) == 1:
                    get = gens[0].chunks.get
                elif not gens:
                    continue
                else:
                    get = _Probe(gens).get
                ts = get(first)
                if ts is None or ts < cutoff:
                    continue
                ts = get(last)
                if ts is not None and ts >= cutoff:
                    result[eid] = best = n
                    continue
                # invariant: chunk lo-1 held, chunk hi-1 not held
                lo, hi = 1, n
                while hi - lo > 1:
                    mid = (lo + hi) >> 1
                    ts = get(hashes[mid - 1])
                    if ts is not None and ts >= cutoff:
                        lo = mid
                    else:
                        hi = mid
                result[eid] = lo
                if lo > best:
                    best = lo
            self._hit_chunks += best
        return result

    def holds(self, endpoint_id: EndpointId, chunk: int, now_s: float) -> bool:
        with self._lock:
            ep = self._endpoints.get(endpoint_id)
            ts = None if ep is None else _Probe(ep.gens).get(chunk)
            return ts is not None and ts >= now_s - self.ttl_s

    # --- writes --------------------------------------------------------------------------

    def record(self, endpoint_id: EndpointId, hashes: Sequence[int], now_s: float) -> None:
        """Note that ``endpoint_id`` now holds every chunk of ``hashes`` (a routing decision)."""
        if not hashes:
            return
        stamp = float(now_s)  # one object shared by every chunk of this request
        with self._lock:
            ep = self._endpoints.get(endpoint_id)
            if ep is None:
                ep = self._endpoints[endpoint_id] = _EndpointChunks(self.default_capacity)
            if len(hashes) > ep.capacity:
                hashes = hashes[: ep.capacity]  # keep the leading chunks: the set stays prefix-closed
            gens = ep.gens
            if not gens or len(gens[-1].chunks) + len(hashes) > max(1, ep.capacity // GENERATIONS):
                if not gens or gens[-1].chunks:
                    gens.append(_Gen({}, stamp, stamp))
            newest = gens[-1]
            chunks = newest.chunks
            before = len(chunks)
            chunks.update(zip(hashes, repeat(stamp)))
            newest.last_s = stamp
            self._entries += len(chunks) - before
            self._fit(ep)
            if self._entries > self.max_entries:
                self._evict_global()

    def remove_endpoint(self, endpoint_id: EndpointId) -> int:
        """Forget everything about an endpoint that left the pool; returns entries removed."""
        with self._lock:
            ep = self._endpoints.pop(endpoint_id, None)
            if ep is None:
                return 0
            size = ep.size()
            self._entries -= size
            return size

    def set_capacity(self, endpoint_id: EndpointId, capacity_chunks: int) -> None:
        """Size one endpoint's cache (from its KV-cache size, or lowered when it proves smaller)."""
        capacity = max(1, int(capacity_chunks))
        with self._lock:
            ep = self._endpoints.get(endpoint_id)
            if ep is None:
                ep = self._endpoints[endpoint_id] = _EndpointChunks(capacity)
            ep.capacity = capacity
            self._fit(ep)

    def capacity(self, endpoint_id: EndpointId) -> int:
        with self._lock:
            ep = self._endpoints.get(endpoint_id)
            return self.default_capacity if ep is None else ep.capacity

    def sweep(self, now_s: float) -> int:
        """Remove expired entries; returns how many."""
        cutoff = now_s - self.ttl_s
        removed = 0
        with self._lock:
            for ep in self._endpoints.values():
                gens = ep.gens
                # whole generations whose newest entry expired go at once
                while gens and gens[0].last_s < cutoff:
                    removed += len(gens.pop(0).chunks)
                # the oldest remaining generation may straddle the cutoff
                if gens and gens[0].born_s < cutoff:
                    oldest = gens[0]
                    kept = {h: ts for h, ts in oldest.chunks.items() if ts >= cutoff}
                    removed += len(oldest.chunks) - len(kept)
                    oldest.chunks = kept
                    oldest.born_s = cutoff
            self._entries -= removed
            self._expirations += removed
        return removed

    # --- internals (lock held) -----------------------------------------------------------

    def _fit(self, ep: _EndpointChunks) -> None:
        """Drop the oldest generations until the endpoint is within capacity and count."""
        gens = ep.gens
        size = ep.size()
        while gens and (size > ep.capacity or len(gens) > GENERATIONS):
            dropped = len(gens.pop(0).chunks)
            size -= dropped
            self._entries -= dropped
            self._evictions += dropped

    def _evict_global(self) -> None:
        """Drop whole oldest generations, across endpoints, until under the global cap."""
        while self._entries > self.max_entries:
            victim: _EndpointChunks | None = None
            oldest = float("inf")
            for ep in self._endpoints.values():
                if ep.gens and ep.gens[0].last_s < oldest:
                    oldest, victim = ep.gens[0].last_s, ep
            if victim is None:
                return
            dropped = len(victim.gens.pop(0).chunks)
            self._entries -= dropped
            self._evictions += dropped

    # --- introspection -------------------------------------------------------------------

    def __len__(self) -> int:
        return self._entries

    def endpoint_ids(self) -> list[EndpointId]:
        with self._lock:
            return list(self._endpoints)

    def chunks_of(self, endpoint_id: EndpointId) -> Mapping[int, float]:
        """The endpoint's chunks with their newest last-use time."""
        with self._lock:
            ep = self._endpoints.get(endpoint_id)
            merged: dict[int, float] = {}
            for gen in ep.gens if ep else ():
                merged.update(gen.chunks)
            return merged

    def stats(self) -> IndexStats:
        with self._lock:
            approx = sum(
                sys.getsizeof(gen.chunks) + 32 * len(gen.chunks)
                for ep in self._endpoints.values()
                for gen in ep.gens
            )
            return IndexStats(
                entries=self._entries,
                endpoints=len(self._endpoints),
                lookups=self._lookups,
                lookup_chunks=self._lookup_chunks,
                hit_chunks=self._hit_chunks,
                evictions=self._evictions,
                expirations=self._expirations,
                approx_bytes=approx,
            )


class _Probe:
    """``get`` over an endpoint's generations, newest first (the newest copy wins)."""

    __slots__ = ("_gets",)

    def __init__(self, gens: list[_Gen]) -> None:
        self._gets = [g.chunks.get for g in reversed(gens)]

    def get(self, chunk: int) -> float | None:
        for get in self._gets:
            ts = get(chunk)
            if ts is not None:
                return ts
        return None
