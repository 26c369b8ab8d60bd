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

from epp.datastore.endpoint import EndpointId


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


class RemoteApplier:
    def __init__(
        self,
        store: Callable[[EndpointId, Sequence[int], float], None],
        known: Callable[[EndpointId], bool],
        clock: Callable[[], float],
    ) -> None:
        """``store`` is ``PrefixProducer.apply_remote`` (never republishes); ``known`` says
        whether an endpoint is in this replica's pool."""
        self._store = store
        self._known = known
        self._clock = clock

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
