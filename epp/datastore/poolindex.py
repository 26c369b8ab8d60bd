"""The datastore's pool index: its routable endpoints ordered by load, kept up to date as
they change, so that a profile's shortlist (``epp.framework.pool``) costs the same in a pool
of 8 endpoints or of 1,000.

For each endpoint that is not stale and can serve (not asleep): its place in one sorted list per ``Load`` (an integer
per endpoint that packs the load, its tie-break and the endpoint's slot, so the lists sort
with integer comparisons), the adapters its last scrape reports, and the pool's sum of
requests running and waiting. A change of one endpoint (a scrape, a request sent there or
finished) moves it in each list: a binary search and a ``list`` insert, in C, whatever the
pool's size. Single-threaded, like the datastore that owns it.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Container
from typing import Literal

from epp.framework.endpoint import Endpoint, EndpointId
from epp.framework.pool import LOADS, Load, Pool, busy, endpoint_hash, kv_use

_SLOT_BITS = 20
_SLOT_MASK = (1 << _SLOT_BITS) - 1
_TIE_BITS = 10
_TIE_MAX = (1 << _TIE_BITS) - 1
_FINE = 1 << 20
_ORDER = {load: i for i, load in enumerate(LOADS)}
"""The order ``least`` reads per load; a fourth orders by queue, then requests running."""
_STAIRS = {("queue", "kv"): 0, ("busy", "kv"): 2, ("queue", "running"): 3}
_TIE_SHIFT = _SLOT_BITS + _TIE_BITS
_LOAD_SHIFT = _TIE_SHIFT + _TIE_BITS
_MAX_STEPS = 4
"""Load values a staircase walks at most (each a binary search)."""


def _codes(e: Endpoint, slot: int) -> tuple[int, int, int, int]:
    """The endpoint's sort codes, one per order: the load, its tie-break and a second
    tie-break (10 bits each), then the slot."""
    kv = kv_use(e)
    kvq = int(kv * _TIE_MAX)
    queue = max(0, e.queue)
    running = max(0, e.metrics.running)
    q, r = min(queue, _TIE_MAX), min(running, _TIE_MAX)
    return (
        _code(queue, kvq, r, slot),  # queue, then KV use, then running
        _code(int(kv * _FINE), q, r, slot),  # KV use, then queue, then running
        _code(queue + running, kvq, q, slot),  # running + waiting, then KV use, then queue
        _code(queue, r, kvq, slot),  # queue, then running, then KV use
    )


def _code(load: int, tie: int, tie2: int, slot: int) -> int:
    return (((((load << _TIE_BITS) | tie) << _TIE_BITS) | tie2) << _SLOT_BITS) | slot


def _adapters(e: Endpoint) -> frozenset[str]:
    m = e.metrics
    return m.running_adapters | m.waiting_adapters if m.running_adapters or m.waiting_adapters else frozenset()


class PoolIndex:
    """The routable endpoints (those not stale) in load order; ``put`` on every change."""

    __slots__ = ("_adapters", "_busy", "_codes", "_endpoints", "_free", "_orders", "_ring", "_slots")

    def __init__(self) -> None:
        self._slots: dict[EndpointId, int] = {}
        self._endpoints: list[Endpoint | None] = []
        self._codes: list[tuple[int, int, int, int]] = []
        self._free: list[int] = []
        self._orders: tuple[list[int], ...] = ([], [], [], [])
        self._busy = 0
        self._adapters: dict[str, dict[EndpointId, None]] = {}
        self._ring: list[int] = []
        """(endpoint hash << slot bits) | slot, sorted: consistent hashing (``ring``)."""

    def __len__(self) -> int:
        return len(self._slots)

    def put(self, e: Endpoint) -> None:
        """Add or update an endpoint (a stale one, or one that reports it cannot serve now,
        leaves the index until it is fresh and serving again)."""
        if e.stale or e.metrics.not_serving:
            self.remove(e.id)
            return
        slot = self._slots.get(e.id)
        if slot is None:
            if len(self._slots) > _SLOT_MASK:
                raise ValueError(f"the pool index holds at most {_SLOT_MASK + 1} endpoints")
            slot = self._free.pop() if self._free else len(self._endpoints)
            if slot == len(self._endpoints):
                self._endpoints.append(None)
                self._codes.append((0, 0, 0, 0))
            self._slots[e.id] = slot
            insort(self._ring, (endpoint_hash(e.id) << _SLOT_BITS) | slot)
            old = None
        else:
            old = self._endpoints[slot]
            assert old is not None
            self._unorder(slot)
            self._busy -= busy(old)
        self._endpoints[slot] = e
        codes = self._codes[slot] = _codes(e, slot)
        for order, code in zip(self._orders, codes, strict=True):
            insort(order, code)
        self._busy += busy(e)
        if old is None or old.metrics is not e.metrics:
            self._readapt(e.id, _adapters(old) if old is not None else frozenset(), _adapters(e))

    def remove(self, endpoint_id: EndpointId) -> None:
        slot = self._slots.pop(endpoint_id, None)
        if slot is None:
            return
        old = self._endpoints[slot]
        assert old is not None
        self._unorder(slot)
        self._busy -= busy(old)
        self._readapt(endpoint_id, _adapters(old), frozenset())
        ring = self._ring
        del ring[bisect_left(ring, (endpoint_hash(endpoint_id) << _SLOT_BITS) | slot)]
        self._endpoints[slot] = None
        self._free.append(slot)

    def _unorder(self, slot: int) -> None:
        for order, code in zip(self._orders, self._codes[slot], strict=True):
            del order[bisect_left(order, code)]

    def _readapt(self, eid: EndpointId, old: frozenset[str], new: frozenset[str]) -> None:
        if old == new:
            return
        for adapter in old - new:
            holders = self._adapters.get(adapter)
            if holders is not None:
                holders.pop(eid, None)
                if not holders:
                    del self._adapters[adapter]
        for adapter in new - old:
            self._adapters.setdefault(adapter, {})[eid] = None

    # --- reads (``Pool``) ---------------------------------------------------------------

    def __contains__(self, endpoint_id: object) -> bool:
        return endpoint_id in self._slots

    @property
    def ids(self) -> Container[EndpointId]:
        """The indexed endpoints' ids (a dict's keys: membership tests in C)."""
        return self._slots

    def get(self, endpoint_id: EndpointId) -> Endpoint | None:
        slot = self._slots.get(endpoint_id)
        return None if slot is None else self._endpoints[slot]

    def least(self, load: Load, k: int) -> list[Endpoint]:
        endpoints = self._endpoints
        return [endpoints[c & _SLOT_MASK] for c in self._orders[_ORDER[load]][:k]]  # type: ignore[misc]

    def staircase(self, load: Literal["queue", "busy"], k: int,
                  against: Literal["kv", "running"] = "kv") -> list[Endpoint]:  # fmt: skip
        order = self._orders[_STAIRS[load, against]]
        if not order:
            return []
        endpoints = self._endpoints
        floor = 0
        if against == "kv":  # the least KV use in the pool: no step can go below it
            floor = int(((self._orders[1][0] >> _LOAD_SHIFT) / _FINE) * _TIE_MAX)
        out: list[Endpoint] = []
        best = _TIE_MAX + 1
        i, n = 0, len(order)
        for _ in range(_MAX_STEPS):  # one step per load value present, least first
            code = order[i]
            tie = (code >> _TIE_SHIFT) & _TIE_MAX
            if tie < best:
                best = tie
                # the step, and those level with it on both (other scores may tell them
                # apart), the lowest on the second tie-break first
                j = bisect_left(order, ((code >> _TIE_SHIFT) + 1) << _TIE_SHIFT, i)
                for c in order[i:min(j, i + max(1, k - len(out)))]:
                    out.append(endpoints[c & _SLOT_MASK])  # type: ignore[arg-type]
                if best <= floor or len(out) >= k:
                    break
            i = bisect_left(order, ((code >> _LOAD_SHIFT) + 1) << _LOAD_SHIFT, i + 1)
            if i >= n:
                break
        return out

    def queue_range(self) -> tuple[int, int]:
        order = self._orders[0]
        if not order:
            return (0, 0)
        return (order[0] >> _LOAD_SHIFT, order[-1] >> _LOAD_SHIFT)

    def busy_total(self) -> int:
        return self._busy

    def holding(self, adapter: str) -> list[Endpoint]:
        holders = self._adapters.get(adapter)
        if not holders:
            return []
        endpoints, slots = self._endpoints, self._slots
        return [endpoints[slots[eid]] for eid in holders]  # type: ignore[misc]

    def ring(self, key: int, count: int, skip: int = 0) -> list[tuple[int, Endpoint]]:
        ring, endpoints = self._ring, self._endpoints
        n = len(ring)
        start = bisect_left(ring, key << _SLOT_BITS)
        codes = [ring[(start + skip + i) % n] for i in range(min(count, n - skip))] if n else []
        return [(c >> _SLOT_BITS, endpoints[c & _SLOT_MASK]) for c in codes]  # type: ignore[misc]


class IndexedPool(Pool):
    """The datastore's routable endpoints (a tuple) with its live ``PoolIndex``: the two
    agree until the datastore next changes, i.e. for the scheduling cycle it is handed to."""

    __slots__ = ("_index",)

    def __init__(self, endpoints: tuple[Endpoint, ...], index: PoolIndex) -> None:
        super().__init__(endpoints)
        self._index = index

    @property
    def ids(self) -> Container[EndpointId]:
        return self._index.ids

    def get(self, endpoint_id: EndpointId) -> Endpoint | None:
        return self._index.get(endpoint_id)

    def least(self, load: Load, k: int) -> list[Endpoint]:
        return self._index.least(load, k)

    def staircase(self, load: Literal["queue", "busy"], k: int,
                  against: Literal["kv", "running"] = "kv") -> list[Endpoint]:  # fmt: skip
        return self._index.staircase(load, k, against)

    def queue_range(self) -> tuple[int, int]:
        return self._index.queue_range()

    def busy_total(self) -> int:
        return self._index.busy_total()

    def holding(self, adapter: str) -> list[Endpoint]:
        return self._index.holding(adapter)

    def ring(self, key: int, count: int, skip: int = 0) -> list[tuple[int, Endpoint]]:
        return self._index.ring(key, count, skip)
