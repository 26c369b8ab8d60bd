"""The request-control layer: between the ext_proc state machine and the scheduler.

For each request the ``Director``
1. narrows the pool to the proxy's subset hint, if any (an empty hint -> 503),
2. keeps it off endpoints that report other models only (``Datastore.serving_model``),
   and sheds it (429) when its priority is negative and the pool is saturated,
3. asks the scheduler for a target (plus fallbacks), records the pick (the post-pick hooks:
   the prefix index, the prefill queued on it) and counts it in flight: the next request
   reads that state, even while this one's reply is still being sent,
4. once the routing reply is on the wire (``settle``), observes the scheduling metrics,
5. when the response ends, reports usage to the scheduler and to metrics, and releases the
   in-flight count; a cancelled request is only released.

What a request keeps while in flight is bounded: once it is picked, its parsed body (the
JSON document) is let go, and what remains for learning from its reply (the prompt text and
its chain hashes, ~1.7x the body) counts against ``max_learning_bytes`` over all requests in
flight; a request past it keeps none of that (its reply is not learnt from).

It knows nothing about protobuf: the ext_proc layer hands it domain values.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import logging
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from epp.datastore.prefill import prefill_of
from epp.datastore.store import Datastore
from epp.errors import (
    DROPPED_NO_ENDPOINTS,
    DROPPED_SATURATED,
    EppError,
    Internal,
    Overloaded,
    Unavailable,
)
from epp.flowcontrol.controller import FlowControlConfig, FlowController
from epp.framework.endpoint import Endpoint, EndpointId
from epp.framework.request import InferenceRequest
from epp.framework.saturation import SaturationConfig
from epp.framework.types import CycleState, PickResult, PrefixMatch, ResponseInfo
from epp.observability.metrics import EppMetrics
from epp.observability.tracing import RequestTrace
from epp.request.parse import PREFILLER_HEADER
from epp.requestcontrol.admission import Admission
from epp.scheduling.saturation import detector, pool_saturated
from epp.scheduling.scheduler import Scheduler

log = logging.getLogger(__name__)

DEFAULT_MAX_LEARNING_BYTES = 512 << 20
"""Prompt text and chain hashes all requests in flight keep to learn from their replies."""
_HASH_BYTES = 40
"""A chain hash in a Python list: a 64-bit int (32-36 bytes) and its list slot."""
_NO_PREFIX = PrefixMatch(())
_CLIENT_CLOSED = 499
"""The status the post-response hooks see for a request whose client went away."""
UNSEEN = "routed"
"""The final status of a request whose response the proxy never shows epp (Envoy's
``--response none``): routed, outcome unknown. The post-response hooks see status 0."""


@dataclass(slots=True)
class Routing:
    """One routed request, alive until its response ends or the client goes away."""

    request: InferenceRequest
    result: PickResult
    destination: str
    """``ip:port[,fallback...]``: the header value and the ``envoy.lb`` metadata value."""
    started_s: float
    scheduling_s: float = 0.0
    request_bytes: int = 0
    headers: tuple[tuple[str, str], ...] = ()
    """Request headers epp sets for the upstream (``x-prefiller-host-port``)."""
    released: bool = False
    settled: bool = False
    trace: RequestTrace | None = None
    """The request's trace (``epp.observability.tracing``): ended with the response, on
    whichever stream sees it end."""
    generation: int = 0
    """The target's generation when it was picked (``Datastore.request_started``)."""
    prefill_at: EndpointId | None = None
    """Where its prefill runs while it counts in the prefill ledger (until its first token)."""
    prefill_chars: float = 0.0
    kept_bytes: int = 0
    """What it keeps to learn from its reply, counted in ``Director.learning_bytes``."""

    @property
    def target_id(self) -> EndpointId:
        return self.result.targets[0].id

    @property
    def client_model(self) -> str:
        return self.request.original_model or self.request.model


@functools.cache
def _prepare_pool() -> concurrent.futures.ThreadPoolExecutor:
    """Threads for request preparation: as many as cores (the tokenizer releases the GIL)."""
    workers = max(2, os.cpu_count() or 2)
    return concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="epp-prepare")


