"""The ext_proc state machine for one HTTP request (Envoy opens one gRPC stream per request).

    request headers --(end_of_stream | body mode NONE)--> route by load -> reply headers
          |                                                              |
          v  FULL_DUPLEX_STREAMED: no reply yet; BUFFERED: reply CONTINUE |
    request body chunks ... end_of_stream (or request trailers)          |
          |  parse -> route                                              |
          |  FULL_DUPLEX_STREAMED: reply headers (routing) + streamed body|
          |  BUFFERED: reply body (routing in its header mutation)       |
          v                                                              v
    response headers -> response body chunks (JSON / SSE) -> [trailers] -> done

With the default bootstrap's response summary (``epp.extproc.summary``: the proxy declares it
on the stream), a 2xx streamed (SSE) answer is read only up to its first body bytes (the
first-token time): the stream then ends (``ended``), Envoy passes the rest of the answer
without epp, and the request waits in the handoff for the access log entry that reports its
end. JSON answers, answers whose model name epp maps back, and every answer while no access
log entry reaches this replica are read to the end as before.

Any domain error becomes an ImmediateResponse (see ``epp.extproc.errors``) and the stream then
ignores whatever Envoy had already sent for that request. ``close`` releases the in-flight
count when the stream ends without a complete response, so a cancelled client leaves nothing.

``handle`` is synchronous and returns the replies to send: the gRPC layer only moves bytes.

Messages out of order (a second ``request_headers``, a body before the headers, a stream
half-closed before the body's ``end_of_stream``) raise :class:`ProtocolError`; the gRPC
layer ends the stream with ``INVALID_ARGUMENT`` and ``close`` releases what it held, so the
in-flight count stays exact under any message sequence.

Bounds: at most ``MAX_HEADERS`` request headers (400 above); the request body up to the
parser's ``max_body_bytes`` per stream (413) and a :class:`BodyBudget` over all streams
together (503 when it is spent); what a response makes epp hold, by ``ResponseLimits`` per
stream and a second budget over all streams (``ResponseReader``).
"""

from __future__ import annotations

import enum
import logging
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from epp.errors import BadRequest, EppError, Internal, PayloadTooLarge, Unavailable
from epp.extproc import convert
from epp.extproc.errors import error_kind, immediate_response
from epp.extproc.observer import OBSERVE_HEADER, Kind, ResponseHandoff
from epp.framework.request import ApiKind, InferenceRequest
from epp.observability.logging import LogEvery
from epp.observability.tracing import RequestTrace, Tracing
from epp.request.parse import (
    CONTROL_HEADERS,
    PREFILLER_HEADER,
    REQUEST_ID_HEADER,
    ParsedRequest,
    RequestParser,
    echo,
)
from epp.requestcontrol.director import UNSEEN, Director, Routing
from epp.requestcontrol.explain import PICK_REASON_HEADER, pick_reason
from epp.requestcontrol.response import DEFAULT_LIMITS, BodyBudget, ResponseLimits, ResponseReader

log = logging.getLogger(__name__)
_ANSWERED = LogEvery(log)
"""Requests epp answers itself: a line per status and type at most every second (under
overload every request is one: 429s by the thousand)."""

STREAMED_CHUNK_BYTES = 1 << 20
"""A rewritten request body goes back to Envoy in pieces of at most this size."""

MAX_HEADERS = 1024
"""Request headers accepted on one request (Envoy's own default cap is 100)."""
DEFAULT_MAX_BUFFERED_BYTES = 512 << 20

_NO_REPLY: list[pb.ProcessingResponse] = []

SUMMARIZED_APIS = frozenset({ApiKind.CHAT, ApiKind.RESPONSES})
"""The APIs whose streamed usage Envoy 1.40's ``ai_protocol_manager`` finds by itself (it
knows OpenAI chat completions and responses, Anthropic messages and Gemini, by the shape of
their events): a legacy ``/v1/completions`` stream is read to its end
(scripts/probe_envoy_response.py)."""


@dataclass(slots=True, frozen=True)
class Held:
    """A parsed request waiting for the service's asynchronous steps."""

    request: InferenceRequest
    size_bytes: int
    headers: Mapping[str, str]
    trace: RequestTrace | None = None
    """The request's trace: the waits before routing are its spans."""
    prepared: dict[str, object] = field(default_factory=dict)
    """What the request preparers computed for it (``Director.admit_held`` fills it)."""


