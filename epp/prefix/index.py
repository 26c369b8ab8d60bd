"""The approximate prefix index: which endpoint recently received which prompt chunk.

Layout: one LRU store per endpoint (``epp/prefix/lru.py``: chunk hash -> last-use time,
oldest use first; native C when built, else a ``dict``). Recording a request moves its chunks
to the young end, deepest chunk first, so among the chunks of one request the deepest ones are
evicted first. That keeps each endpoint's set of chunks *prefix-closed* along
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
eagerly by ``sweep``. All public methods take one lock, so another thread may call them; no
call holds it for long. The passes over the whole index (``sweep_steps``, ``export_slices``,
and freeing a removed endpoint's entries) run in slices of ``SLICE_ITEMS`` entries, the lock
taken per slice: the serving loop runs them one slice at a time and serves requests in
between (a 500k-entry sweep or export in one piece held the loop for 50-430 ms; a lock
shared with a worker thread only moved that stall into ``match``).

Memory: with the native store an entry costs ~40 bytes (a 24-byte node and its hash-table
slots); with the Python store, a dict slot and a key object (~75 bytes; the last-use time
object is shared by all chunks recorded by one request). ``bench/bench_scheduling.py``
prints the measured figure.
"""

from __future__ import annotations

import threading
from bisect import bisect_left, insort
from collections.abc import Container, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import islice

from epp.framework.endpoint import EndpointId
from epp.prefix.lru import ChunkStore, store_factory

SLICE_ITEMS = 1024
"""Entries one slice of a pass touches (~0.1-0.5 ms) before it lets the loop serve."""


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


@dataclass(slots=True, frozen=True)
class ExportedWrite:
    hashes: list[int]
    stamp_s: float


@dataclass(slots=True, frozen=True)
class EndpointExport:
    endpoint_id: EndpointId
    writes: list[ExportedWrite]
    roots: list[int]

    @property
    def entries(self) -> int:
        return sum(len(w.hashes) for w in self.writes)


_FILL_SCALE = 1 << 20


def _fill_code(store: ChunkStore) -> int:
    return len(store) * _FILL_SCALE // store.capacity


