"""The outbox: this replica's own index writes, waiting to be streamed to its peers.

One bounded ring shared by every subscriber; each subscriber reads from its own cursor. The
request path only stores a reference into the ring (``append``: no copy, no lock, no I/O).
The ring is bounded twice: in writes (``capacity_records``) and in the chain hashes they hold
(``capacity_chunks``: a 270 KB prompt's chain is ~4,000 Python ints, ~160 KB, so a bound in
writes alone let 8,192 of them pin over a gigabyte). Past either bound the oldest writes go;
a subscriber behind them loses them: its next read skips to the oldest write still held and
reports how many it missed. Nothing is replayed to a new subscriber: it starts at the newest
write, and with no subscriber attached nothing is held at all.

Single-threaded: ``append`` and the readers run on the serving event loop.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from epp.framework.endpoint import EndpointId


@dataclass(slots=True, frozen=True)
class OwnWrite:
    endpoint_id: EndpointId
    hashes: Sequence[int]
    stamp_s: float
    """The ``now_s`` the write carried, on this process's monotonic clock."""


@dataclass(slots=True, frozen=True)
class OutboxRead:
    writes: list[OwnWrite]
    next_cursor: int
    dropped: int
    """Writes between the cursor and the oldest one still held: lost to this reader."""


def _window(head: int, oldest: int, cursor: int, most: int) -> tuple[int, int, int]:
    """A reader's next window of a ring that has seen ``head`` items and still holds those
    from ``oldest`` on: (first, end, dropped), where ``dropped`` items fell out of the ring
    between ``cursor`` and the oldest one still held."""
    dropped = 0
    if cursor < oldest:
        dropped, cursor = oldest - cursor, oldest
    return cursor, min(head, cursor + most), dropped


def _no_wakeup() -> None:
    return None


DEFAULT_CAPACITY_CHUNKS = 1 << 20
"""Chain hashes the outbox holds at most (~40 MB of Python ints and list slots)."""


class Outbox:
    def __init__(
        self,
        capacity_records: int = 8192,
        batch_records: int = 256,
        wakeup: Callable[[], None] = _no_wakeup,
        capacity_chunks: int = DEFAULT_CAPACITY_CHUNKS,
    ) -> None:
        if capacity_records <= 0 or batch_records <= 0 or capacity_chunks <= 0:
            raise ValueError("capacity_records, batch_records and capacity_chunks must be positive")
        self.capacity = capacity_records
        self.capacity_chunks = capacity_chunks
        self.batch_records = batch_records
        self.readers = 0
        """Subscribers attached (``attach``); with none, writes are counted, not held."""
        self.chunks = 0
        """Chain hashes held in the ring."""
        self._tail = 0
        """Sequence number of the oldest write still held."""
        # three parallel rings: appending stores three references and allocates nothing
        self._eids: list[EndpointId] = [EndpointId("")] * capacity_records
        self._hashes: list[Sequence[int]] = [()] * capacity_records
        self._stamps: list[float] = [0.0] * capacity_records
        self._head = 0
        """Sequence number of the next write; also the count of writes ever appended."""
        self._wakeup = wakeup

    @property
    def head(self) -> int:
        """Where a new reader starts (it sees only writes appended from now on)."""
        return self._head

    @property
    def published(self) -> int:
        return self._head

    def attach(self) -> int:
        """A subscriber starts reading: returns its cursor (the newest write)."""
        self.readers += 1
        return self._head

    def detach(self) -> None:
        """A subscriber left; the last one to leave lets go of everything held."""
        self.readers = max(0, self.readers - 1)
        if not self.readers:
            while self._tail < self._head:
                self._drop_oldest()

    def append(self, endpoint_id: EndpointId, hashes: Sequence[int], now_s: float) -> None:
        """The producer's ``on_record``: remember one write of this replica's own."""
        seq = self._head
        self._head = seq + 1
        if not self.readers:  # nobody to send it to: count it, hold nothing
            self._tail = self._head
            return
        if len(hashes) > self.capacity_chunks:  # the leading chunks: still a prefix
            hashes = hashes[: self.capacity_chunks]
        while self._tail < seq and (seq - self._tail >= self.capacity
                                    or self.chunks + len(hashes) > self.capacity_chunks):  # fmt: skip
            self._drop_oldest()
        i = seq % self.capacity
        self._eids[i] = endpoint_id
        self._hashes[i] = hashes
        self._stamps[i] = now_s
        self.chunks += len(hashes)
        if (seq + 1) % self.batch_records == 0:
            self._wakeup()  # a full batch is waiting: readers need not wait for the timer

    def _drop_oldest(self) -> None:
        i = self._tail % self.capacity
        self.chunks -= len(self._hashes[i])
        self._hashes[i] = ()
        self._tail += 1

    def read(self, cursor: int, max_records: int, max_chunks: int = 1 << 62) -> OutboxRead:
        """Writes from ``cursor`` on: at most ``max_records``, and no more chunks than
        ``max_chunks`` (unless the first write alone exceeds it)."""
        cursor, end, dropped = _window(self._head, self._tail, cursor, max_records)
        cap = self.capacity
        writes: list[OwnWrite] = []
        chunks = 0
        seq = cursor
        while seq < end:
            i = seq % cap
            hashes = self._hashes[i]
            chunks += len(hashes)
            if writes and chunks > max_chunks:
                break
            writes.append(OwnWrite(self._eids[i], hashes, self._stamps[i]))
            seq += 1
        return OutboxRead(writes, seq, dropped)


@dataclass(slots=True, frozen=True)
class RingRead:
    items: list[tuple[Any, float]]
    """``(item, stamp_s)``, oldest first."""
    next_cursor: int
    dropped: int


class ItemRing:
    """Items waiting to be streamed to the peers with the stamp they carry: a bounded ring
    with a cursor per reader, as the outbox. Two of them: this replica's observations of
    other replicas' responses (``--response-observer``: a generated
    ``epp.sync.v1.Observation`` without its age, which the sender fills in from the stamp),
    and the stored objects it learnt (``(id, endpoint)``)."""

    def __init__(self, capacity: int = 4096) -> None:
        if capacity <= 0:
            raise ValueError("capacity must be positive")
        self.capacity = capacity
        self._items: list[tuple[Any, float]] = [(None, 0.0)] * capacity
        self._head = 0

    @property
    def head(self) -> int:
        return self._head

    def append(self, item: Any, now_s: float) -> None:
        self._items[self._head % self.capacity] = (item, now_s)
        self._head += 1

    def read(self, cursor: int, max_items: int) -> RingRead:
        cursor, end, dropped = _window(self._head, max(0, self._head - self.capacity), cursor,
                                       max_items)  # fmt: skip
        items = [self._items[seq % self.capacity] for seq in range(cursor, end)]
        return RingRead(items, end, dropped)
