"""One endpoint's chunk LRU: which chunks it recently received, oldest use first.

Two implementations with one interface: ``LruChunks`` from the optional C extension
(``epp/prefix/_lru.c``: a hash table and a linked list, no Python object per chunk) and
``PyLruChunks`` here (an insertion-ordered ``dict``). ``new_store`` picks the native one when it
is built and ``EPP_PURE_PYTHON`` is not set. The model-based tests run both against the same
reference LRU.

Recording a chain moves its held chunks to the young end and appends the new ones, deepest
chunk first, evicting the oldest entry whenever the store is full; a chain longer than the
capacity keeps its leading chunks. So among one chain's chunks the deepest are evicted first,
which keeps the store *prefix-closed* along every chain and lets ``held`` binary-search.
"""

from __future__ import annotations

import os
import sys
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from itertools import islice, repeat
from typing import Protocol

_consume: Callable[[Iterable[object]], None] = deque[object](maxlen=0).extend


class ChunkStore(Protocol):
    @property
    def capacity(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    def __len__(self) -> int: ...
    def record(self, hashes: Sequence[int], stamp: float, /) -> int: ...
    def held(self, hashes: Sequence[int], cutoff: float, /) -> int: ...
    def get(self, chunk: int, /) -> float | None: ...
    def sweep(self, cutoff: float, limit: int = ..., /) -> int: ...
    def evict_oldest(self, count: int, /) -> int: ...
    def set_capacity(self, capacity: int, /) -> int: ...
    def oldest_stamp(self) -> float | None: ...
    def items(self, start: int = 0, count: int = ..., /) -> list[tuple[int, float]]: ...


class PyLruChunks:
    """The pure-Python store: the dict's order is the LRU order (oldest first)."""

    __slots__ = ("_capacity", "_chunks")

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self._capacity = capacity
        self._chunks: dict[int, float] = {}

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def nbytes(self) -> int:
        return sys.getsizeof(self._chunks) + 32 * len(self._chunks)

    def __len__(self) -> int:
        return len(self._chunks)

    def record(self, hashes: Sequence[int], stamp: float, /) -> int:
        if len(hashes) > self._capacity:
            hashes = hashes[: self._capacity]
        chunks = self._chunks
        held = _held(chunks, hashes)
        if held:  # only the held prefix needs popping: nothing deeper is present
            _consume(map(chunks.pop, hashes[held - 1 :: -1], repeat(None)))
        chunks.update(zip(reversed(hashes), repeat(stamp)))
        over = len(chunks) - self._capacity
        return self.evict_oldest(over) if over > 0 else 0

    def held(self, hashes: Sequence[int], cutoff: float, /) -> int:
        n = len(hashes)
        if n == 0:
            return 0
        get = self._chunks.get
        ts = get(hashes[0])
        if ts is None or ts < cutoff:
            return 0
        ts = get(hashes[-1])
        if ts is not None and ts >= cutoff:
            return n
        lo, hi = 1, n  # chunk lo-1 held, chunk hi-1 not
        while hi - lo > 1:
            mid = (lo + hi) >> 1
            ts = get(hashes[mid - 1])
            if ts is not None and ts >= cutoff:
                lo = mid
            else:
                hi = mid
        return lo

    def get(self, chunk: int, /) -> float | None:
        return self._chunks.get(chunk)

    def sweep(self, cutoff: float, limit: int = sys.maxsize, /) -> int:
        expired = []
        for h, ts in islice(self._chunks.items(), max(0, limit)):
            if ts >= cutoff:
                break
            expired.append(h)
        _consume(map(self._chunks.__delitem__, expired))
        return len(expired)

    def evict_oldest(self, count: int, /) -> int:
        victims = list(islice(self._chunks, max(0, count)))
        _consume(map(self._chunks.__delitem__, victims))
        return len(victims)

    def set_capacity(self, capacity: int, /) -> int:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self._capacity = capacity
        over = len(self._chunks) - capacity
        return self.evict_oldest(over) if over > 0 else 0

    def oldest_stamp(self) -> float | None:
        return next(iter(self._chunks.values()), None)

    def items(self, start: int = 0, count: int = sys.maxsize, /) -> list[tuple[int, float]]:
        if start < 0 or count < 0:
            raise ValueError("start and count must be >= 0")
        if start == 0 and count >= len(self._chunks):
            return list(self._chunks.items())
        return list(islice(self._chunks.items(), start, min(sys.maxsize, start + count)))


def _held(chunks: dict[int, float], hashes: Sequence[int]) -> int:
    """Leading chunks stored (expired or not): a binary search over a prefix-closed set."""
    n = len(hashes)
    if n == 0 or hashes[0] not in chunks:
        return 0
    if hashes[-1] in chunks:
        return n
    lo, hi = 1, n
    while hi - lo > 1:
        mid = (lo + hi) >> 1
        if hashes[mid - 1] in chunks:
            lo = mid
        else:
            hi = mid
    return lo


StoreFactory = Callable[[int], ChunkStore]

_native: StoreFactory | None
try:  # the optional C store (setup.py)
    from epp.prefix._lru import LruChunks as _native
except ImportError:  # pragma: no cover - depends on the build
    _native = None
if os.environ.get("EPP_PURE_PYTHON"):
    _native = None

NATIVE = _native is not None
"""Whether the native store is in use (``EPP_PURE_PYTHON=1`` turns it off)."""


def store_factory(native: bool | None = None) -> StoreFactory:
    """The native store when built (or asked for with ``native=True``), else the Python one."""
    if native is False or _native is None:
        return PyLruChunks
    return _native