class Director:
    def __init__(
        self,
        datastore: Datastore,
        scheduler: Scheduler,
        saturation: SaturationConfig,
        metrics: EppMetrics,
        fallbacks: int = 0,
        clock: Callable[[], float] = time.monotonic,
        flow: FlowControlConfig | None = None,
        max_learning_bytes: int = DEFAULT_MAX_LEARNING_BYTES,
    ) -> None:
        self._datastore = datastore
        self.max_learning_bytes = max_learning_bytes
        self.learning_bytes = 0
        """Prompt text and chain hashes the requests in flight keep (``max_learning_bytes``)."""
        self.learning_dropped = 0
        """Requests that kept none of it: the bound was reached."""
        self._in_flight = datastore.in_flight_view()
        self._prefill = datastore.prefill
        self._scheduler = scheduler
        self._saturation = saturation
        self._metrics = metrics
        self._fallbacks = fallbacks
        self._clock = clock
        self.flow: FlowController | None = None
        """Flow control's queue (``flowControl.enabled``); the replay drives it directly."""
        self.admission: Admission | None = None
        """Flow control on the event loop (``epp serve``)."""
        if flow is not None and flow.enabled:
            self.flow = FlowController(flow, self.pool_full, self.no_ready_endpoint)
        self._detector = detector(
            flow.saturation if flow is not None else "thresholds", saturation, self._in_flight,
            flow.max_concurrency if flow is not None else 0,
        )  # fmt: skip

    def enable_admission(self, observe: Any = None) -> Admission:
        """``epp serve``: queued requests wait on the event loop (see ``Admission``)."""
        assert self.flow is not None
        self.admission = Admission(self.flow, self._clock, observe)
        return self.admission

    def saturation_level(self) -> float:
        """For the gauge: the share of endpoints over a threshold, or of the concurrency
        slots in use."""
        if self.flow is None:
            return 0.0
        return self._detector.level(self._datastore.routable(), self._clock())

    def no_ready_endpoint(self) -> bool:
        """No endpoint can take a request now (none in the pool, or none ready: asleep,
        draining): flow control holds requests for the first one (scale from zero)."""
        return not self._datastore.routable()

    def pool_full(self, reserved: int) -> bool:
        """Flow control's saturation detector (``flowControl.saturation``)."""
        endpoints = self._datastore.routable()
        if self.flow is None or not endpoints:
            return False  # no endpoint: route() answers 503 at once
        return self._detector.full(endpoints, reserved, self._clock())

    @property
    def prepares(self) -> bool:
        """Requests should go through :meth:`prepare` before :meth:`route`."""
        return self._scheduler.prepares

    @property
    def holds(self) -> bool:
        """A parsed request waits for :meth:`admit_held` before :meth:`route`."""
        return self.prepares or self.admission is not None

    async def admit_held(self, held: Any) -> EppError | None:
        """The asynchronous steps before routing a parsed request (``held``: the ext_proc
        stream's ``Held``): flow control, and its preparation (tokenizing, in a worker
        thread) while it waits in the queue; what the preparers computed goes to
        ``held.prepared`` (then ``route(..., prepared=held.prepared)``). A request flow
        control refuses at once is not prepared. Returns the error to answer with, or None
        to route it."""
        trace = held.trace if held.trace is not None and held.trace.recording else None
        t0 = waited = time.time_ns()
        try:
            request = held.request
            queued = None
            if self.admission is not None:
                queued = self.admission.enter(request, held.size_bytes, held.headers)
            preparing = (asyncio.ensure_future(self._prepare_traced(request, trace))
                         if self.prepares else None)  # fmt: skip
            if queued is not None:
                try:
                    await self.admission.wait(queued)  # type: ignore[union-attr]
                except BaseException:
                    if preparing is not None:
                        preparing.cancel()
                    raise
            waited = time.time_ns()
            if preparing is not None:
                held.prepared.update(await preparing)
            if self.admission is None:
                return None
        except EppError as exc:
            if trace is not None and self.admission is not None:
                trace.child("epp.flow_control.wait", t0, time.time_ns(),
                            {"epp.flow_control.outcome": type(exc).__name__}, error=exc.message)  # fmt: skip
            return exc
        except Exception:  # a bug: the stream answers 500 and keeps serving
            log.exception("admitting request %s failed", held.request.request_id)
            self.internal_error("admission")
            return Internal("epp failed to admit the request")
        if trace is not None:
            trace.child("epp.flow_control.wait", t0, waited,
                        {"epp.flow_control.outcome": "dispatched"})  # fmt: skip
        return None

    async def _prepare_traced(self, request: InferenceRequest, trace: Any) -> dict[str, object]:
        t0 = time.time_ns()
        prepared = await self.prepare(request)
        if trace is not None:
            trace.child("epp.prepare", t0, time.time_ns())
        return prepared

    async def prepare(self, request: InferenceRequest) -> dict[str, object]:
        """The producers' per-request work (tokenizing) in a worker thread, so a long prompt
        does not hold the event loop; returns what they computed, by producer, for
        ``route(..., prepared=)``. A failure only costs the work (``route`` redoes it or
        falls back)."""
        try:
            return await asyncio.get_running_loop().run_in_executor(
                _prepare_pool(), self._scheduler.prepare_request, request
            )
        except Exception:
            log.exception("preparing request %s failed", request.request_id)
            return {}

    def route(
        self, request: InferenceRequest, subset: Sequence[str] | None, request_bytes: int = 0,
        prepared: Mapping[str, object] | None = None,
        record: bool = False,
    ) -> Routing:
        """Pick targets for ``request`` (``prepared``: what ``prepare`` returned for it);
        raises Unavailable (503) or Overloaded (429). ``record``: keep each profile's run in
        ``routing.result.state.runs`` (a trace, the pick-reason header)."""
        try:
            routing = self._route(request, subset, request_bytes, prepared, record)
        except (Unavailable, Overloaded):
            self._metrics.schedule_failed()
            raise
        self._metrics.scheduled()
        self._metrics.request_running(routing.client_model, 1)
        return routing

    def _route(
        self, request: InferenceRequest, subset: Sequence[str] | None, request_bytes: int,
        prepared: Mapping[str, object] | None,
        record: bool = False,
    ) -> Routing:
        now_s = self._clock()
        endpoints: Sequence[Endpoint] = self._datastore.routable()
        allowed = None if subset is None else set(subset)
        if allowed is not None:
            endpoints = [e for e in endpoints if e.id in allowed]
            if not endpoints:
                raise Unavailable(
                    "no endpoint in the proxy's subset hint"
                    if allowed
                    else "the proxy's subset hint is empty",
                    "no-endpoints", DROPPED_NO_ENDPOINTS,
                )
        if not endpoints:
            raise Unavailable("no ready endpoint in the pool", "no-endpoints", DROPPED_NO_ENDPOINTS)
        # the endpoints that serve the request's model, when some do (a server restarted at
        # the same address with another model gets none of the old one's requests)
        endpoints = self._datastore.serving_model(request.model, endpoints)
        if request.priority < 0 and pool_saturated(endpoints, self._saturation, now_s):
            raise Overloaded(
                f"request shed: priority {request.priority} is sheddable and every endpoint is "
                "saturated", "shed", DROPPED_SATURATED,
            )
        t0 = time.perf_counter()
        try:
            result = self._scheduler.schedule(
                request, endpoints, now_s, fallbacks=self._fallbacks, commit=False,
                in_flight=self._in_flight, runs=[] if record else None, prefill=self._prefill,
                prepared=prepared,
            )  # fmt: skip
        except Unavailable:
            # The filters left none of the endpoints with fresh metrics: if some were left out
            # as stale, try them rather than refuse. A slow /metrics is not a dead server (a
            # decoder busy with a prefill it pulled, the only one of its role).
            pool = self._datastore.serving_model(request.model, [
                e for e in self._datastore.serving() if allowed is None or e.id in allowed])
            if len(pool) == len(endpoints):
                raise
            log.debug("request %s: no fresh endpoint passed the filters; trying the stale ones too",
                      request.request_id)  # fmt: skip
            result = self._scheduler.schedule(
                request, pool, now_s, fallbacks=self._fallbacks, commit=False,
                in_flight=self._in_flight, runs=[] if record else None, prefill=self._prefill,
                prepared=prepared,
            )  # fmt: skip
        # Record the pick before the reply goes out: in a burst, the next stream routes while
        # this reply is being sent, and must see this pick (its prefix, its queued prefill).
        # Deferred until after the send, 16 cold conversations arriving together saw the same
        # empty state and herded (10 of 11 onto one server, on real vLLM behind Envoy);
        # it costs ~10 us a request, 0.3 ms for a 119k-token prompt.
        self._scheduler.commit(result)
        scheduling_s = time.perf_counter() - t0
        targets = result.targets
        destination = targets[0].id if len(targets) == 1 else ",".join(e.id for e in targets)
        generation = self._datastore.request_started(targets[0].id)
        headers: tuple[tuple[str, str], ...] = ()
        prefiller = result.prefiller
        if prefiller is not None:  # the decoder's sidecar sends it the prefill
            headers = ((PREFILLER_HEADER, prefiller.id),)
            self._datastore.request_sent(prefiller.id)
        where, chars = prefill_of(result)  # the prefill it queues, where it runs
        self._prefill.sent(where, chars)
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "routed request %s model=%s api=%s prompt_chars=%d -> %s",
                request.request_id, request.model, request.api.value, len(request.prompt),
                destination,
            )
        request, kept = self._keep_for_learning(request, result.state)
        return Routing(request, result, destination, now_s, scheduling_s, request_bytes, headers,
                       generation=generation, prefill_at=where, prefill_chars=chars,
                       kept_bytes=kept)  # fmt: skip

    def _keep_for_learning(
        self, request: InferenceRequest, state: CycleState
    ) -> tuple[InferenceRequest, int]:
        """After the pick: the request as it stays in flight. Its parsed body goes (the
        post-pick hooks were its last readers); its prompt and chain hashes stay for the
        post-response hooks while ``max_learning_bytes`` has room, else they go too."""
        kept = sys.getsizeof(request.prompt) + _HASH_BYTES * sum(
            len(m.hashes) for m in {id(m): m for m in state.matches.values()}.values()
        )
        if self.learning_bytes + kept <= self.max_learning_bytes:
            self.learning_bytes += kept
            slim = dataclasses.replace(request, body=None) if request.body is not None else request
        else:
            self.learning_dropped += 1
            kept = 0
            slim = dataclasses.replace(request, body=None, prompt="")
            state.matches.clear()
            state.prefix = _NO_PREFIX
        state.request = slim
        return slim, kept

    def settle(self, routing: Routing) -> None:
        """After the routing reply was sent: observe scheduling metrics (the pick was recorded
        in ``route``)."""
        if routing.settled:
            return
        routing.settled = True
        self._metrics.observe_scheduling(routing.scheduling_s)
        self._metrics.plugin_timings(routing.result.state.timings)

    def first_token(self, routing: Routing, ttft_s: float, status: int = 0) -> None:
        """The response's first bytes arrived ``ttft_s`` after the pick (once per request),
        with the response's HTTP ``status`` where known (0: not known)."""
        if routing.released:
            return
        if routing.trace is not None:
            routing.trace.first_token(ttft_s)
        self._prefilled(routing)
        if 0 < status < 500:
            self._datastore.request_answered(routing.target_id)  # it is serving
        self._metrics.first_token(routing.client_model, ttft_s)
        if not self._scheduler.wants_first_token:
            return
        self.settle(routing)
        try:
            self._scheduler.on_first_token(routing.result, ttft_s)
        except Exception:  # learning is best effort; never fail the stream for it
            log.exception("scheduler.on_first_token failed for request %s",
                          routing.request.request_id)  # fmt: skip

    def stored(self, routing: Routing, ids: Sequence[str]) -> None:
        """The response names objects the server stored for this request (a stored
        response's id), as soon as it shows them; before ``finish``."""
        try:
            self._scheduler.on_stored(routing.result, ids)
        except Exception:  # learning is best effort; never fail the stream for it
            log.exception("scheduler.on_stored failed for request %s", routing.request.request_id)

    def finish(self, routing: Routing, info: ResponseInfo) -> None:
        """The response ended: learn from it and release the in-flight count."""
        if routing.released:
            return
        self.settle(routing)  # learning from the reply extends the recorded chain
        if routing.trace is not None:
            routing.trace.finished(info)
        if 0 < info.status < 500:
            self._datastore.request_answered(routing.target_id)
        self._release(routing, str(info.status))
        self._metrics.objective_done(
            routing.client_model, routing.request.model, info.status,
            self._clock() - routing.started_s, routing.request_bytes, info.response_bytes,
            info.prompt_tokens, info.completion_tokens,
        )  # fmt: skip
        if info.prompt_tokens or info.completion_tokens:
            self._metrics.usage(
                routing.client_model, info.prompt_tokens, info.cached_tokens,
                info.completion_tokens,
            )
        try:
            self._scheduler.on_response(routing.result, info)
        except Exception:  # learning is best effort; never fail the stream for it
            log.exception("scheduler.on_response failed for request %s", routing.request.request_id)

    def abandon(self, routing: Routing, status: str) -> None:
        """The stream ended without a complete response (client cancel or no response phase).
        The post-response hooks hear of it as status ``status`` (499 for a cancel), so what a
        plugin holds for the request (prefill counted in flight) is released now."""
        if not routing.released:
            self._release(routing, status)
            if routing.trace is not None:
                routing.trace.ended(status if not status.isdigit() else f"HTTP {status}")
            if status.isdigit():
                self._metrics.objective_done(
                    routing.client_model, routing.request.model, int(status),
                    self._clock() - routing.started_s, routing.request_bytes, 0, 0, 0,
                )  # fmt: skip
            self.settle(routing)  # the pick was recorded in route: its hooks hear of the end
            code = int(status) if status.isdigit() else 0 if status == UNSEEN else _CLIENT_CLOSED
            try:
                self._scheduler.on_response(routing.result, ResponseInfo(code))
            except Exception:  # best effort, as in finish
                log.exception("scheduler.on_response failed for request %s",
                              routing.request.request_id)  # fmt: skip

    def _prefilled(self, routing: Routing) -> None:
        """The request's prefill is done (or it ended): out of the prefill ledger."""
        where = routing.prefill_at
        if where is not None:
            routing.prefill_at = None
            self._prefill.done(where, routing.prefill_chars)

    def _release(self, routing: Routing, status: str) -> None:
        routing.released = True
        self._prefilled(routing)
        self.learning_bytes -= routing.kept_bytes
        routing.kept_bytes = 0
        self._datastore.request_finished(routing.target_id, routing.generation)
        if self.admission is not None:
            self.admission.wake()  # room for a queued request
        self._metrics.request_done(routing.client_model, status)
        self._metrics.request_running(routing.client_model, -1)

    def internal_error(self, stage: str) -> None:
        """epp answers a request 500 for a fault of its own (counted by ``stage``)."""
        self._metrics.internal_errors.labels(stage).inc()

    def answered(self, routing: Routing | None, model: str, status: int, reason: str) -> None:
        """epp answered the request itself with an error ``status`` (an ImmediateResponse:
        refused, shed, bad input, its own fault): released if it was routed, counted in
        ``epp_requests_total`` with every request and in ``epp_answered_requests_total``,
        which holds epp's own answers only (``reason``: flow control's ``queue-full``...,
        else the error's type), never a model server's."""
        if routing is not None:
            if not routing.released:
                self.abandon(routing, str(status))
        else:
            self._metrics.request_done(model, str(status))
            self._metrics.objective_done(model, "", status, 0.0, 0, 0, 0, 0)
        self._metrics.answered_by_epp(status, reason)
