"""Flow control: while the pool is saturated, requests wait in epp, in priority bands, shared
fairly between flows, instead of piling into the model servers' own queues.

Pure and synchronous (the clock is passed in): ``epp serve`` drives it from an asyncio
dispatcher (``epp.requestcontrol.admission``), the replay from its simulated clock.

* A request belongs to a **flow** (its fairness id: a header, else the model) and a **band**
  (its priority; higher bands are served first).
* :meth:`FlowController.offer`: with nothing queued and room in the pool the request goes
  at once; otherwise it is queued, unless the queue is full (count or bytes, total or of its
  band): then, with displacement on, the newest request of the lowest band below it makes
  room (and is rejected), else the offer is rejected.
* :meth:`FlowController.dispatch`: while the saturation detector says the pool has room,
  the next request leaves: the highest non-empty band; inside it the flows take turns
  (round-robin), or the oldest head of any flow goes first (``global-strict``); inside a
  flow, first come first served or earliest deadline first.
* :meth:`FlowController.expire`: requests past their deadline leave with an error; the
  deadline is the request's queue-time limit after it was queued (its objective's, else its
  band's, else ``maxQueueSeconds``; shortened by its own deadline header); :meth:`cancel`
  removes one whose client left; :meth:`drain` empties the queue at shutdown.
* **Scale from zero**: while the pool has no ready endpoint (scaled to zero, every server
  starting or asleep), requests wait for the first one, bounded by ``scaleFromZeroSeconds``
  (the longer of it and their own limit), ``scaleFromZeroMaxRequests`` and
  ``scaleFromZeroMaxBytes``; nothing is dispatched until an endpoint is ready. A request
  that overflows those bounds is rejected ``no-endpoints``.

The detector sees how many requests were released and are not routed yet (``reserved``),
so one dispatch cycle cannot release more than the pool can take.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from epp.errors import ConfigError
from epp.framework.request import InferenceRequest

DEFAULT_FAIRNESS_HEADER = "x-llm-d-inference-fairness-id"
FAIRNESS_HEADER_ALIAS = "x-gateway-inference-fairness-id"
"""Read when the default header is absent (the Inference Extension's name for it)."""


@dataclass(slots=True, frozen=True)
class FlowControlConfig:
    """The ``flowControl:`` config section (docs/flow-control.md)."""

    enabled: bool = False
    """Queue requests in epp while the pool is saturated, instead of sending them on."""
    fairness_header: str = DEFAULT_FAIRNESS_HEADER
    """The header naming a request's flow (tenant); without it the flow is the model."""
    saturation: Literal["thresholds", "concurrency"] = "thresholds"
    """``thresholds``: the ``saturation`` section's queue/KV thresholds on every endpoint
    (queue = waiting + sent since the last scrape, in flight); ``concurrency``: every
    endpoint has ``maxConcurrency`` requests in flight from epp."""
    max_concurrency: int = 8
    """``concurrency`` saturation: requests in flight from epp per endpoint."""
    fairness: Literal["round-robin", "global-strict"] = "round-robin"
    """Between flows of a band: take turns, or the oldest request of any flow first."""
    ordering: Literal["fcfs", "edf"] = "fcfs"
    """Inside a flow: arrival order, or earliest deadline (the deadline is the queue-time
    limit, shortened by a request's own ``x-gateway-request-deadline-ms`` header)."""
    max_queue_seconds: float = 30.0
    """A request queued this long leaves with 429 ``queue-timeout`` (503 when no endpoint is
    ready then). Bands and objectives may set their own (below)."""
    band_max_queue_seconds: Mapping[int, float] = field(default_factory=dict)
    """Priority -> queue-time limit of that band (e.g. ``{100: 120, -10: 5}``: critical
    traffic waits longer than sheddable); a band not listed uses ``maxQueueSeconds``."""
    objective_max_queue_seconds: Mapping[str, float] = field(default_factory=dict)
    """InferenceObjective name -> queue-time limit of its requests; wins over the band's."""
    scale_from_zero_seconds: float | None = None
    """While no endpoint is ready (pool scaled to zero, all starting or asleep), requests
    wait this long for the first one (the longer of it and their own limit); unset: the
    same as ``maxQueueSeconds``; 0: answer 503 at once."""
    scale_from_zero_max_requests: int = 1000
    """Requests that may wait at once while no endpoint is ready (more: 503)."""
    scale_from_zero_max_bytes: int = 64 << 20
    """Request-body bytes that may wait at once while no endpoint is ready (more: 503)."""
    max_requests: int = 10_000
    """Requests queued at once, all bands."""
    max_bytes: int = 512 << 20
    """Request-body bytes queued at once, all bands."""
    band_max_requests: int = 0
    """Per priority band (0: ``maxRequests``)."""
    band_max_bytes: int = 0
    """Per priority band (0: ``maxBytes``)."""
    displacement: bool = True
    """A full queue makes room for a higher band by rejecting the lowest band's newest."""
    dispatch_interval_seconds: float = 0.02
    """How often the dispatcher looks again without an event (expiry, stale metrics)."""

    def __post_init__(self) -> None:
        for name, table in (("bandMaxQueueSeconds", self.band_max_queue_seconds),
                            ("objectiveMaxQueueSeconds", self.objective_max_queue_seconds)):  # fmt: skip
            for key, seconds in table.items():
                if not seconds > 0 or seconds == float("inf"):
                    raise ConfigError(f"flowControl.{name}.{key}",
                                      f"must be a number of seconds > 0, got {seconds!r}")

    @property
    def cold_seconds(self) -> float:
        """The scale-from-zero wait (``scaleFromZeroSeconds``, unset: ``maxQueueSeconds``)."""
        if self.scale_from_zero_seconds is None:
            return self.max_queue_seconds
        return self.scale_from_zero_seconds

    def queue_seconds(self, request: InferenceRequest) -> float:
        """The request's queue-time limit: its objective's, else its band's, else
        ``maxQueueSeconds``."""
        if request.objective:
            limit = self.objective_max_queue_seconds.get(request.objective)
            if limit is not None:
                return limit
        return self.band_max_queue_seconds.get(request.priority, self.max_queue_seconds)

    def longest_hold_seconds(self) -> float:
        """The longest a request may wait in the queue (for Envoy's timeouts)."""
        return max(self.max_queue_seconds, self.cold_seconds,
                   *self.band_max_queue_seconds.values(),
                   *self.objective_max_queue_seconds.values())  # fmt: skip


@dataclass(slots=True, eq=False)
class QueuedRequest:
    request: InferenceRequest
    flow: str
    band: int
    size_bytes: int
    enqueued_s: float
    deadline_s: float
    seq: int
    ticket: Any = None
    """The waiter's handle (a future in ``epp serve``, the arrival in the replay)."""
    outcome: str = ""
    """``dispatched`` or the reason it left: ``expired``, ``displaced``, ``cancelled``,
    ``shutdown``."""
    limit_s: float = 0.0
    """The queue-time limit it was given (its deadline is at most this after queueing)."""
    queued: bool = True


@dataclass(slots=True, frozen=True)
class Offer:
    """The answer to :meth:`FlowController.offer`."""

    go: bool
    """Route it now."""
    item: QueuedRequest | None = None
    """Queued: wait for it to be dispatched (or to leave with ``outcome``)."""
    rejected: str = ""
    """Not queued: ``queue-full``, ``band-full``, or ``no-endpoints`` (no endpoint is ready
    and scale from zero is off or its wait is full)."""
    displaced: tuple[QueuedRequest, ...] = ()
    """Lower-band requests rejected to make room."""


class _Flow:
    """One flow's queued requests: by arrival (``items``, oldest first: FCFS order, the
    newest last) and, with ``edf``, also in a deadline heap. A request that leaves is
    removed from ``items`` at once; the heap drops it lazily and is compacted once more than
    half of it is gone, so a flow holds at most ~2x its queued requests."""

    __slots__ = ("edf", "heap", "items")

    def __init__(self, ordering: str) -> None:
        self.edf = ordering == "edf"
        self.items: OrderedDict[int, QueuedRequest] = OrderedDict()
        self.heap: list[tuple[float, int, QueuedRequest]] = []

    def __len__(self) -> int:
        return len(self.items)

    def push(self, item: QueuedRequest) -> None:
        self.items[item.seq] = item
        if self.edf:
            heapq.heappush(self.heap, (item.deadline_s, item.seq, item))

    def remove(self, item: QueuedRequest) -> None:
        del self.items[item.seq]
        if self.edf and len(self.heap) > 2 * len(self.items) + 16:
            self.heap = [e for e in self.heap if e[2].queued]
            heapq.heapify(self.heap)

    def head(self) -> QueuedRequest | None:
        if not self.items:
            return None
        if not self.edf:
            return next(iter(self.items.values()))
        heap = self.heap
        while not heap[0][2].queued:
            heapq.heappop(heap)
        return heap[0][2]

    def newest(self) -> QueuedRequest | None:
        return next(reversed(self.items.values()), None)

    def all(self) -> Iterator[QueuedRequest]:
        yield from self.items.values()


@dataclass(slots=True)
class _Band:
    flows: OrderedDict[str, _Flow] = field(default_factory=OrderedDict)
    """Non-empty flows; the first is next in round-robin turn."""
    count: int = 0
    bytes: int = 0
    by_size: dict[int, dict[str, None]] = field(default_factory=dict)
    """Flow names by how many requests each has queued: the displacement victim comes from
    the largest flow without a scan of the queue."""
    largest: int = 0

    def resized(self, name: str, old: int, new: int) -> None:
        """Flow ``name`` went from ``old`` to ``new`` requests queued (0: none)."""
        if old:
            bucket = self.by_size[old]
            del bucket[name]
            if not bucket:
                del self.by_size[old]
        if new:
            self.by_size.setdefault(new, {})[name] = None
            self.largest = max(self.largest, new)
        while self.largest and self.largest not in self.by_size:
            self.largest -= 1  # a size changes by one at a time: one step, amortised

    def biggest_flow(self) -> _Flow | None:
        bucket = self.by_size.get(self.largest)
        return self.flows[next(iter(bucket))] if bucket else None


@dataclass(slots=True)
class FlowStats:
    """Totals since start, by outcome (read by metrics and tests)."""

    queued: int = 0
    dispatched: int = 0
    immediate: int = 0
    rejected: dict[str, int] = field(default_factory=dict)

    def reject(self, reason: str) -> None:
        self.rejected[reason] = self.rejected.get(reason, 0) + 1


Saturated = Callable[[int], bool]
"""The detector: is the pool full, given ``reserved`` requests released but not routed?"""


def _never() -> bool:
    return False


class FlowController:
    def __init__(
        self, cfg: FlowControlConfig, saturated: Saturated,
        no_endpoint: Callable[[], bool] = _never,
    ) -> None:  # fmt: skip
        self.cfg = cfg
        self.saturated = saturated
        self.no_endpoint = no_endpoint
        """Is no endpoint ready now? (scale from zero: requests wait, nothing dispatches)"""
        self.bands: dict[int, _Band] = {}
        self.count = 0
        self.bytes = 0
        self.reserved = 0
        self.stats = FlowStats()
        self._seq = itertools.count()
        self._band_max_requests = cfg.band_max_requests or cfg.max_requests
        self._band_max_bytes = cfg.band_max_bytes or cfg.max_bytes
        self._deadlines: list[tuple[float, int, QueuedRequest]] = []
        """Every queued request by deadline (those that left are skipped when popped, and
        dropped once they are half of it: the queue's memory follows what it holds)."""

    # --- entry ------------------------------------------------------------------------

    def offer(
        self, request: InferenceRequest, flow: str, size_bytes: int, now_s: float,
        deadline_s: float | None = None,
    ) -> Offer:  # fmt: skip
        cold = self.no_endpoint()
        if cold:
            cfg = self.cfg
            if cfg.cold_seconds <= 0 or self.count + 1 > cfg.scale_from_zero_max_requests or (
                self.bytes + size_bytes > cfg.scale_from_zero_max_bytes
            ):
                self.stats.reject("no-endpoints")
                return Offer(go=False, rejected="no-endpoints")
        elif self.count == 0 and not self.saturated(self.reserved):
            self.stats.immediate += 1
            return Offer(go=True)
        band_id = request.priority
        band = self.bands.get(band_id)
        displaced: list[QueuedRequest] = []
        while not self._fits(band, size_bytes):
            victim = self._victim(band_id) if self.cfg.displacement else None
            if victim is None:
                reason = "queue-full" if self._total_full(size_bytes) else "band-full"
                self.stats.reject(reason)
                return Offer(go=False, rejected=reason, displaced=tuple(displaced))
            self._leave(victim, "displaced")
            displaced.append(victim)
            band = self.bands.get(band_id)
        limit_s = self.cfg.queue_seconds(request)
        if cold:  # waiting for the first ready endpoint: the longer of the two budgets
            limit_s = max(limit_s, self.cfg.cold_seconds)
        limit = now_s + limit_s
        item = QueuedRequest(request, flow, band_id, size_bytes, now_s,
                             min(limit, deadline_s) if deadline_s else limit, next(self._seq),
                             limit_s=limit_s)  # fmt: skip
        if band is None:
            band = self.bands[band_id] = _Band()
            self.bands = dict(sorted(self.bands.items(), key=lambda kv: -kv[0]))
        f = band.flows.get(flow)
        if f is None:
            f = band.flows[flow] = _Flow(self.cfg.ordering)
        f.push(item)
        band.resized(flow, len(f) - 1, len(f))
        heapq.heappush(self._deadlines, (item.deadline_s, item.seq, item))
        band.count += 1
        band.bytes += size_bytes
        self.count += 1
        self.bytes += size_bytes
        self.stats.queued += 1
        return Offer(go=False, item=item, displaced=tuple(displaced))

    def _total_full(self, size: int) -> bool:
        cfg = self.cfg
        return self.count + 1 > cfg.max_requests or self.bytes + size > cfg.max_bytes

    def _fits(self, band: _Band | None, size: int) -> bool:
        if self._total_full(size):
            return False
        if band is None:
            return True
        return band.count + 1 <= self._band_max_requests and band.bytes + size <= self._band_max_bytes

    def _victim(self, band_id: int) -> QueuedRequest | None:
        """The newest request of the largest flow of the lowest band below ``band_id``; when
        the band itself is full, nothing below it can help (bands have their own limits).
        O(1): no scan of the queue, however full (bands are few and kept sorted)."""
        band = self.bands.get(band_id)
        if band is not None and (band.count + 1 > self._band_max_requests):
            return None
        lowest = next(reversed(self.bands), None)  # empty bands are dropped: it has requests
        if lowest is None or lowest >= band_id:
            return None
        biggest = self.bands[lowest].biggest_flow()
        return biggest.newest() if biggest is not None else None

    # --- leaving ----------------------------------------------------------------------

    def _leave(self, item: QueuedRequest, outcome: str) -> None:
        if not item.queued:
            return
        item.queued = False
        item.outcome = outcome
        band = self.bands[item.band]
        band.count -= 1
        band.bytes -= item.size_bytes
        self.count -= 1
        self.bytes -= item.size_bytes
        if outcome == "dispatched":
            self.stats.dispatched += 1
            self.reserved += 1
        else:
            self.stats.reject(outcome)
        f = band.flows.get(item.flow)
        if f is not None and item.seq in f.items:
            f.remove(item)
            band.resized(item.flow, len(f) + 1, len(f))
            if not f.items:
                del band.flows[item.flow]
        if band.count == 0:
            del self.bands[item.band]
        heap = self._deadlines
        if len(heap) > 2 * self.count + 64:  # what left is skipped when popped; past half, drop it
            self._deadlines = [e for e in heap if e[2].queued]
            heapq.heapify(self._deadlines)

    def routed(self) -> None:
        """A dispatched request was routed (or gave up): it no longer counts as reserved."""
        if self.reserved:
            self.reserved -= 1

    def cancel(self, item: QueuedRequest) -> bool:
        """The client left: the request leaves the queue at once (False: it had left)."""
        if not item.queued:
            return False
        self._leave(item, "cancelled")
        return True

    def dispatch(self, now_s: float) -> list[QueuedRequest]:
        """Release requests while the pool has room, in band / fairness / ordering order."""
        out: list[QueuedRequest] = []
        if self.count and self.no_endpoint():
            return out  # waiting for the first ready endpoint
        while self.count and not self.saturated(self.reserved):
            item = self._next()
            if item is None:
                break
            self._leave(item, "dispatched")
            out.append(item)
        return out

    def _next(self) -> QueuedRequest | None:
        for band in self.bands.values():
            if not band.count:
                continue
            if self.cfg.fairness == "global-strict":
                best: tuple[float, int, str] | None = None
                for name, f in band.flows.items():
                    head = f.head()
                    if head is not None:
                        key = (head.deadline_s if self.cfg.ordering == "edf" else head.enqueued_s,
                               head.seq, name)  # fmt: skip
                        if best is None or key < best:
                            best = key
                if best is not None:
                    return band.flows[best[2]].head()
                continue
            flows = band.flows
            if flows:  # only flows with requests queued are kept: the first one has a head
                name = next(iter(flows))
                flows.move_to_end(name)  # the next turn goes to the next flow
                return flows[name].head()
        return None

    def expire(self, now_s: float) -> list[QueuedRequest]:
        """Requests past their deadline, removed (outcome ``expired``); O(expired + left)."""
        heap = self._deadlines
        out: list[QueuedRequest] = []
        while heap and (heap[0][0] <= now_s or not heap[0][2].queued):
            item = heapq.heappop(heap)[2]
            if item.queued:
                self._leave(item, "expired")
                out.append(item)
        return out

    def drain(self) -> list[QueuedRequest]:
        """Everything still queued, removed (outcome ``shutdown``)."""
        out = [i for band in self.bands.values() for f in band.flows.values() for i in f.all()
               if i.queued]  # fmt: skip
        for item in out:
            self._leave(item, "shutdown")
        self._deadlines.clear()
        return out

    def queued_by(self) -> dict[tuple[str, int, str, str], tuple[int, int]]:
        """(flow, band, client model, target model) -> (requests, bytes) queued now."""
        out: dict[tuple[str, int, str, str], tuple[int, int]] = {}
        for bid, band in self.bands.items():
            for name, f in band.flows.items():
                for i in f.all():
                    if i.queued:
                        r = i.request
                        key = (name, bid, r.original_model or r.model, r.model)
                        n, size = out.get(key, (0, 0))
                        out[key] = (n + 1, size + i.size_bytes)
        return out
