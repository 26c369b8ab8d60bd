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
together (503 when it is spent).
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from epp.errors import BadRequest, EppError, Internal, PayloadTooLarge, Unavailable
from epp.extproc import convert
from epp.extproc.errors import error_kind, immediate_response
from epp.extproc.observer import OBSERVE_HEADER, Kind, ResponseHandoff
from epp.framework.request import ApiKind, InferenceRequest
from epp.request.parse import CONTROL_HEADERS, PREFILLER_HEADER, ParsedRequest, RequestParser, echo
from epp.requestcontrol.director import Director, Routing
from epp.requestcontrol.response import DEFAULT_LIMITS, ResponseLimits, ResponseReader

log = logging.getLogger(__name__)

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


class ProtocolError(Exception):
    """The ext_proc messages broke the protocol's order; the stream is ended with a gRPC
    error (Envoy would not do this; a buggy or hostile client would)."""


class BodyBudget:
    """Request-body bytes held by all streams together, bounded by ``max_bytes``."""

    __slots__ = ("max_bytes", "used")

    def __init__(self, max_bytes: int = DEFAULT_MAX_BUFFERED_BYTES) -> None:
        self.max_bytes = max_bytes
        self.used = 0


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
        "_finish_later",
        "_first",
        "_first_body_s",
        "_handed",
        "_handoff",
        "_headers",
        "_held",
        "_limits",
        "_observing",
        "_parser",
        "_path",
        "_phase",
        "_reader",
        "_remote",
        "_request_mode",
        "_response_mode",
        "_routing",
        "_status",
        "_strip",
        "_subset",
        "_summary",
        "_summary_token",
        "_token",
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
        summary: bool = False,
    ) -> None:
        self._parser = parser
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
        self._deferred: Routing | None = None
        self.awaiting: Held | None = None
        """A parsed request held until the service has run ``Director.prepare`` (off the
        event loop) and ``Director.admit`` (flow control) on it; then :meth:`resume`."""
        self._held: tuple[ParsedRequest, int, bool, bool] | None = None
        self._observing = False
        self._first_body_s = 0.0
        self._finish_later = False
        self._summary = summary and handoff is not None
        """The proxy sends epp an access log entry for each request (``SUMMARY_DECLARATION``)."""
        self._summary_token = ""
        self._handed = False
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
        stream's end is the exchange's.
        """
        if self._phase is Phase.RESPONSE_BODY and self._response_mode == convert.NONE:
            # response_body_mode NONE: Envoy sends no body and ends the stream when the
            # exchange ends, so the response finished with the status its headers gave (epp
            # cannot tell a client that left mid-response from one that did not)
            self._finish()
        self.after_replies()
        if self._remote and self._handoff is not None:  # ended before the response did
            self._handoff.observed(self._remote, Kind.ENDED)
            self._remote = ""
        routing = self._routing
        if (self._token and self._phase is Phase.ROUTED) or self._handed:
            routing = None  # its response is the observer stream's (or the handoff's) now
        if routing is not None and not routing.released:
            self._director.abandon(routing, "cancelled")
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
        if not self._parser.trust_control_headers:
            self._strip = tuple(name for name in CONTROL_HEADERS if name in headers)
        if PREFILLER_HEADER in headers:  # only epp's P/D handler says where to prefill
            self._strip = (*self._strip, PREFILLER_HEADER)
        self._path = headers.get(":path", "/")
        self._subset = convert.subset_hint(msg.metadata_context)
        mode = self._request_mode
        if h.end_of_stream or mode == convert.NONE:
            request = self._parser.headers_only(self._path, headers, body_seen=h.end_of_stream)
            routing = self._routing = self._deferred = self._director.route(request, self._subset)
            self._phase = Phase.ROUTED
            return [
                convert.routed_headers_response(
                    routing.destination, None, self._removed(routing), self._hand_off(routing),
                    routing.headers, self._issue(),
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
        held, self._held, self.awaiting = self._held, None, None
        if held is None:
            return _NO_REPLY
        parsed, size, trailers_follow, observe_only = held
        try:
            if error is not None:
                raise error
            out = self._routed(parsed, size, trailers_follow)
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
        parsed = self._parser.parse(self._path, self._headers, raw)
        if self._director.holds:
            self._held = (parsed, len(raw), trailers_follow, self._observing)
            self.awaiting = Held(parsed.request, len(raw), self._headers)
            return _NO_REPLY
        return self._routed(parsed, len(raw), trailers_follow)

    def _routed(
        self, parsed: ParsedRequest, size: int, trailers_follow: bool
    ) -> list[pb.ProcessingResponse]:
        routing = self._routing = self._deferred = self._director.route(
            parsed.request, self._subset, size
        )
        self._phase = Phase.ROUTED
        body = parsed.body
        token = self._hand_off(routing)
        if self._request_mode != convert.FULL_DUPLEX_STREAMED:
            return [
                convert.routed_buffered_body_response(
                    routing.destination, body if parsed.body_rewritten else None,
                    self._removed(routing), token, routing.headers, self._issue(),
                )
            ]
        out = [convert.routed_headers_response(routing.destination, len(body), self._removed(routing),
                                               token, routing.headers, self._issue())]  # fmt: skip
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
        if self._token and self._handoff is not None:
            # the response came here after all (the proxy sends it to both filters): the
            # first stream to see it observes it
            self._handoff.claim(self._token)
            self._token = ""
        headers = convert.headers_to_dict(h.headers)
        status_text = headers.get(":status", "200")
        ok = status_text.isascii() and status_text.isdigit() and len(status_text) == 3
        self._status = int(status_text) if ok else 0
        routing = self._routing
        if routing is not None:
            sse = "text/event-stream" in headers.get("content-type", "")
            req = routing.request
            self._reader = ResponseReader(
                self._status, sse, req.model, req.original_model, self._limits
            )
        elif self._remote:  # read for the replica that routed it (nothing to rewrite)
            sse = "text/event-stream" in headers.get("content-type", "")
            self._reader = ResponseReader(self._status, sse, "", "", self._limits)
        self._phase = Phase.RESPONSE_BODY
        if h.end_of_stream:
            self._finish()
        served = self._parser.served_endpoint_header
        if served and routing is not None:  # the conformance profile's read-back
            return [convert.response_headers_with(served, routing.destination.split(",")[0])]
        return [convert.RESPONSE_HEADERS_CONTINUE]

    def _response_body(self, b: pb.HttpBody) -> list[pb.ProcessingResponse]:
        reader = self._reader
        mode = self._response_mode
        chunk = b.body
        end = b.end_of_stream
        if chunk and not self._first_body_s:
            self._first_body_s = first = time.monotonic()
            routing = self._routing
            if routing is not None:
                self._director.first_token(routing, first - routing.started_s, self._status)
                if not end and self._leaves_to_summary(reader, first):
                    return self._leave_to_summary(routing, chunk, first)
            elif self._remote and self._handoff is not None:
                self._handoff.observed(self._remote, Kind.FIRST_BYTES)
        data = chunk if reader is None else reader.feed(chunk, end)
        if end:
            self._finish()
        if mode == convert.FULL_DUPLEX_STREAMED:
            if data or end:
                return [convert.streamed_response_body(data, end)]
            return _NO_REPLY
        if reader is not None and reader.rewriting:
            return [convert.replaced_response_body(data, buffered=mode == convert.BUFFERED)]
        return [convert.RESPONSE_BODY_CONTINUE]

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
            self._finish()
        out.append(convert.RESPONSE_TRAILERS_CONTINUE)
        return out

    def _finish(self) -> None:
        """The response is complete; what epp learns from it and its metrics run in
        ``after_replies``, once the last reply is on the wire."""
        self._phase = Phase.DONE
        self._finish_later = True

    def _settle_response(self) -> None:
        routing = self._routing
        if routing is None:
            if self._remote and self._handoff is not None and self._reader is not None:
                first = self._first_body_s or None
                self._handoff.observed(self._remote, Kind.FINISHED, first, self._reader.info())
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
        routing = self._routing
        if routing is not None and not routing.released:
            self._director.abandon(routing, str(kind.status))
            model = routing.client_model
        else:
            self._director.rejected("", kind.status)
            model = ""
        log.info(
            "request answered by epp: status=%d type=%s path=%s model=%s reason=%s",
            kind.status, kind.type, echo(self._path.partition("?")[0]), echo(model),
            exc.message if isinstance(exc, EppError) else type(exc).__name__,
        )
        self._phase = Phase.ANSWERED
        self._drop_body()
        return [immediate_response(exc)]