class ProtocolError(Exception):
    """The ext_proc messages broke the protocol's order; the stream is ended with a gRPC
    error (Envoy would not do this; a buggy or hostile client would)."""


class Phase(enum.Enum):
    REQUEST_HEADERS = 1
    REQUEST_BODY = 2
    ROUTED = 3
    RESPONSE_BODY = 4
    DONE = 5
    ANSWERED = 6
    """epp answered with an ImmediateResponse; Envoy sends nothing more that needs a reply."""


class RequestStream:
    __slots__ = (
        "_body",
        "_budget",
        "_deferred",
        "_director",
        "_explain",
        "_finish_later",
        "_first",
        "_first_body_s",
        "_forward_only",
        "_handed",
        "_handoff",
        "_headers",
        "_held",
        "_leave_pending",
        "_limits",
        "_model",
        "_new_id",
        "_observing",
        "_parser",
        "_path",
        "_phase",
        "_reader",
        "_remote",
        "_request_mode",
        "_response_budget",
        "_response_mode",
        "_routing",
        "_status",
        "_stored_seen",
        "_strip",
        "_subset",
        "_summary",
        "_summary_token",
        "_token",
        "_trace",
        "_tracing",
        "awaiting",
        "ended",
    )

    def __init__(
        self,
        parser: RequestParser,
        director: Director,
        default_mode: int,
        budget: BodyBudget | None = None,
        limits: ResponseLimits = DEFAULT_LIMITS,
        handoff: ResponseHandoff | None = None,
        tracing: Tracing | None = None,
        response_budget: BodyBudget | None = None,
        summary: bool = False,
    ) -> None:
        self._parser = parser
        self._response_budget = (
            response_budget if response_budget is not None else BodyBudget(limits.total_bytes)
        )
        self._tracing = tracing
        self._trace: RequestTrace | None = None
        self._explain = False
        """The response carries ``x-epp-pick-reason`` (config, or a trusted request header)."""
        self._new_id = ""
        """The ``x-request-id`` epp made up for a request without one (set upstream too)."""
        self._limits = limits
        self._handoff = handoff
        self._remote = ""
        """An observer stream of another replica's request (its token): what it reads goes
        to the peers (``ResponseHandoff.observed``)."""
        self._token = ""
        """Set when this stream routed and handed its response to an observer stream."""
        self._budget = budget if budget is not None else BodyBudget()
        self._strip: tuple[str, ...] = ()
        self._director = director
        self._request_mode = default_mode
        self._response_mode = default_mode
        self._phase = Phase.REQUEST_HEADERS
        self._first = True
        self._path = "/"
        self._headers: dict[str, str] = {}
        self._subset: list[str] | None = None
        self._body = bytearray()
        self._routing: Routing | None = None
        self._reader: ResponseReader | None = None
        self._status = 0
        self._stored_seen = 0
        """How many of the reader's ``stored_ids`` the Director was told of."""
        self._deferred: Routing | None = None
        self.awaiting: Held | None = None
        """A parsed request held until the service has run ``Director.prepare`` (off the
        event loop) and ``Director.admit`` (flow control) on it; then :meth:`resume`."""
        self._held: tuple[ParsedRequest, int, bool, bool] | None = None
        self._model = ""
        """The model the parsed body names, as the client sent it ('' before parsing): what
        epp's own answer to a request it did not route (shed, queued out) logs and counts."""
        self._observing = False
        self._first_body_s = 0.0
        self._forward_only = False
        """The observer stream claimed this stream's request first: it only forwards."""
        self._finish_later = False
        self._summary = summary and handoff is not None
        """The proxy sends epp an access log entry for each request (``SUMMARY_DECLARATION``)."""
        self._summary_token = ""
        self._handed = False
        self._leave_pending = False
        """The answer goes unread once what must be read of it is (``_response_body``)."""
        """The response's end was left to the access log (``ResponseHandoff.await_summary``)."""
        self.ended = False
        """epp has read what it needs: the service ends the stream, Envoy goes on without it."""

    @property
    def phase(self) -> Phase:
        return self._phase

    @property
    def routing(self) -> Routing | None:
        return self._routing

    # --- entry points ------------------------------------------------------------------

    def handle(self, msg: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        if self._first:
            self._first = False
            if msg.HasField("protocol_config"):
                self._request_mode = msg.protocol_config.request_body_mode
                self._response_mode = msg.protocol_config.response_body_mode
        if self._phase is Phase.ANSWERED:
            return _NO_REPLY
        kind = msg.WhichOneof("request")
        self._observing = msg.observability_mode
        try:
            if kind == "request_headers":
                out = self._request_headers(msg)
            elif kind == "request_body":
                out = self._request_body(msg.request_body)
            elif kind == "response_headers":
                out = self._response_headers(msg.response_headers)
            elif kind == "response_body":
                out = self._response_body(msg.response_body)
            elif kind == "request_trailers":
                out = self._request_trailers()
            elif kind == "response_trailers":
                out = self._response_trailers()
            else:
                raise ProtocolError(f"ext_proc message carries no known request ({kind!r})")
        except EppError as exc:
            out = self._answer(exc)
        except ProtocolError:
            raise
        except Exception as exc:  # a bug: answer 500, keep the server alive
            log.exception("ext_proc stream failed on %s", kind)
            self._director.internal_error(kind or "unknown")
            out = self._answer(exc)
        return _NO_REPLY if msg.observability_mode else out

    def after_replies(self) -> None:
        """Work that must not delay a reply: call once the replies of ``handle`` are sent.

        Observes the scheduling metrics; once the response is complete, learns from it,
        observes its metrics and releases the request.
        """
        routing = self._deferred
        if routing is not None:
            self._deferred = None
            try:
                self._director.settle(routing)
            except Exception:  # a bug: the request is routed already; keep the stream alive
                log.exception("settling request %s failed", routing.request.request_id)
        if self._finish_later:
            self._finish_later = False
            try:
                self._settle_response()
            except Exception:  # a bug: the reply is sent already; keep the stream alive
                log.exception("finishing request %s failed",
                              self._routing.request.request_id if self._routing else "?")

    def check_complete(self) -> None:
        """Envoy half-closed the stream: that is fine once the request body is complete."""
        if self._phase is Phase.REQUEST_BODY:
            raise ProtocolError(
                "the ext_proc stream was half-closed before the request body's end_of_stream"
            )

    def close(self) -> None:
        """The gRPC stream ended; release whatever the request still holds.

        A stream that ends before the response is complete counts as ``cancelled``: gRPC does
        not tell a client cancel from an early half-close, and both mean nobody is waiting.
        With response body mode NONE the response is complete once its headers came: the
        stream's end is the exchange's; and when no response headers came either, the proxy
        sends epp no response at all (``--response none``): the request ends as ``routed``,
        its outcome unknown (the post-response hooks hear status 0).
        """
        if self._phase is Phase.RESPONSE_BODY and self._response_mode == convert.NONE:
            # response_body_mode NONE: Envoy sends no body and ends the stream when the
            # exchange ends, so the response finished with the status its headers gave (epp
            # cannot tell a client that left mid-response from one that did not)
            self._finish()
        self.after_replies()
        if self._reader is not None:
            self._reader.release()
        if self._remote and self._handoff is not None:  # ended before the response did
            stored = self._reader.stored_ids if self._reader is not None else ()
            self._handoff.observed(self._remote, Kind.ENDED, stored=stored)
            self._remote = ""
        routing = self._routing
        if (self._token and self._phase is Phase.ROUTED) or self._forward_only or self._handed:
            routing = None  # its response is the observer stream's (or the handoff's) now
        if routing is not None and not routing.released:
            if self._phase is Phase.ROUTED and self._response_mode == convert.NONE:
                # the proxy sends this stream no response (Envoy's ``--response none``:
                # response headers SKIP, body NONE): the request is over for epp, its
                # outcome unknown, not a cancel
                self._director.abandon(routing, UNSEEN)
            else:
                self._director.abandon(routing, "cancelled")
        elif self._trace is not None and self._routing is None:
            self._trace.ended("cancelled")  # before it was routed
        self._drop_body()
        self._reader = None

    def _drop_body(self) -> None:
        self._budget.used -= len(self._body)
        self._body = bytearray()

    # --- request path ------------------------------------------------------------------

    def _request_headers(self, msg: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        if self._phase is not Phase.REQUEST_HEADERS:
            raise ProtocolError(f"request_headers in phase {self._phase.name}: one per stream")
        h = msg.request_headers
        if len(h.headers.headers) > MAX_HEADERS:
            self._phase = Phase.REQUEST_BODY  # no second request_headers after this
            raise BadRequest(f"{len(h.headers.headers)} request headers; at most {MAX_HEADERS}")
        headers = self._headers = convert.headers_to_dict(h.headers)
        if msg.observability_mode and self._handoff is not None and OBSERVE_HEADER in headers:
            # the observer filter's stream: the routing stream picked already
            token = headers[OBSERVE_HEADER]
            self._routing = self._handoff.claim(token)
            if self._routing is None and self._handoff.forwards(token):
                self._remote = token
                self._handoff.observed(token, Kind.CLAIMED)
            self._phase = Phase.ROUTED
            return _NO_REPLY
        if not headers.get(REQUEST_ID_HEADER):  # one id for the logs, the server and the client
            self._new_id = headers[REQUEST_ID_HEADER] = str(uuid.uuid4())
        self._explain = self._parser.explains(headers)
        if self._tracing is not None:
            self._trace = self._tracing.begin(headers, headers[REQUEST_ID_HEADER],
                                              headers.get(":path", "/"), headers.get(":method", ""))  # fmt: skip
        if not self._parser.trust_control_headers:
            self._strip = tuple(name for name in CONTROL_HEADERS if name in headers)
        if PREFILLER_HEADER in headers:  # only epp's P/D handler says where to prefill
            self._strip = (*self._strip, PREFILLER_HEADER)
        self._path = headers.get(":path", "/")
        self._subset = convert.subset_hint(msg.metadata_context)
        mode = self._request_mode
        if h.end_of_stream or mode == convert.NONE:
            request = self._parser.headers_only(self._path, headers, body_seen=h.end_of_stream)
            routing = self._routing = self._deferred = self._route(request, 0)
            self._phase = Phase.ROUTED
            return [
                convert.routed_headers_response(
                    routing.destination, None, self._removed(routing), self._hand_off(routing),
                    self._upstream_headers(routing), self._issue(),
                )
            ]
        self._phase = Phase.REQUEST_BODY
        self._parser.check_headers(self._path, headers)
        if mode == convert.FULL_DUPLEX_STREAMED:
            return _NO_REPLY  # reply to the headers once the body is complete
        if mode in (convert.BUFFERED, convert.BUFFERED_PARTIAL):
            return [convert.REQUEST_HEADERS_CONTINUE]
        raise Internal(
            "epp needs request_body_mode FULL_DUPLEX_STREAMED or BUFFERED, got "
            + convert.BodySendMode.Name(mode)
        )

    def _request_body(self, b: pb.HttpBody) -> list[pb.ProcessingResponse]:
        if self._phase is not Phase.REQUEST_BODY:
            if self._phase is Phase.REQUEST_HEADERS:
                raise ProtocolError("request_body before request_headers")
            log.debug("request body chunk in phase %s ignored", self._phase.name)
            return _NO_REPLY
        body = self._body
        chunk = b.body
        if len(body) + len(chunk) > self._parser.max_body_bytes:
            raise PayloadTooLarge(self._parser.too_large_message(len(body) + len(chunk)))
        budget = self._budget
        if budget.used + len(chunk) > budget.max_bytes:
            raise Unavailable(
                f"epp holds the most request-body bytes it may buffer ({budget.max_bytes}); "
                "retry shortly"
            )
        budget.used += len(chunk)
        body += chunk
        if b.end_of_stream:
            return self._route_body(trailers_follow=False)
        if self._request_mode != convert.FULL_DUPLEX_STREAMED:
            raise PayloadTooLarge(
                "request body is larger than the proxy's buffer (BUFFERED_PARTIAL sent a part)"
            )
        return _NO_REPLY

    def _request_trailers(self) -> list[pb.ProcessingResponse]:
        if self._phase is Phase.REQUEST_BODY and self._request_mode == convert.FULL_DUPLEX_STREAMED:
            out = self._route_body(trailers_follow=True)
            if self.awaiting is not None:
                return _NO_REPLY  # resume() sends the routing and the trailers' reply
            return [*out, convert.REQUEST_TRAILERS_CONTINUE]
        return [convert.REQUEST_TRAILERS_CONTINUE]

    def resume(self, error: EppError | None = None) -> list[pb.ProcessingResponse]:
        """Route the held request (see ``awaiting``), or answer ``error`` (flow control
        rejected it)."""
        waited = self.awaiting
        held, self._held, self.awaiting = self._held, None, None
        if held is None:
            return _NO_REPLY
        parsed, size, trailers_follow, observe_only = held
        try:
            if error is not None:
                raise error
            out = self._routed(parsed, size, trailers_follow,
                               waited.prepared if waited is not None else None)  # fmt: skip
            if trailers_follow:
                out.append(convert.REQUEST_TRAILERS_CONTINUE)
        except EppError as exc:
            out = self._answer(exc)
        except Exception as exc:  # a bug: answer 500, keep the server alive
            log.exception("ext_proc stream failed routing a prepared request")
            self._director.internal_error("routing")
            out = self._answer(exc)
        return _NO_REPLY if observe_only else out

    def _route_body(self, trailers_follow: bool) -> list[pb.ProcessingResponse]:
        raw = bytes(self._body)
        self._drop_body()
        trace = self._trace
        if trace is not None and trace.recording:
            parsed = self._traced_parse(trace, raw)
        else:
            parsed = self._parser.parse(self._path, self._headers, raw)
        self._model = parsed.request.original_model or parsed.request.model
        if self._director.holds:
            self._held = (parsed, len(raw), trailers_follow, self._observing)
            self.awaiting = Held(parsed.request, len(raw), self._headers, trace)
            return _NO_REPLY
        return self._routed(parsed, len(raw), trailers_follow)

    def _traced_parse(self, trace: RequestTrace, raw: bytes) -> ParsedRequest:
        t0 = time.time_ns()
        try:
            parsed = self._parser.parse(self._path, self._headers, raw)
        except EppError as exc:
            trace.child("epp.parse", t0, time.time_ns(), {"http.request.body.size": len(raw)},
                        error=exc.message)  # fmt: skip
            raise
        trace.child("epp.parse", t0, time.time_ns(), {"http.request.body.size": len(raw)})
        r = parsed.request
        trace.request(r.model, r.api.value, r.stream, r.priority, len(raw), len(r.prompt))
        return parsed

    def _route(
        self, request: InferenceRequest, size: int, prepared: Mapping[str, object] | None = None
    ) -> Routing:
        """The Director's pick (``prepared``: what the preparers computed for the request),
        traced and recorded for the pick-reason header when asked."""
        trace = self._trace
        recording = trace is not None and trace.recording
        t0 = time.time_ns() if recording else 0
        routing = self._director.route(request, self._subset, size, prepared,
                                       record=recording or self._explain)  # fmt: skip
        if trace is not None:
            routing.trace = trace
            if recording:
                trace.scheduled(routing.result, routing.destination, t0, time.time_ns())
        return routing

    def _upstream_headers(self, routing: Routing) -> tuple[tuple[str, str], ...]:
        """Request headers epp sets for the model server: the Director's (the prefiller),
        a made-up ``x-request-id``, the trace context."""
        extra = routing.headers
        if self._new_id:
            extra = (*extra, (REQUEST_ID_HEADER, self._new_id))
        if self._trace is not None:
            extra = (*extra, *self._trace.upstream(routing.target_id).items())
        return extra

    def _routed(
        self, parsed: ParsedRequest, size: int, trailers_follow: bool,
        prepared: Mapping[str, object] | None = None,
    ) -> list[pb.ProcessingResponse]:
        routing = self._routing = self._deferred = self._route(parsed.request, size, prepared)
        self._phase = Phase.ROUTED
        body = parsed.body
        token = self._hand_off(routing)
        extra = self._upstream_headers(routing)
        if self._request_mode != convert.FULL_DUPLEX_STREAMED:
            return [
                convert.routed_buffered_body_response(
                    routing.destination, body if parsed.body_rewritten else None,
                    self._removed(routing), token, extra, self._issue(),
                )
            ]
        out = [convert.routed_headers_response(routing.destination, len(body), self._removed(routing),
                                               token, extra, self._issue())]  # fmt: skip
        if len(body) <= STREAMED_CHUNK_BYTES:
            out.append(convert.streamed_request_body(body, not trailers_follow))
            return out
        view = memoryview(body)
        for start in range(0, len(body), STREAMED_CHUNK_BYTES):
            piece = bytes(view[start : start + STREAMED_CHUNK_BYTES])
            last = start + STREAMED_CHUNK_BYTES >= len(body)
            out.append(convert.streamed_request_body(piece, last and not trailers_follow))
        return out

    def _removed(self, routing: Routing) -> tuple[str, ...]:
        """The request headers to strip: the client's control headers, less any epp sets
        itself (a set header overwrites the client's value)."""
        if not routing.headers:
            return self._strip
        own = {key for key, _ in routing.headers}
        return tuple(name for name in self._strip if name not in own)

    def _hand_off(self, routing: Routing) -> str:
        """With an observer filter (``--response-observer``), the token its stream claims
        ``routing`` with; else ""."""
        if self._handoff is None or self._observing or not self._handoff.observing:
            return ""
        self._token = self._handoff.offer(routing)
        return self._token

    def _issue(self) -> str:
        """With the response summary, the token the access log entry names the request by."""
        if self._summary and self._handoff is not None:
            self._summary_token = self._handoff.issue()
        return self._summary_token

    # --- response path -----------------------------------------------------------------

    def _response_headers(self, h: pb.HttpHeaders) -> list[pb.ProcessingResponse]:
        routing = self._routing
        if self._token and self._handoff is not None:
            # the response came here after all (the proxy sends it to both filters): the
            # first stream to see it observes it. Claimed by the observer stream already:
            # that stream reads it; this one only forwards it
            self._forward_only = self._handoff.claim(self._token) is None
            self._token = ""
        headers = convert.headers_to_dict(h.headers)
        status_text = headers.get(":status", "200")
        ok = status_text.isascii() and status_text.isdigit() and len(status_text) == 3
        self._status = int(status_text) if ok else 0
        observed = self._observed()
        if observed is not None:
            sse = "text/event-stream" in headers.get("content-type", "")
            req = observed.request
            self._reader = ResponseReader(
                self._status, sse, req.model, req.original_model, self._limits,
                self._response_budget,
            )
        elif self._remote:  # read for the replica that routed it (nothing to rewrite)
            sse = "text/event-stream" in headers.get("content-type", "")
            self._reader = ResponseReader(self._status, sse, "", "", self._limits,
                                          self._response_budget)  # fmt: skip
        self._phase = Phase.RESPONSE_BODY
        if h.end_of_stream:
            self._finish()
        if routing is None:
            return [convert.RESPONSE_HEADERS_CONTINUE]
        return [convert.response_headers_response(self._response_headers_set(routing),
                                                  convert.FAIL_OPEN_REMOVE)]  # fmt: skip

    def _response_headers_set(self, routing: Routing) -> list[tuple[str, str]]:
        """Response headers epp sets: the request id, the pick's reason when asked, the
        conformance profile's served endpoint."""
        out = [(REQUEST_ID_HEADER, self._headers.get(REQUEST_ID_HEADER, ""))]
        if self._explain:
            runs = routing.result.state.runs or ()
            prefiller = routing.result.prefiller
            reason = pick_reason(runs, routing.target_id, prefiller.id if prefiller else "")
            if reason:
                out.append((PICK_REASON_HEADER, reason))
        served = self._parser.served_endpoint_header
        if served:  # the conformance profile's read-back
            out.append((served, routing.destination.split(",")[0]))
        return out

    def _response_body(self, b: pb.HttpBody) -> list[pb.ProcessingResponse]:
        reader = self._reader
        mode = self._response_mode
        chunk = b.body
        end = b.end_of_stream
        if chunk and not self._first_body_s:
            self._first_body_s = first = time.monotonic()
            routing = self._observed()
            if routing is not None:
                self._director.first_token(routing, first - routing.started_s, self._status)
                self._leave_pending = not end and self._leaves_to_summary(reader, first)
            elif self._remote and self._handoff is not None:
                self._handoff.observed(self._remote, Kind.FIRST_BYTES)
        data = chunk
        if reader is not None:
            data = reader.feed(chunk, end)  # an unrewritten SSE stream: data is chunk
            if len(reader.stored_ids) > self._stored_seen:
                self._report_stored(reader)
        if self._leave_pending and not end and self._read_enough(reader):
            assert self._routing is not None
            self._leave_pending = False
            return self._leave_to_summary(self._routing, chunk, self._first_body_s)
        if end:
            self._finish()
        if mode == convert.FULL_DUPLEX_STREAMED:
            if data or end:
                return [convert.streamed_response_body(data, end)]
            return _NO_REPLY
        if reader is not None and reader.rewriting:
            return [convert.replaced_response_body(data, buffered=mode == convert.BUFFERED)]
        return [convert.RESPONSE_BODY_CONTINUE]

    def _read_enough(self, reader: ResponseReader | None) -> bool:
        """Whether what epp must read of this answer is read: a Responses stream's response
        id (its response.created event), so that a follow-up naming it reaches this server;
        of any other stream, its first bytes."""
        routing = self._routing
        if routing is None:
            return False
        return routing.request.api is not ApiKind.RESPONSES or bool(reader and reader.stored_ids)

    def _leaves_to_summary(self, reader: ResponseReader | None, now: float) -> bool:
        """Whether the rest of this answer can go by unread: a 2xx SSE stream of an API whose
        usage Envoy reads (``SUMMARIZED_APIS``), whose model name epp does not map back,
        while the proxy's access log reaches this replica."""
        return (
            self._summary_token != ""
            and self._routing is not None
            and self._routing.request.api in SUMMARIZED_APIS
            and reader is not None
            and reader.sse
            and not reader.rewriting
            and 200 <= self._status < 300
            and self._handoff is not None
            and self._handoff.summaries_live(now)
        )

    def _leave_to_summary(
        self, routing: Routing, chunk: bytes, first_s: float
    ) -> list[pb.ProcessingResponse]:
        assert self._handoff is not None
        self._handoff.await_summary(self._summary_token, routing, first_s)
        self._handed = True
        self._phase = Phase.DONE
        self._reader = None
        self.ended = True
        if self._response_mode == convert.FULL_DUPLEX_STREAMED:
            return [convert.streamed_response_body(chunk, False)]
        return [convert.RESPONSE_BODY_CONTINUE]

    def _response_trailers(self) -> list[pb.ProcessingResponse]:
        out: list[pb.ProcessingResponse] = []
        reader = self._reader
        if self._phase is Phase.RESPONSE_BODY:
            if reader is not None:
                rest = reader.feed(b"", True)
                if rest and self._response_mode == convert.FULL_DUPLEX_STREAMED:
                    out.append(convert.streamed_response_body(rest, False))
                if len(reader.stored_ids) > self._stored_seen:
                    self._report_stored(reader)
            self._finish()
        out.append(convert.RESPONSE_TRAILERS_CONTINUE)
        return out

    def _report_stored(self, reader: ResponseReader) -> None:
        """The server stored objects for this request (a stored response): the plugins that
        route follow-ups to them learn of it now, before the client can send one. An observer
        stream of another replica's request sends them with its last observation."""
        new = reader.stored_ids[self._stored_seen :]
        self._stored_seen = len(reader.stored_ids)
        if self._routing is not None:
            self._director.stored(self._routing, new)

    def _finish(self) -> None:
        """The response is complete; what epp learns from it and its metrics run in
        ``after_replies``, once the last reply is on the wire."""
        self._phase = Phase.DONE
        self._finish_later = True

    def _observed(self) -> Routing | None:
        """The request whose response this stream reads: its own routing, unless the
        observer stream claimed it first (then this one only forwards the response)."""
        return None if self._forward_only else self._routing

    def _settle_response(self) -> None:
        if self._forward_only:
            return
        routing = self._routing
        if routing is None:
            if self._remote and self._handoff is not None and self._reader is not None:
                first = self._first_body_s or None
                self._handoff.observed(self._remote, Kind.FINISHED, first, self._reader.info(),
                                       self._reader.stored_ids)  # fmt: skip
                self._remote = ""
            return
        reader = self._reader
        if reader is not None:
            first = self._first_body_s
            self._director.finish(routing, reader.info(first - routing.started_s if first else None))
        else:
            self._director.abandon(routing, str(self._status))

    # --- errors ------------------------------------------------------------------------

    def _answer(self, exc: BaseException) -> list[pb.ProcessingResponse]:
        kind = error_kind(exc)
        if self._trace is not None:
            self._trace.answered(kind.status, kind.type,
                                 exc.message if isinstance(exc, EppError) else type(exc).__name__)  # fmt: skip
        routing = self._routing
        model = routing.client_model if routing is not None else self._model
        reason = exc.reason if isinstance(exc, EppError) and exc.reason else kind.type
        self._director.answered(routing, model, kind.status, reason)
        _ANSWERED.log(
            logging.INFO, (kind.status, kind.type),
            "request answered by epp: status=%d type=%s path=%s model=%s reason=%s",
            kind.status, kind.type, echo(self._path.partition("?")[0]), echo(model),
            exc.message if isinstance(exc, EppError) else type(exc).__name__,
        )
        self._phase = Phase.ANSWERED
        self._drop_body()
        return [immediate_response(exc, self._path)]