class PrefixIndex:
    def __init__(
        self,
        *,
        capacity_chunks: int = 31_250,
        max_entries: int = 4_000_000,
        ttl_s: float = 600.0,
        native: bool | None = None,
    ) -> None:
        if capacity_chunks <= 0 or max_entries <= 0 or ttl_s <= 0:
            raise ValueError("capacity_chunks, max_entries and ttl_s must be positive")
        self.default_capacity = capacity_chunks
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self._new_store = store_factory(native)
        self._endpoints: dict[EndpointId, ChunkStore] = {}
        self._roots: dict[int, set[EndpointId]] = {}
        """First chunk of a recorded chain -> endpoints it was recorded for. Only those can
        hold any leading chunk of a request starting with it (prefix-closure), so a lookup
        touches them alone instead of every endpoint of the pool. Entries whose endpoint no
        longer holds the chunk are dropped when a lookup or a sweep finds them."""
        self._fills: dict[EndpointId, int] = {}
        """Per endpoint, its fill (entries over capacity) as an integer code, and"""
        self._fill_order: list[tuple[int, EndpointId]] = []
        """(code, endpoint) sorted: the least-filled endpoints first (``least_filled``)."""
        self._entries = 0
        self._retired: list[ChunkStore] = []
        """Stores of removed endpoints, emptied a slice at a time by ``sweep_steps``."""
        self._lock = threading.Lock()
        self._lookups = 0
        self._lookup_chunks = 0
        self._hit_chunks = 0
        self._evictions = 0
        self._expirations = 0

    # --- reads ---------------------------------------------------------------------------

    def match(
        self, hashes: Sequence[int], endpoint_ids: Container[EndpointId], now_s: float
    ) -> dict[EndpointId, int]:
        """Per endpoint of ``endpoint_ids``, how many leading chunks of ``hashes`` it holds
        (endpoints holding none are omitted). Entries older than the TTL count as absent.
        ``endpoint_ids`` is only tested for membership (a set, or a ``Pool.ids``)."""
        n = len(hashes)
        result: dict[EndpointId, int] = {}
        if n == 0:
            return result
        cutoff = now_s - self.ttl_s
        best = 0
        with self._lock:
            self._lookups += 1
            self._lookup_chunks += n
            holders = self._roots.get(hashes[0])
            if holders:
                endpoints = self._endpoints
                gone: list[EndpointId] = []
                for eid in holders:
                    store = endpoints.get(eid)
                    if store is None or store.get(hashes[0]) is None:
                        gone.append(eid)  # removed, or its chain's root was evicted
                        continue
                    if eid not in endpoint_ids:
                        continue
                    k = store.held(hashes, cutoff)
                    if k:
                        result[eid] = k
                        best = max(best, k)
                for eid in gone:
                    holders.discard(eid)
                if not holders:
                    del self._roots[hashes[0]]
            self._hit_chunks += best
        return result

    def holds(self, endpoint_id: EndpointId, chunk: int, now_s: float) -> bool:
        with self._lock:
            store = self._endpoints.get(endpoint_id)
            ts = None if store is None else store.get(chunk)
            return ts is not None and ts >= now_s - self.ttl_s

    # --- writes --------------------------------------------------------------------------

    def record(
        self,
        endpoint_id: EndpointId,
        hashes: Sequence[int],
        now_s: float,
        *,
        chain_root: bool = True,
    ) -> None:
        """Note that ``endpoint_id`` now holds every chunk of ``hashes`` (a routing decision).
        ``chain_root=False``: ``hashes[0]`` is not the first chunk of a prompt (a restore
        replays groups of entries; their roots come separately, ``add_roots``)."""
        if not hashes:
            return
        stamp = float(now_s)  # (Python store) one object shared by every chunk of the request
        with self._lock:
            store = self._endpoints.get(endpoint_id)
            if store is None:
                store = self._endpoints[endpoint_id] = self._new_store(self.default_capacity)
            before = len(store)
            evicted = store.record(hashes, stamp)
            if chain_root:
                holders = self._roots.get(hashes[0])
                if holders is None:
                    self._roots[hashes[0]] = {endpoint_id}
                else:
                    holders.add(endpoint_id)
            self._entries += len(store) - before
            self._evictions += evicted
            self._refill(endpoint_id, store)
            if self._entries > self.max_entries:
                self._evict_global(self._entries - self.max_entries)

    def add_roots(self, endpoint_id: EndpointId, roots: Iterable[int]) -> None:
        """Mark chain roots of ``endpoint_id`` (after a restore); roots it does not hold are
        skipped."""
        with self._lock:
            store = self._endpoints.get(endpoint_id)
            if store is None:
                return
            for root in roots:
                if store.get(root) is not None:
                    self._roots.setdefault(root, set()).add(endpoint_id)

    def export_endpoint(self, endpoint_id: EndpointId) -> EndpointExport:
        """What rebuilds this endpoint's entries elsewhere (a peer's warm start): its chunks
        as writes, oldest first, each the chunks that share one last-use time, leading
        chunk first (``record`` of them in order gives the same LRU order), and its chain
        roots. In one piece: ``export_slices`` is the same, a slice at a time."""
        writes: list[ExportedWrite] = []
        roots: list[int] = []
        for part in self.export_slices(endpoint_id):
            writes += part.writes
            roots += part.roots
        return EndpointExport(endpoint_id, writes, roots)

    def export_slices(self, endpoint_id: EndpointId, size: int = SLICE_ITEMS) -> Iterator[EndpointExport]:
        """``export_endpoint`` in slices of ``size`` entries (then of chain roots), each read
        under the lock on its own: the caller may serve requests between them. Entries the
        index moves or drops meanwhile may be sent twice or not at all (a warm start is
        best effort); a group of one last-use time may be split across slices, in order."""
        start = 0
        while True:
            with self._lock:
                store = self._endpoints.get(endpoint_id)
                items = [] if store is None else store.items(start, size)
            if not items:
                break
            start += len(items)
            yield EndpointExport(endpoint_id, _groups(items), [])
            if len(items) < size:
                break
        with self._lock:
            candidates = list(self._roots)
        for at in range(0, len(candidates), size):
            with self._lock:
                roots = self._roots
                mine = [r for r in candidates[at : at + size]
                        if endpoint_id in roots.get(r, ())]  # fmt: skip
            if mine:
                yield EndpointExport(endpoint_id, [], mine)

    def remove_endpoint(self, endpoint_id: EndpointId) -> int:
        """Forget everything about an endpoint that left the pool; returns entries removed.
        Its entries stop counting at once; their memory is given back by ``sweep_steps``."""
        with self._lock:
            store = self._endpoints.pop(endpoint_id, None)
            if store is None:
                return 0
            self._unfill(endpoint_id)
            self._entries -= len(store)
            if len(store):
                self._retired.append(store)
            return len(store)

    def set_capacity(self, endpoint_id: EndpointId, capacity_chunks: int) -> None:
        """Size one endpoint's LRU (from its KV-cache size, or lowered when it proves smaller)."""
        capacity = max(1, int(capacity_chunks))
        with self._lock:
            store = self._endpoints.get(endpoint_id)
            if store is None:
                store = self._endpoints[endpoint_id] = self._new_store(capacity)
            else:
                removed = store.set_capacity(capacity)
                self._entries -= removed
                self._evictions += removed
            self._refill(endpoint_id, store)

    def capacity(self, endpoint_id: EndpointId) -> int:
        with self._lock:
            store = self._endpoints.get(endpoint_id)
            return self.default_capacity if store is None else store.capacity

    def least_filled(self, k: int, endpoint_ids: Container[EndpointId]) -> list[EndpointId]:
        """Up to ``k`` endpoints of ``endpoint_ids`` whose LRU is the least full, least first,
        among those something was recorded for (one nothing was recorded for is emptier
        still: it is not known here). A walk of the least-filled, not of every endpoint."""
        out: list[EndpointId] = []
        with self._lock:
            for _, eid in islice(self._fill_order, 8 * k + 64):
                if eid in endpoint_ids:
                    out.append(eid)
                    if len(out) >= k:
                        break
        return out

    def fill(self, endpoint_ids: Sequence[EndpointId]) -> list[float]:
        """Per endpoint, the share of its LRU in use (0 for one nothing was recorded for):
        how full epp believes its KV cache is with reusable prefixes."""
        with self._lock:
            stores = self._endpoints
            out = []
            for eid in endpoint_ids:
                store = stores.get(eid)
                out.append(0.0 if store is None else len(store) / store.capacity)
            return out

    def sweep(self, now_s: float) -> int:
        """Remove expired entries (oldest first on every endpoint) and the chain roots no
        endpoint holds any more; returns how many entries expired. In one piece:
        ``sweep_steps`` is the same pass a slice at a time."""
        return sum(self.sweep_steps(now_s))

    def sweep_steps(self, now_s: float, size: int = SLICE_ITEMS) -> Iterator[int]:
        """``sweep`` in slices of at most ``size`` entries (or roots), the lock taken per
        slice; yields the entries each slice expired. Also empties removed endpoints'
        stores."""
        cutoff = now_s - self.ttl_s
        while True:
            with self._lock:
                if not self._retired:
                    break
                store = self._retired[-1]
                store.evict_oldest(size)
                if not len(store):
                    self._retired.pop()
            yield 0
        with self._lock:
            stores = list(self._endpoints.items())
        for eid, store in stores:
            while True:
                with self._lock:
                    if self._endpoints.get(eid) is not store:
                        break  # removed (or replaced) meanwhile
                    removed = store.sweep(cutoff, size)
                    self._entries -= removed
                    self._expirations += removed
                    if removed:
                        self._refill(eid, store)
                yield removed
                if removed < size:
                    break
        with self._lock:
            roots = list(self._roots)
        for start in range(0, len(roots), size):
            with self._lock:
                self._prune_roots(roots[start : start + size])
            yield 0

    def _prune_roots(self, roots: Sequence[int]) -> None:
        endpoints = self._endpoints
        for root in roots:
            holders = self._roots.get(root)
            if holders is None:
                continue
            live = {
                eid
                for eid in holders
                if (holder := endpoints.get(eid)) is not None and holder.get(root) is not None
            }
            if not live:
                del self._roots[root]
            elif len(live) != len(holders):
                self._roots[root] = live

    # --- internals (lock held) -----------------------------------------------------------

    def _refill(self, endpoint_id: EndpointId, store: ChunkStore) -> None:
        """Move the endpoint to its place in the fill order."""
        code = _fill_code(store)
        old = self._fills.get(endpoint_id)
        if old == code:
            return
        order = self._fill_order
        if old is not None:
            del order[bisect_left(order, (old, endpoint_id))]
        self._fills[endpoint_id] = code
        insort(order, (code, endpoint_id))

    def _unfill(self, endpoint_id: EndpointId) -> None:
        old = self._fills.pop(endpoint_id, None)
        if old is not None:
            del self._fill_order[bisect_left(self._fill_order, (old, endpoint_id))]

    def _evict_global(self, count: int) -> None:
        # Evict a little more than asked (0.1% of the cap), so that a full index does not scan
        # every endpoint on every record; always from the endpoint holding the oldest entry.
        count += self.max_entries // 1000
        while count > 0 and self._entries > 0:
            victim: ChunkStore | None = None
            victim_id: EndpointId | None = None
            oldest = float("inf")
            for eid, store in self._endpoints.items():
                ts = store.oldest_stamp()
                if ts is not None and ts < oldest:
                    oldest, victim, victim_id = ts, store, eid
            if victim is None or victim_id is None:
                return
            # from the oldest endpoint, as much as is older than the next-oldest endpoint's
            # oldest entry would be exact; a 1/16 slice of its entries is close and cheap
            removed = victim.evict_oldest(min(count, max(1, len(victim) // 16)))
            self._refill(victim_id, victim)
            self._entries -= removed
            self._evictions += removed
            count -= removed

    # --- introspection -------------------------------------------------------------------

    def __len__(self) -> int:
        return self._entries

    def endpoint_ids(self) -> list[EndpointId]:
        with self._lock:
            return list(self._endpoints)

    def chunks_of(self, endpoint_id: EndpointId) -> Mapping[int, float]:
        """The endpoint's chunks with their last-use time, oldest first."""
        with self._lock:
            store = self._endpoints.get(endpoint_id)
            return dict(store.items()) if store is not None else {}

    def stats(self) -> IndexStats:
        with self._lock:
            return IndexStats(
                entries=self._entries,
                endpoints=len(self._endpoints),
                lookups=self._lookups,
                lookup_chunks=self._lookup_chunks,
                hit_chunks=self._hit_chunks,
                evictions=self._evictions,
                expirations=self._expirations,
                approx_bytes=sum(store.nbytes for store in list(self._endpoints.values())),
            )


def _groups(items: Sequence[tuple[int, float]]) -> list[ExportedWrite]:
    """Consecutive entries (oldest first) of one last-use time as writes, leading chunk
    first (a record moves its deepest chunk first)."""
    groups: list[ExportedWrite] = []
    chunk: list[int] = []
    stamp = 0.0
    for h, ts in items:
        if ts != stamp and chunk:
            chunk.reverse()
            groups.append(ExportedWrite(chunk, stamp))
            chunk = []
        stamp = ts
        chunk.append(h)
    if chunk:
        chunk.reverse()
        groups.append(ExportedWrite(chunk, stamp))
    return groups
