"""The datastore: the pool's endpoints and their latest metrics.

Sources (a static list, Kubernetes discovery) call ``upsert``/``remove``/``replace_all``; the
metrics scraper calls ``update_metrics``; the request path calls ``snapshot`` and the
in-flight counters. Listeners hear about endpoints leaving (the prefix index drops them) and
about cache configs (the index sizes the endpoint's LRU).

Single-threaded by design: everything runs on the serving event loop. ``snapshot`` returns a
cached tuple that is rebuilt only after a change, so a scheduling decision costs no copying.
``routable`` returns the endpoints a request may go to as a ``Pool`` whose index
(``epp.datastore.poolindex``) every change updates in place: the look-ups a large pool's
shortlist needs cost the same at any pool size.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from epp.datastore.poolindex import IndexedPool, PoolIndex
from epp.framework.endpoint import Endpoint, EndpointId, Metrics

RemovalListener = Callable[[EndpointId], None]
MetricsListener = Callable[[Endpoint], None]


@dataclass(slots=True)
class _Entry:
    endpoint: Endpoint
    in_flight: int = 0
    started: int = 0
    """Requests started here since the last scrape and still in flight (at most
    ``in_flight``: one that finished is no longer waiting, whenever it started)."""
    sent: int = 0
    """Work sent here since the last scrape whose end epp does not see (``request_sent``)."""
    first_seen_s: float | None = None
    """When ``mark_stale`` first saw the endpoint: a new endpoint gets ``stale_after_s`` for
    its first good scrape before it is reported stale."""
    answered: int = 0
    """Responses the endpoint has begun to answer (``request_answered``)."""
    answered_seen: int = 0
    """``answered`` at the last ``mark_stale``."""
    alive_s: float = -math.inf
    """The last ``mark_stale`` (its clock) that found new answers: the endpoint was serving."""


@dataclass(slots=True)
class Datastore:
    stale_after_s: float = 2.0
    _entries: dict[EndpointId, _Entry] = field(default_factory=dict)
    _snapshot: tuple[Endpoint, ...] | None = None
    _routable: Sequence[Endpoint] | None = None
    _index: PoolIndex = field(default_factory=PoolIndex)
    """The endpoints that are not stale, ordered by load (``routable`` hands it out)."""
    _positions: dict[EndpointId, int] = field(default_factory=dict)
    """Index of each endpoint in ``_snapshot`` (valid while it is)."""
    _routable_positions: dict[EndpointId, int] = field(default_factory=dict)
    """Index of each endpoint in ``_routable`` while that is the fresh part of the snapshot."""
    _removal_listeners: list[RemovalListener] = field(default_factory=list)
    _metrics_listeners: list[MetricsListener] = field(default_factory=list)
    synced: bool = False
    """True once a source has delivered its first full list (health reports SERVING then)."""
    _synced_listeners: list[Callable[[], None]] = field(default_factory=list)

    def on_synced(self, listener: Callable[[], None]) -> None:
        """Call ``listener`` once a source has delivered its first full list (at once if it
        has)."""
        if self.synced:
            listener()
        else:
            self._synced_listeners.append(listener)

    def on_removed(self, listener: RemovalListener) -> None:
        self._removal_listeners.append(listener)

    def on_metrics(self, listener: MetricsListener) -> None:
        self._metrics_listeners.append(listener)

    # --- sources -------------------------------------------------------------------------

    def upsert(self, endpoint: Endpoint) -> None:
        """Add an endpoint or update its address data and labels, keeping its metrics."""
        entry = self._entries.get(endpoint.id)
        if entry is None:
            entry = self._entries[endpoint.id] = _Entry(endpoint)
        else:
            entry.endpoint = dataclasses.replace(
                endpoint, metrics=entry.endpoint.metrics, stale=entry.endpoint.stale
            )
        self._index.put(entry.endpoint)
        self._snapshot = None

    def remove(self, endpoint_id: EndpointId) -> None:
        if self._entries.pop(endpoint_id, None) is None:
            return
        self._index.remove(endpoint_id)
        self._snapshot = None
        for listener in self._removal_listeners:
            listener(endpoint_id)

    def replace_all(self, endpoints: Iterable[Endpoint]) -> None:
        """Make the pool exactly ``endpoints`` (a full re-list from a source)."""
        wanted = {e.id: e for e in endpoints}
        for gone in [eid for eid in self._entries if eid not in wanted]:
            self.remove(gone)
        for endpoint in wanted.values():
            self.upsert(endpoint)
        if not self.synced:
            self.synced = True
            listeners, self._synced_listeners = self._synced_listeners, []
            for listener in listeners:
                listener()

    # --- metrics -------------------------------------------------------------------------

    def update_metrics(self, endpoint_id: EndpointId, metrics: Metrics) -> None:
        entry = self._entries.get(endpoint_id)
        if entry is None:  # vanished while its scrape was in flight
            return
        entry.started = entry.sent = 0
        entry.endpoint = dataclasses.replace(entry.endpoint, metrics=metrics, stale=False, pending=0)
        self._index.put(entry.endpoint)
        self._snapshot = None
        for listener in self._metrics_listeners:
            listener(entry.endpoint)

    def mark_stale(self, now_s: float, resumed_s: float = -math.inf) -> list[EndpointId]:
        """Flag endpoints whose last good scrape is older than ``stale_after_s`` and that
        have answered no request since either. An endpoint that answers requests is serving,
        whatever its ``/metrics`` does: a server busy on a loaded host can be slow to render
        its page (real vLLM on this project's 2 CPU cores missed the 1 s scrape timeout while
        streaming answers), and taking it out of routing moves its conversations away from
        their caches. ``resumed_s``: when epp's own event loop came back from a stall (the
        scrapes stalled with it): an endpoint still fresh then is judged from that moment, so
        a stall of epp is not taken for the servers going silent; one already stale stays so
        until a good scrape or an answer."""
        newly: list[EndpointId] = []
        for eid, entry in self._entries.items():
            m = entry.endpoint.metrics
            if entry.first_seen_s is None:
                entry.first_seen_s = now_s
            if entry.answered != entry.answered_seen:
                entry.answered_seen = entry.answered
                entry.alive_s = now_s
            last_good = max(m.scraped_at_s if m.known else entry.first_seen_s, entry.alive_s)
            if not entry.endpoint.stale:
                last_good = max(last_good, resumed_s)
            stale = now_s - last_good > self.stale_after_s
            if stale != entry.endpoint.stale:
                entry.endpoint = dataclasses.replace(entry.endpoint, stale=stale)
                self._index.put(entry.endpoint)
                self._snapshot = None
                if stale:
                    newly.append(eid)
        return newly

    # --- request path --------------------------------------------------------------------

    def snapshot(self) -> tuple[Endpoint, ...]:
        snap = self._snapshot
        if snap is None:
            snap = self._snapshot = tuple(e.endpoint for e in self._entries.values())
            self._positions = {e.id: i for i, e in enumerate(snap)}
            self._routable = None
        return snap

    def _replace_in_snapshot(self, endpoint: Endpoint) -> None:
        """Per-request load changes patch the cached snapshot instead of rebuilding it."""
        snap = self._snapshot
        if snap is None:
            return
        i = self._positions[endpoint.id]
        new = self._snapshot = (*snap[:i], endpoint, *snap[i + 1:])
        # routable() is the whole snapshot while no endpoint is stale, else its fresh part:
        # patch that too (a pool with a stale endpoint must not rebuild it per request)
        routable = self._routable
        if not isinstance(routable, IndexedPool):
            self._routable = None
        elif routable.endpoints is snap:
            self._routable = IndexedPool(new, self._index)
        else:
            j = self._routable_positions.get(endpoint.id)
            if j is not None:  # else the endpoint is stale: not routable, nothing to patch
                fresh = routable.endpoints
                self._routable = IndexedPool((*fresh[:j], endpoint, *fresh[j + 1:]), self._index)

    def routable(self) -> Sequence[Endpoint]:
        """The endpoints a request may go to: those with fresh metrics, or all of them when
        none has (a replica whose ``/metrics`` stopped answering has most likely stopped
        serving too; with every scrape failing, the pool is still tried rather than refused).
        The director also tries the stale ones when the filters leave none of these (one
        role's only endpoint stale, say). While some are fresh, a ``Pool`` (an
        ``IndexedPool``: the endpoints with the index that orders them by load, for the
        scheduler's shortlist), else the snapshot tuple."""
        snap = self.snapshot()
        routable = self._routable
        if routable is None:
            fresh = tuple(e for e in snap if not e.stale)
            if not fresh:
                routable = snap
            elif len(fresh) == len(snap):  # the snapshot itself: a per-request patch keeps it
                routable = IndexedPool(snap, self._index)
            else:
                routable = IndexedPool(fresh, self._index)
                self._routable_positions = {e.id: i for i, e in enumerate(fresh)}
            self._routable = routable
        return routable

    def get(self, endpoint_id: EndpointId) -> Endpoint | None:
        entry = self._entries.get(endpoint_id)
        return None if entry is None else entry.endpoint

    def __len__(self) -> int:
        return len(self._entries)

    def request_started(self, endpoint_id: EndpointId) -> None:
        entry = self._entries.get(endpoint_id)
        if entry is None:
            return
        entry.in_flight += 1
        entry.started += 1
        self._update_pending(entry)

    def _update_pending(self, entry: _Entry) -> None:
        pending = entry.started + entry.sent
        if pending != entry.endpoint.pending:
            entry.endpoint = _with_pending(entry.endpoint, pending)
            self._index.put(entry.endpoint)
            self._replace_in_snapshot(entry.endpoint)

    def request_sent(self, endpoint_id: EndpointId) -> None:
        """Work epp sent there whose end it will not see (a disaggregated prefill, which the
        decoder's sidecar runs): counted as sent since the last scrape, not as in flight."""
        entry = self._entries.get(endpoint_id)
        if entry is None or not entry.endpoint.metrics.known:
            return  # never scraped: no scrape would ever reset the count
        entry.sent += 1
        self._update_pending(entry)

    def request_answered(self, endpoint_id: EndpointId) -> None:
        """The endpoint began to answer a request (its first response bytes, or a response
        that was not a server error): it is serving (``mark_stale``)."""
        entry = self._entries.get(endpoint_id)
        if entry is not None:
            entry.answered += 1

    def request_finished(self, endpoint_id: EndpointId) -> None:
        entry = self._entries.get(endpoint_id)
        if entry is None or entry.in_flight == 0:
            return
        entry.in_flight -= 1
        if entry.started > entry.in_flight:
            # a request that finished waits no more: of those started since the last scrape,
            # no more than are in flight can still be queued (never scraped, --no-scrape:
            # pending is then the requests in flight)
            entry.started = entry.in_flight
            self._update_pending(entry)

    def in_flight(self) -> Mapping[EndpointId, int]:
        return {eid: e.in_flight for eid, e in self._entries.items()}

    def in_flight_view(self) -> Mapping[EndpointId, int]:
        """The in-flight counts as a live read-only mapping (no copy: the Director hands it
        to every scheduling cycle, ``CycleState.in_flight``)."""
        return _InFlightView(self._entries)


class _InFlightView(Mapping[EndpointId, int]):
    __slots__ = ("_entries",)

    def __init__(self, entries: dict[EndpointId, _Entry]) -> None:
        self._entries = entries

    def __getitem__(self, key: EndpointId) -> int:
        return self._entries[key].in_flight

    def __iter__(self) -> Iterator[EndpointId]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)


def _with_pending(e: Endpoint, pending: int) -> Endpoint:
    """``dataclasses.replace`` for the per-request field, 4x cheaper (request path)."""
    return Endpoint(e.id, e.address, e.port, e.labels, e.metrics, pending, e.metrics_port, e.stale,
                    e.rank)
