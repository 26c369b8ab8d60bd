"""The approximate prefix index: which endpoint recently received which prompt chunk.

Layout: one insertion-ordered ``dict`` per endpoint, chunk hash -> last-use time. The dict's
order is the LRU order: recording a request pops and re-inserts its chunks at the end, deepest
chunk first, so the oldest entries sit at the front and, among the chunks of one request, the
deepest ones are evicted first. That keeps each endpoint's set of chunks *prefix-closed* along
every chain (if chunk ``i`` of a prompt is present, so are chunks ``1..i-1``), so the number of
leading chunks an endpoint holds is found by binary search instead of a scan: a 220 KB prompt
costs ~12 lookups per endpoint that holds its first chunk, and one per endpoint that does not.
Last-use times along a chain are non-increasing with depth for the same reason, so expiry also
preserves prefix-closure.

Why an exact LRU: a model server's prefix cache is an LRU over KV blocks, and the index is
most useful when it forgets what the server forgets, no sooner. A segmented LRU (dropping the
oldest quarter of an endpoint's entries at once, one dict update per record instead of a pop
and an insert per chunk) was 2-3x cheaper to record into but forgot the tail the servers still
held: on the Mooncake trace replay it cost 4 points of hit rate (17.8% vs 22.1%, with `precise`
at 23.0%) and 20% of TTFT p90. ``epp-sim replay`` reproduces the comparison.

Bounds: a per-endpoint capacity in chunks (LRU), a global cap on entries (evicting from the
endpoint whose oldest entry is the oldest), and a time-to-live applied lazily on every read and
eagerly by ``sweep``. All public methods take one lock, so a sweeper thread and the serving
loop may call them at once.

Memory: an entry costs one dict slot plus its key object (~80-90 bytes in CPython; the last-use
time object is shared by all chunks recorded by one request). ``tests/bench/bench_scheduling.py``
prints the measured figure.
"""

from __future__ import annotations

import sys
import threading
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import islice, repeat

from epp.datastore.endpoint import EndpointId

_consume: Callable[[Iterable[object]], None] = deque[object](maxlen=0).extend


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
class _EndpointChunks:
    capacity: int
    chunks: dict[int, float] = field(default_factory=dict)


def _held_prefix(chunks: dict[int, float], hashes: Sequence[int]) -> int:
    """How many leading chunks of ``hashes`` are stored (expired or not): a binary search."""
    n = len(hashes)
    if n == 0 or hashes[0] not in chunks:
        return 0
    if hashes[-1] in chunks:
        return n
    lo, hi = 1, n  # chunk lo-1 held, chunk hi-1 not
    while hi - lo > 1:
        mid = (lo + hi) >> 1
        if hashes[mid - 1] in chunks:
            lo = mid
        else:
            hi = mid
    return lo


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
                get = ep.chunks.get
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
                best = max(best, lo)
            self._hit_chunks += best
        return result

    def holds(self, endpoint_id: EndpointId, chunk: int, now_s: float) -> bool:
        with self._lock:
            ep = self._endpoints.get(endpoint_id)
            ts = None if ep is None else ep.chunks.get(chunk)
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
            chunks = ep.chunks
            before = len(chunks)
            held = _held_prefix(chunks, hashes)
            # re-insert at the LRU's young end, deepest chunk first; only the held prefix needs
            # popping (prefix-closure: nothing deeper is present)
            if held:
                _consume(map(chunks.pop, hashes[held - 1 :: -1], repeat(None)))
            chunks.update(zip(reversed(hashes), repeat(stamp)))
            self._entries += len(chunks) - before
            over = len(chunks) - ep.capacity
            if over > 0:
                self._evict_front(ep, over)
            if self._entries > self.max_entries:
                self._evict_global(self._entries - self.max_entries)

    def remove_endpoint(self, endpoint_id: EndpointId) -> int:
        """Forget everything about an endpoint that left the pool; returns entries removed."""
        with self._lock:
            ep = self._endpoints.pop(endpoint_id, None)
            if ep is None:
                return 0
            self._entries -= len(ep.chunks)
            return len(ep.chunks)

    def set_capacity(self, endpoint_id: EndpointId, capacity_chunks: int) -> None:
        """Size one endpoint's LRU (from its KV-cache size, or lowered when it proves smaller)."""
        capacity = max(1, int(capacity_chunks))
        with self._lock:
            ep = self._endpoints.get(endpoint_id)
            if ep is None:
                ep = self._endpoints[endpoint_id] = _EndpointChunks(capacity)
            ep.capacity = capacity
            over = len(ep.chunks) - capacity
            if over > 0:
                self._evict_front(ep, over)

    def capacity(self, endpoint_id: EndpointId) -> int:
        with self._lock:
            ep = self._endpoints.get(endpoint_id)
            return self.default_capacity if ep is None else ep.capacity

    def sweep(self, now_s: float) -> int:
        """Remove expired entries (oldest first on every endpoint); returns how many."""
        cutoff = now_s - self.ttl_s
        removed = 0
        with self._lock:
            for ep in self._endpoints.values():
                chunks = ep.chunks
                expired = []
                for h, ts in chunks.items():
                    if ts >= cutoff:
                        break
                    expired.append(h)
                if expired:
                    _consume(map(chunks.__delitem__, expired))
                    removed += len(expired)
            self._entries -= removed
            self._expirations += removed
        return removed

    # --- internals (lock held) -----------------------------------------------------------

    def _evict_front(self, ep: _EndpointChunks, count: int) -> None:
        victims = list(islice(ep.chunks, count))
        _consume(map(ep.chunks.__delitem__, victims))
        self._entries -= len(victims)
        self._evictions += len(victims)

    def _evict_global(self, count: int) -> None:
        # Evict a little more than asked (0.1% of the cap), so that a full index does not scan
        # every endpoint on every record; always from the endpoint holding the oldest entry.
        count += self.max_entries // 1000
        while count > 0 and self._entries > 0:
            oldest_ep: _EndpointChunks | None = None
            oldest_ts = float("inf")
            for ep in self._endpoints.values():
                if ep.chunks:
                    ts = next(iter(ep.chunks.values()))
                    if ts < oldest_ts:
                        oldest_ts, oldest_ep = ts, ep
            if oldest_ep is None:
                return
            take = min(count, len(oldest_ep.chunks))
            self._evict_front(oldest_ep, take)
            count -= take

    # --- introspection -------------------------------------------------------------------

    def __len__(self) -> int:
        return self._entries

    def endpoint_ids(self) -> list[EndpointId]:
        with self._lock:
            return list(self._endpoints)

    def chunks_of(self, endpoint_id: EndpointId) -> Mapping[int, float]:
        with self._lock:
            ep = self._endpoints.get(endpoint_id)
            return dict(ep.chunks) if ep else {}

    def stats(self) -> IndexStats:
        with self._lock:
            approx = sum(
                sys.getsizeof(ep.chunks) + 32 * len(ep.chunks) for ep in self._endpoints.values()
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
