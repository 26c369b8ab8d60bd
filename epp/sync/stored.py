"""What index sync shares of the objects model servers store (stored Responses-API
responses): which endpoint holds each id.

The plugin that keeps them (``response-affinity-filter``) implements ``SharedStored``; the
sync node finds it among the plugins by this protocol, not by name. Each replica sends the
ids it learnt from its own responses (``RecordBatch.stored``, the same stream and flush as
the index writes) and a starting replica fetches a peer's whole table with its snapshot
(``SnapshotPart.stored``). Received ids are never republished, as index writes. Unlike index
writes, an id for an endpoint this replica does not know is kept: pools converge, and the
filter checks the home against the candidates at every request anyway.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

from epp.framework.endpoint import EndpointId

StoredSink = Callable[[str, EndpointId, float], None]
"""Told of each stored object this replica learnt itself: id, endpoint, last use (stamp)."""


@runtime_checkable
class SharedStored(Protocol):
    name: str

    def subscribe_stored(self, sink: StoredSink) -> Callable[[], None]:
        """Hear of every id this replica learns from its own responses; returns the
        unsubscribe."""
        ...

    def apply_remote_stored(self, object_id: str, endpoint_id: EndpointId, stamp_s: float) -> None:
        """Store a peer's id (never republished)."""
        ...

    def export_stored(self) -> list[tuple[str, EndpointId, float]]:
        """Every id held, least recently used first: (id, endpoint, last use)."""
        ...
