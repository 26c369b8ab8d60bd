"""Applying peers' records: ages become stamps on this clock, unknown endpoints are ignored,
and applying never republishes (no echo)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest

from epp.framework.endpoint import EndpointId
from epp.plugins.approxprefix import PrefixProducer
from epp.prefix.hasher import ChunkHasher
from epp.prefix.index import PrefixIndex
from epp.sync.apply import RemoteApplier, stamp_from_age
from epp.sync.gen import sync_pb2

A = EndpointId("10.0.0.1:8000")
B = EndpointId("10.0.0.2:8000")


@dataclass
class Written:
    calls: list[tuple[EndpointId, list[int], float]] = field(default_factory=list)

    def __call__(self, eid: EndpointId, hashes: Sequence[int], stamp: float) -> None:
        self.calls.append((eid, list(hashes), stamp))


@pytest.mark.parametrize(
    ("now", "age", "stamp"),
    [(100.0, 0.0, 100.0), (100.0, 0.25, 99.75), (100.0, 30.0, 70.0), (100.0, -5.0, 100.0)],
)
def test_stamp_is_now_minus_age_never_in_the_future(now: float, age: float, stamp: float) -> None:
    assert stamp_from_age(now, age) == stamp


def test_records_are_stamped_on_the_receivers_clock() -> None:
    # the sender's clock read 5000.0; ours reads 10.0: only the age crosses
    written = Written()
    applier = RemoteApplier(written, lambda eid: True, clock=lambda: 10.0)
    batch = sync_pb2.RecordBatch(records=[sync_pb2.Record(endpoint_id=A, hashes=[1, 2], age_s=0.5)])
    result = applier.apply(batch.records)
    assert written.calls == [(A, [1, 2], 9.5)]
    assert (result.applied, result.ignored) == (1, 0)


def test_records_for_endpoints_outside_the_pool_are_ignored() -> None:
    written = Written()
    applier = RemoteApplier(written, lambda eid: eid == A, clock=lambda: 1.0)
    records = [
        sync_pb2.Record(endpoint_id=B, hashes=[1], age_s=0.0),
        sync_pb2.Record(endpoint_id=A, hashes=[2], age_s=0.0),
        sync_pb2.Record(endpoint_id=A, hashes=[], age_s=0.0),
    ]
    result = applier.apply(records)
    assert [c[0] for c in written.calls] == [A]
    assert (result.applied, result.ignored) == (1, 1)


def test_hashes_survive_the_wire_as_unsigned_64_bit() -> None:
    hashes = [0, 1, 2**63, 2**64 - 1]
    wire = sync_pb2.Record(endpoint_id=A, hashes=hashes, age_s=0.1).SerializeToString()
    assert list(sync_pb2.Record.FromString(wire).hashes) == hashes


def producer_with_sink() -> tuple[PrefixProducer, Written]:
    sink = Written()
    producer = PrefixProducer(ChunkHasher(64), PrefixIndex())
    producer.subscribe(sink)
    return producer, sink


def test_applying_a_peer_write_does_not_republish_it() -> None:
    producer, sink = producer_with_sink()
    applier = RemoteApplier(producer.apply_remote, lambda eid: True, clock=lambda: 50.0)
    applier.apply([sync_pb2.Record(endpoint_id=A, hashes=[7, 8, 9], age_s=2.0)])
    assert producer.index.match([7, 8, 9], [A], 50.0) == {A: 3}
    assert dict(producer.index.chunks_of(A)) == {7: 48.0, 8: 48.0, 9: 48.0}
    assert sink.calls == []
