"""Applying peers' writes to this replica's index.

Peers send ages, not stamps (monotonic clocks are per process): the stamp stored here is
``now - age`` on this process's clock. A negative age (it cannot happen between honest
peers) is read as 0 so that no entry is dated in the future and outlives its TTL. Writes for
endpoints that are not in this replica's pool are ignored: the two pools may briefly differ
while discovery converges, and an unknown endpoint would only hold index memory.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from epp.framework.endpoint import EndpointId
from epp.prefix.index import PrefixIndex


class RemoteWrite(Protocol):
    """One record as received (the generated ``epp.sync.v1.Record`` has this shape)."""

    @property
    def endpoint_id(self) -> str: ...
    @property
    def hashes(self) -> Sequence[int]: ...
    @property
    def age_s(self) -> float: ...


@dataclass(slots=True, frozen=True)
class ApplyResult:
    applied: int
    ignored: int
    """Writes for endpoints this replica does not know."""


def stamp_from_age(now_s: float, age_s: float) -> float:
    return now_s - max(0.0, age_s)


class SnapshotPart(Protocol):
    """One part of a peer's snapshot (the generated ``epp.sync.v1.SnapshotPart``)."""

    @property
    def endpoint_id(self) -> str: ...
    @property
    def writes(self) -> Sequence[RemoteWrite]: ...
    @property
    def roots(self) -> Sequence[int]: ...


class RemoteApplier:
    def __init__(
        self,
        store: Callable[[EndpointId, Sequence[int], float], None],
        known: Callable[[EndpointId], bool],
        clock: Callable[[], float],
        index: PrefixIndex | None = None,
    ) -> None:
        """``store`` is ``PrefixProducer.apply_remote`` (never republishes); ``known`` says
        whether an endpoint is in this replica's pool; ``index`` takes snapshots."""
        self._store = store
        self._known = known
        self._clock = clock
        self._index = index

    def restore(self, part: SnapshotPart) -> int:
        """Replay one snapshot part into the index; returns the entries written (0 for an
        endpoint this replica does not know)."""
        index = self._index
        eid = EndpointId(part.endpoint_id)
        if index is None or not self._known(eid):
            return 0
        now = self._clock()
        written = 0
        for w in part.writes:
            hashes = list(w.hashes)
            index.record(eid, hashes, stamp_from_age(now, w.age_s), chain_root=False)
            written += len(hashes)
        index.add_roots(eid, part.roots)
        return written

    def apply(self, writes: Iterable[RemoteWrite]) -> ApplyResult:
        now = self._clock()  # one clock read per batch
        applied = ignored = 0
        store, known = self._store, self._known
        for w in writes:
            eid = EndpointId(w.endpoint_id)
            if not known(eid):
                ignored += 1
                continue
            hashes = list(w.hashes)
            if hashes:
                store(eid, hashes, stamp_from_age(now, w.age_s))
                applied += 1
        return ApplyResult(applied, ignored)
