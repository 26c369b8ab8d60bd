"""Flow control on the event loop (``epp serve``): a queued request's ext_proc stream waits
on a future, without blocking the loop; a dispatcher task releases requests when the pool
has room (woken when a request ends, when metrics arrive, and every
``dispatchIntervalSeconds`` for deadlines), and rejects those that expire. The queueing
rules are :class:`epp.flowcontrol.controller.FlowController`'s, shared with the replay.

Errors follow llm-d's rule: a request shed because the pool is busy gets 429, whichever
path shed it; 503 only when no endpoint can serve it. ``error.reason`` in the JSON body says
epp's cause, the ``x-llm-d-request-dropped-reason`` header llm-d's (docs/serve.md, the
shedding table): 429 ``queue-full`` / ``band-full`` (no room and nothing lower to displace)
and ``displaced`` (a higher band took the place), all ``rejected-saturated``; 429
``queue-timeout`` / ``rejected-ttl-expired`` (waited its limit); 503 ``no-endpoints`` /
``rejected-no-endpoints`` (no endpoint is ready, and the wait for one ran out, overflowed or
is off; also a time-out while none is ready); 503 ``shutting-down`` /
``rejected-shutting-down`` (SIGTERM drains the queue). A client that goes away leaves the
queue at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping

from epp.errors import (
    DROPPED_NO_ENDPOINTS,
    DROPPED_SATURATED,
    DROPPED_SHUTTING_DOWN,
    DROPPED_TTL_EXPIRED,
    BadRequest,
    EppError,
    Overloaded,
    Unavailable,
)
from epp.flowcontrol.controller import (
    DEFAULT_FAIRNESS_HEADER,
    FAIRNESS_HEADER_ALIAS,
    FlowController,
    QueuedRequest,
)
from epp.framework.request import InferenceRequest

log = logging.getLogger(__name__)

DEADLINE_HEADER = "x-gateway-request-deadline-ms"
"""How long the client will wait for the request, in milliseconds from its arrival: a queued
request that cannot start within it leaves the queue as if it had waited its time."""
MAX_DEADLINE_DIGITS = 10
"""A deadline of more than ten digits (over 115 days) is no deadline a client means."""


def parse_deadline_ms(raw: str) -> int:
    """The ``x-gateway-request-deadline-ms`` value: 1 to 10 ASCII digits (milliseconds).

    Raises BadRequest naming the header for anything else: an empty value, a sign, a
    non-ASCII digit (``str.isdigit`` accepts ``"²"``, which ``int`` refuses), or more digits
    than a deadline needs (``int`` on thousands of digits raises or costs quadratic time).
    """
    value = raw.strip()
    if not (value.isascii() and value.isdigit()) or len(value) > MAX_DEADLINE_DIGITS:
        shown = repr(value[:20]) + ("..." if len(value) > 20 else "")
        raise BadRequest(
            f"header {DEADLINE_HEADER} must be a whole number of milliseconds (1 to "
            f"{MAX_DEADLINE_DIGITS} digits), not {shown}"
        )
    return int(value)


def rejection(item_or_reason: QueuedRequest | str, no_endpoint: bool = False) -> EppError:
    """The error a request gets for leaving the queue (or not entering it) with this reason;
    ``no_endpoint``: no endpoint is ready now (a time-out is then 503, not 429)."""
    if isinstance(item_or_reason, str):
        reason, waited = item_or_reason, ""
    else:
        reason, waited = item_or_reason.outcome, f"{item_or_reason.limit_s:g} s"
    if reason == "queue-full":
        return Overloaded("flow control: the pool is saturated and epp's queue is full", reason,
                          DROPPED_SATURATED)  # fmt: skip
    if reason == "band-full":
        return Overloaded(
            "flow control: the pool is saturated and this priority's queue is full", reason,
            DROPPED_SATURATED,
        )
    if reason == "displaced":
        return Overloaded("flow control: displaced from the queue by higher-priority requests",
                          reason, DROPPED_SATURATED)  # fmt: skip
    if reason == "no-endpoints":
        return Unavailable(
            "flow control: no endpoint is ready, and no more requests may wait for one",
            reason, DROPPED_NO_ENDPOINTS,
        )
    if reason == "expired":
        if no_endpoint:
            return Unavailable(f"flow control: waited {waited} and no endpoint became ready",
                               "queue-timeout", DROPPED_NO_ENDPOINTS)  # fmt: skip
        return Overloaded(f"flow control: waited {waited} for room in the pool",
                          "queue-timeout", DROPPED_TTL_EXPIRED)  # fmt: skip
    return Unavailable("flow control: epp is shutting down", "shutting-down", DROPPED_SHUTTING_DOWN)


class Admission:
    def __init__(
        self,
        controller: FlowController,
        clock: Callable[[], float] = time.monotonic,
        observe: Callable[[QueuedRequest, float], None] | None = None,
    ) -> None:
        self.controller = controller
        self.clock = clock
        self.observe = observe
        """Told of each request leaving the queue, with its wait (metrics)."""
        self._wake = asyncio.Event()
        self.cycles = 0
        self.on_cycle: Callable[[float], None] | None = None
        """Told of each dispatch cycle's duration (metrics)."""

    def wake(self) -> None:
        """Capacity may have freed (a request ended, metrics arrived)."""
        self._wake.set()

    async def admit(
        self, request: InferenceRequest, size_bytes: int, headers: Mapping[str, str]
    ) -> None:
        """Return when the request may be routed; raise the rejection otherwise."""
        item = self.enter(request, size_bytes, headers)
        if item is not None:
            await self.wait(item)

    def enter(
        self, request: InferenceRequest, size_bytes: int, headers: Mapping[str, str]
    ) -> QueuedRequest | None:
        """Offer the request to the queue: None when it may be routed at once, its place
        when it waits (then ``wait``); raises the rejection when it is refused."""
        c = self.controller
        now = self.clock()
        flow = headers.get(c.cfg.fairness_header) or (
            headers.get(FAIRNESS_HEADER_ALIAS) if c.cfg.fairness_header == DEFAULT_FAIRNESS_HEADER
            else None
        ) or request.model
        deadline = None
        raw = headers.get(DEADLINE_HEADER)
        if raw is not None:
            deadline = now + parse_deadline_ms(raw) / 1000
        offer = c.offer(request, flow[:256], size_bytes, now, deadline)
        for victim in offer.displaced:
            self._settle(victim, now)
        if offer.go:
            return None
        if offer.item is None:
            raise rejection(offer.rejected)
        item = offer.item
        item.ticket = asyncio.get_running_loop().create_future()
        self.wake()  # the dispatcher may have room already (reserved requests routed)
        return item

    async def wait(self, item: QueuedRequest) -> None:
        """Return when the queued request is dispatched; raise its rejection otherwise (a
        client that goes away leaves the queue at once)."""
        c = self.controller
        fut: asyncio.Future[None] = item.ticket
        try:
            await fut
        except asyncio.CancelledError:
            if c.cancel(item):  # the client left while queued
                self._observe(item, self.clock())
            elif item.outcome == "dispatched":
                c.routed()  # released, but nobody will route it
            raise
        c.routed()

    def _observe(self, item: QueuedRequest, now: float) -> None:
        if self.observe is not None:
            self.observe(item, now - item.enqueued_s)

    def _settle(self, item: QueuedRequest, now: float) -> None:
        """Resolve a request that left the queue (dispatched or rejected)."""
        self._observe(item, now)
        fut = item.ticket
        if fut is None or fut.done():
            if item.outcome == "dispatched":
                self.controller.routed()  # its waiter is gone
            return
        if item.outcome == "dispatched":
            fut.set_result(None)
        else:
            fut.set_exception(rejection(item, self.controller.no_endpoint()))

    def cycle(self) -> None:
        """One dispatch cycle: expire, then release while there is room."""
        c = self.controller
        now = self.clock()
        t0 = time.perf_counter()
        for item in c.expire(now):
            self._settle(item, now)
        for item in c.dispatch(now):
            self._settle(item, now)
        self.cycles += 1
        if self.on_cycle is not None:
            self.on_cycle(time.perf_counter() - t0)

    async def run(self) -> None:
        """The dispatcher (a supervised task)."""
        interval = self.controller.cfg.dispatch_interval_seconds
        while True:
            try:
                async with asyncio.timeout(interval):
                    await self._wake.wait()
            except TimeoutError:
                pass
            self._wake.clear()
            if self.controller.count:
                self.cycle()

    def drain(self) -> int:
        """SIGTERM: reject everything queued; returns how many."""
        now = self.clock()
        items = self.controller.drain()
        for item in items:
            self._settle(item, now)
        return len(items)
