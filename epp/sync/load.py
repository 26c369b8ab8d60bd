"""The prefill other epp replicas have in flight, per endpoint.

Each replica counts the prefill it sent to an endpoint and has not seen answered (the
Director's prefill ledger, ``epp.datastore.prefill``, which the predicted-TTFT and token-load
scorers and the load-aware P/D decider read); between two scrapes of the endpoint's metrics
that is all it knows of the endpoint's queue. With R replicas it sees 1/R of it, and the
replicas pile onto the same endpoint. Over index sync each replica also sends its own
figures, whole, every flush they changed and at least once a second (``RecordBatch.prefill``);
this table keeps the last set from each peer, and the ledger adds their sum to its own.

A set replaces the peer's previous one, so a lost message costs one flush of accuracy, not a
drift. A peer that stops sending is dropped after ``stale_s`` (its stream's keepalive ends
the stream within ~15 s; the staleness bound is tighter), and at once when its stream ends.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Protocol, runtime_checkable

from epp.framework.endpoint import EndpointId

_MAX_TOKENS = 1e9
"""A figure above this (a peer's bug, or hostile input) is read as this."""


@runtime_checkable
class SharedPrefill(Protocol):
    """What prefill sharing reads and feeds: the prefill ledger (``Datastore.prefill``)."""

    def prefill_in_flight(self) -> Mapping[str, float]:
        """This replica's prefill in flight per endpoint (uncached prompt tokens)."""
        ...

    def use_peer_prefill(self, tokens: Callable[[EndpointId], float]) -> None:
        """Add ``tokens(endpoint)``, the other replicas' figure, to this replica's own."""
        ...


class PeerPrefill:
    def __init__(self, stale_s: float = 3.0, max_peers: int = 64, max_endpoints: int = 10_000) -> None:
        self.stale_s = stale_s
        self.max_peers = max_peers
        self.max_endpoints = max_endpoints
        self._sets: dict[str, tuple[float, dict[EndpointId, float]]] = {}
        """Per peer: when its last set came (this process's clock) and the set."""
        self._total: dict[EndpointId, float] = {}

    def tokens(self, endpoint_id: EndpointId) -> float:
        """The peers' prefill in flight on the endpoint (the request path: one lookup)."""
        return self._total.get(endpoint_id, 0.0)

    @property
    def peers(self) -> int:
        return len(self._sets)

    def total(self) -> float:
        """Every peer's prefill in flight, over all endpoints (the exported gauge)."""
        return sum(self._total.values())

    def update(self, peer: str, loads: Iterable[tuple[str, float]], now_s: float) -> None:
        """``peer``'s whole set, replacing its previous one; non-finite or negative figures
        are skipped, endpoints past ``max_endpoints`` ignored."""
        fresh: dict[EndpointId, float] = {}
        for eid, tokens in loads:
            if len(fresh) >= self.max_endpoints:
                break
            if math.isfinite(tokens) and tokens > 0:
                fresh[EndpointId(eid)] = fresh.get(EndpointId(eid), 0.0) + min(tokens, _MAX_TOKENS)
        if peer not in self._sets and len(self._sets) >= self.max_peers:
            return
        self._remove(peer)
        self._sets[peer] = (now_s, fresh)
        total = self._total
        for eid, tokens in fresh.items():
            total[eid] = total.get(eid, 0.0) + tokens
        self.expire(now_s)

    def forget(self, peer: str) -> None:
        """The peer's stream ended: its prefill no longer counts."""
        self._remove(peer)

    def expire(self, now_s: float) -> None:
        """Drop the sets of peers that have sent none for ``stale_s``."""
        limit = now_s - self.stale_s
        for peer in [p for p, (at, _) in self._sets.items() if at < limit]:
            self._remove(peer)

    def _remove(self, peer: str) -> None:
        old = self._sets.pop(peer, None)
        if old is None:
            return
        total = self._total
        for eid, tokens in old[1].items():
            left = total.get(eid, 0.0) - tokens
            if left > 1e-6:
                total[eid] = left
            else:
                total.pop(eid, None)
