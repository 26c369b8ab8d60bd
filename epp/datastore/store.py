"""The datastore: the pool's endpoints and their latest metrics.

Sources (a static list, Kubernetes discovery) call ``upsert``/``remove``/``replace_all``; the
metrics scraper calls ``update_metrics``; the request path calls ``snapshot`` and the
in-flight counters. Listeners hear about endpoints leaving (the prefix index drops them) and
about cache configs (the index sizes the endpoint's LRU).

**Identity.** Endpoints are keyed by ``ip:port``, but the server behind an address can
change: a new pod at a reused IP (its UID, ``Endpoint.instance``, differs: a re-list after a
dropped watch shows no removal), a restarted server (a new process start time, or lifetime
counters that went backwards, on its next scrape), a server now serving another model. Then
everything epp believed about the old one is dropped: the removal listeners forget it (the
prefix index in either mode, the plugins' per-endpoint state), its metrics and in-flight
counts start afresh (requests still in flight to the old server are not counted against the
new one: ``request_started`` returns a generation ``request_finished`` checks), and the
reset listeners hear the reason (counted, logged).

**Not serving.** A server that reports it cannot serve now (``Metrics.not_serving``: vLLM's
sleep mode) leaves the candidates (``routable``) until it reports it can again; entering
that state forgets its cache (the removal listeners), which it lost.

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
from epp.datastore.prefill import PrefillLedger
from epp.framework.endpoint import Endpoint, EndpointId, Metrics, identity_change

MAX_GENERATIONS = 65_536
"""Addresses that left the pool whose last generation is remembered."""

RemovalListener = Callable[[EndpointId], None]
MetricsListener = Callable[[Endpoint], None]
ResetListener = Callable[[EndpointId, str], None]
"""``(endpoint, reason)``: ``replaced``, ``restarted``, ``model_changed``."""
ServingListener = Callable[[EndpointId, str], None]
"""``(endpoint, reason)``: it stopped serving (``asleep``), or '' when it serves again."""


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
    generation: int = 0
    """Bumped when another server takes the address: in-flight requests of an older
    generation are not released against this one."""


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
    _model_sets: frozenset[frozenset[str]] | None = None
    """The distinct base-model sets the snapshot's endpoints report (valid while it is)."""
    _removal_listeners: list[RemovalListener] = field(default_factory=list)
    _metrics_listeners: list[MetricsListener] = field(default_factory=list)
    _reset_listeners: list[ResetListener] = field(default_factory=list)
    _serving_listeners: list[ServingListener] = field(default_factory=list)
    _generations: dict[EndpointId, int] = field(default_factory=dict)
    """The last generation of addresses that left the pool (bounded by ``MAX_GENERATIONS``):
    one that comes back gets a newer one, so requests to its old server stay unmatched."""
    synced: bool = False
    """True once a source has delivered its first full list (health reports SERVING then)."""
    prefill: PrefillLedger = field(default_factory=PrefillLedger)
    """Prompt characters in flight to prefill per endpoint (the Director keeps it)."""
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

    def on_reset(self, listener: ResetListener) -> None:
        """Hear of a new server behind a known address (after the removal listeners forgot
        the old one)."""
        self._reset_listeners.append(listener)

    def on_serving(self, listener: ServingListener) -> None:
        """Hear of an endpoint that stops serving (with the reason) or serves again ('')."""
        self._serving_listeners.append(listener)

    # --- sources -------------------------------------------------------------------------

    def upsert(self, endpoint: Endpoint) -> None:
        """Add an endpoint or update its address data and labels, keeping its metrics; one
        whose ``instance`` differs from the known one's is another server (``_reset``)."""
        entry = self._entries.get(endpoint.id)
        if entry is None:
            generation = self._generations.pop(endpoint.id, -1) + 1
            entry = self._entries[endpoint.id] = _Entry(endpoint, generation=generation)
        elif endpoint.instance and entry.endpoint.instance and (
            endpoint.instance != entry.endpoint.instance
        ):
            entry = self._reset(entry, endpoint, "replaced")
        else:
            entry.endpoint = dataclasses.replace(
                endpoint, metrics=entry.endpoint.metrics, stale=entry.endpoint.stale,
                instance=endpoint.instance or entry.endpoint.instance,
            )
        self._index.put(entry.endpoint)
        self._snapshot = None

    def remove(self, endpoint_id: EndpointId) -> None:
        entry = self._entries.pop(endpoint_id, None)
        if entry is None:
            return
        self._generations[endpoint_id] = entry.generation
        if len(self._generations) > MAX_GENERATIONS:
            del self._generations[next(iter(self._generations))]
        self._index.remove(endpoint_id)
        self._snapshot = None
        self.prefill.forget(endpoint_id)
        for listener in self._removal_listeners:
            listener(endpoint_id)

    def _reset(self, entry: _Entry, endpoint: Endpoint, reason: str) -> _Entry:
        """Another server behind ``entry``'s address: forget the old one (removal
        listeners), start a fresh entry (no metrics, nothing in flight), tell the reset
        listeners."""
        eid = endpoint.id
        for listener in self._removal_listeners:
            listener(eid)
        fresh = _Entry(dataclasses.replace(endpoint, metrics=Metrics(), stale=False, pending=0),
                       generation=entry.generation + 1)  # fmt: skip
        self._entries[eid] = fresh
        self._snapshot = None
        for reset in self._reset_listeners:
            reset(eid, reason)
        return fresh

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
        old = entry.endpoint.metrics
        changed = identity_change(old, metrics)
        if changed:
            entry = self._reset(entry, entry.endpoint, changed)
        elif metrics.not_serving and not old.not_serving:
            for forget in self._removal_listeners:  # the cache it held is gone
                forget(endpoint_id)
        entry.started = entry.sent = 0
        entry.endpoint = dataclasses.replace(entry.endpoint, metrics=metrics, stale=False, pending=0)
        self._index.put(entry.endpoint)
        self._snapshot = None
        if metrics.not_serving != old.not_serving and (metrics.not_serving or old.known):
            for serving in self._serving_listeners:
                serving(endpoint_id, metrics.not_serving)
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
            self._model_sets = None
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
        """The endpoints a request may go to: of those that can serve (``serving``), the
        ones with fresh metrics, or all of them when none has (a replica whose ``/metrics``
        stopped answering has most likely stopped serving too; with every scrape failing,
        the pool is still tried rather than refused). The director also tries the stale
        ones when the filters leave none of these (one role's only endpoint stale, say).
        Empty: no endpoint is ready (flow control then holds requests: scale from zero).
        While some are fresh, a ``Pool`` (an ``IndexedPool``: the endpoints with the index
        that orders them by load, for the scheduler's shortlist), else a tuple."""
        snap = self.snapshot()  # a rebuilt snapshot drops the cached routable pool
        routable = self._routable
        if routable is None:
            serving = self.serving()
            fresh = tuple(e for e in serving if not e.stale)
            if not fresh:
                routable = serving
            elif len(fresh) == len(snap):  # the snapshot itself: a per-request patch keeps it
                routable = IndexedPool(snap, self._index)
            else:
                routable = IndexedPool(fresh, self._index)
                self._routable_positions = {e.id: i for i, e in enumerate(fresh)}
            self._routable = routable
        return routable

    def serving_model(self, model: str, endpoints: Sequence[Endpoint]) -> Sequence[Endpoint]:
        """Of ``endpoints``, the ones that can serve ``model``: those that report it (their
        base model, or a LoRA adapter they have loaded: ``Metrics.serves``), those with the
        base model of one that reports it (an adapter loads on demand there), and those whose
        models are not known yet (never scraped). ``endpoints`` itself when no endpoint
        reports ``model`` (nothing to go by: the server answers) and in a pool whose
        endpoints all report the same base models (the common case, at no cost). Keeps a
        server restarted at the same address to serve another model from getting the old
        model's requests while others still serve it."""
        snap = self.snapshot()
        sets = self._model_sets
        if sets is None:
            sets = self._model_sets = frozenset(
                e.metrics.served_models for e in snap if e.metrics.served_models
            )
        if len(sets) < 2 or not model:
            return endpoints
        bases: set[str] = set()
        for e in endpoints:
            if e.metrics.serves(model):
                bases |= e.metrics.served_models
        if not bases:
            return endpoints
        return tuple(e for e in endpoints if not e.metrics.served_models
                     or not bases.isdisjoint(e.metrics.served_models) or e.metrics.serves(model))  # fmt: skip

    def serving(self) -> tuple[Endpoint, ...]:
        """The endpoints that do not report they cannot serve now (asleep)."""
        snap = self.snapshot()
        if not any(e.metrics.not_serving for e in snap):
            return snap
        return tuple(e for e in snap if not e.metrics.not_serving)

    def get(self, endpoint_id: EndpointId) -> Endpoint | None:
        entry = self._entries.get(endpoint_id)
        return None if entry is None else entry.endpoint

    def __len__(self) -> int:
        return len(self._entries)

    def request_started(self, endpoint_id: EndpointId) -> int:
        """Count a request in flight; returns the endpoint's generation, for
        ``request_finished`` (-1: unknown endpoint)."""
        entry = self._entries.get(endpoint_id)
        if entry is None:
            return -1
        entry.in_flight += 1
        entry.started += 1
        self._update_pending(entry)
        return entry.generation

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

    def request_finished(self, endpoint_id: EndpointId, generation: int | None = None) -> None:
        """A request ``request_started`` counted ended; ``generation``: what that returned
        (a request to a server that has since been replaced is not released against the new
        one)."""
        entry = self._entries.get(endpoint_id)
        if entry is None or entry.in_flight == 0:
            return
        if generation is not None and generation != entry.generation:
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
                    e.rank, e.instance)
