"""The outbox: a bounded ring of this replica's own writes, one cursor per subscriber."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from epp.framework.endpoint import EndpointId
from epp.sync.outbox import Outbox

E = EndpointId("10.0.0.1:8000")


def fill(box: Outbox, n: int, start: int = 0) -> None:
    for i in range(start, start + n):
        box.append(E, [i], float(i))


def test_a_new_reader_starts_at_the_newest_write() -> None:
    box = Outbox(capacity_records=8)
    fill(box, 3)
    cursor = box.attach()
    assert box.read(cursor, 10).writes == []
    fill(box, 2, start=3)
    read = box.read(cursor, 10)
    assert [w.stamp_s for w in read.writes] == [3.0, 4.0]
    assert (read.next_cursor, read.dropped) == (5, 0)


def test_a_slow_reader_loses_the_oldest_writes_and_is_told_how_many() -> None:
    box = Outbox(capacity_records=4)
    fast = slow = box.attach()
    fill(box, 3)
    fast = box.read(fast, 10).next_cursor
    fill(box, 7, start=3)  # 10 writes in all, the ring holds the last 4
    read_slow = box.read(slow, 10)
    assert read_slow.dropped == 6
    assert [w.stamp_s for w in read_slow.writes] == [6.0, 7.0, 8.0, 9.0]
    read_fast = box.read(fast, 10)  # the fast reader was 7 behind: it loses 3, not 6
    assert read_fast.dropped == 3 and len(read_fast.writes) == 4
    assert box.published == 10


def test_reads_are_split_by_records_and_by_chunks() -> None:
    box = Outbox(capacity_records=16)
    cursor = box.attach()
    for i in range(6):
        box.append(E, list(range(10)), float(i))
    assert len(box.read(cursor, 4).writes) == 4
    assert len(box.read(cursor, 10, max_chunks=25).writes) == 2
    # a single write bigger than the chunk cap still goes out (alone)
    assert len(box.read(cursor, 10, max_chunks=3).writes) == 1


def test_a_full_batch_wakes_the_readers() -> None:
    wakes: list[int] = []
    box = Outbox(capacity_records=64, batch_records=4, wakeup=lambda: wakes.append(box.head))
    box.attach()
    fill(box, 9)
    assert wakes == [4, 8]


def test_append_keeps_a_reference_not_a_copy() -> None:
    box = Outbox()
    hashes = [1, 2, 3]
    cursor = box.attach()
    box.append(E, hashes, 1.0)
    assert box.read(cursor, 1).writes[0].hashes is hashes


@given(
    capacity=st.integers(1, 8),
    steps=st.lists(st.one_of(st.integers(1, 5), st.just(0)), max_size=40),
)
def test_every_write_is_either_delivered_in_order_or_counted_as_dropped(
    capacity: int, steps: list[int]
) -> None:
    box = Outbox(capacity_records=capacity, capacity_chunks=max(1, capacity // 2))
    cursor = box.attach()
    got: list[float] = []
    dropped = 0
    n = 0
    for step in steps:
        if step:  # append
            fill(box, step, start=n)
            n += step
        else:  # drain
            while True:
                read = box.read(cursor, 3)
                if not read.writes and not read.dropped:
                    break
                cursor = read.next_cursor
                dropped += read.dropped
                got += [w.stamp_s for w in read.writes]
    read = box.read(cursor, n + 1)
    dropped += read.dropped
    got += [w.stamp_s for w in read.writes]
    assert got == sorted(got) and len(set(got)) == len(got)
    assert len(got) + dropped == n


def test_the_item_ring_keeps_the_newest_and_counts_what_a_reader_missed() -> None:
    from epp.sync.outbox import ItemRing

    box = ItemRing(capacity=4)
    start = box.head
    for i in range(10):
        box.append(f"o{i}", float(i))
    read = box.read(start, 3)
    assert read.dropped == 6 and [o for o, _ in read.items] == ["o6", "o7", "o8"]
    rest = box.read(read.next_cursor, 3)
    assert rest.dropped == 0 and rest.items == [("o9", 9.0)] and rest.next_cursor == box.head
    assert box.read(box.head, 3).items == []


def test_with_no_subscriber_nothing_is_held() -> None:
    """A replica with sync on and no peer subscribed yet kept the last 8,192 chains whole
    (issue 70, item 11): now it counts its writes and holds none; the last subscriber to
    leave lets go of what it had not read."""
    box = Outbox(capacity_records=8192)
    for i in range(100):
        box.append(E, list(range(4_000)), float(i))
    assert box.published == 100 and box.chunks == 0
    cursor = box.attach()
    fill(box, 3, start=100)
    assert box.chunks == 3 and len(box.read(cursor, 10).writes) == 3
    box.detach()
    assert box.chunks == 0 and box.readers == 0


def test_the_ring_is_bounded_in_chain_hashes_not_only_in_writes() -> None:
    """8,192 writes of a 270 KB prompt's chain (~4,200 hashes each) pinned ~1.5 GB: the
    ring now also holds at most ``capacity_chunks`` hashes, the oldest writes going first,
    and a slow reader is told what it lost."""
    import sys

    box = Outbox(capacity_records=8192, capacity_chunks=100_000)
    cursor = box.attach()
    chain = 4_200
    for i in range(500):
        box.append(E, list(range(i, i + chain)), float(i))
        assert box.chunks <= 100_000
    held = box.chunks
    assert held > 100_000 - chain
    read = box.read(cursor, 8192, max_chunks=1 << 62)
    assert read.dropped == 500 - len(read.writes) and len(read.writes) == held // chain
    assert sum(sys.getsizeof(w.hashes) for w in read.writes) < 8 * 100_000 + 64 * len(read.writes)
    big = list(range(300_000))  # one write larger than the bound keeps its leading chunks
    box.append(E, big, 600.0)
    assert box.chunks == 100_000
